//! `clade images …`

use std::process::ExitCode;

use clade_host::image::Progress;
use clade_host::{HostConfig, ImageStore};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum ImagesCommand {
    /// Build (or verify the cache of) an image: kernel, root filesystem, agent.
    Build {
        #[arg(long, default_value = "base")]
        image: String,
    },
    /// List the images this build knows and whether they are built.
    Ls,
}

pub async fn run(command: ImagesCommand, config: HostConfig) -> anyhow::Result<ExitCode> {
    let store = ImageStore::new(&config.cache_dir, config.guestd.clone());
    match command {
        ImagesCommand::Build { image } => {
            let built = tokio::task::spawn_blocking(move || store.ensure(&image, &Progress::Stderr)).await??;
            println!("{}\t{}\t{}", built.name, built.kernel.display(), built.rootfs.display());
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
