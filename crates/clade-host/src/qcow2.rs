//! The few fields of a qcow2 header the host reads itself: a layer's size,
//! and which file backs it (what a disk chain needs to stay whole, and what
//! the host opens to hand a chain to QEMU layer by layer, ADR 14).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"QFI\xfb";
/// QEMU refuses longer backing file names.
const MAX_BACKING_NAME: u32 = 1023;
/// The header extension that names the backing file's format.
const BACKING_FORMAT_EXTENSION: u32 = 0xe279_2aca;
/// How deep a chain may be: snapshots of VMs made from snapshots never
/// chain their memory, but their disk layers do.
pub const MAX_CHAIN: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub virtual_size: u64,
    /// As written in the header: absolute for every layer Clade makes.
    pub backing_file: Option<PathBuf>,
    /// The backing file's format, when the header records it (every layer
    /// Clade makes does, `qemu-img create -F`).
    pub backing_format: Option<Format>,
}

/// A disk image's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Qcow2,
    Raw,
}

impl Format {
    /// QEMU's name for the format driver.
    pub fn driver(self) -> &'static str {
        match self {
            Format::Qcow2 => "qcow2",
            Format::Raw => "raw",
        }
    }
}

/// One layer of a disk chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    pub path: PathBuf,
    pub format: Format,
}

impl Layer {
    pub fn qcow2(path: PathBuf) -> Self {
        Self { path, format: Format::Qcow2 }
    }
}

/// Checks that each qcow2 layer of `layers` (top first) names the next one
/// as its backing file (and its format, where the header records one), and
/// that a qcow2 layer at the bottom names none. Opens only the layers given,
/// never a file a header names.
pub fn check_chain(layers: &[Layer]) -> std::io::Result<()> {
    let mismatch = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    if layers.len() > MAX_CHAIN {
        return Err(mismatch(format!("a disk chain of more than {MAX_CHAIN} layers")));
    }
    for (n, layer) in layers.iter().enumerate().filter(|(_, l)| l.format == Format::Qcow2) {
        let header = read_header(&layer.path)?;
        let below = layers.get(n + 1);
        let named = header.backing_file.as_deref().map(|name| std::path::absolute(name).unwrap_or_default());
        let expected = below.map(|l| std::path::absolute(&l.path).unwrap_or_default());
        if named != expected {
            return Err(mismatch(format!(
                "{} names {:?} as its backing file where {:?} belongs",
                layer.path.display(),
                header.backing_file,
                below.map(|l| &l.path)
            )));
        }
        if let (Some(recorded), Some(below)) = (header.backing_format, below) {
            if recorded != below.format {
                return Err(mismatch(format!(
                    "{} says its backing file is {}, not {}",
                    layer.path.display(),
                    recorded.driver(),
                    below.format.driver()
                )));
            }
        }
    }
    Ok(())
}

pub fn read_header(path: &Path) -> std::io::Result<Header> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
    let mut file = std::fs::File::open(path)?;
    let mut header = [0u8; 104];
    file.read_exact(&mut header[..72])?;
    if &header[..4] != MAGIC {
        return Err(invalid("not a qcow2 image"));
    }
    let be32 = |bytes: &[u8]| u32::from_be_bytes(bytes[..4].try_into().expect("4 bytes"));
    // Version 2 headers are 72 bytes; version 3 ones say how long they are.
    let header_length = match be32(&header[4..]) {
        2 => 72,
        _ => {
            file.read_exact(&mut header[72..104])?;
            u64::from(be32(&header[100..]))
        }
    };
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
    let backing_format = match backing_file {
        Some(_) => backing_format(&mut file, header_length, backing_offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => invalid("header extensions run past the end"),
            _ => e,
        })?,
        None => None,
    };
    Ok(Header { virtual_size, backing_file, backing_format })
}

/// The backing format extension, if any, among the header extensions that
/// follow the header (up to the backing file name, or the first cluster).
fn backing_format(file: &mut std::fs::File, header_length: u64, backing_offset: u64) -> std::io::Result<Option<Format>> {
    let end = if backing_offset > header_length { backing_offset } else { 65536 };
    let mut at = header_length;
    file.seek(SeekFrom::Start(at))?;
    while at + 8 <= end {
        let mut entry = [0u8; 8];
        file.read_exact(&mut entry)?;
        let kind = u32::from_be_bytes(entry[..4].try_into().expect("4 bytes"));
        let length = u32::from_be_bytes(entry[4..].try_into().expect("4 bytes"));
        if kind == 0 || length > 1023 {
            return Ok(None);
        }
        let mut data = vec![0u8; (length as usize).next_multiple_of(8)];
        file.read_exact(&mut data)?;
        if kind == BACKING_FORMAT_EXTENSION {
            return Ok(match &data[..length as usize] {
                b"qcow2" => Some(Format::Qcow2),
                b"raw" => Some(Format::Raw),
                _ => None,
            });
        }
        at += 8 + data.len() as u64;
    }
    Ok(None)
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
        let made =
            std::process::Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"]).arg(&base).arg(&layer).status();
        let Ok(status) = made else {
            assert!(std::env::var_os("CI").is_none(), "qemu-img is missing");
            eprintln!("skipped: qemu-img is not installed");
            return;
        };
        assert!(status.success());
        let header = read_header(&layer).unwrap();
        assert_eq!(header, Header { virtual_size: 1 << 20, backing_file: Some(base.clone()), backing_format: Some(Format::Raw) });
        let plain = dir.path().join("plain.qcow2");
        assert!(std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&plain)
            .arg("1M")
            .status()
            .unwrap()
            .success());
        assert_eq!(read_header(&plain).unwrap().backing_file, None);
        assert_eq!(read_header(&base).unwrap_err().kind(), std::io::ErrorKind::InvalidData);

        // A chain: layer over a layer over the raw base.
        let upper = dir.path().join("upper.qcow2");
        let made = |args: &[&str]| std::process::Command::new("qemu-img").args(args).status().unwrap().success();
        assert!(made(&["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", layer.to_str().unwrap(), upper.to_str().unwrap()]));
        let whole = [Layer::qcow2(upper.clone()), Layer::qcow2(layer.clone()), Layer { path: base.clone(), format: Format::Raw }];
        check_chain(&whole).unwrap();
        let v2 = dir.path().join("v2.qcow2");
        assert!(made(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "compat=0.10",
            "-F",
            "qcow2",
            "-b",
            plain.to_str().unwrap(),
            v2.to_str().unwrap()
        ]));
        assert_eq!(read_header(&v2).unwrap().backing_format, Some(Format::Qcow2), "version 2 headers too");
        check_chain(&[Layer::qcow2(v2.clone()), Layer::qcow2(plain.clone())]).unwrap();
        // Whatever a header names that the records do not is refused.
        let refused = |layers: &[Layer]| check_chain(layers).unwrap_err().kind();
        assert_eq!(refused(&[Layer::qcow2(upper.clone()), Layer::qcow2(plain.clone())]), std::io::ErrorKind::InvalidData, "another layer");
        assert_eq!(refused(&whole[..2]), std::io::ErrorKind::InvalidData, "a layer that has a backing file at the bottom");
        assert_eq!(refused(&[Layer::qcow2(upper.clone())]), std::io::ErrorKind::InvalidData, "a layer alone that has a backing file");
        let raw_named = [Layer::qcow2(upper.clone()), Layer { path: layer.clone(), format: Format::Raw }];
        assert_eq!(refused(&raw_named), std::io::ErrorKind::InvalidData, "a recorded format that disagrees");
        // Without the recorded format, the name alone decides.
        let mut bytes = std::fs::read(&upper).unwrap();
        let at = bytes.windows(4).position(|w| w == BACKING_FORMAT_EXTENSION.to_be_bytes()).unwrap();
        bytes[at..at + 4].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        std::fs::write(&upper, bytes).unwrap();
        assert_eq!(read_header(&upper).unwrap().backing_format, None);
        check_chain(&whole).unwrap();
    }
}
