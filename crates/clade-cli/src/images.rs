//! `clade images …`

use std::path::PathBuf;
use std::process::ExitCode;

use clade_host::image::Progress;
use clade_host::{HostConfig, ImageStore};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum ImagesCommand {
    /// Build (or verify the cache of) images: kernel, root filesystem, agent.
    Build {
        /// The image to build (repeatable): base, code-interpreter, agent, postgres.
        #[arg(long = "image", default_value = "base")]
        images: Vec<String>,
    },
    /// List the images this build knows and whether they are built.
    Ls,
    /// Remove built images that are not current and that no template, VM or
    /// snapshot of the data directory (or of those named with
    /// --other-data-dir, which share this cache) is backed by.
    Prune {
        /// Another data directory that uses this cache (repeatable).
        #[arg(long = "other-data-dir")]
        other_data_dirs: Vec<PathBuf>,
        /// Only list what would be removed.
        #[arg(long)]
        dry_run: bool,
    },
}

pub async fn run(command: ImagesCommand, config: HostConfig) -> anyhow::Result<ExitCode> {
    let store = ImageStore::new(&config.cache_dir, config.guestd.clone());
    match command {
        ImagesCommand::Build { images } => {
            for image in images {
                let store = store.clone();
                let built = tokio::task::spawn_blocking(move || store.ensure(&image, &Progress::Stderr)).await??;
                println!("{}\t{}\t{}", built.name, built.kernel.display(), built.rootfs.display());
            }
        }
        ImagesCommand::Prune { other_data_dirs, dry_run } => {
            let data_dirs: Vec<PathBuf> = std::iter::once(config.data_dir.clone()).chain(other_data_dirs).collect();
            let pruned = tokio::task::spawn_blocking(move || store.prune(&data_dirs, dry_run)).await??;
            for image in &pruned {
                println!("{}\t{}", image.dir.display(), crate::output::human_bytes(image.bytes));
            }
            let total = crate::output::human_bytes(pruned.iter().map(|i| i.bytes).sum());
            let verb = if dry_run { "would remove" } else { "removed" };
            eprintln!("{verb} {} image(s), {total}", pruned.len());
        }
        ImagesCommand::Ls => {
            for name in ImageStore::available() {
                let state = match store.cached(name) {
                    Ok(Some(image)) => format!("built\t{}", image.rootfs.display()),
                    Ok(None) => "not built".to_string(),
                    Err(e) => format!("unavailable: {e}"),
                };
                println!("{name}\t{state}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
