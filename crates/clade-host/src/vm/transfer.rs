//! A VM's files as they move between hosts (ADR 22): a template, a
//! snapshot or a hibernated VM is a *bundle*, the files of one directory.
//!
//! The host that has a bundle describes it in a [`Manifest`]: each file's
//! size, the ranges that hold data (a template's RAM file is 512 MiB with
//! some 60 MiB written; holes are never sent) and a SHA-256 over those
//! ranges. The host that needs it asks for the data in chunks by offset
//! ([`BundleSource`]), writes each where it belongs in a sparse file, and
//! keeps how far it got: a transfer cut short resumes where it stopped,
//! within the call (a few retries) and across calls (the staging
//! directory stays). A file is published only once its digest matches.
//!
//! Bundles do not change while they are read: a template's files are
//! read-only, a snapshot's are complete before its record exists, and a
//! hibernated VM is held by its host while it is read.

use std::future::Future;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::{io_err, task_err, VmError};

/// The most one read answers: big enough that a round trip is cheap next to it.
pub const CHUNK: u64 = 4 << 20;
/// Reads of one chunk before the transfer gives up (and can be resumed later).
const TRIES: u32 = 4;
/// A manifest kept in the staging directory: a new one that differs (the
/// bundle changed since, a VM hibernated again) starts the transfer over.
const STAGED_MANIFEST: &str = "manifest.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BundleKind {
    /// A template (`templates/<key>`).
    Template,
    /// A snapshot (`snapshots/<id>`): a fork's, or a layer a disk stands on.
    Snapshot,
    /// A hibernated VM (`vms/<id>`).
    Vm,
}

impl BundleKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Template => "template",
            Self::Snapshot => "snapshot",
            Self::Vm => "vm",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Template, Self::Snapshot, Self::Vm].into_iter().find(|k| k.as_str() == s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleFile {
    pub name: String,
    /// Its length; what is not in `extents` reads as zeros.
    pub size: u64,
    /// The ranges that hold data: `[offset, length]`, in order.
    pub extents: Vec<[u64; 2]>,
    /// SHA-256, hex, over each extent's offset and length (little-endian
    /// u64s) and its bytes, in order.
    pub sha256: String,
}

impl BundleFile {
    pub fn data_bytes(&self) -> u64 {
        self.extents.iter().map(|[_, len]| len).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub kind: BundleKind,
    pub id: String,
    pub files: Vec<BundleFile>,
}

impl Manifest {
    pub fn file(&self, name: &str) -> Option<&BundleFile> {
        self.files.iter().find(|f| f.name == name)
    }
}

/// Where a host reads another's bundles (over the cluster's internal API).
pub trait BundleSource: Send + Sync {
    /// Which host this is, for messages.
    fn label(&self) -> &str;
    fn manifest(&self, kind: BundleKind, id: &str) -> impl Future<Output = Result<Manifest, String>> + Send;
    /// At most `len` bytes of file `name` from `offset` (fewer only at its end).
    fn read(&self, kind: BundleKind, id: &str, name: &str, offset: u64, len: u64) -> impl Future<Output = Result<Vec<u8>, String>> + Send;
}

/// A bundle id names one directory: letters, digits and dashes.
pub(super) fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The manifest of the files `names` (those that exist) in `dir`.
pub(super) fn describe(kind: BundleKind, id: &str, dir: &Path, names: &[&str]) -> Result<Manifest, VmError> {
    let mut files = Vec::new();
    for name in names {
        let path = dir.join(name);
        let file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(format!("opening {}", path.display()))(e)),
        };
        let size = file.metadata().map_err(io_err(format!("reading {}", path.display())))?.len();
        let extents = data_extents(&file, size).map_err(io_err(format!("mapping {}", path.display())))?;
        let sha256 = digest(&file, &extents).map_err(io_err(format!("reading {}", path.display())))?;
        files.push(BundleFile { name: name.to_string(), size, extents, sha256 });
    }
    Ok(Manifest { kind, id: id.to_string(), files })
}

/// Up to `len` bytes (at most [`CHUNK`]) of `dir`/`name` from `offset`.
pub(super) fn read_chunk(dir: &Path, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, VmError> {
    let path = dir.join(name);
    let mut file = std::fs::File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
    file.seek(SeekFrom::Start(offset)).map_err(io_err("seeking"))?;
    let mut bytes = Vec::with_capacity(len.min(CHUNK) as usize);
    file.take(len.min(CHUNK)).read_to_end(&mut bytes).map_err(io_err(format!("reading {}", path.display())))?;
    Ok(bytes)
}

/// The ranges of `file` that hold data (the file system's, by
/// `SEEK_DATA`/`SEEK_HOLE`); the whole file where it cannot tell.
fn data_extents(file: &std::fs::File, size: u64) -> std::io::Result<Vec<[u64; 2]>> {
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut extents = Vec::new();
    let mut at = 0i64;
    while (at as u64) < size {
        let start = match lseek(fd, at, Whence::SeekData) {
            Ok(start) => start,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(nix::errno::Errno::EINVAL) => return Ok(vec![[0, size]]),
            Err(e) => return Err(e.into()),
        };
        let end = lseek(fd, start, Whence::SeekHole)?;
        extents.push([start as u64, (end - start) as u64]);
        at = end;
    }
    Ok(extents)
}

fn digest(file: &std::fs::File, extents: &[[u64; 2]]) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; CHUNK as usize];
    for &[offset, len] in extents {
        hasher.update(offset.to_le_bytes());
        hasher.update(len.to_le_bytes());
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK) as usize;
            file.read_exact_at(&mut buffer[..n], offset + done)?;
            hasher.update(&buffer[..n]);
            done += n as u64;
        }
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Brings the files `names` of the bundle `manifest` describes from `source`
/// into `staging` (made if need be), each checked against its digest.
/// Files already there from an earlier call are kept, and a file cut short
/// resumes from its last chunk.
pub(super) async fn fetch<S: BundleSource>(source: &S, manifest: &Manifest, names: &[&str], staging: &Path) -> Result<(), VmError> {
    prepare_staging(manifest, staging)?;
    for name in names {
        let file = manifest.file(name).ok_or_else(|| {
            VmError::Transfer(format!("{} {} on {} has no file {name}", manifest.kind.as_str(), manifest.id, source.label()))
        })?;
        if staging.join(name).is_file() {
            continue;
        }
        fetch_file(source, manifest, file, staging).await?;
    }
    Ok(())
}

/// Makes `staging`, emptied first when it holds another version of the bundle.
fn prepare_staging(manifest: &Manifest, staging: &Path) -> Result<(), VmError> {
    let recorded = staging.join(STAGED_MANIFEST);
    let same = std::fs::read(&recorded).ok().and_then(|b| serde_json::from_slice::<Manifest>(&b).ok()).is_some_and(|m| m == *manifest);
    if !same {
        let _ = std::fs::remove_dir_all(staging);
    }
    std::fs::create_dir_all(staging).map_err(io_err(format!("creating {}", staging.display())))?;
    let json = serde_json::to_vec(manifest).map_err(|e| VmError::Records(format!("a manifest: {e}")))?;
    std::fs::write(&recorded, json).map_err(io_err("recording the manifest"))
}

async fn fetch_file<S: BundleSource>(source: &S, manifest: &Manifest, file: &BundleFile, staging: &Path) -> Result<(), VmError> {
    let part = staging.join(format!("{}.part", file.name));
    let progress = staging.join(format!("{}.progress", file.name));
    let out = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&part).map_err(io_err("staging"))?;
    out.set_len(file.size).map_err(io_err("sizing the staged file"))?;
    // How much of the data, in extent order, an earlier call wrote.
    let resumed = std::fs::read_to_string(&progress).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0).min(file.data_bytes());
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    let mut buffer = vec![0u8; CHUNK as usize];
    for &[offset, len] in &file.extents {
        hasher.update(offset.to_le_bytes());
        hasher.update(len.to_le_bytes());
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(CHUNK);
            if done + n <= resumed {
                out.read_exact_at(&mut buffer[..n as usize], offset + at).map_err(io_err("re-reading the staged file"))?;
                hasher.update(&buffer[..n as usize]);
            } else {
                let bytes = read_with_retries(source, manifest, &file.name, offset + at, n).await?;
                out.write_all_at(&bytes, offset + at).map_err(io_err("writing the staged file"))?;
                hasher.update(&bytes);
                std::fs::write(&progress, (done + n).to_string()).map_err(io_err("recording the transfer's progress"))?;
            }
            at += n;
            done += n;
        }
    }
    if hex::encode(hasher.finalize()) != file.sha256 {
        let _ = std::fs::remove_file(&part);
        let _ = std::fs::remove_file(&progress);
        return Err(VmError::Transfer(format!(
            "file {} of {} {} from {} does not match its checksum; it will be fetched again",
            file.name,
            manifest.kind.as_str(),
            manifest.id,
            source.label()
        )));
    }
    let synced = tokio::task::spawn_blocking(move || out.sync_all()).await.map_err(task_err("sync"))?;
    synced.map_err(io_err("flushing the staged file"))?;
    std::fs::rename(&part, staging.join(&file.name)).map_err(io_err("publishing the staged file"))?;
    let _ = std::fs::remove_file(&progress);
    Ok(())
}

async fn read_with_retries<S: BundleSource>(
    source: &S,
    manifest: &Manifest,
    name: &str,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, VmError> {
    let mut last = String::new();
    for attempt in 0..TRIES {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
        }
        match source.read(manifest.kind, &manifest.id, name, offset, len).await {
            Ok(bytes) if bytes.len() as u64 == len => return Ok(bytes),
            Ok(bytes) => last = format!("{} bytes where {len} were asked for", bytes.len()),
            Err(e) => last = e,
        }
    }
    Err(VmError::Transfer(format!(
        "reading {name} of {} {} from {} (at {offset}, {TRIES} tries): {last}; a retry resumes from there",
        manifest.kind.as_str(),
        manifest.id,
        source.label()
    )))
}

/// One importer at a time per staging directory (across processes too):
/// two imports of one snapshot, or a move and a copy of one VM, would
/// write the same files.
pub(super) struct StagingLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl StagingLock {
    pub(super) async fn take(staging: &Path) -> Result<Self, VmError> {
        let path = staging.with_extension("lock");
        let taken = tokio::task::spawn_blocking(move || {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
            nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| std::io::Error::from(e))
        })
        .await
        .map_err(task_err("staging lock"))?;
        Ok(Self { _lock: taken.map_err(io_err("locking the staging directory"))? })
    }
}

/// Where the bundles fetched from other hosts are staged, under the data directory.
pub(super) fn imports_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("imports")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A bundle directory served from this process; `fail_every`: every
    /// that many reads fails, as a network would.
    struct Local {
        dir: PathBuf,
        reads: AtomicU32,
        fail_every: u32,
        corrupt: bool,
    }

    impl BundleSource for Local {
        fn label(&self) -> &str {
            "local"
        }
        async fn manifest(&self, kind: BundleKind, id: &str) -> Result<Manifest, String> {
            describe(kind, id, &self.dir, &["sparse", "small"]).map_err(|e| e.to_string())
        }
        async fn read(&self, _: BundleKind, _: &str, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, String> {
            let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
            if self.fail_every > 0 && n.is_multiple_of(self.fail_every) {
                return Err("connection reset".into());
            }
            let mut bytes = read_chunk(&self.dir, name, offset, len).map_err(|e| e.to_string())?;
            if self.corrupt {
                bytes[0] ^= 1;
            }
            Ok(bytes)
        }
    }

    fn source(fail_every: u32, corrupt: bool) -> (tempfile::TempDir, Local) {
        let dir = tempfile::tempdir().unwrap();
        let sparse = std::fs::File::create(dir.path().join("sparse")).unwrap();
        sparse.set_len(64 << 20).unwrap();
        // Two data ranges, one over several chunks, in a 64 MiB file.
        let pattern: Vec<u8> = (0..(9 << 20) as u32).map(|i| (i % 251) as u8).collect();
        sparse.write_all_at(&pattern, 1 << 20).unwrap();
        sparse.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        std::fs::write(dir.path().join("small"), b"{\"id\":1}").unwrap();
        let path = dir.path().to_path_buf();
        (dir, Local { dir: path, reads: AtomicU32::new(0), fail_every, corrupt })
    }

    fn block_on<F: Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(future)
    }

    #[test]
    fn a_bundle_arrives_whole_and_sparse_through_failing_reads() {
        let (_dir, local) = source(3, false);
        let manifest = block_on(local.manifest(BundleKind::Snapshot, "s1")).unwrap();
        let sparse = manifest.file("sparse").unwrap();
        assert!(sparse.data_bytes() < 16 << 20, "holes are not data: {:?}", sparse.extents);
        let staging = tempfile::tempdir().unwrap();
        block_on(fetch(&local, &manifest, &["sparse", "small"], staging.path())).unwrap();
        for name in ["sparse", "small"] {
            assert_eq!(std::fs::read(staging.path().join(name)).unwrap(), std::fs::read(local.dir.join(name)).unwrap(), "{name}");
        }
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(staging.path().join("sparse")).unwrap().blocks() * 512;
        assert!(blocks < 32 << 20, "the copy stays sparse: {blocks} bytes allocated");
    }

    #[test]
    fn a_transfer_that_gives_up_resumes_where_it_stopped() {
        // Every read fails after the first few: the call gives up…
        let (_dir, mut local) = source(0, false);
        let manifest = block_on(local.manifest(BundleKind::Vm, "v1")).unwrap();
        let staging = tempfile::tempdir().unwrap();
        struct FirstReadsOnly<'a>(&'a Local, AtomicU32);
        impl BundleSource for FirstReadsOnly<'_> {
            fn label(&self) -> &str {
                "flaky"
            }
            async fn manifest(&self, kind: BundleKind, id: &str) -> Result<Manifest, String> {
                self.0.manifest(kind, id).await
            }
            async fn read(&self, _: BundleKind, _: &str, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, String> {
                if self.1.fetch_add(1, Ordering::Relaxed) >= 2 {
                    return Err("host unreachable".into());
                }
                read_chunk(&self.0.dir, name, offset, len).map_err(|e| e.to_string())
            }
        }
        let flaky = FirstReadsOnly(&local, AtomicU32::new(0));
        let failed = block_on(fetch(&flaky, &manifest, &["sparse"], staging.path())).unwrap_err();
        assert!(failed.to_string().contains("a retry resumes"), "{failed}");
        let progress: u64 = std::fs::read_to_string(staging.path().join("sparse.progress")).unwrap().parse().unwrap();
        assert_eq!(progress, 2 * CHUNK, "two chunks were kept");
        // …and the next call asks only for the rest.
        local.fail_every = 0;
        local.reads.store(0, Ordering::Relaxed);
        block_on(fetch(&local, &manifest, &["sparse"], staging.path())).unwrap();
        let chunks = manifest.file("sparse").unwrap().extents.iter().map(|[_, len]| len.div_ceil(CHUNK)).sum::<u64>();
        assert_eq!(u64::from(local.reads.load(Ordering::Relaxed)), chunks - 2);
        assert_eq!(std::fs::read(staging.path().join("sparse")).unwrap(), std::fs::read(local.dir.join("sparse")).unwrap());
    }

    #[test]
    fn bytes_that_do_not_match_the_digest_are_never_published() {
        let (_dir, local) = source(0, true);
        let manifest = block_on(local.manifest(BundleKind::Template, "t1")).unwrap();
        let staging = tempfile::tempdir().unwrap();
        let refused = block_on(fetch(&local, &manifest, &["small"], staging.path())).unwrap_err();
        assert!(refused.to_string().contains("does not match its checksum"), "{refused}");
        assert!(!staging.path().join("small").exists() && !staging.path().join("small.part").exists());
    }

    #[test]
    fn a_changed_bundle_starts_its_transfer_over() {
        let (_dir, local) = source(0, false);
        let staging = tempfile::tempdir().unwrap();
        let first = block_on(local.manifest(BundleKind::Vm, "v1")).unwrap();
        block_on(fetch(&local, &first, &["small"], staging.path())).unwrap();
        std::fs::write(local.dir.join("small"), b"{\"id\":2}").unwrap();
        let second = block_on(local.manifest(BundleKind::Vm, "v1")).unwrap();
        block_on(fetch(&local, &second, &["small"], staging.path())).unwrap();
        assert_eq!(std::fs::read(staging.path().join("small")).unwrap(), b"{\"id\":2}");
    }
}
