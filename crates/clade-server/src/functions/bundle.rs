//! A function's code as Clade keeps it: always a tar.gz bundle, whatever
//! form it came in. A create sends one file as base64 (plain, as both
//! PandaStack SDKs send it, or gzip, as its server's comment says), or a
//! tar.gz; a deploy uploads a tar.gz. Bundles are checked here, before
//! anything is kept: every entry a relative path inside the code's root,
//! only files and directories, and a bounded size once unpacked.

use std::io::Read;

use base64::Engine;
use flate2::read::GzDecoder;

/// The most a created function's code may be, decoded (PandaStack's limit).
pub const CODE_LIMIT: usize = 512 << 10;
/// The most a deployed bundle may be, compressed.
pub const BUNDLE_LIMIT: usize = 16 << 20;
/// The most a bundle may unpack to.
const UNPACKED_LIMIT: u64 = 128 << 20;
/// The most entries a bundle may have.
const ENTRIES_LIMIT: usize = 10_000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BundleError {
    #[error("code is not base64: {0}")]
    Base64(String),
    #[error("code is larger than {} KiB once decoded", CODE_LIMIT >> 10)]
    CodeTooLarge,
    #[error("the bundle is larger than {} MiB", BUNDLE_LIMIT >> 20)]
    BundleTooLarge,
    #[error("the bundle unpacks to more than {} MiB", UNPACKED_LIMIT >> 20)]
    UnpackedTooLarge,
    #[error("the bundle has more than {ENTRIES_LIMIT} entries")]
    TooManyEntries,
    #[error("the bundle is not a tar.gz archive: {0}")]
    NotTarGz(String),
    #[error("bundle entry {0:?}: only files and directories, at relative paths inside the bundle")]
    BadEntry(String),
    #[error("the entrypoint {0:?} is not in the code")]
    NoEntrypoint(String),
    #[error("entrypoint {0:?}: a relative path to a file inside the code (no '..', at most 255 bytes)")]
    BadEntrypoint(String),
}

/// Code as kept: the bundle and the size it was given at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Code {
    pub bundle: Vec<u8>,
    pub size: u64,
}

/// A create's `code` (base64): a tar.gz is kept as it is, after the same
/// checks as a deploy's; one file (plain or gzip) becomes a bundle of
/// `entrypoint` alone.
pub fn from_base64(code: &str, entrypoint: &str) -> Result<Code, BundleError> {
    check_entrypoint(entrypoint)?;
    let compact: String = code.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if compact.len() > CODE_LIMIT.div_ceil(3) * 4 + 4 {
        return Err(BundleError::CodeTooLarge);
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(compact).map_err(|e| BundleError::Base64(e.to_string()))?;
    if bytes.len() > CODE_LIMIT {
        return Err(BundleError::CodeTooLarge);
    }
    let size = bytes.len() as u64;
    if !is_gzip(&bytes) {
        return Ok(Code { bundle: single_file(entrypoint, &bytes), size });
    }
    let unpacked = gunzip(&bytes, CODE_LIMIT as u64)?;
    if is_tar(&unpacked) {
        check(&bytes, entrypoint)?;
        return Ok(Code { bundle: bytes, size });
    }
    Ok(Code { bundle: single_file(entrypoint, &unpacked), size })
}

/// A deploy's upload: checked and kept as it is.
pub fn from_upload(bundle: Vec<u8>, entrypoint: &str) -> Result<Code, BundleError> {
    check_entrypoint(entrypoint)?;
    if bundle.len() > BUNDLE_LIMIT {
        return Err(BundleError::BundleTooLarge);
    }
    check(&bundle, entrypoint)?;
    let size = bundle.len() as u64;
    Ok(Code { bundle, size })
}

/// An entrypoint is a relative path inside the code.
pub fn check_entrypoint(entrypoint: &str) -> Result<(), BundleError> {
    let bad = entrypoint.is_empty()
        || entrypoint.len() > 255
        || entrypoint.starts_with('/')
        || entrypoint.chars().any(char::is_control)
        || entrypoint.split('/').any(|part| part.is_empty() || part == "..");
    if bad {
        return Err(BundleError::BadEntrypoint(entrypoint.to_string()));
    }
    Ok(())
}

/// Whether a kept bundle holds the file `entrypoint`.
pub fn holds(bundle: &[u8], entrypoint: &str) -> bool {
    check(bundle, entrypoint).is_ok()
}

/// Checks every entry of a bundle, and that it holds the file `entrypoint`.
fn check(bundle: &[u8], entrypoint: &str) -> Result<(), BundleError> {
    let mut archive = tar::Archive::new(GzDecoder::new(bundle));
    let entries = archive.entries().map_err(|e| BundleError::NotTarGz(e.to_string()))?;
    let (mut unpacked, mut count, mut has_entrypoint) = (0u64, 0usize, false);
    for entry in entries {
        let entry = entry.map_err(|e| BundleError::NotTarGz(e.to_string()))?;
        count += 1;
        if count > ENTRIES_LIMIT {
            return Err(BundleError::TooManyEntries);
        }
        let path = entry.path().map_err(|e| BundleError::NotTarGz(e.to_string()))?.to_string_lossy().into_owned();
        let relative = path.trim_start_matches("./").trim_end_matches('/');
        let kind = entry.header().entry_type();
        let inside = !path.starts_with('/') && !relative.split('/').any(|part| part == "..");
        if !inside || !(kind.is_file() || kind.is_dir()) {
            return Err(BundleError::BadEntry(path));
        }
        unpacked += entry.size();
        if unpacked > UNPACKED_LIMIT {
            return Err(BundleError::UnpackedTooLarge);
        }
        has_entrypoint |= kind.is_file() && relative == entrypoint;
    }
    if count == 0 {
        return Err(BundleError::NotTarGz("it is empty".into()));
    }
    if !has_entrypoint {
        return Err(BundleError::NoEntrypoint(entrypoint.to_string()));
    }
    Ok(())
}

/// A bundle of one file.
fn single_file(name: &str, content: &[u8]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default()));
    let mut header = tar::Header::new_gnu();
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_cksum();
    // Writing into memory cannot fail, and the name was checked.
    builder.append_data(&mut header, name, content).expect("a tar entry in memory");
    builder.into_inner().and_then(flate2::write::GzEncoder::finish).expect("a gzip stream in memory")
}

fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

fn is_tar(bytes: &[u8]) -> bool {
    bytes.get(257..262) == Some(b"ustar".as_slice())
}

fn gunzip(bytes: &[u8], limit: u64) -> Result<Vec<u8>, BundleError> {
    let mut out = Vec::new();
    GzDecoder::new(bytes).take(limit + 1).read_to_end(&mut out).map_err(|e| BundleError::NotTarGz(e.to_string()))?;
    if out.len() as u64 > limit {
        return Err(BundleError::CodeTooLarge);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn files_of(bundle: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut archive = tar::Archive::new(GzDecoder::new(bundle));
        archive
            .entries()
            .unwrap()
            .map(|entry| {
                let mut entry = entry.unwrap();
                let mut content = Vec::new();
                entry.read_to_end(&mut content).unwrap();
                (entry.path().unwrap().to_string_lossy().into_owned(), content)
            })
            .collect()
    }

    #[test]
    fn a_plain_or_gzipped_file_becomes_a_bundle_of_its_entrypoint() {
        let source = b"def handler(event):\n    return event\n";
        for code in [b64(source), b64(&gzip(source))] {
            let kept = from_base64(&code, "handler.py").unwrap();
            assert_eq!(files_of(&kept.bundle), [("handler.py".to_string(), source.to_vec())]);
        }
        assert_eq!(from_base64(&b64(source), "handler.py").unwrap().size, source.len() as u64);
    }

    #[test]
    fn a_bundle_is_kept_as_it_is_and_must_hold_its_entrypoint() {
        let bundle = single_file("app/main.py", b"print(1)");
        assert_eq!(from_base64(&b64(&bundle), "app/main.py").unwrap().bundle, bundle);
        assert_eq!(from_upload(bundle.clone(), "app/main.py").unwrap().bundle, bundle);
        assert_eq!(from_upload(bundle, "main.py"), Err(BundleError::NoEntrypoint("main.py".into())));
    }

    #[test]
    fn bad_code_is_refused_with_its_reason() {
        assert!(matches!(from_base64("not base64!", "h.py"), Err(BundleError::Base64(_))));
        assert_eq!(from_base64(&b64(&vec![b'x'; CODE_LIMIT + 1]), "h.py"), Err(BundleError::CodeTooLarge));
        assert!(matches!(from_upload(gzip(b"just text"), "h.py"), Err(BundleError::NotTarGz(_))));
        assert!(matches!(from_upload(b"plain".to_vec(), "h.py"), Err(BundleError::NotTarGz(_))));
        for entrypoint in ["", "/etc/passwd", "../x.py", "a//b.py", "a\nb.py"] {
            assert_eq!(from_base64(&b64(b"x"), entrypoint), Err(BundleError::BadEntrypoint(entrypoint.into())));
        }
    }

    #[test]
    fn entries_outside_the_root_or_links_are_refused() {
        let with = |name: &str, kind: tar::EntryType| {
            let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default()));
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_size(0);
            header.set_cksum();
            // Written raw: the tar crate refuses to build a '..' path itself.
            let raw = header.as_old_mut();
            raw.name[..name.len()].copy_from_slice(name.as_bytes());
            header.set_cksum();
            builder.append(&header, std::io::empty()).unwrap();
            let mut ok = tar::Header::new_gnu();
            ok.set_size(1);
            ok.set_cksum();
            builder.append_data(&mut ok, "h.py", b"x".as_slice()).unwrap();
            builder.into_inner().unwrap().finish().unwrap()
        };
        assert!(from_upload(with("data/", tar::EntryType::Directory), "h.py").is_ok());
        assert_eq!(from_upload(with("../evil", tar::EntryType::Regular), "h.py"), Err(BundleError::BadEntry("../evil".into())));
        assert_eq!(from_upload(with("link", tar::EntryType::Symlink), "h.py"), Err(BundleError::BadEntry("link".into())));
    }
}
