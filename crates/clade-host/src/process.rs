//! Process identity on the host: a pid plus its start time, so that a
//! recycled pid is never mistaken for the process we started.

use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessId {
    pub pid: u32,
    /// Start time in clock ticks since boot (/proc/PID/stat field 22).
    pub start_ticks: u64,
}

impl ProcessId {
    /// The identity of a live process, or `None` when it does not exist.
    pub fn of(pid: u32) -> Option<Self> {
        start_ticks(pid).map(|start_ticks| Self { pid, start_ticks })
    }

    pub fn current() -> Self {
        Self::of(std::process::id()).expect("our own /proc entry exists")
    }

    /// Puts every thread of this process in the background (`SCHED_IDLE`:
    /// it runs only on CPU time nothing else wants) or back in the
    /// foreground (`SCHED_OTHER` at niceness 0). Linux schedules threads one
    /// by one, and threads started later inherit their creator's policy.
    /// Leaving the background needs root (the host is).
    pub fn set_background(&self, background: bool) -> std::io::Result<()> {
        if !self.is_alive() {
            return Err(std::io::ErrorKind::NotFound.into());
        }
        let policy = if background { libc::SCHED_IDLE } else { libc::SCHED_OTHER };
        let param = libc::sched_param { sched_priority: 0 };
        for task in std::fs::read_dir(format!("/proc/{}/task", self.pid))? {
            let Ok(tid) = task?.file_name().to_string_lossy().parse::<libc::pid_t>() else { continue };
            // SAFETY: sched_setscheduler reads the parameter we pass by
            // reference for the duration of the call; setpriority takes
            // integers only. Neither touches other memory of ours.
            #[allow(unsafe_code)]
            let failed = unsafe {
                libc::sched_setscheduler(tid, policy, &param) != 0
                    || (!background && libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 0) != 0)
            };
            if failed {
                let error = std::io::Error::last_os_error();
                // A thread that ended meanwhile has no priority to set.
                if error.raw_os_error() != Some(libc::ESRCH) {
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    /// The memory it costs the host: its proportional set size (pages
    /// shared with other processes, a template's RAM file, count in part),
    /// in bytes; `None` once it is gone.
    pub fn proportional_memory(&self) -> Option<u64> {
        let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.pid)).ok()?;
        let kib = rollup.lines().find_map(|line| line.strip_prefix("Pss:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
        self.is_alive().then_some(kib * 1024)
    }

    /// Whether this very process is still running (not merely its pid).
    /// A zombie counts as gone.
    pub fn is_alive(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        match parse_stat(&stat) {
            Some(Stat { state, start_ticks, .. }) => start_ticks == self.start_ticks && state != 'Z' && state != 'X',
            None => false,
        }
    }

    /// Whether it has exited but is still a zombie of this very process:
    /// ours to reap, and left to init if we exit first.
    pub fn awaits_our_reap(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        parse_stat(&stat).is_some_and(|s| s.start_ticks == self.start_ticks && s.state == 'Z' && s.parent == std::process::id())
    }

    /// How it ended, in the words of `std::process::ExitStatus` ("signal: 9
    /// (SIGKILL)", "exit status: 1"), while it is a zombie that its parent
    /// has not reaped yet; `None` when it runs or is gone.
    pub fn zombie_status(&self) -> Option<String> {
        use std::os::unix::process::ExitStatusExt;
        let stat = parse_stat(&std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?)?;
        if stat.start_ticks != self.start_ticks || stat.state != 'Z' {
            return None;
        }
        Some(std::process::ExitStatus::from_raw(stat.exit_code?).to_string())
    }

    /// Blocks until it has exited (a zombie or gone), however far it is
    /// from us — a pidfd wakes us the moment it does (Linux 5.3+; older
    /// kernels are polled) — or until `give_up` says so (asked every
    /// second). Whether it exited.
    pub fn wait_exit(&self, give_up: impl Fn() -> bool) -> bool {
        let pidfd = self.pidfd();
        while self.is_alive() {
            if give_up() {
                return false;
            }
            match &pidfd {
                Some(pidfd) => {
                    let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(pidfd), nix::poll::PollFlags::POLLIN)];
                    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(1000u16));
                }
                None => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
        }
        true
    }

    /// A descriptor that becomes readable when the process exits.
    fn pidfd(&self) -> Option<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor or -1; no memory of ours is involved.
        #[allow(unsafe_code)]
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, self.pid as libc::pid_t, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` was just returned by the kernel and is owned by no one else.
        #[allow(unsafe_code)]
        let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        // The pid may have been recycled between our check and the open.
        self.is_alive().then_some(pidfd)
    }

    /// SIGKILL, only if it is still the same process.
    pub fn kill(&self) {
        if self.is_alive() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid as i32), nix::sys::signal::SIGKILL);
        }
    }

    /// The CPU time it has used (user and system, all threads), or `None`
    /// once it is gone.
    pub fn cpu_time(&self) -> Option<std::time::Duration> {
        let stat = parse_stat(&std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?)?;
        (stat.start_ticks == self.start_ticks).then(|| ticks(stat.cpu_ticks))
    }

    /// Whether its command line mentions `path` (our VMs name their directory).
    pub fn cmdline_mentions(&self, path: &Path) -> bool {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.pid)).unwrap_or_default();
        // With the separator, so that VM `ab` never matches VM `abc`'s files.
        let needle = format!("{}/", path.display());
        String::from_utf8_lossy(&cmdline).contains(&needle)
    }
}

/// Has this process's allocator serve every large allocation (a fork's
/// page buffers, a file's chunks) from a mapping of its own, unmapped when
/// freed. glibc otherwise raises that threshold each time such a block is
/// freed, after which large blocks come from its arenas and stay there:
/// a server that made forks kept tens of MiB it no longer used.
pub fn unmap_large_blocks_when_freed() {
    // SAFETY: mallopt sets an allocator parameter; it takes integers only
    // and is meant to be called at any time.
    #[allow(unsafe_code)]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
    }
}

/// Gives the system back the memory this process's allocator keeps after
/// freeing it. glibc's malloc holds freed memory in its per-thread arenas;
/// after a burst of requests on many threads a long-running server would
/// keep its peak, so a server calls this when things are quiet.
pub fn return_freed_memory() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; it
    // touches no memory of ours and is safe to call from any thread.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

fn start_ticks(pid: u32) -> Option<u64> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?).map(|s| s.start_ticks)
}

/// Clock ticks (/proc's unit, `USER_HZ`: 100 on Linux x86-64) as a duration.
fn ticks(n: u64) -> std::time::Duration {
    std::time::Duration::from_millis(n * 10)
}

/// The fields of a /proc/PID/stat line that we read.
#[derive(Debug, PartialEq, Eq)]
struct Stat {
    state: char,
    parent: u32,
    /// User and system time, in clock ticks.
    cpu_ticks: u64,
    start_ticks: u64,
    /// A zombie's wait status (field 52, Linux 3.5+).
    exit_code: Option<i32>,
}

/// Parses a /proc/PID/stat line; the command name may hold spaces and parens.
fn parse_stat(stat: &str) -> Option<Stat> {
    let rest = &stat[stat.rfind(')')? + 2..];
    // The state is field 3 (index 0 here), the parent field 4, user and
    // system time fields 14 and 15, the start time field 22.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let number = |field: usize| fields.get(field - 3)?.parse::<u64>().ok();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        parent: u32::try_from(number(4)?).ok()?,
        cpu_ticks: number(14)? + number(15)?,
        start_ticks: number(22)?,
        exit_code: number(52).and_then(|code| i32::try_from(code).ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn we_are_alive_and_a_wrong_start_time_is_not() {
        let me = ProcessId::current();
        assert!(me.is_alive());
        assert!(!ProcessId { start_ticks: me.start_ticks + 1, ..me }.is_alive());
        assert!(ProcessId::of(u32::MAX - 1).is_none());
    }

    #[test]
    fn an_exited_child_awaits_our_reap_until_it_is_reaped() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let exited = ProcessId::of(child.id()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while exited.is_alive() {
            assert!(std::time::Instant::now() < deadline, "`true` never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(exited.awaits_our_reap());
        child.wait().unwrap();
        assert!(!exited.awaits_our_reap());
        assert!(!ProcessId::current().awaits_our_reap());
    }

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let line = "42 (a) b (c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 19";
        assert_eq!(parse_stat(line), Some(Stat { state: 'S', parent: 1, cpu_ticks: 11 + 12, start_ticks: 777, exit_code: None }));
    }

    #[test]
    fn a_killed_process_is_told_apart_from_one_that_exited_while_it_is_a_zombie() {
        let mut killed = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let mut exited = std::process::Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let (killed_id, exited_id) = (ProcessId::of(killed.id()).unwrap(), ProcessId::of(exited.id()).unwrap());
        assert_eq!(killed_id.zombie_status(), None, "a running process has no status");
        killed_id.kill();
        // Waits as for a process that is not ours: the zombie stays until we reap it.
        assert!(killed_id.wait_exit(|| false) && exited_id.wait_exit(|| false));
        assert_eq!(killed_id.zombie_status().as_deref(), Some("signal: 9 (SIGKILL)"));
        assert_eq!(exited_id.zombie_status().as_deref(), Some("exit status: 3"));
        killed.wait().unwrap();
        exited.wait().unwrap();
        assert_eq!(killed_id.zombie_status(), None, "reaped: gone");
    }

    #[test]
    fn cpu_time_grows_with_work_and_ends_with_the_process() {
        let me = ProcessId::current();
        let before = me.cpu_time().unwrap();
        let spin = std::time::Instant::now();
        while me.cpu_time().unwrap() < before + std::time::Duration::from_millis(50) {
            assert!(spin.elapsed() < std::time::Duration::from_secs(30), "50 ms of work never showed in our CPU time");
        }
        assert_eq!(ProcessId { start_ticks: me.start_ticks + 1, ..me }.cpu_time(), None);
    }

    #[test]
    fn a_process_goes_to_the_background_and_back_with_all_its_threads() {
        // The policy is per thread: every task's is read.
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let id = ProcessId::of(child.id()).unwrap();
        let policies = || -> Vec<i32> {
            std::fs::read_dir(format!("/proc/{}/task", id.pid))
                .unwrap()
                .map(|task| {
                    let tid: libc::pid_t = task.unwrap().file_name().to_string_lossy().parse().unwrap();
                    // SAFETY: sched_getscheduler takes an integer and touches no memory of ours.
                    #[allow(unsafe_code)]
                    unsafe {
                        libc::sched_getscheduler(tid)
                    }
                })
                .collect()
        };
        id.set_background(true).unwrap();
        assert!(policies().iter().all(|&p| p == libc::SCHED_IDLE), "{:?}", policies());
        if nix::unistd::geteuid().is_root() {
            id.set_background(false).unwrap();
            assert!(policies().iter().all(|&p| p == libc::SCHED_OTHER), "{:?}", policies());
        }
        id.kill();
        child.wait().unwrap();
        assert!(id.set_background(true).is_err(), "a process that is gone has no priority");
    }

    #[test]
    fn our_proportional_memory_is_counted_and_ends_with_us() {
        let me = ProcessId::current();
        let pss = me.proportional_memory().unwrap();
        assert!(pss > 1 << 20, "a test process uses more than 1 MiB: {pss}");
        assert_eq!(ProcessId { start_ticks: me.start_ticks + 1, ..me }.proportional_memory(), None);
    }
}
