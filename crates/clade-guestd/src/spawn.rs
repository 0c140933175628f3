//! Starting a program: a `vfork`-style clone, then the child's setup and
//! exec.
//!
//! The agent is a multi-threaded process. `fork` would copy its page tables
//! for a child that throws them away at exec, and leave the agent taking a
//! copy-on-write fault on every page it writes afterwards: under TCG a
//! restored sandbox's first exec also translates all that kernel code.
//! The child is therefore cloned with `CLONE_VM | CLONE_VFORK`, as glibc's
//! `posix_spawn` does: it runs on a stack of its own in the agent's memory
//! while the calling thread waits, and the agent's memory is never copied.
//! (`posix_spawn` itself cannot join a cgroup or switch users.)
//!
//! The child shares the agent's memory with the agent's other threads, so
//! it may only make raw system calls on data the parent prepared in
//! [`Program`]: no allocation, no locks, and no glibc call that consults
//! process-wide state. In particular the user switch uses the raw
//! `setgroups`/`setgid`/`setuid` system calls: glibc's wrappers would try to
//! switch every thread of the agent too.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// The ids a child switches to.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// Prepared by the parent, applied by the child in this order: new session,
/// controlling terminal, cgroup, user, working directory.
#[derive(Debug)]
pub struct ChildSetup {
    /// Make stdin (a pty slave) the controlling terminal of the new session.
    pub controlling_tty: bool,
    /// `cgroup.procs` of the exec's cgroup, to join before anything else runs.
    pub cgroup_procs: Option<CString>,
    /// `None` keeps the agent's own ids.
    pub credentials: Option<Credentials>,
    /// Changed into after the user switch, so access is checked as the user.
    pub cwd: CString,
}

/// A program with everything its child needs, built in the parent.
pub struct Program {
    /// Paths to try in order: the program itself if it names a path,
    /// otherwise each directory of the child's `PATH` joined with it (the
    /// search `execvp` makes, against the child's environment).
    candidates: Vec<CString>,
    argv: Vec<CString>,
    envp: Vec<CString>,
}

/// The child's stack. The child runs only the code below and the kernel's
/// exec; a guard page under it turns an overflow into a fault.
const CHILD_STACK: usize = 128 * 1024;

/// Used when the environment has no `PATH`, as `execvp` does.
const FALLBACK_PATH: &str = "/bin:/usr/bin";

impl Program {
    /// `program` with `args` (after `argv[0]`) and exactly `env`. Fails with
    /// `InvalidInput` on a NUL byte, `NotFound` on an empty program.
    pub fn new(program: &str, args: &[String], env: &[(String, String)]) -> io::Result<Self> {
        let cstring = |s: String| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
        if program.is_empty() {
            return Err(io::ErrorKind::NotFound.into());
        }
        let candidates = if program.contains('/') {
            vec![cstring(program.to_string())?]
        } else {
            let path = env.iter().rev().find(|(k, _)| k == "PATH").map_or(FALLBACK_PATH, |(_, v)| v.as_str());
            path.split(':')
                // An empty entry is the working directory, for execvp.
                .map(|dir| if dir.is_empty() { format!("./{program}") } else { format!("{}/{program}", dir.trim_end_matches('/')) })
                .map(cstring)
                .collect::<io::Result<_>>()?
        };
        let argv = std::iter::once(program.to_string()).chain(args.iter().cloned()).map(cstring).collect::<io::Result<_>>()?;
        let envp = env.iter().map(|(k, v)| cstring(format!("{k}={v}"))).collect::<io::Result<_>>()?;
        Ok(Self { candidates, argv, envp })
    }

    /// Starts the program with `stdio` as its fds 0, 1 and 2 and `setup`
    /// applied, and returns its pid once it has exec'd. A failure of the
    /// setup or of every exec is returned as that step's error, after the
    /// child is reaped. Blocks the calling thread until the exec.
    pub fn spawn(&self, stdio: [&OwnedFd; 3], setup: &ChildSetup) -> io::Result<i32> {
        match self.spawn_once(stdio, setup)? {
            Ok(pid) => Ok(pid),
            // A file without a `#!` line: run it with the shell, as execvp does.
            Err((error, Some(script))) if error.raw_os_error() == Some(libc::ENOEXEC) => {
                let shell = Program {
                    candidates: vec![c"/bin/sh".to_owned()],
                    argv: [c"/bin/sh".to_owned(), script].into_iter().chain(self.argv.iter().skip(1).cloned()).collect(),
                    envp: self.envp.clone(),
                };
                shell.spawn_once(stdio, setup)?.map_err(|(error, _)| error)
            }
            Err((error, _)) => Err(error),
        }
    }

    /// The outer error is the clone's; the inner one the child's, with the
    /// candidate whose exec gave it.
    #[allow(clippy::type_complexity)]
    #[allow(unsafe_code)]
    fn spawn_once(&self, stdio: [&OwnedFd; 3], setup: &ChildSetup) -> io::Result<Result<i32, (io::Error, Option<CString>)>> {
        let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
            strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
        };
        let argv = pointers(&self.argv);
        let envp = pointers(&self.envp);
        let candidates: Vec<&CStr> = self.candidates.iter().map(CString::as_c_str).collect();
        let child = Child {
            candidates: &candidates,
            argv: argv.as_ptr(),
            envp: envp.as_ptr(),
            stdio: stdio.map(AsRawFd::as_raw_fd),
            setup,
            failed_errno: AtomicI32::new(0),
            failed_candidate: AtomicI32::new(-1),
        };
        let stack = Stack::new()?;

        // Signals stay blocked from the clone until the child has reset
        // their handlers: one delivered in between would run the agent's
        // handler in the child, on the agent's memory.
        // SAFETY: sigset_t is plain data, filled by sigfillset before use;
        // the previous mask is written into `saved` and restored below.
        let mut saved: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe {
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        }
        // SAFETY: `child_main` runs on `stack` (owned here, outlives the
        // child's use of it: with CLONE_VFORK this call returns only once the
        // child has exec'd or exited) and only reads `child`, which lives on
        // this frame for as long, apart from its two atomics. The child's
        // code is async-signal-safe: see `Child::run`.
        let pid = unsafe {
            libc::clone(
                child_main,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                std::ptr::from_ref(&child).cast_mut().cast(),
            )
        };
        let clone_error = io::Error::last_os_error();
        // SAFETY: restores the mask saved above on this thread.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut()) };
        if pid < 0 {
            return Err(clone_error);
        }
        let errno = child.failed_errno.load(Ordering::Acquire);
        if errno == 0 {
            return Ok(Ok(pid));
        }
        // The child exited without exec'ing: collect it here (the reaper
        // holds off while a spawn is registering, see `Reaper::spawn`).
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        let candidate = usize::try_from(child.failed_candidate.load(Ordering::Acquire)).ok().and_then(|i| self.candidates.get(i).cloned());
        Ok(Err((io::Error::from_raw_os_error(errno), candidate)))
    }
}

/// An anonymous mapping with a guard page at its low end.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

impl Stack {
    #[allow(unsafe_code)]
    fn new() -> io::Result<Self> {
        let len = CHILD_STACK + page_size();
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the first page of the mapping made above.
        if unsafe { libc::mprotect(base, page_size(), libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The highest address, 16-byte aligned (the stack grows down).
    #[allow(unsafe_code)]
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which is page aligned.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unused once the child has exec'd.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

#[allow(unsafe_code)]
fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// What the child reads, and the two slots it writes when it fails.
struct Child<'a> {
    candidates: &'a [&'a CStr],
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    setup: &'a ChildSetup,
    failed_errno: AtomicI32,
    failed_candidate: AtomicI32,
}

#[allow(unsafe_code)]
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Child` that `spawn_once` passed, alive until
    // this child execs or exits (CLONE_VFORK).
    let child = unsafe { &*arg.cast::<Child>() };
    let (errno, candidate) = child.run();
    child.failed_candidate.store(candidate, Ordering::Relaxed);
    child.failed_errno.store(errno.max(1), Ordering::Release);
    // SAFETY: ends this child at once (exit_group); no atexit handlers, no
    // stdio flush, nothing of the agent's state touched.
    unsafe { libc::_exit(127) }
}

impl Child<'_> {
    /// Everything between the clone and the exec. Returns only on failure:
    /// the errno and the candidate whose exec failed last (-1 before any).
    ///
    /// Only async-signal-safe system call wrappers run here (sigaction,
    /// sigprocmask, dup2, fcntl, setsid, ioctl, open, write, close, chdir,
    /// execve, raw syscalls), on memory the parent prepared; `errno` is the
    /// suspended calling thread's, which nothing else reads meanwhile.
    #[allow(unsafe_code)]
    fn run(&self) -> (i32, i32) {
        reset_signal_handlers();
        for (target, &fd) in (0..).zip(&self.stdio) {
            let ok = if fd == target {
                // Already in place; let it survive the exec.
                // SAFETY: fcntl on an fd number; no memory involved.
                (unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }) == 0
            } else {
                // SAFETY: dup2 on fd numbers; `fd` is the parent's, kept open until the exec.
                (unsafe { libc::dup2(fd, target) }) == target
            };
            if !ok {
                return (last_errno(), -1);
            }
        }
        // SAFETY: no arguments, no memory.
        if unsafe { libc::setsid() } < 0 {
            return (last_errno(), -1);
        }
        // SAFETY: fd 0 is the pty slave just put in place; TIOCSCTTY takes
        // an int argument (0: do not steal) and touches no memory of ours.
        if self.setup.controlling_tty && unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
            return (last_errno(), -1);
        }
        if let Some(procs) = &self.setup.cgroup_procs {
            if let Err(e) = join_cgroup(procs) {
                return (e, -1);
            }
        }
        if let Some(creds) = &self.setup.credentials {
            // Raw calls: this process alone (see the module comment).
            // SAFETY: `groups` is a live slice of u32 (gid_t) of the given
            // length, which the kernel only reads; the other two take plain ids.
            let switched = unsafe { libc::syscall(libc::SYS_setgroups, creds.groups.len(), creds.groups.as_ptr()) } == 0
                // SAFETY: as above.
                && unsafe { libc::syscall(libc::SYS_setgid, creds.gid) } == 0
                // SAFETY: as above.
                && unsafe { libc::syscall(libc::SYS_setuid, creds.uid) } == 0;
            if !switched {
                return (last_errno(), -1);
            }
        }
        // SAFETY: `cwd` is a NUL-terminated path the parent keeps alive.
        if unsafe { libc::chdir(self.setup.cwd.as_ptr()) } < 0 {
            return (last_errno(), -1);
        }
        // As std does: the child starts with no signal blocked.
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before
        // sigprocmask reads it; the old mask is not asked for.
        let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe {
            libc::sigemptyset(&mut empty);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        }
        // execvp's search: a missing or unreadable candidate moves on, any
        // other failure is the answer; EACCES wins over a later ENOENT.
        let mut outcome = (libc::ENOENT, -1);
        let mut denied = None;
        for (index, path) in (0..).zip(self.candidates) {
            // SAFETY: `path`, `argv` and `envp` are NUL-terminated strings and
            // NULL-terminated arrays of them that the parent keeps alive; on
            // success this never returns.
            unsafe { libc::execve(path.as_ptr(), self.argv, self.envp) };
            let error = last_errno();
            match error {
                libc::EACCES => {
                    denied.get_or_insert((error, index));
                }
                libc::ENOENT | libc::ENOTDIR => outcome = (error, index),
                _ => return (error, index),
            }
        }
        denied.unwrap_or(outcome)
    }
}

/// Handlers of the agent's (tokio's) would run in the child on the agent's
/// memory; every caught signal goes back to its default, and SIGPIPE, which
/// Rust programs ignore, too (as std's spawn does).
#[allow(unsafe_code)]
fn reset_signal_handlers() {
    for signal in 1..=libc::SIGRTMAX() {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: sigaction only reads and writes the two structs on this
        // stack; glibc refuses its own reserved signals (EINVAL), which is fine.
        unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut current) != 0 {
                continue;
            }
            let caught = current.sa_sigaction != libc::SIG_DFL && current.sa_sigaction != libc::SIG_IGN;
            if caught || signal == libc::SIGPIPE {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
    }
}

/// errno of the last failed call (read from the thread's errno, no allocation).
fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Writes "0" (this process) into a `cgroup.procs` file; the errno on failure.
#[allow(unsafe_code)]
fn join_cgroup(procs: &CStr) -> Result<(), i32> {
    // SAFETY: `procs` is a valid NUL-terminated path that outlives the call;
    // open returns a new fd that only this function uses and closes.
    let fd = unsafe { libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(last_errno());
    }
    // SAFETY: `fd` is open for writing and the buffer is a 1-byte static.
    let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
    let error = last_errno();
    // SAFETY: `fd` was opened above and is not used after this.
    unsafe { libc::close(fd) };
    if written != 1 {
        return Err(error);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;

    /// Runs `program` to its end; its stdout and exit status.
    fn run(program: &Program, cwd: &std::path::Path) -> io::Result<(String, i32)> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let null: OwnedFd = std::fs::File::open("/dev/null")?.into();
        let setup = ChildSetup {
            controlling_tty: false,
            cgroup_procs: None,
            credentials: None,
            cwd: CString::new(cwd.as_os_str().as_encoded_bytes()).unwrap(),
        };
        let pid = program.spawn([&null, &write, &null], &setup)?;
        drop(write);
        let mut out = String::new();
        std::fs::File::from(read).read_to_string(&mut out)?;
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None).unwrap();
        let nix::sys::wait::WaitStatus::Exited(_, code) = status else { panic!("{status:?}") };
        Ok((out, code))
    }

    #[test]
    fn searches_the_childs_path_runs_scripts_without_a_shebang_and_reports_why_an_exec_failed() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("greet");
        std::fs::write(&script, "echo \"hello $1 from $(pwd)\"\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let env = [("PATH".to_string(), format!("/nonexistent:{}", dir.path().display()))];

        // Found on the child's PATH, not the agent's; no `#!`, so run by sh.
        let greet = Program::new("greet", &["you".into()], &env).unwrap();
        let (out, code) = run(&greet, dir.path()).unwrap();
        assert_eq!((out.as_str(), code), (format!("hello you from {}\n", dir.path().display()).as_str(), 0));

        // The environment is exactly the one given.
        let printenv = Program::new("/usr/bin/env", &[], &[("ONLY".into(), "this".into())]).unwrap();
        assert_eq!(run(&printenv, dir.path()).unwrap(), ("ONLY=this\n".to_string(), 0));

        let missing = Program::new("not-there", &[], &env).unwrap();
        assert_eq!(run(&missing, dir.path()).unwrap_err().kind(), io::ErrorKind::NotFound);
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
        let denied = Program::new(script.to_str().unwrap(), &[], &env).unwrap();
        assert_eq!(run(&denied, dir.path()).unwrap_err().raw_os_error(), Some(libc::EACCES));
        let no_dir = Program::new("/bin/true", &[], &env).unwrap();
        assert_eq!(run(&no_dir, &dir.path().join("gone")).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
