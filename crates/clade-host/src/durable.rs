//! Files that must outlive a crash of the machine, not only of the host
//! process: a hibernated VM and a snapshot. A rename alone is atomic for
//! readers, but after a power loss the new name may be on disk before the
//! data it names (ext4 allocates blocks late), leaving an empty file. So
//! such files are flushed before they are renamed into place, and their
//! directory after.

use std::io;
use std::path::Path;

/// Replaces `path` with `bytes` through a temporary name in its directory;
/// with `durable`, the data is on disk before the rename, and the rename
/// after.
pub fn replace(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other(format!("{} has no directory", path.display())))?;
    let name = path.file_name().ok_or_else(|| io::Error::other(format!("{} has no file name", path.display())))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, bytes)?;
    if durable {
        sync_file(&tmp)?;
    }
    std::fs::rename(&tmp, path)?;
    if durable {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Flushes a file's data and metadata to disk.
pub fn sync_file(path: &Path) -> io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// Flushes a directory's entries (names created, renamed or removed in it).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_replaced_whole_and_no_temporary_name_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.json");
        for (content, durable) in [(&b"first"[..], false), (&b"second, longer"[..], true)] {
            replace(&path, content, durable).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), content);
        }
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["vm.json"]);
        let missing = replace(&dir.path().join("gone/vm.json"), b"x", true).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
    }
}
