//! The QEMU command line, and starting the process.
//!
//! QEMU runs the `microvm` machine without ACPI or PCI: the kernel is an
//! uncompressed PVH vmlinux, devices are virtio-mmio (QEMU appends their
//! `virtio_mmio.device=` parameters to the kernel command line itself).

#![allow(unsafe_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;

use crate::accel::Accel;

/// Everything that decides a VM's QEMU command line.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub id: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub disk: Disk,
    pub memory_mb: u32,
    pub vcpus: u32,
    pub accel: Accel,
    /// Host TSC kHz for TCG guests (no HPET or PM timer to calibrate against).
    pub tsc_khz: Option<u64>,
    pub hostname: String,
    pub memory: Memory,
    /// Start paused, waiting for `migrate-incoming` (a restore).
    pub incoming: bool,
    /// Stay paused after an incoming migration instead of running the guest.
    pub stay_paused: bool,
    /// The NIC's backend: `tap0` of the network namespace QEMU is started
    /// in, or nothing (a hub port with no other port: packets go nowhere).
    /// Every VM has the NIC either way, so any VM's state restores into any.
    /// QEMU gets the tap as a descriptor ([`TapFd`], attached by [`spawn`]).
    pub tap: bool,
}

/// The descriptor number under which QEMU finds its tap: one the host
/// holds open (on `/dev/null`) while it starts QEMU, so that no other
/// descriptor of the child has it, replaced in the child by the tap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TapFd(pub i32);

/// The root disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disk {
    /// A qcow2 layer (over the image or an earlier layer).
    Qcow2(PathBuf),
    /// Not known yet: a standby VMM's, whose VM's layer (a create's or a
    /// fork child's) is attached when it is taken (`standby::attach_disk`). Until
    /// then `root` is a `raw` node over a placeholder of `bytes` that reads
    /// as zeros; no guest instruction runs before the layer is in place.
    Deferred { bytes: u64 },
}

/// Where guest RAM lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Memory {
    /// Anonymous memory (a throwaway cold boot).
    Anonymous,
    /// A file the guest writes through (`share=on`): a template being baked.
    /// Saving with `x-ignore-shared` then leaves RAM out of the state file.
    TemplateFile(PathBuf),
    /// A template's RAM file mapped copy-on-write (`share=off`) and opened
    /// read-only (`readonly=on,rom=off`): every VM of a template shares its
    /// unwritten pages, and none can ever write the file.
    FromTemplate(PathBuf),
}

/// The RAM block's name; a restore must use the same one as the save.
pub const RAM_ID: &str = "mem";
/// QEMU's machine type, named in saved state.
pub const MACHINE: &str = "microvm";

/// How the guest mounts its root filesystem. A template keeps the mount it
/// was saved with, so these are part of every template's key.
///
/// `no_prefetch_block_bitmaps`: ext4 otherwise reads every block group's
/// bitmap in a background thread that starts up to 5 s after the mount. A
/// template is saved before that, so each sandbox restored from it did the
/// reads itself (disk I/O, its own page cache and, under TCG, their code
/// translated anew) for bitmaps ext4 loads anyway when a group is first
/// written to.
pub const ROOT_MOUNT_ARGS: [&str; 4] = ["root=/dev/vda", "rw", "rootfstype=ext4", "rootflags=no_prefetch_block_bitmaps"];

/// The most memory, MiB, TCG may fill with translated code per VM. QEMU
/// never returns what it translated: without a cap, a long-lived sandbox's
/// cache grows with every program it ever ran, up to QEMU's default of
/// 1 GiB. When the cache is full QEMU empties it and translates anew. A
/// mixed Python and git workload has a working set of ~65 MiB, 400
/// different programs run once each filled 129 MiB (ADR 1).
pub const TCG_CACHE_MB: u32 = 256;

pub fn console_log(dir: &Path) -> PathBuf {
    dir.join("console.log")
}
pub fn agent_socket(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}
/// The file QEMU process `pid` maps its RAM from (`mem-path` of its
/// memory backend), if any.
pub fn mapped_ram_file(pid: u32) -> Option<PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    ram_file_in(&cmdline)
}

fn ram_file_in(cmdline: &[u8]) -> Option<PathBuf> {
    let backend = format!("memory-backend-file,id={RAM_ID},");
    cmdline.split(|&b| b == 0).map(String::from_utf8_lossy).find_map(|arg| {
        let options = arg.strip_prefix(&backend)?.to_string();
        options.split(',').find_map(|o| o.strip_prefix("mem-path=")).map(PathBuf::from)
    })
}

pub fn qmp_socket(dir: &Path) -> PathBuf {
    dir.join("qmp.sock")
}

pub fn kernel_cmdline(spec: &LaunchSpec) -> String {
    let mut args = vec![
        "console=ttyS0".to_string(),
        // Any reboot or panic ends the QEMU process (-no-reboot): a dead guest is a dead VM.
        "reboot=t".into(),
        "panic=-1".into(),
        "quiet".into(),
    ];
    args.extend(ROOT_MOUNT_ARGS.map(String::from));
    args.extend([
        format!("init={}", crate::image::GUESTD_PATH_IN_GUEST),
        format!("clade.hostname={}", spec.hostname),
    ]);
    if spec.accel == Accel::Tcg {
        // Without these, TCG boots can hang in TSC calibration, or the clocksource
        // watchdog marks the TSC unstable and the guest falls back to jiffies.
        if let Some(khz) = spec.tsc_khz {
            args.push(format!("tsc_early_khz={khz}"));
        }
        args.push("tsc=reliable".into());
    }
    args.join(" ")
}

/// QEMU's command line; `tap` is where its tap will be, if it has one.
pub fn qemu_args(spec: &LaunchSpec, tap: Option<TapFd>) -> Vec<OsString> {
    let dir = &spec.dir;
    let path = |p: PathBuf| p.display().to_string();
    let mut args: Vec<String> = vec![
        "-name".into(),
        format!("clade-{},debug-threads=on", spec.id),
        "-machine".into(),
        match spec.memory {
            Memory::Anonymous => format!("{MACHINE},x-option-roms=off,rtc=off,acpi=off"),
            _ => format!("{MACHINE},x-option-roms=off,rtc=off,acpi=off,memory-backend={RAM_ID}"),
        },
        "-accel".into(),
        match spec.accel {
            Accel::Kvm => "kvm".into(),
            Accel::Tcg => format!("tcg,tb-size={TCG_CACHE_MB}"),
        },
        "-cpu".into(),
        match spec.accel {
            Accel::Kvm => "host".into(),
            Accel::Tcg => "max".into(),
        },
        "-m".into(),
        format!("{}M", spec.memory_mb),
        "-smp".into(),
        spec.vcpus.to_string(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        // Seccomp: no obsolete syscalls, no privilege gain, no spawning, no resource changes.
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        "-kernel".into(),
        path(spec.kernel.clone()),
        "-append".into(),
        kernel_cmdline(spec),
        "-chardev".into(),
        format!("file,id=console,path={}", path(console_log(dir))),
        "-serial".into(),
        "chardev:console".into(),
        "-blockdev".into(),
        match &spec.disk {
            Disk::Qcow2(file) => format!(
                r#"{{"driver":"qcow2","node-name":"root","discard":"unmap","file":{{"driver":"file","filename":"{}"}}}}"#,
                path(file.clone())
            ),
            Disk::Deferred { bytes } => format!(
                r#"{{"driver":"raw","node-name":"root","file":{{"driver":"null-co","node-name":"placeholder","size":{bytes},"read-zeroes":true}}}}"#
            ),
        },
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-object".into(),
        "rng-random,id=rng,filename=/dev/urandom".into(),
        "-device".into(),
        "virtio-rng-device,rng=rng".into(),
        "-device".into(),
        "virtio-serial-device,max_ports=2".into(),
        "-chardev".into(),
        format!("socket,id=agent,path={},server=on,wait=off", path(agent_socket(dir))),
        "-device".into(),
        format!("virtserialport,chardev=agent,name={}", clade_proto::AGENT_PORT_NAME),
        "-netdev".into(),
        match tap {
            // No vnet header: the descriptor is attached without one
            // (QEMU reads that from it), as offloads would have to match
            // across restores on every host.
            Some(TapFd(fd)) => format!("tap,id=net0,fd={fd}"),
            None => "hubport,id=net0,hubid=0".into(),
        },
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={}", clade_proto::guest_net::GUEST_MAC),
        "-chardev".into(),
        format!("socket,id=qmp,path={},server=on,wait=off", path(qmp_socket(dir))),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
        // After an incoming migration QEMU asks the guest, five times over
        // ~1.3 s, to announce itself (gratuitous ARP, unsolicited neighbour
        // advertisements) so switches learn where a migrated VM now is. A
        // sandbox's tap is its own and its address never moves, so each
        // request would only be guest work on the create path.
        "-global".into(),
        "migration.announce-rounds=0".into(),
    ];
    // Copy-on-write and read-only for restores: no VM can write the template.
    let backing = match &spec.memory {
        Memory::Anonymous => None,
        Memory::TemplateFile(file) => Some((file, "share=on")),
        Memory::FromTemplate(file) => Some((file, "share=off,readonly=on,rom=off")),
    };
    if let Some((file, sharing)) = backing {
        args.push("-object".into());
        args.push(format!(
            "memory-backend-file,id={RAM_ID},size={}M,mem-path={},{sharing}",
            spec.memory_mb,
            path(file.clone())
        ));
    }
    if spec.stay_paused {
        args.push("-S".into());
    }
    if spec.incoming {
        args.push("-incoming".into());
        args.push("defer".into());
    }
    args.shrink_to_fit();
    args.into_iter().map(OsString::from).collect()
}

/// A spawn request for the launcher thread.
struct SpawnRequest {
    command: Command,
    die_with_owner: bool,
    netns: Option<std::fs::File>,
    tap: Option<TapFd>,
    huge_pages: bool,
    reply: mpsc::Sender<std::io::Result<Child>>,
}

/// Starts `command` in its own session (a terminal's Ctrl-C reaches us, not
/// QEMU). With `die_with_owner`, the kernel kills it when this process dies,
/// however it dies.
///
/// The parent-death signal fires when the *thread* that forked exits, so every
/// spawn happens on one launcher thread that lives as long as the process.
///
/// With `netns` (a `/run/netns/NAME` file), the process starts inside that
/// network namespace and has no other network. With `tap` too, the child
/// attaches that namespace's `tap0` before it runs QEMU, and QEMU gets the
/// descriptor: it needs no privilege over network devices (ADR 14).
///
/// Without `huge_pages`, the process gets no transparent huge pages, even
/// where it asks for them (`PR_SET_THP_DISABLE`). Under TCG, QEMU asks for
/// them for its translation buffer: the vCPU thread then zeroes, and the
/// kernel may compact memory for, 2 MiB at once whenever generated code
/// first reaches a new part of it, in the middle of a create's first steps.
pub fn spawn(command: Command, die_with_owner: bool, netns: Option<&Path>, tap: Option<TapFd>, huge_pages: bool) -> std::io::Result<Child> {
    if tap.is_some() && netns.is_none() {
        return Err(std::io::Error::other("a tap is attached only inside a sandbox's network namespace"));
    }
    let netns = netns.map(std::fs::File::open).transpose()?;
    static LAUNCHER: OnceLock<std::sync::Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let launcher = LAUNCHER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("clade-vmm-launcher".into())
            .spawn(move || {
                for request in rx {
                    let _ = request.reply.send(spawn_here(request.command, request.die_with_owner, request.netns, request.tap, request.huge_pages));
                }
            })
            .expect("starting the VMM launcher thread");
        std::sync::Mutex::new(tx)
    });
    let (reply, outcome) = mpsc::channel();
    launcher
        .lock()
        .expect("launcher lock")
        .send(SpawnRequest { command, die_with_owner, netns, tap, huge_pages, reply })
        .map_err(|_| std::io::Error::other("VMM launcher thread is gone"))?;
    outcome.recv().map_err(|_| std::io::Error::other("VMM launcher thread is gone"))?
}

fn spawn_here(mut command: Command, die_with_owner: bool, netns: Option<std::fs::File>, tap: Option<TapFd>, huge_pages: bool) -> std::io::Result<Child> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let owner = std::process::id() as libc::pid_t;
    let netns_fd = netns.as_ref().map(|file| file.as_raw_fd());
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setns, open, ioctl, dup2, close, setsid,
    // prctl, getppid, _exit); it touches no locks and allocates nothing (the
    // tap request is on its stack, all zeros before its fields are set).
    // `netns` outlives the spawn.
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = netns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(TapFd(target)) = tap {
                let fd = libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // As `ip tuntap add … mode tap` made it: no packet
                // information header; and no vnet header, which QEMU then
                // does not use.
                let mut request: libc::ifreq = std::mem::zeroed();
                for (to, from) in request.ifr_name.iter_mut().zip(b"tap0") {
                    *to = *from as libc::c_char;
                }
                request.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
                // dup2 leaves the copy without close-on-exec: QEMU keeps it.
                if libc::ioctl(fd, libc::TUNSETIFF, &request) < 0 || libc::dup2(fd, target) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if die_with_owner && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Kept across exec; refused only by kernels older than 3.15.
            if !huge_pages && libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // An owner that died since the fork cannot record this VM, and
            // the sweep may already have passed: do not become an orphan.
            if libc::getppid() != owner {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    command.stdin(Stdio::null()).spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(accel: Accel) -> LaunchSpec {
        LaunchSpec {
            id: "abc".into(),
            dir: "/var/lib/clade/vms/abc".into(),
            kernel: "/k/vmlinux".into(),
            disk: Disk::Qcow2("/var/lib/clade/vms/abc/disk.qcow2".into()),
            memory_mb: 512,
            vcpus: 1,
            accel,
            tsc_khz: Some(2_596_000),
            hostname: "sandbox".into(),
            memory: Memory::Anonymous,
            incoming: false,
            stay_paused: false,
            tap: false,
        }
    }

    #[test]
    fn tcg_gets_its_clock_parameters_and_kvm_does_not() {
        let tcg = kernel_cmdline(&spec(Accel::Tcg));
        assert!(tcg.contains("tsc_early_khz=2596000") && tcg.contains("tsc=reliable"), "{tcg}");
        assert!(tcg.contains("init=/sbin/clade-guestd"));
        assert!(tcg.contains("root=/dev/vda rw rootfstype=ext4 rootflags=no_prefetch_block_bitmaps"), "{tcg}");
        let kvm = kernel_cmdline(&spec(Accel::Kvm));
        assert!(!kvm.contains("tsc"), "{kvm}");
        let accel = |accel| {
            let args = qemu_args(&spec(accel), None);
            args.iter().position(|a| a == "-accel").map(|i| args[i + 1].clone()).unwrap()
        };
        assert_eq!(accel(Accel::Tcg), "tcg,tb-size=256", "TCG's translation cache is capped");
        assert_eq!(accel(Accel::Kvm), "kvm");
    }

    #[test]
    fn restores_map_the_template_read_only_and_wait_for_the_state() {
        let mut restore = spec(Accel::Tcg);
        restore.memory = Memory::FromTemplate("/t/ram".into());
        restore.incoming = true;
        let joined: Vec<String> = qemu_args(&restore, None).into_iter().map(|a| a.into_string().unwrap()).collect();
        let joined = joined.join(" ");
        assert!(joined.contains("memory-backend=mem"), "{joined}");
        assert!(joined.contains("mem-path=/t/ram,share=off,readonly=on,rom=off"), "{joined}");
        assert!(joined.contains("-global migration.announce-rounds=0"), "no announce requests after the load: {joined}");
        assert!(joined.ends_with("-incoming defer"), "{joined}");
        let cmdline: Vec<u8> = qemu_args(&restore, None).into_iter().flat_map(|a| a.into_encoded_bytes().into_iter().chain([0])).collect();
        assert_eq!(ram_file_in(&cmdline), Some(PathBuf::from("/t/ram")), "the RAM file is read back from the command line");
        assert_eq!(ram_file_in(b"qemu\0-m\0-smp\0"), None);
    }

    #[test]
    fn command_line_names_every_device_and_the_accelerator() {
        let args: Vec<String> = qemu_args(&spec(Accel::Kvm), None).into_iter().map(|a| a.into_string().unwrap()).collect();
        let joined = args.join(" ");
        for needle in [
            "-accel kvm",
            "-cpu host",
            "virtio-blk-device,drive=root",
            "virtserialport,chardev=agent,name=clade.agent",
            "virtio-rng-device",
            "-no-reboot",
            "-sandbox on",
            "path=/var/lib/clade/vms/abc/agent.sock",
            "hubport,id=net0",
            "virtio-net-device,netdev=net0,mac=02:c1:ad:00:00:02",
        ] {
            assert!(joined.contains(needle), "missing {needle:?} in {joined}");
        }
    }

    #[test]
    fn a_tap_is_handed_to_qemu_as_a_descriptor_not_opened_by_name() {
        let args: Vec<String> = qemu_args(&spec(Accel::Tcg), Some(TapFd(41))).into_iter().map(|a| a.into_string().unwrap()).collect();
        let netdev = args.iter().position(|a| a == "-netdev").map(|i| args[i + 1].clone()).unwrap();
        assert_eq!(netdev, "tap,id=net0,fd=41");
        let refused = spawn(Command::new("true"), false, None, Some(TapFd(41)), false);
        assert!(refused.is_err(), "a tap outside a namespace would be the host's");
    }
}
