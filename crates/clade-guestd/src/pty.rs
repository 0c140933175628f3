//! Pseudo-terminals for interactive execs.
//!
//! Both ends are opened close-on-exec in one step (`/dev/ptmx` with
//! `O_CLOEXEC`, the slave through `TIOCGPTPEER`), so a concurrent spawn can
//! never inherit a slave and keep the master from seeing the child's hangup.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use clade_proto::PtySize;
use nix::errno::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

#[derive(Debug, thiserror::Error)]
pub enum PtyError {
    #[error("cannot open /dev/ptmx")]
    Open(#[source] io::Error),
    #[error("cannot unlock the pty")]
    Unlock(#[source] io::Error),
    #[error("cannot open the pty slave")]
    Slave(#[source] io::Error),
    #[error("cannot set the pty size")]
    Size(#[source] io::Error),
    #[error("cannot register the pty with the runtime")]
    Register(#[source] io::Error),
}

/// A fresh terminal: the agent keeps the master, the child gets the slave.
pub struct Pty {
    pub master: PtyMaster,
    pub slave: OwnedFd,
}

/// Opens a pty of the given size. Must be called inside a tokio runtime.
#[allow(unsafe_code)]
pub fn open(size: PtySize) -> Result<Pty, PtyError> {
    // std adds O_CLOEXEC itself.
    let master: OwnedFd = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open("/dev/ptmx")
        .map_err(PtyError::Open)?
        .into();
    let unlock: libc::c_int = 0;
    // SAFETY: `master` is an open ptmx fd; TIOCSPTLCK reads one int through
    // the pointer, which points at a live local.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) } < 0 {
        return Err(PtyError::Unlock(io::Error::last_os_error()));
    }
    // SAFETY: TIOCGPTPEER takes open flags by value and returns a new fd (or -1).
    let slave = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if slave < 0 {
        return Err(PtyError::Slave(io::Error::last_os_error()));
    }
    // SAFETY: the ioctl succeeded, so `slave` is a new fd that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    set_size(&master, size).map_err(PtyError::Size)?;
    // SAFETY: an OwnedFd is a valid open fd, and it stays owned (never
    // closed or swapped) by the AsyncFd until the AsyncFd is dropped.
    let fd = unsafe { AsyncFd::register_with_interest(master, Interest::READABLE | Interest::WRITABLE) };
    let fd = fd.map_err(|e| PtyError::Register(e.into()))?;
    Ok(Pty { master: PtyMaster { fd }, slave })
}

#[allow(unsafe_code)]
fn set_size(fd: &impl AsRawFd, size: PtySize) -> io::Result<()> {
    let ws = libc::winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one `winsize` through the pointer, which points at a live local.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The agent's end of a pty, readable and writable concurrently through `&self`.
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

impl PtyMaster {
    /// Reads terminal output; `Ok(0)` once every slave fd is closed (the
    /// kernel reports that as EIO).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| nix::unistd::read(fd.as_raw_fd(), buf).map_err(io::Error::from)) {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(Errno::EIO as i32) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` as terminal input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref().as_fd(), data).map_err(io::Error::from)) {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    /// The master fd itself, for tests that need a pty as a plain channel.
    #[cfg(test)]
    pub fn into_fd(self) -> OwnedFd {
        self.fd.into_inner()
    }

    /// Changes the terminal size; the kernel sends SIGWINCH to the foreground group.
    pub fn resize(&self, size: PtySize) -> io::Result<()> {
        set_size(self.fd.get_ref(), size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slave_input_reaches_the_master_and_hangup_reads_as_eof() {
        let pty = open(PtySize { rows: 24, cols: 80 }).unwrap();
        nix::unistd::write(&pty.slave, b"hi").unwrap();
        let mut buf = [0u8; 16];
        let n = pty.master.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"hi");
        drop(pty.slave);
        assert_eq!(pty.master.read(&mut buf).await.unwrap(), 0);
    }
}
