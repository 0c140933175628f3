//! The local terminal: raw mode for interactive shells, and its size.

use std::os::fd::{AsFd, BorrowedFd};

use clade_proto::PtySize;
use nix::sys::termios::{self, SetArg, Termios};

nix::ioctl_read_bad!(tiocgwinsz, libc::TIOCGWINSZ, libc::winsize);

/// The size of the terminal on `fd`, if it is one.
#[allow(unsafe_code)]
pub fn size(fd: BorrowedFd<'_>) -> Option<PtySize> {
    use std::os::fd::AsRawFd;
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes one `winsize` into the pointer we pass, which
    // points to a live, properly aligned local; the fd is borrowed for the call.
    let ok = unsafe { tiocgwinsz(fd.as_raw_fd(), &mut ws) }.is_ok();
    (ok && ws.ws_row > 0).then_some(PtySize { rows: ws.ws_row, cols: ws.ws_col })
}

/// Puts the terminal into raw mode until dropped.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    pub fn enable() -> nix::Result<Self> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}
