//! File operations: streamed reads and atomic writes, and the small
//! metadata requests (list, stat, remove, rename, chmod, mkdir).
//!
//! Every path must be absolute; a relative one is refused with
//! `InvalidInput` rather than guessed at (the agent's own working directory
//! means nothing to the host). Operations run as root, the agent's user.

use std::fs::{self, Metadata};
use std::io::{self, SeekFrom};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use clade_proto::{
    read_frame, write_frame, DirEntry, ErrorKind, FileKind, FileStat, FrameError, GuestError, GuestFrame, HostFrame, ReadFileRequest,
    Reply, WriteFileRequest, CHUNK_SIZE,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt};

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// The operation failed; the host is told with `GuestFrame::Error`.
    #[error(transparent)]
    Refused(#[from] GuestError),
    /// The substream failed: nobody is left to tell.
    #[error("agent channel")]
    Channel(#[from] FrameError),
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> FilesError + '_ {
    move |e| FilesError::Refused(GuestError::from_io(&e, &path.display().to_string()))
}

/// Checks that a request path is absolute and turns it into a `PathBuf`.
pub fn absolute(path: &str) -> Result<PathBuf, GuestError> {
    if !path.starts_with('/') {
        return Err(GuestError::new(ErrorKind::InvalidInput, format!("{path}: paths must be absolute")));
    }
    if path.contains('\0') {
        return Err(GuestError::new(ErrorKind::InvalidInput, "path contains a NUL byte"));
    }
    Ok(PathBuf::from(path))
}

/// The path with `.` and `..` resolved lexically, for recognising `/` in disguise.
fn normalized(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The protocol's view of a file's metadata. `symlink_target` is filled for symlinks.
pub fn file_stat(path: &Path, meta: &Metadata) -> FileStat {
    let file_type = meta.file_type();
    let kind = if file_type.is_symlink() {
        FileKind::Symlink
    } else if file_type.is_dir() {
        FileKind::Dir
    } else if file_type.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let symlink_target = match kind {
        FileKind::Symlink => fs::read_link(path).ok().map(|t| t.to_string_lossy().into_owned()),
        _ => None,
    };
    FileStat {
        kind,
        size: meta.size(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_ms: meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000,
        symlink_target,
    }
}

/// Opens what `path` names for reading — following links, without ever
/// waiting: a FIFO opens at once (`O_NONBLOCK`) rather than when a writer
/// comes, a terminal does not become ours (`O_NOCTTY`) — and refuses
/// anything but a regular file, judged on the opened descriptor (so a link
/// to a FIFO or a device is refused like the thing itself). The descriptor
/// stays non-blocking: a `/proc` or `/sys` file that has nothing to give
/// (`/proc/kmsg`) fails with `EAGAIN` instead of holding a thread for ever.
fn open_regular(path: &Path, shown: &str) -> Result<(fs::File, Metadata), FilesError> {
    let file = fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path).map_err(io_err(path))?;
    let meta = file.metadata().map_err(io_err(path))?;
    if meta.is_dir() {
        return Err(GuestError::new(ErrorKind::IsADirectory, format!("{shown}: is a directory")).into());
    }
    if !meta.is_file() {
        let what = special_kind(&meta);
        let msg = format!("{shown}: not a regular file (a {what}): it may never end or never answer; read it with exec");
        return Err(GuestError::new(ErrorKind::InvalidInput, msg).into());
    }
    Ok((file, meta))
}

/// What a file that is not a regular file or a directory is.
fn special_kind(meta: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_fifo() {
        "FIFO"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_block_device() {
        "block device"
    } else if kind.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// `ReadFile`: `FileInfo`, then `Chunk`s from `offset` for `length` bytes (or to EOF), then `End`.
/// Only regular files (see [`open_regular`]); the read ends when the host
/// goes away (the next chunk cannot be sent).
pub async fn read_file<W: AsyncWrite + Unpin>(w: &mut W, req: ReadFileRequest) -> Result<(), FilesError> {
    let path = absolute(&req.path)?;
    let opened = {
        let (path, shown) = (path.clone(), req.path.clone());
        tokio::task::spawn_blocking(move || open_regular(&path, &shown))
            .await
            .map_err(|e| GuestError::new(ErrorKind::Io, format!("open task: {e}")))??
    };
    let (file, meta) = opened;
    let mut file = tokio::fs::File::from_std(file);
    write_frame(w, &GuestFrame::FileInfo(file_stat(&path, &meta))).await?;
    if req.offset > 0 {
        file.seek(SeekFrom::Start(req.offset)).await.map_err(io_err(&path))?;
    }
    let mut remaining = req.length.unwrap_or(u64::MAX);
    let mut buf = vec![0u8; CHUNK_SIZE];
    while remaining > 0 {
        let want = (remaining.min(CHUNK_SIZE as u64)) as usize;
        let n = match file.read(&mut buf[..want]).await {
            Ok(n) => n,
            // A `/proc` or `/sys` file with nothing to give now (the descriptor does not wait).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let msg = format!("{}: nothing to read now, and it would wait for more; read it with exec", req.path);
                return Err(GuestError::new(ErrorKind::InvalidInput, msg).into());
            }
            Err(e) => return Err(io_err(&path)(e)),
        };
        if n == 0 {
            break;
        }
        remaining -= n as u64;
        write_frame(w, &GuestFrame::Chunk(buf[..n].to_vec())).await?;
    }
    write_frame(w, &GuestFrame::End).await?;
    Ok(())
}

/// `WriteFile`: takes `Chunk`s until `End`, then answers `Written`. A
/// replacement goes through a temporary file in the same directory, renamed
/// over the target on `End`; a stream that ends early leaves the target
/// untouched. Appends go straight to the file and cannot be undone.
pub async fn write_file<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, req: WriteFileRequest) -> Result<(), FilesError> {
    let requested = absolute(&req.path)?;
    let target = write_target(&requested)?;
    let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Err(GuestError::new(ErrorKind::InvalidInput, format!("{}: not a file path", req.path)).into());
    };
    let parent = target.parent().unwrap_or(Path::new("/")).to_path_buf();
    let existing = match fs::metadata(&target) {
        Ok(meta) if meta.is_dir() => return Err(GuestError::new(ErrorKind::IsADirectory, format!("{}: is a directory", req.path)).into()),
        // Opening a FIFO to append would wait for a reader; a device is no file to add to.
        Ok(meta) if req.append && !meta.is_file() => {
            let what = special_kind(&meta);
            let msg = format!("{}: not a regular file (a {what}): write to it with exec", req.path);
            return Err(GuestError::new(ErrorKind::InvalidInput, msg).into());
        }
        Ok(meta) => Some(meta),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_err(&target)(e)),
    };
    match fs::metadata(&parent) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(GuestError::new(ErrorKind::NotADirectory, format!("{}: not a directory", parent.display())).into()),
        Err(e) if e.kind() == io::ErrorKind::NotFound && req.create_parents => {
            fs::DirBuilder::new().recursive(true).mode(0o755).create(&parent).map_err(io_err(&parent))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let msg = format!("{}: parent directory does not exist", req.path);
            return Err(GuestError::new(ErrorKind::NotFound, msg).into());
        }
        Err(e) => return Err(io_err(&parent)(e)),
    }
    let new_mode = req.mode.unwrap_or(0o644) & 0o7777;

    if req.append {
        let file = fs::OpenOptions::new().append(true).create(true).mode(new_mode).open(&target);
        let mut file = tokio::fs::File::from_std(file.map_err(io_err(&target))?);
        if existing.is_none() {
            // The umask must not change the mode the host asked for.
            file.set_permissions(fs::Permissions::from_mode(new_mode)).await.map_err(io_err(&target))?;
        }
        let bytes = receive(s, &mut file, &target).await?;
        return reply(s, Reply::Written { bytes }).await;
    }

    let temp = parent.join(format!(".{name}.clade-tmp-{:016x}", rand::random::<u64>()));
    let file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp);
    let mut file = tokio::fs::File::from_std(file.map_err(io_err(&temp))?);
    let result = async {
        let bytes = receive(s, &mut file, &target).await?;
        let (mode, owner) = match &existing {
            Some(meta) => (meta.mode() & 0o7777, Some((meta.uid(), meta.gid()))),
            None => (new_mode, None),
        };
        let std_file = file.into_std().await;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&std_file, Some(uid), Some(gid)).map_err(io_err(&target))?;
        }
        // After chown, which clears setuid/setgid bits.
        std_file.set_permissions(fs::Permissions::from_mode(mode)).map_err(io_err(&target))?;
        fs::rename(&temp, &target).map_err(io_err(&target))?;
        Ok::<_, FilesError>(bytes)
    }
    .await;
    match result {
        Ok(bytes) => reply(s, Reply::Written { bytes }).await,
        Err(e) => {
            let _ = fs::remove_file(&temp);
            Err(e)
        }
    }
}

/// Writes go through an existing symlink to its target, as a plain write would.
fn write_target(path: &Path) -> Result<PathBuf, FilesError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => match fs::canonicalize(path) {
            Ok(resolved) => Ok(resolved),
            // A dangling link: create what it points to.
            Err(_) => {
                let link = fs::read_link(path).map_err(io_err(path))?;
                Ok(path.parent().unwrap_or(Path::new("/")).join(link))
            }
        },
        _ => Ok(path.to_path_buf()),
    }
}

/// Copies `Chunk`s into `file` until `End`; returns the byte count.
async fn receive<S, F>(s: &mut S, file: &mut F, path: &Path) -> Result<u64, FilesError>
where
    S: AsyncRead + Unpin,
    F: AsyncWrite + Unpin,
{
    let mut bytes = 0u64;
    loop {
        match read_frame::<_, HostFrame>(s).await? {
            Some(HostFrame::Chunk(data)) => {
                file.write_all(&data).await.map_err(io_err(path))?;
                bytes += data.len() as u64;
            }
            Some(HostFrame::End) => break,
            Some(other) => {
                let msg = format!("expected a file chunk, got {other:?}");
                return Err(GuestError::new(ErrorKind::Protocol, msg).into());
            }
            None => {
                let e = io::Error::new(io::ErrorKind::UnexpectedEof, "the host ended the upload without End");
                return Err(FrameError::Io(e).into());
            }
        }
    }
    // Surfaces errors of writes still in flight.
    file.flush().await.map_err(io_err(path))?;
    Ok(bytes)
}

async fn reply<W: AsyncWrite + Unpin>(w: &mut W, reply: Reply) -> Result<(), FilesError> {
    write_frame(w, &GuestFrame::Reply(reply)).await?;
    Ok(())
}

/// `ListDir`: entries sorted by name, without `.` and `..`, each with its lstat.
/// Names that are not UTF-8 are shown lossily.
pub fn list_dir(path: &str) -> Result<Reply, GuestError> {
    let dir = absolute(path)?;
    let meta = fs::metadata(&dir).map_err(|e| GuestError::from_io(&e, path))?;
    if !meta.is_dir() {
        return Err(GuestError::new(ErrorKind::NotADirectory, format!("{path}: not a directory")));
    }
    let mut entries = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| GuestError::from_io(&e, path))? {
        let entry = entry.map_err(|e| GuestError::from_io(&e, path))?;
        let entry_path = entry.path();
        // An entry removed while we list it is simply not listed.
        let Ok(meta) = fs::symlink_metadata(&entry_path) else {
            continue;
        };
        entries.push(DirEntry { name: entry.file_name().to_string_lossy().into_owned(), stat: file_stat(&entry_path, &meta) });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Reply::Entries(entries))
}

/// `Stat`: of the path itself (symlinks are not followed).
pub fn stat(path: &str) -> Result<Reply, GuestError> {
    let p = absolute(path)?;
    let meta = fs::symlink_metadata(&p).map_err(|e| GuestError::from_io(&e, path))?;
    Ok(Reply::Stat(file_stat(&p, &meta)))
}

/// `Remove`: files and symlinks; directories if empty, or with `recursive`. Never `/`.
pub fn remove(path: &str, recursive: bool) -> Result<Reply, GuestError> {
    let p = absolute(path)?;
    if normalized(&p) == Path::new("/") {
        return Err(GuestError::new(ErrorKind::InvalidInput, "refusing to remove /"));
    }
    let meta = fs::symlink_metadata(&p).map_err(|e| GuestError::from_io(&e, path))?;
    let result = if !meta.is_dir() {
        fs::remove_file(&p)
    } else if recursive {
        fs::remove_dir_all(&p)
    } else {
        fs::remove_dir(&p)
    };
    result.map_err(|e| GuestError::from_io(&e, path))?;
    Ok(Reply::Done)
}

/// `Rename`: replaces `to` if it is a file (or an empty directory, as rename(2) does).
pub fn rename(from: &str, to: &str) -> Result<Reply, GuestError> {
    let (src, dst) = (absolute(from)?, absolute(to)?);
    fs::rename(&src, &dst).map_err(|e| GuestError::from_io(&e, &format!("{from} -> {to}")))?;
    Ok(Reply::Done)
}

/// `Chmod`: permission bits (and setuid/setgid/sticky) only.
pub fn chmod(path: &str, mode: u32) -> Result<Reply, GuestError> {
    let p = absolute(path)?;
    fs::set_permissions(&p, fs::Permissions::from_mode(mode & 0o7777)).map_err(|e| GuestError::from_io(&e, path))?;
    Ok(Reply::Done)
}

/// `Mkdir`: the directory and its missing parents (0755); an existing directory is fine.
pub fn mkdir(path: &str) -> Result<Reply, GuestError> {
    let p = absolute(path)?;
    fs::DirBuilder::new().recursive(true).mode(0o755).create(&p).map_err(|e| GuestError::from_io(&e, path))?;
    Ok(Reply::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::{next, send, temp_dir, Harness};
    use clade_proto::mux::Substream;
    use clade_proto::Request;

    fn p(dir: &tempfile::TempDir, rel: &str) -> String {
        dir.path().join(rel).display().to_string()
    }

    async fn upload(h: &Harness, req: WriteFileRequest, data: &[u8]) -> GuestFrame {
        let mut s = h.open(&Request::WriteFile(req)).await;
        for chunk in data.chunks(CHUNK_SIZE) {
            send(&mut s, HostFrame::Chunk(chunk.to_vec())).await;
        }
        send(&mut s, HostFrame::End).await;
        next(&mut s).await.unwrap()
    }

    fn write_req(path: String) -> WriteFileRequest {
        WriteFileRequest { path, mode: None, create_parents: false, append: false }
    }

    /// Reads a whole download: its stat, then the bytes.
    async fn download(s: &mut Substream) -> Result<(FileStat, Vec<u8>), GuestError> {
        let stat = match next(s).await.unwrap() {
            GuestFrame::FileInfo(stat) => stat,
            GuestFrame::Error(e) => return Err(e),
            other => panic!("unexpected {other:?}"),
        };
        let mut data = Vec::new();
        loop {
            match next(s).await.unwrap() {
                GuestFrame::Chunk(chunk) => {
                    assert!(chunk.len() <= CHUNK_SIZE);
                    data.extend(chunk);
                }
                GuestFrame::End => return Ok((stat, data)),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    async fn read(h: &Harness, path: String, offset: u64, length: Option<u64>) -> Result<(FileStat, Vec<u8>), GuestError> {
        let mut s = h.open(&Request::ReadFile(ReadFileRequest { path, offset, length })).await;
        download(&mut s).await
    }

    fn error_kind(frame: GuestFrame) -> ErrorKind {
        match frame {
            GuestFrame::Error(e) => e.kind,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn twenty_mib_round_trip_byte_identical() {
        let h = Harness::start().await;
        let dir = temp_dir();
        let data: Vec<u8> = (0..20 << 20).map(|_| rand::random::<u8>()).collect();
        let reply = upload(&h, write_req(p(&dir, "big.bin")), &data).await;
        assert_eq!(reply, GuestFrame::Reply(Reply::Written { bytes: data.len() as u64 }));
        let (stat, back) = read(&h, p(&dir, "big.bin"), 0, None).await.unwrap();
        assert_eq!((stat.kind, stat.size, stat.mode), (FileKind::File, data.len() as u64, 0o644));
        assert!(back == data, "read-back differs");
        let (_, part) = read(&h, p(&dir, "big.bin"), 1000, Some(300_000)).await.unwrap();
        assert!(part == data[1000..301_000]);
        let (_, tail) = read(&h, p(&dir, "big.bin"), data.len() as u64 - 5, Some(100)).await.unwrap();
        assert_eq!(tail, data[data.len() - 5..]);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn write_creates_parents_only_when_asked() {
        let h = Harness::start().await;
        let dir = temp_dir();
        let frame = upload(&h, write_req(p(&dir, "a/b/c.txt")), b"x").await;
        assert_eq!(error_kind(frame), ErrorKind::NotFound);
        let req = WriteFileRequest { create_parents: true, mode: Some(0o600), ..write_req(p(&dir, "a/b/c.txt")) };
        assert_eq!(upload(&h, req, b"hi").await, GuestFrame::Reply(Reply::Written { bytes: 2 }));
        assert_eq!(fs::read(dir.path().join("a/b/c.txt")).unwrap(), b"hi");
        assert_eq!(fs::metadata(dir.path().join("a/b/c.txt")).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(fs::metadata(dir.path().join("a/b")).unwrap().mode() & 0o7777, 0o755);
        // A refusal before the data must not leave a big upload blocked on flow control.
        let big = vec![7u8; 4 << 20];
        let frame = tokio::time::timeout(std::time::Duration::from_secs(20), upload(&h, write_req(p(&dir, "a")), &big));
        assert_eq!(error_kind(frame.await.expect("the refused upload finishes")), ErrorKind::IsADirectory);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn replacing_keeps_mode_and_append_appends() {
        let h = Harness::start().await;
        let dir = temp_dir();
        let target = dir.path().join("f");
        fs::write(&target, "old").unwrap();
        fs::set_permissions(&target, fs::Permissions::from_mode(0o750)).unwrap();
        let req = WriteFileRequest { mode: Some(0o600), ..write_req(p(&dir, "f")) };
        upload(&h, req, b"new").await;
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(fs::metadata(&target).unwrap().mode() & 0o7777, 0o750);
        let req = WriteFileRequest { append: true, ..write_req(p(&dir, "f")) };
        assert_eq!(upload(&h, req, b"er").await, GuestFrame::Reply(Reply::Written { bytes: 2 }));
        assert_eq!(fs::read(&target).unwrap(), b"newer");
        // No temporary files are left behind.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn an_upload_without_end_changes_nothing() {
        let h = Harness::start().await;
        let dir = temp_dir();
        fs::write(dir.path().join("f"), "old").unwrap();
        let mut s = h.open(&Request::WriteFile(write_req(p(&dir, "f")))).await;
        send(&mut s, HostFrame::Chunk(b"partial".to_vec())).await;
        drop(s);
        // The agent notices the closed substream and cleans up.
        for _ in 0..100 {
            if fs::read_dir(dir.path()).unwrap().count() == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(fs::read(dir.path().join("f")).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "temp file left behind");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn read_errors() {
        let h = Harness::start().await;
        let dir = temp_dir();
        assert_eq!(read(&h, p(&dir, "missing"), 0, None).await.unwrap_err().kind, ErrorKind::NotFound);
        assert_eq!(read(&h, p(&dir, ""), 0, None).await.unwrap_err().kind, ErrorKind::IsADirectory);
        assert_eq!(read(&h, "relative".into(), 0, None).await.unwrap_err().kind, ErrorKind::InvalidInput);
        h.shutdown().await;
    }

    /// Whatever a read names — directly, by a link, by `/proc/self/fd` —
    /// is judged after the links are followed: nothing but a regular file
    /// is read, and nothing waits.
    #[tokio::test]
    async fn special_files_are_refused_at_once_however_they_are_named() {
        let h = Harness::start().await;
        let dir = temp_dir();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        std::os::unix::fs::symlink(&fifo, dir.path().join("to-fifo")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("to-zero")).unwrap();
        // A FIFO held open for writing by us: its reader would wait for data, not for a writer.
        let writer = fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
        let by_fd = format!("/proc/{}/fd/{}", std::process::id(), std::os::fd::AsRawFd::as_raw_fd(&writer));
        let cases = [
            (p(&dir, "fifo"), "FIFO"),
            (p(&dir, "to-fifo"), "FIFO"),
            (p(&dir, "to-zero"), "character device"),
            ("/dev/zero".to_string(), "character device"),
            (by_fd, "FIFO"),
        ];
        for (path, kind) in cases {
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), read(&h, path.clone(), 0, None));
            let error = read.await.unwrap_or_else(|_| panic!("reading {path} waited")).unwrap_err();
            assert_eq!(error.kind, ErrorKind::InvalidInput, "{path}: {error}");
            assert!(error.message.contains(&format!("not a regular file (a {kind})")), "{path}: {error}");
        }
        drop(writer);
        // A regular file behind a link is read as itself.
        fs::write(dir.path().join("real"), "content").unwrap();
        std::os::unix::fs::symlink(dir.path().join("real"), dir.path().join("to-real")).unwrap();
        let (stat, data) = read(&h, p(&dir, "to-real"), 0, None).await.unwrap();
        assert_eq!((stat.kind, data.as_slice()), (FileKind::File, b"content".as_slice()));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn metadata_operations() {
        let h = Harness::start().await;
        let dir = temp_dir();
        let done = GuestFrame::Reply(Reply::Done);

        assert_eq!(h.call(Request::Mkdir { path: p(&dir, "d/e") }).await, done);
        assert_eq!(h.call(Request::Mkdir { path: p(&dir, "d/e") }).await, done);
        fs::write(dir.path().join("d/file"), "12345").unwrap();
        std::os::unix::fs::symlink("file", dir.path().join("d/link")).unwrap();

        let GuestFrame::Reply(Reply::Entries(entries)) = h.call(Request::ListDir { path: p(&dir, "d") }).await else {
            panic!("expected entries")
        };
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["e", "file", "link"]);
        assert_eq!(entries[0].stat.kind, FileKind::Dir);
        assert_eq!((entries[1].stat.kind, entries[1].stat.size), (FileKind::File, 5));
        assert_eq!(entries[2].stat.kind, FileKind::Symlink);
        assert_eq!(entries[2].stat.symlink_target.as_deref(), Some("file"));
        let kind = |f| error_kind(f);
        assert_eq!(kind(h.call(Request::ListDir { path: p(&dir, "d/file") }).await), ErrorKind::NotADirectory);
        assert_eq!(kind(h.call(Request::ListDir { path: p(&dir, "nope") }).await), ErrorKind::NotFound);

        let GuestFrame::Reply(Reply::Stat(stat)) = h.call(Request::Stat { path: p(&dir, "d/link") }).await else {
            panic!("expected a stat")
        };
        assert_eq!((stat.kind, stat.symlink_target.as_deref()), (FileKind::Symlink, Some("file")));
        assert_eq!(kind(h.call(Request::Stat { path: p(&dir, "nope") }).await), ErrorKind::NotFound);

        assert_eq!(h.call(Request::Chmod { path: p(&dir, "d/file"), mode: 0o4711 }).await, done);
        assert_eq!(fs::metadata(dir.path().join("d/file")).unwrap().mode() & 0o7777, 0o4711);
        assert_eq!(kind(h.call(Request::Chmod { path: p(&dir, "nope"), mode: 0o600 }).await), ErrorKind::NotFound);

        let rename = Request::Rename { from: p(&dir, "d/file"), to: p(&dir, "d/e/moved") };
        assert_eq!(h.call(rename).await, done);
        assert_eq!(fs::read(dir.path().join("d/e/moved")).unwrap(), b"12345");
        let rename = Request::Rename { from: p(&dir, "nope"), to: p(&dir, "x") };
        assert_eq!(kind(h.call(rename).await), ErrorKind::NotFound);

        let remove = |path, recursive| Request::Remove { path, recursive };
        assert_eq!(h.call(remove(p(&dir, "d/link"), false)).await, done);
        assert_eq!(kind(h.call(remove(p(&dir, "d"), false)).await), ErrorKind::DirectoryNotEmpty);
        assert_eq!(h.call(remove(p(&dir, "d"), true)).await, done);
        assert!(!dir.path().join("d").exists());
        assert_eq!(kind(h.call(remove(p(&dir, "d"), true)).await), ErrorKind::NotFound);
        assert_eq!(kind(h.call(remove("/".into(), true)).await), ErrorKind::InvalidInput);
        assert_eq!(kind(h.call(remove("/tmp/..".into(), true)).await), ErrorKind::InvalidInput);
        h.shutdown().await;
    }

    #[test]
    fn root_in_disguise_is_recognised() {
        for p in ["/", "//", "/.", "/tmp/..", "/a/b/../../.."] {
            assert_eq!(normalized(Path::new(p)), Path::new("/"), "{p}");
        }
        assert_eq!(normalized(Path::new("/tmp/./x/../y")), Path::new("/tmp/y"));
    }

    #[test]
    fn relative_paths_are_refused() {
        assert_eq!(absolute("tmp/x").unwrap_err().kind, ErrorKind::InvalidInput);
        assert_eq!(stat("etc").unwrap_err().kind, ErrorKind::InvalidInput);
        assert_eq!(remove("///", true).unwrap_err().kind, ErrorKind::InvalidInput);
    }
}
