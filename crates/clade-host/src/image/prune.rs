//! `clade images prune`: removing built images nothing needs any more.
//!
//! Every change of the agent or the package list builds a new image (~450 MB)
//! beside the old ones. An old image may still be the bottom of a disk chain:
//! a template's frozen layer, or a cold-booted VM's disk, in any data
//! directory that shares this cache. The store cannot know those
//! directories, so pruning is an operator's command that names them, never
//! automatic (templates, which live in one data directory, are, ADR 6).

use std::collections::HashSet;
use std::path::PathBuf;

use super::{build, io_err, ImageError, ImageStore, RECIPES};

/// An image directory that was removed (or, in a dry run, would be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunedImage {
    pub dir: PathBuf,
    /// Disk space it took (allocated blocks: the images are sparse).
    pub bytes: u64,
}

impl ImageStore {
    /// Removes every built image that is not the current build of an image
    /// name and that no disk layer in `data_dirs` is backed by (templates,
    /// templates being baked, VMs, snapshots). Holds the image build lock,
    /// so no image is published meanwhile.
    pub fn prune(&self, data_dirs: &[PathBuf], dry_run: bool) -> Result<Vec<PrunedImage>, ImageError> {
        // Paths are compared resolved: a cache reached through a symlink or
        // spelled differently must not make a used image look unused.
        let current: HashSet<PathBuf> =
            RECIPES.iter().map(|recipe| self.plan(recipe.name).map(|plan| resolved(plan.image_dir))).collect::<Result<_, _>>()?;
        let images_dir = self.cache_dir.join("images");
        let _building = build::lock(&self.cache_dir, "image")?;
        let backing = backing_files(data_dirs)?;
        let mut pruned = Vec::new();
        let entries = match std::fs::read_dir(&images_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(pruned),
            Err(e) => return Err(io_err(format!("reading {}", images_dir.display()))(e)),
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            // Staging directories of builds (none runs: we hold the lock) and
            // leftovers of an earlier prune go as well, without a report.
            if name.contains(".tmp-") || name.starts_with(".trash-") {
                if !dry_run {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                continue;
            }
            // A custom image stays while its template keeps it marked.
            let kept = dir.join(super::custom::KEEP_MARKER).exists();
            if !dir.is_dir() || kept || current.contains(&resolved(dir.clone())) || backing.contains(&resolved(dir.join("rootfs.ext4"))) {
                continue;
            }
            let bytes = crate::space::allocated_bytes(&dir);
            if !dry_run {
                let trash = images_dir.join(format!(".trash-{name}-{}", std::process::id()));
                std::fs::rename(&dir, &trash).map_err(io_err(format!("removing {}", dir.display())))?;
                std::fs::remove_dir_all(&trash).map_err(io_err(format!("removing {}", trash.display())))?;
            }
            pruned.push(PrunedImage { dir, bytes });
        }
        pruned.sort_by(|a, b| a.dir.cmp(&b.dir));
        Ok(pruned)
    }
}

/// The backing files of every disk layer in these data directories. A data
/// directory that does not exist uses nothing; one that cannot be read
/// fails the prune (it might use anything).
fn backing_files(data_dirs: &[PathBuf]) -> Result<HashSet<PathBuf>, ImageError> {
    let mut backing = HashSet::new();
    for data_dir in data_dirs {
        for kind in ["templates", "vms", "snapshots"] {
            let parent = data_dir.join(kind);
            let entries = match std::fs::read_dir(&parent) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(format!("reading {}", parent.display()))(e)),
            };
            // Directories only: a kind's directory also holds lock files
            // (`templates/.KEY.lock`), which have no layer.
            for entry in entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
                let layer = entry.path().join("disk.qcow2");
                match crate::qcow2::read_header(&layer) {
                    Ok(header) => backing.extend(header.backing_file.map(resolved)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(format!("reading {}", layer.display()))(e)),
                }
            }
        }
    }
    Ok(backing)
}

fn resolved(path: PathBuf) -> PathBuf {
    std::fs::canonicalize(&path).unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A fake built image: prune looks at paths and disk chains, not content.
    fn image(cache: &Path, name: &str) -> PathBuf {
        let dir = cache.join("images").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rootfs.ext4"), vec![1u8; 8192]).unwrap();
        dir
    }

    /// `data_dir/kind/name/disk.qcow2`, backed by `image`'s root filesystem.
    fn layer_over(data_dir: &Path, kind: &str, name: &str, image: &Path) -> bool {
        let dir = data_dir.join(kind).join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(image.join("rootfs.ext4"))
            .arg(dir.join("disk.qcow2"))
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn only_images_that_are_not_current_and_back_no_listed_disk_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let (cache, ours, other) = (tmp.path().join("cache"), tmp.path().join("data"), tmp.path().join("other-data"));
        let guestd = tmp.path().join("clade-guestd");
        std::fs::write(&guestd, b"an agent").unwrap();
        let store = ImageStore::new(&cache, Some(guestd));
        let current = store.plan("base").unwrap().image_dir;
        std::fs::create_dir_all(&current).unwrap();
        std::fs::write(current.join("rootfs.ext4"), b"current").unwrap();
        let templated = image(&cache, "old-under-a-template");
        let cold = image(&cache, "old-under-a-cold-booted-vm");
        let unused = image(&cache, "old-unused");
        let staging = cache.join("images").join("abc.tmp-1");
        std::fs::create_dir_all(&staging).unwrap();
        if !layer_over(&ours, "templates", "t1", &templated) || !layer_over(&other, "vms", "v1", &cold) {
            assert!(std::env::var_os("CI").is_none(), "qemu-img is missing");
            eprintln!("skipped: qemu-img is not installed");
            return;
        }
        let both = [ours.clone(), other.clone()];
        // A template's bake lock beside the templates is not one of them.
        std::fs::write(ours.join("templates").join(".t2.lock"), b"").unwrap();

        let listed = store.prune(&both, true).unwrap();
        assert_eq!(listed, [PrunedImage { dir: unused.clone(), bytes: 8192 }]);
        assert!(unused.is_dir() && staging.is_dir(), "a dry run removes nothing");

        assert_eq!(store.prune(&both, false).unwrap(), listed);
        assert!(!unused.exists() && !staging.exists());
        assert!(current.is_dir() && templated.is_dir() && cold.is_dir());
        // A data directory left out is not looked at: what only it used goes.
        let pruned: Vec<PathBuf> = store.prune(std::slice::from_ref(&ours), false).unwrap().into_iter().map(|p| p.dir).collect();
        assert_eq!(pruned, [cold]);
        assert!(templated.is_dir() && current.is_dir());
        // A cache spelled through a symlink still sees the template's image as used.
        let link = tmp.path().join("cache-link");
        std::os::unix::fs::symlink(&cache, &link).unwrap();
        let through_link = ImageStore::new(&link, Some(tmp.path().join("clade-guestd")));
        assert!(through_link.prune(std::slice::from_ref(&ours), false).unwrap().is_empty());
        assert!(templated.is_dir());
    }
}
