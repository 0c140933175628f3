//! `clade-bench images`: how long each first-party image takes to build
//! from a warm package cache (issue 27) — every package already downloaded
//! once (Debian's, npm's, PyPI's), so the figure is the build's own work:
//! debootstrap and dpkg, npm's and pip's installs, the ext4 image.
//!
//! The images are first made in the real cache (which also fills the
//! package cache, when it is not yet), then made again from nothing in a
//! scratch cache that shares only the package cache and the kernel.

use std::path::Path;
use std::time::{Duration, Instant};

use clade_host::image::Progress;
use clade_host::{HostConfig, ImageStore};

#[derive(clap::Args)]
pub struct ImagesArgs {
    /// The images to build, in order (a child after its parent).
    #[arg(long, value_delimiter = ',', default_value = "base,code-interpreter,agent")]
    images: Vec<String>,
}

pub async fn run(args: ImagesArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || measure(&args)).await?
}

fn measure(args: &ImagesArgs) -> anyhow::Result<()> {
    let config = HostConfig::from_env().map_err(anyhow::Error::msg)?;
    let real = ImageStore::new(&config.cache_dir, config.guestd.clone());
    let package_cache = config.cache_dir.join("packages");
    for name in &args.images {
        let started = Instant::now();
        real.ensure(name, &Progress::Quiet)?;
        eprintln!("{name}: in the real cache ({:.0} s; the package cache is warm now)", started.elapsed().as_secs_f64());
    }
    let scratch = config.cache_dir.join(format!("bench-images-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    // The kernel is not what is measured: the scratch cache shares it.
    std::os::unix::fs::symlink(config.cache_dir.join("kernel"), scratch.join("kernel"))?;
    // Read by the builds below (this thread's, one at a time).
    std::env::set_var("CLADE_PACKAGE_CACHE", &package_cache);
    let measured = build_each(&scratch, &config, &args.images);
    let _ = std::fs::remove_dir_all(&scratch);
    let times = measured?;

    println!("clade-bench images (from a warm package cache: {})", package_cache.display());
    println!();
    println!("| image | build (tree + ext4 image) | image size |");
    println!("|---|---|---|");
    for (name, took, bytes) in &times {
        println!("| {name} | {:.0} s | {:.2} GB |", took.as_secs_f64(), *bytes as f64 / 1e9);
    }
    println!();
    println!("A child (code-interpreter, agent) is built on base's finished tree, so its figure excludes base's.");
    Ok(())
}

/// Builds each image in the scratch cache: its time and its files' size.
fn build_each(scratch: &Path, config: &HostConfig, images: &[String]) -> anyhow::Result<Vec<(String, Duration, u64)>> {
    let store = ImageStore::new(scratch, config.guestd.clone());
    let mut times = Vec::new();
    for name in images {
        let started = Instant::now();
        let image = store.ensure(name, &Progress::Quiet)?;
        let took = started.elapsed();
        let bytes = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&image.rootfs)?) * 512;
        eprintln!("{name}: {:.0} s", took.as_secs_f64());
        times.push((name.clone(), took, bytes));
    }
    Ok(times)
}
