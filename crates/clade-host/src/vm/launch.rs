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
use crate::qcow2;

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
    /// A chain of layers, top first (the VM's qcow2 layer over earlier
    /// layers and the image), as the host's records say it is
    /// (`VmRuntime::disk_chain`): QEMU gets each layer as a descriptor.
    Chain(Vec<qcow2::Layer>),
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
///
/// `discard`: the blocks of a file the guest deletes are given back to its
/// disk at once (the next journal commit), and through QEMU (`discard:
/// unmap` down to the layer's file, [`chain_blockdev`]) to the host's
/// disk: a guest that filled its disk and cleaned up holds no space on the
/// host for it, without waiting for an `fstrim` nobody runs.
pub const ROOT_MOUNT_ARGS: [&str; 4] = ["root=/dev/vda", "rw", "rootfstype=ext4", "rootflags=no_prefetch_block_bitmaps,discard"];

/// The most memory, MiB, TCG may fill with translated code per VM. QEMU
/// never returns what it translated: without a cap, a long-lived sandbox's
/// cache grows with every program it ever ran, up to QEMU's default of
/// 1 GiB. When the cache is full QEMU empties it and translates anew. A
/// mixed Python and git workload has a working set of ~65 MiB, 400
/// different programs run once each filled 129 MiB (ADR 1).
pub const TCG_CACHE_MB: u32 = 256;

/// QEMU's id of the agent's channel (a socket chardev under a virtio-serial port).
pub const AGENT_CHARDEV: &str = "agent";

pub fn console_log(dir: &Path) -> PathBuf {
    dir.join("console.log")
}
pub fn agent_socket(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}
/// The file QEMU process `pid` maps its RAM from (`mem-path` of its
/// memory backend, one of its own descriptors), if any.
pub fn mapped_ram_file(pid: u32) -> Option<PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let named = ram_file_in(&cmdline)?;
    match named.strip_prefix("/proc/self/fd") {
        Ok(fd) => std::fs::read_link(Path::new(&format!("/proc/{pid}/fd")).join(fd)).ok(),
        Err(_) => Some(named),
    }
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
    args.extend([format!("init={}", crate::image::GUESTD_PATH_IN_GUEST), format!("clade.hostname={}", spec.hostname)]);
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

/// The descriptors a QEMU finds its files under (see [`Handed`]): it
/// opens by name nothing that holds or leads to sandbox data, and needs no
/// access to the data directory (ADR 14).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fds {
    pub kernel: i32,
    pub console: i32,
    /// Listening sockets the host bound.
    pub qmp: i32,
    pub agent: i32,
    pub ram: Option<i32>,
    /// The disk chain, top first (empty for [`Disk::Deferred`]).
    pub disk: Vec<(i32, qcow2::Layer)>,
    pub tap: Option<TapFd>,
}

/// The fdset of the console, and of disk layer `n` (counted from the top):
/// sets made on the command line, apart from those QMP's `add-fd` numbers.
const CONSOLE_SET: usize = 1;
const FIRST_LAYER_SET: usize = 2;

/// QEMU's command line, its files under the descriptors `fds`.
pub fn qemu_args(spec: &LaunchSpec, fds: &Fds) -> Vec<OsString> {
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
        // What this QEMU saves carries no run state, so a QEMU that loads it
        // starts the guest by itself once it has loaded it; and it reports
        // each migration's progress as events: a load is followed without a
        // `cont` or a poll on a create's path (see `migrate::load`).
        "-global".into(),
        "migration.store-global-state=off".into(),
        "-global".into(),
        "migration.x-events=on".into(),
        // Seccomp: no obsolete syscalls, no privilege gain, no spawning, no resource changes.
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        // The opaque names say what each set is (`query-fdsets`), and put
        // the VM's directory on the command line, where the host finds its
        // VMM by (`ProcessId::cmdline_mentions`).
        "-add-fd".into(),
        format!("fd={},set={CONSOLE_SET},opaque={}", fds.console, path(console_log(dir))),
        "-kernel".into(),
        format!("/proc/self/fd/{}", fds.kernel),
        "-append".into(),
        kernel_cmdline(spec),
        "-chardev".into(),
        format!("file,id=console,path=/dev/fdset/{CONSOLE_SET}"),
        "-serial".into(),
        "chardev:console".into(),
    ];
    for (n, (fd, layer)) in fds.disk.iter().enumerate() {
        args.push("-add-fd".into());
        args.push(format!("fd={fd},set={},opaque={}", FIRST_LAYER_SET + n, path(layer.path.clone())));
    }
    args.extend([
        "-blockdev".into(),
        match &spec.disk {
            Disk::Chain(_) => root_blockdev(&fds.disk).to_string(),
            Disk::Deferred { bytes } => format!(
                r#"{{"driver":"raw","node-name":"root","discard":"unmap","file":{{"driver":"null-co","node-name":"placeholder","size":{bytes},"read-zeroes":true}}}}"#
            ),
        },
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
    ]);
    args.extend(super::volumes::slot_args());
    args.extend([
        "-object".into(),
        "rng-random,id=rng,filename=/dev/urandom".into(),
        "-device".into(),
        "virtio-rng-device,rng=rng".into(),
        "-device".into(),
        "virtio-serial-device,max_ports=2".into(),
        "-chardev".into(),
        format!("socket,id={AGENT_CHARDEV},fd={},server=on,wait=off", fds.agent),
        "-device".into(),
        format!("virtserialport,chardev={AGENT_CHARDEV},name={}", clade_proto::AGENT_PORT_NAME),
        "-netdev".into(),
        match fds.tap {
            // No vnet header: the descriptor is attached without one
            // (QEMU reads that from it), as offloads would have to match
            // across restores on every host.
            Some(TapFd(fd)) => format!("tap,id=net0,fd={fd}"),
            None => "hubport,id=net0,hubid=0".into(),
        },
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={}", clade_proto::guest_net::GUEST_MAC),
        "-chardev".into(),
        format!("socket,id=qmp,fd={},server=on,wait=off", fds.qmp),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
        // After an incoming migration QEMU asks the guest, five times over
        // ~1.3 s, to announce itself (gratuitous ARP, unsolicited neighbour
        // advertisements) so switches learn where a migrated VM now is. A
        // sandbox's tap is its own and its address never moves, so each
        // request would only be guest work on the create path.
        "-global".into(),
        "migration.announce-rounds=0".into(),
    ]);
    // Copy-on-write and read-only for restores: no VM can write the template.
    let sharing = match &spec.memory {
        Memory::Anonymous => None,
        Memory::TemplateFile(_) => Some("share=on"),
        Memory::FromTemplate(_) => Some("share=off,readonly=on,rom=off"),
    };
    if let (Some(sharing), Some(ram)) = (sharing, fds.ram) {
        // QEMU opens `mem-path` with a plain open(), which knows no fdsets;
        // reopening its own descriptor needs no access to the directory.
        args.push("-object".into());
        args.push(format!("memory-backend-file,id={RAM_ID},size={}M,mem-path=/proc/self/fd/{ram},{sharing}", spec.memory_mb));
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

/// The `root` node over the handed chain (sets from [`FIRST_LAYER_SET`] on).
fn root_blockdev(disk: &[(i32, qcow2::Layer)]) -> serde_json::Value {
    let files: Vec<(String, qcow2::Format)> =
        disk.iter().enumerate().map(|(n, (_, layer))| (format!("/dev/fdset/{}", FIRST_LAYER_SET + n), layer.format)).collect();
    chain_blockdev("root", &files)
}

/// The blockdev options of a chain whose layers QEMU opens as `files`
/// (top first, with their formats), the top one named `node`. Each
/// layer's backing is spelled out: QEMU follows no name written in a
/// layer's header, and the bottom one gets none.
pub fn chain_blockdev(node: &str, files: &[(String, qcow2::Format)]) -> serde_json::Value {
    let mut below: Option<serde_json::Value> = None;
    for (file, format) in files.iter().rev() {
        let mut layer = serde_json::json!({ "driver": format.driver(), "file": { "driver": "file", "filename": file } });
        if *format == qcow2::Format::Qcow2 {
            layer["backing"] = below.take().unwrap_or(serde_json::Value::Null);
        }
        below = Some(layer);
    }
    let mut top = below.unwrap_or_else(|| serde_json::json!({}));
    top["node-name"] = node.into();
    // The guest's trims free space in its own layer, and the layer's
    // freed clusters are punched out of its file on the host.
    top["discard"] = "unmap".into();
    top["file"]["discard"] = "unmap".into();
    top
}

/// The files of one QEMU, opened by the host: the kernel, the console, the
/// QMP and agent sockets (bound and listening), the RAM file and the disk
/// chain. QEMU inherits them and opens nothing of a sandbox by name: it
/// runs as a user of its own that could not (ADR 14).
#[derive(Debug)]
pub struct Handed {
    kernel: std::fs::File,
    console: std::fs::File,
    qmp: std::os::unix::net::UnixListener,
    agent: std::os::unix::net::UnixListener,
    ram: Option<std::fs::File>,
    disk: Vec<(std::fs::File, qcow2::Layer)>,
    /// Whether the RAM file becomes the VMM user's for its run: a template
    /// being baked, which QEMU writes through and may have to size.
    ram_given: bool,
}

impl Handed {
    pub fn open(spec: &LaunchSpec) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let context = |what: String| move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"));
        let kernel = std::fs::File::open(&spec.kernel).map_err(context(format!("opening {}", spec.kernel.display())))?;
        let console = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(console_log(&spec.dir))
            .map_err(context("creating console.log".into()))?;
        let listen = |path: PathBuf| {
            // A socket left by an earlier QEMU of this VM (a wake).
            let _ = std::fs::remove_file(&path);
            std::os::unix::net::UnixListener::bind(&path).map_err(context(format!("binding {}", path.display())))
        };
        let (qmp, agent) = (listen(qmp_socket(&spec.dir))?, listen(agent_socket(&spec.dir))?);
        let ram = match &spec.memory {
            Memory::Anonymous => None,
            Memory::TemplateFile(path) => Some(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(context(format!("creating {}", path.display())))?,
            ),
            Memory::FromTemplate(path) => Some(std::fs::File::open(path).map_err(context(format!("opening {}", path.display())))?),
        };
        let disk = match &spec.disk {
            Disk::Deferred { .. } => Vec::new(),
            Disk::Chain(layers) => open_chain(layers)?.into_iter().zip(layers.iter().cloned()).collect(),
        };
        let ram_given = matches!(spec.memory, Memory::TemplateFile(_));
        Ok(Self { kernel, console, qmp, agent, ram, disk, ram_given })
    }

    /// Their numbers here, which the child keeps.
    pub fn fds(&self, tap: Option<TapFd>) -> Fds {
        use std::os::fd::AsRawFd;
        Fds {
            kernel: self.kernel.as_raw_fd(),
            console: self.console.as_raw_fd(),
            qmp: self.qmp.as_raw_fd(),
            agent: self.agent.as_raw_fd(),
            ram: self.ram.as_ref().map(AsRawFd::as_raw_fd),
            disk: self.disk.iter().map(|(file, layer)| (file.as_raw_fd(), layer.clone())).collect(),
            tap,
        }
    }

    /// Every descriptor QEMU inherits.
    pub fn inherited(&self) -> Vec<i32> {
        use std::os::fd::AsRawFd;
        let mut all = vec![self.kernel.as_raw_fd(), self.console.as_raw_fd(), self.qmp.as_raw_fd(), self.agent.as_raw_fd()];
        all.extend(self.ram.as_ref().map(AsRawFd::as_raw_fd));
        all.extend(self.disk.iter().map(|(file, _)| file.as_raw_fd()));
        all
    }

    /// The descriptors whose files become the VMM user's.
    pub fn given(&self) -> Vec<i32> {
        use std::os::fd::AsRawFd;
        self.ram.iter().filter(|_| self.ram_given).map(AsRawFd::as_raw_fd).collect()
    }
}

/// Opens the layers of a disk chain (top first) as QEMU is to get them:
/// only the top one writable, the rest read-only.
pub fn open_chain(layers: &[qcow2::Layer]) -> std::io::Result<Vec<std::fs::File>> {
    let open = |(n, layer): (usize, &qcow2::Layer)| {
        let file = std::fs::OpenOptions::new().read(true).write(n == 0).open(&layer.path);
        file.map_err(|e| std::io::Error::new(e.kind(), format!("opening {}: {e}", layer.path.display())))
    };
    layers.iter().enumerate().map(open).collect()
}

/// How a VMM process is set apart from the host; see [`spawn`].
#[derive(Debug, Default)]
pub struct Confinement<'a> {
    pub die_with_owner: bool,
    pub netns: Option<&'a Path>,
    pub tap: Option<TapFd>,
    pub huge_pages: bool,
    /// Descriptors (of this process, same numbers in the child) the child keeps.
    pub inherited: Vec<i32>,
    /// Inherited descriptors whose files become the VMM user's.
    pub given: Vec<i32>,
    /// A group the VMM user joins: the one that owns `/dev/kvm`, under KVM.
    pub group: Option<u32>,
}

/// The first user id of the VMM users: the VMM whose process id is `pid`
/// runs as `VMM_UID_BASE + pid` (Linux process ids stay below 2^22). Above
/// the ranges systemd hands to dynamic users and containers, below 2^31.
pub const VMM_UID_BASE: u32 = 0x7800_0000;

/// A spawn request for the launcher thread.
struct SpawnRequest {
    command: Command,
    /// The namespace opened; `confinement.netns` is left out.
    netns: Option<std::fs::File>,
    confinement: Confinement<'static>,
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
/// descriptor: it needs no privilege over network devices.
///
/// A host running as root runs the process as a user of its own
/// ([`VMM_UID_BASE`] plus its process id; no two live VMMs share one),
/// with no supplementary group but `group`, no capability and no way to
/// gain privileges. It keeps the `inherited` descriptors and gets the files
/// of the `given` ones (ADR 14).
///
/// Without `huge_pages`, the process gets no transparent huge pages, even
/// where it asks for them (`PR_SET_THP_DISABLE`). Under TCG, QEMU asks for
/// them for its translation buffer: the vCPU thread then zeroes, and the
/// kernel may compact memory for, 2 MiB at once whenever generated code
/// first reaches a new part of it, in the middle of a create's first steps.
pub fn spawn(command: Command, confinement: Confinement) -> std::io::Result<Child> {
    if confinement.tap.is_some() && confinement.netns.is_none() {
        return Err(std::io::Error::other("a tap is attached only inside a sandbox's network namespace"));
    }
    let netns = confinement.netns.map(std::fs::File::open).transpose()?;
    let confinement = Confinement { netns: None, ..confinement };
    static LAUNCHER: OnceLock<std::sync::Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let launcher = LAUNCHER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("clade-vmm-launcher".into())
            .spawn(move || {
                for request in rx {
                    let reply = request.reply.clone();
                    let _ = reply.send(spawn_here(request));
                }
            })
            .expect("starting the VMM launcher thread");
        std::sync::Mutex::new(tx)
    });
    let (reply, outcome) = mpsc::channel();
    let request = SpawnRequest { command, netns, confinement, reply };
    launcher.lock().expect("launcher lock").send(request).map_err(|_| std::io::Error::other("VMM launcher thread is gone"))?;
    outcome.recv().map_err(|_| std::io::Error::other("VMM launcher thread is gone"))?
}

fn spawn_here(request: SpawnRequest) -> std::io::Result<Child> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let SpawnRequest { mut command, netns, confinement, .. } = request;
    let Confinement { die_with_owner, tap, huge_pages, inherited, given, group, .. } = confinement;
    let owner = std::process::id() as libc::pid_t;
    let netns_fd = netns.as_ref().map(|file| file.as_raw_fd());
    let switch_user = nix::unistd::geteuid().is_root();
    let groups: Vec<libc::gid_t> = group.into_iter().collect();
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setns, open, ioctl, dup2, close, setsid,
    // getpid, fcntl, fchown, setgroups, setgid, setuid, prctl, getppid,
    // _exit); it touches no locks and allocates nothing (the tap request is
    // on its stack, all zeros before its fields are set; the descriptor and
    // group lists were made before the fork). `netns` outlives the spawn.
    unsafe {
        command.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if let Some(fd) = netns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) < 0 {
                    return fail();
                }
            }
            if let Some(TapFd(target)) = tap {
                let fd = libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
                if fd < 0 {
                    return fail();
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
                    return fail();
                }
                libc::close(fd);
            }
            for &fd in &inherited {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return fail();
                }
            }
            if libc::setsid() < 0 {
                return fail();
            }
            if switch_user {
                let user = VMM_UID_BASE + libc::getpid() as u32;
                for &fd in &given {
                    if libc::fchown(fd, user, user) < 0 {
                        return fail();
                    }
                }
                // Groups first: only root may change them.
                if libc::setgroups(groups.len(), groups.as_ptr()) < 0 || libc::setgid(user) < 0 || libc::setuid(user) < 0 {
                    return fail();
                }
            }
            // After the user switch, which clears the parent-death signal.
            if die_with_owner && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) < 0 {
                return fail();
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                return fail();
            }
            // Kept across exec; refused only by kernels older than 3.15.
            if !huge_pages && libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) < 0 {
                return fail();
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
            disk: Disk::Chain(vec![qcow2::Layer::qcow2("/var/lib/clade/vms/abc/disk.qcow2".into())]),
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

    /// Descriptor numbers as a host would hand them, a chain of two layers.
    fn fds() -> Fds {
        let layer = |path: &str, format| qcow2::Layer { path: path.into(), format };
        Fds {
            kernel: 3,
            console: 4,
            qmp: 5,
            agent: 6,
            ram: None,
            disk: vec![
                (7, layer("/var/lib/clade/vms/abc/disk.qcow2", qcow2::Format::Qcow2)),
                (8, layer("/images/base.ext4", qcow2::Format::Raw)),
            ],
            tap: None,
        }
    }

    #[test]
    fn the_disk_chain_is_spelled_out_from_handed_sets() {
        let args: Vec<String> = qemu_args(&spec(Accel::Tcg), &fds()).into_iter().map(|a| a.into_string().unwrap()).collect();
        let joined = args.join(" ");
        assert!(joined.contains("-add-fd fd=7,set=2,opaque=/var/lib/clade/vms/abc/disk.qcow2"), "{joined}");
        assert!(joined.contains("-add-fd fd=8,set=3,opaque=/images/base.ext4"), "{joined}");
        let blockdev = args.iter().position(|a| a == "-blockdev").map(|i| args[i + 1].clone()).unwrap();
        let blockdev: serde_json::Value = serde_json::from_str(&blockdev).unwrap();
        assert_eq!(
            blockdev,
            serde_json::json!({
                "driver": "qcow2", "node-name": "root", "discard": "unmap",
                "file": { "driver": "file", "filename": "/dev/fdset/2", "discard": "unmap" },
                "backing": { "driver": "raw", "file": { "driver": "file", "filename": "/dev/fdset/3" } },
            })
        );
        let bottom = chain_blockdev("n", &[("/dev/fdset/9".into(), qcow2::Format::Qcow2)]);
        assert_eq!(bottom["backing"], serde_json::Value::Null, "a qcow2 bottom follows no name in its header");
    }

    #[test]
    fn tcg_gets_its_clock_parameters_and_kvm_does_not() {
        let tcg = kernel_cmdline(&spec(Accel::Tcg));
        assert!(tcg.contains("tsc_early_khz=2596000") && tcg.contains("tsc=reliable"), "{tcg}");
        assert!(tcg.contains("init=/sbin/clade-guestd"));
        assert!(tcg.contains("root=/dev/vda rw rootfstype=ext4 rootflags=no_prefetch_block_bitmaps,discard"), "{tcg}");
        let kvm = kernel_cmdline(&spec(Accel::Kvm));
        assert!(!kvm.contains("tsc"), "{kvm}");
        let accel = |accel| {
            let args = qemu_args(&spec(accel), &fds());
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
        let fds = Fds { ram: Some(9), ..fds() };
        let joined: Vec<String> = qemu_args(&restore, &fds).into_iter().map(|a| a.into_string().unwrap()).collect();
        let joined = joined.join(" ");
        assert!(joined.contains("memory-backend=mem"), "{joined}");
        assert!(joined.contains("mem-path=/proc/self/fd/9,share=off,readonly=on,rom=off"), "{joined}");
        assert!(joined.contains("-global migration.announce-rounds=0"), "no announce requests after the load: {joined}");
        assert!(joined.ends_with("-incoming defer"), "{joined}");
        let cmdline: Vec<u8> = qemu_args(&restore, &fds).into_iter().flat_map(|a| a.into_encoded_bytes().into_iter().chain([0])).collect();
        assert_eq!(ram_file_in(&cmdline), Some(PathBuf::from("/proc/self/fd/9")), "the RAM file is read back from the command line");
        assert_eq!(ram_file_in(b"qemu\0-m\0-smp\0"), None);
    }

    #[test]
    fn command_line_names_every_device_and_the_accelerator() {
        let args: Vec<String> = qemu_args(&spec(Accel::Kvm), &fds()).into_iter().map(|a| a.into_string().unwrap()).collect();
        let joined = args.join(" ");
        for needle in [
            "-accel kvm",
            "-cpu host",
            "virtio-blk-device,drive=root",
            "virtserialport,chardev=agent,name=clade.agent",
            "virtio-rng-device",
            "-no-reboot",
            "-sandbox on",
            "socket,id=agent,fd=6,server=on,wait=off",
            "socket,id=qmp,fd=5,server=on,wait=off",
            "-kernel /proc/self/fd/3",
            "fd=4,set=1,opaque=/var/lib/clade/vms/abc/console.log",
            "file,id=console,path=/dev/fdset/1",
            "hubport,id=net0",
            "virtio-net-device,netdev=net0,mac=02:c1:ad:00:00:02",
        ] {
            assert!(joined.contains(needle), "missing {needle:?} in {joined}");
        }
    }

    #[test]
    fn a_tap_is_handed_to_qemu_as_a_descriptor_not_opened_by_name() {
        let fds = Fds { tap: Some(TapFd(41)), ..fds() };
        let args: Vec<String> = qemu_args(&spec(Accel::Tcg), &fds).into_iter().map(|a| a.into_string().unwrap()).collect();
        let netdev = args.iter().position(|a| a == "-netdev").map(|i| args[i + 1].clone()).unwrap();
        assert_eq!(netdev, "tap,id=net0,fd=41");
        let refused = spawn(Command::new("true"), Confinement { tap: Some(TapFd(41)), ..Confinement::default() });
        assert!(refused.is_err(), "a tap outside a namespace would be the host's");
    }
}
