//! The few fields of a qcow2 header the host reads itself: a layer's size,
//! and which file backs it (what a disk chain needs to stay whole).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"QFI\xfb";
/// QEMU refuses longer backing file names.
const MAX_BACKING_NAME: u32 = 1023;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub virtual_size: u64,
    /// As written in the header: absolute for every layer Clade makes.
    pub backing_file: Option<PathBuf>,
}

pub fn read_header(path: &Path) -> std::io::Result<Header> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
    let mut file = std::fs::File::open(path)?;
    let mut header = [0u8; 32];
    file.read_exact(&mut header)?;
    if &header[..4] != MAGIC {
        return Err(invalid("not a qcow2 image"));
    }
    let backing_offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let backing_len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    let virtual_size = u64::from_be_bytes(header[24..32].try_into().expect("8 bytes"));
    let backing_file = if backing_offset == 0 || backing_len == 0 {
        None
    } else if backing_len > MAX_BACKING_NAME {
        return Err(invalid("backing file name too long"));
    } else {
        let mut name = vec![0u8; backing_len as usize];
        file.seek(SeekFrom::Start(backing_offset))?;
        file.read_exact(&mut name)?;
        let name = String::from_utf8(name).map_err(|_| invalid("backing file name is not UTF-8"))?;
        Some(PathBuf::from(name))
    };
    Ok(Header { virtual_size, backing_file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_size_and_backing_file_qemu_img_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let layer = dir.path().join("layer.qcow2");
        let made = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&base)
            .arg(&layer)
            .status();
        let Ok(status) = made else {
            assert!(std::env::var_os("CI").is_none(), "qemu-img is missing");
            eprintln!("skipped: qemu-img is not installed");
            return;
        };
        assert!(status.success());
        let header = read_header(&layer).unwrap();
        assert_eq!(header, Header { virtual_size: 1 << 20, backing_file: Some(base.clone()) });
        let plain = dir.path().join("plain.qcow2");
        assert!(std::process::Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&plain).arg("1M").status().unwrap().success());
        assert_eq!(read_header(&plain).unwrap().backing_file, None);
        assert_eq!(read_header(&base).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    }
}
