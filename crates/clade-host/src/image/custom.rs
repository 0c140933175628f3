//! Images users build (issue 27): an ext4 root filesystem in the image
//! cache beside the first-party ones, under a key of its own
//! (`custom-<hex>`), booted with the same kernel. Its name is its key, so
//! that what a snapshot or a template records of its image finds it again
//! ([`ImageStore::cached`]).
//!
//! A root filesystem that arrives as a tarball is the user's: nothing in it
//! is trusted. It is unpacked into a staging directory by GNU tar (which
//! keeps members inside it and defers symlinks), and every path the build
//! writes into it (the agent, the default user, `/workspace`) is checked to
//! be reached without a symlink, so that nothing is written outside it.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use clade_proto::ImageDefaults;

use super::{build, hash, io_err, GuestImage, ImageError, ImageStore, GUESTD_PATH_IN_GUEST, ROOTFS_FILE};

/// What starts a custom image's key.
pub const CUSTOM_PREFIX: &str = "custom-";
/// Beside a custom image's file: it is kept by `clade images prune` while
/// this marker is there (a template uses it).
pub(super) const KEEP_MARKER: &str = "custom.json";
/// Smallest and largest custom image, MiB.
pub const MIN_SIZE_MB: u32 = 512;
pub const MAX_SIZE_MB: u32 = 16384;

impl ImageStore {
    /// A new key for a custom image.
    pub fn new_custom_key() -> String {
        format!("{CUSTOM_PREFIX}{}", hash(&[&rand::random::<[u8; 16]>()]))
    }

    /// Whether `name` is a custom image's key (not a recipe's name).
    pub fn is_custom(name: &str) -> bool {
        name.strip_prefix(CUSTOM_PREFIX).is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    }

    /// A custom image, if it is built (and the kernel is).
    pub(super) fn custom(&self, key: &str) -> Result<Option<GuestImage>, ImageError> {
        let base = self.plan("base")?;
        let dir = self.cache_dir.join("images").join(key);
        let rootfs = dir.join(ROOTFS_FILE);
        let kernel = base.kernel_dir.join("vmlinux");
        if !Self::is_custom(key) || !rootfs.is_file() || !kernel.is_file() {
            return Ok(None);
        }
        let kernel_key = base.kernel_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(Some(GuestImage { name: key.to_string(), kernel, rootfs, id: hash(&[kernel_key.as_bytes(), key.as_bytes()]) }))
    }

    /// Publishes the ext4 file `ext4` (moved, made read-only) as custom image `key`.
    pub fn publish_custom(&self, key: &str, ext4: &Path) -> Result<GuestImage, ImageError> {
        if !Self::is_custom(key) {
            return Err(ImageError::UnknownImage { name: key.to_string(), available: "custom-<hex> keys".into() });
        }
        let dir = self.cache_dir.join("images").join(key);
        let staging = build::staging(&dir)?;
        let file = staging.join(ROOTFS_FILE);
        std::fs::rename(ext4, &file).map_err(io_err(format!("moving {} into the image cache", ext4.display())))?;
        set_mode(&file, 0o444)?;
        std::fs::write(staging.join(KEEP_MARKER), b"{}\n").map_err(io_err("writing the image's marker"))?;
        build::publish(&staging, &dir)?;
        self.custom(key)?.ok_or_else(|| ImageError::Io {
            context: format!("custom image {key} was published but is not found (is the kernel built?)"),
            source: std::io::ErrorKind::NotFound.into(),
        })
    }

    /// Lets `clade images prune` remove custom image `key` once nothing
    /// stands on it (its template was deleted or replaced).
    pub fn release_custom(&self, key: &str) {
        if Self::is_custom(key) {
            let _ = std::fs::remove_file(self.cache_dir.join("images").join(key).join(KEEP_MARKER));
        }
    }

    /// A staging directory in the cache for a build's files (an upload,
    /// an unpacked tree), named by this process; the caller removes it.
    pub fn scratch_dir(&self, what: &str) -> Result<PathBuf, ImageError> {
        let name = format!("{}-{what}-{}", std::process::id(), hash(&[&rand::random::<[u8; 16]>()]));
        let dir = self.cache_dir.join("builds").join(name);
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(dir)
    }

    /// Removes the scratch directories of processes that are gone (a
    /// server that stopped mid-build); those of live ones stay.
    pub fn remove_orphan_scratch(&self) {
        for entry in std::fs::read_dir(self.cache_dir.join("builds")).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let owner = name.split('-').next().and_then(|pid| pid.parse::<u32>().ok());
            if owner.is_none_or(|pid| crate::process::ProcessId::of(pid).is_none()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Unpacks a tarball the user gave (plain, gzip, xz or zstd: tar tells
    /// them apart) into `into`, a new directory. Blocking.
    pub fn unpack_upload(&self, tarball: &Path, into: &Path, log: &Path) -> Result<(), ImageError> {
        std::fs::create_dir_all(into).map_err(io_err(format!("creating {}", into.display())))?;
        build::run(
            "unpacking the upload",
            &[
                "tar".as_ref(),
                "--extract".as_ref(),
                "--numeric-owner".as_ref(),
                "--file".as_ref(),
                tarball.as_os_str(),
                "--directory".as_ref(),
                into.as_os_str(),
            ],
            log,
            &super::Progress::Quiet,
        )
    }

    /// Makes the ext4 image `out` of at least `size_mb` MiB from a root
    /// filesystem `tree` (the user's, unpacked): the agent, the default
    /// user, `/workspace` and the image's `defaults` added. Blocking.
    pub fn ext4_from_tree(&self, tree: &Path, defaults: &ImageDefaults, out: &Path, size_mb: u32, log: &Path) -> Result<(), ImageError> {
        if !has_shell(tree) {
            return Err(ImageError::Invalid("the root filesystem has no /bin/sh".into()));
        }
        let guestd = self.guestd.clone().or_else(super::find_guestd).ok_or(ImageError::GuestdMissing)?;
        make_bootable(tree, &guestd)?;
        write_defaults(tree, defaults)?;
        let used_mb = (crate::space::allocated_bytes(tree) >> 20) as u32;
        // Room for the metadata and some for the sandbox to write.
        let size_mb = size_mb.max(used_mb + used_mb / 4 + 256);
        build::mkfs_ext4(tree, out, &format!("{size_mb}M"), log, &super::Progress::Quiet)
    }
}

/// Writes (or replaces) the image's defaults file when there are any.
fn write_defaults(tree: &Path, defaults: &ImageDefaults) -> Result<(), ImageError> {
    if defaults.is_empty() {
        return Ok(());
    }
    let relative = Path::new(clade_proto::IMAGE_DEFAULTS_PATH.trim_start_matches('/'));
    let file = writable_in_tree(tree, relative)?;
    let _ = std::fs::remove_file(&file);
    write_new(&file, defaults.to_text().as_bytes(), 0o644)
}

/// Whether `/bin/sh` exists in the tree (through its own links, resolved
/// inside it).
fn has_shell(tree: &Path) -> bool {
    let mut path = PathBuf::from("bin/sh");
    for _ in 0..8 {
        let full = in_tree(tree, &path);
        match std::fs::symlink_metadata(&full) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let Ok(target) = std::fs::read_link(&full) else { return false };
                path = if target.is_absolute() {
                    target.strip_prefix("/").unwrap_or(&target).to_path_buf()
                } else {
                    path.parent().unwrap_or(Path::new("")).join(target)
                };
            }
            Ok(meta) => return meta.is_file(),
            Err(_) => {
                // `/bin` itself may be a link (`usr/bin` in a merged /usr).
                let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else { return false };
                let Ok(target) = std::fs::read_link(in_tree(tree, parent)) else { return false };
                let target = if target.is_absolute() { target.strip_prefix("/").unwrap_or(&target).to_path_buf() } else { target };
                path = target.join(path.file_name().unwrap_or_default());
            }
        }
    }
    false
}

/// `relative` under `tree`, `..` and root components dropped.
fn in_tree(tree: &Path, relative: &Path) -> PathBuf {
    tree.join(relative.components().filter(|c| matches!(c, Component::Normal(_))).collect::<PathBuf>())
}

/// Adds what Clade needs to boot and use a root filesystem: the agent at
/// its path (through a merged-/usr `/sbin` link, if it is the usual one),
/// the default user (uid 1000) when there is none, and `/workspace`.
fn make_bootable(tree: &Path, guestd: &Path) -> Result<(), ImageError> {
    let agent_dir = match std::fs::read_link(tree.join("sbin")) {
        Ok(link) if link == Path::new("usr/sbin") || link == Path::new("/usr/sbin") => PathBuf::from("usr/sbin"),
        Ok(link) => return Err(ImageError::Invalid(format!("/sbin is a link to {}; Clade's agent lives in /sbin", link.display()))),
        Err(_) => PathBuf::from("sbin"),
    };
    let agent_name = Path::new(GUESTD_PATH_IN_GUEST).file_name().expect("a file name");
    let agent = writable_in_tree(tree, &agent_dir.join(agent_name))?;
    let _ = std::fs::remove_file(&agent);
    let bytes = std::fs::read(guestd).map_err(io_err(format!("reading {}", guestd.display())))?;
    write_new(&agent, &bytes, 0o755)?;

    let passwd = writable_in_tree(tree, Path::new("etc/passwd"))?;
    let users = std::fs::read_to_string(&passwd).unwrap_or_default();
    if !users.lines().any(|line| line.starts_with("user:")) {
        append(&passwd, "user:x:1000:1000::/home/user:/bin/sh\n")?;
        let group = writable_in_tree(tree, Path::new("etc/group"))?;
        append(&group, "user:x:1000:\n")?;
        let home = writable_in_tree(tree, Path::new("home/user"))?;
        std::fs::create_dir_all(&home).map_err(io_err("creating /home/user"))?;
        std::os::unix::fs::chown(&home, Some(1000), Some(1000)).map_err(io_err("chown /home/user"))?;
    }
    let workspace = writable_in_tree(tree, Path::new("workspace"))?;
    std::fs::create_dir_all(&workspace).map_err(io_err("creating /workspace"))?;
    set_mode(&workspace, 0o1777)
}

/// `relative` under `tree`, refused when any directory on the way is a
/// symlink (or not a directory) or the path itself is a symlink: writing
/// there cannot reach outside the tree.
fn writable_in_tree(tree: &Path, relative: &Path) -> Result<PathBuf, ImageError> {
    let mut path = tree.to_path_buf();
    let parts: Vec<_> = relative.components().collect();
    for (i, part) in parts.iter().enumerate() {
        let Component::Normal(name) = part else { return Err(ImageError::Invalid(format!("{} is not a plain path", relative.display()))) };
        path.push(name);
        let last = i + 1 == parts.len();
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(ImageError::Invalid(format!("/{} is a symbolic link in the root filesystem", relative.display())));
            }
            Ok(meta) if !last && !meta.is_dir() => {
                return Err(ImageError::Invalid(format!("/{} is not a directory in the root filesystem", Path::new(name).display())));
            }
            Ok(_) => {}
            Err(_) if last => {}
            Err(_) => std::fs::create_dir(&path).map_err(io_err(format!("creating {}", path.display())))?,
        }
    }
    Ok(path)
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), ImageError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err(format!("creating {}", path.display())))?;
    file.write_all(bytes).map_err(io_err(format!("writing {}", path.display())))
}

fn append(path: &Path, text: &str) -> Result<(), ImageError> {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    file.write_all(text.as_bytes()).map_err(io_err(format!("writing {}", path.display())))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_err(format!("chmod {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_told_from_recipe_names() {
        let key = ImageStore::new_custom_key();
        assert!(ImageStore::is_custom(&key), "{key}");
        assert_ne!(key, ImageStore::new_custom_key());
        for name in ["base", "custom-", "custom-xyz", "custom-../x"] {
            assert!(!ImageStore::is_custom(name), "{name}");
        }
    }

    #[test]
    fn nothing_is_written_through_a_link_out_of_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, outside) = (dir.path().join("tree"), dir.path().join("outside"));
        std::fs::create_dir_all(tree.join("etc")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, tree.join("home")).unwrap();
        std::os::unix::fs::symlink(outside.join("passwd"), tree.join("etc/group")).unwrap();
        assert!(writable_in_tree(&tree, Path::new("home/user")).is_err(), "a linked directory on the way");
        assert!(writable_in_tree(&tree, Path::new("etc/group")).is_err(), "a linked file");
        assert_eq!(writable_in_tree(&tree, Path::new("etc/passwd")).unwrap(), tree.join("etc/passwd"));
        assert_eq!(writable_in_tree(&tree, Path::new("a/b/c")).unwrap(), tree.join("a/b/c"));
        assert!(tree.join("a/b").is_dir(), "directories on the way are made");
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none(), "nothing written outside");
    }

    #[test]
    fn a_shell_is_found_through_a_merged_usr() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path();
        assert!(!has_shell(tree));
        std::fs::create_dir_all(tree.join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("usr/bin", tree.join("bin")).unwrap();
        std::fs::write(tree.join("usr/bin/dash"), b"").unwrap();
        std::os::unix::fs::symlink("dash", tree.join("usr/bin/sh")).unwrap();
        assert!(has_shell(tree));
    }
}
