//! Running the build scripts, one artifact kind at a time.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::fcntl::{Flock, FlockArg};

use super::{io_err, script_path, ImageError, GUESTD_PATH_IN_GUEST, HOST_DEPS, KERNEL_BUILD, KERNEL_FRAGMENT, ROOTFS_BUILD, ROOTFS_EXTEND};

/// Where a build's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The build's own output goes to our stderr as it runs (the CLI).
    Stderr,
    /// Only to the build log in the cache (tests, the server).
    Quiet,
}

pub(super) fn lock(cache_dir: &Path, kind: &str) -> Result<Flock<File>, ImageError> {
    std::fs::create_dir_all(cache_dir).map_err(io_err(format!("creating {}", cache_dir.display())))?;
    let path = cache_dir.join(format!(".{kind}.lock"));
    let file = File::create(&path).map_err(io_err(format!("creating {}", path.display())))?;
    Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| ImageError::Io { context: format!("locking {}", path.display()), source: e.into() })
}

/// Runs `argv`, teeing its output into `log` (and our stderr when asked).
pub(super) fn run(what: &str, argv: &[&std::ffi::OsStr], log: &Path, progress: &Progress) -> Result<(), ImageError> {
    if *progress == Progress::Stderr {
        eprintln!("clade: {what} (log: {})", log.display());
    }
    let log_file = File::create(log).map_err(io_err(format!("creating {}", log.display())))?;
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file.try_clone().map_err(io_err("cloning log fd"))?))
        .spawn()
        .map_err(io_err(format!("starting {what}")))?;
    let stdout = child.stdout.take().expect("piped");
    let mut log_out = log_file;
    for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
        use std::io::Write;
        let _ = writeln!(log_out, "{line}");
        if *progress == Progress::Stderr {
            eprintln!("  {line}");
        }
    }
    let status = child.wait().map_err(io_err(format!("waiting for {what}")))?;
    if status.success() {
        Ok(())
    } else {
        if *progress == Progress::Stderr {
            if let Ok(text) = std::fs::read_to_string(log) {
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                for line in tail.into_iter().rev() {
                    eprintln!("  | {line}");
                }
            }
        }
        Err(ImageError::BuildFailed { what: what.to_string(), code: status.code(), log: log.to_path_buf() })
    }
}

/// Installs QEMU and the build tools when something is missing (a no-op otherwise).
pub(super) fn host_deps(cache_dir: &Path, progress: &Progress) -> Result<(), ImageError> {
    let _lock = lock(cache_dir, "deps")?;
    let script = script_path(cache_dir, "install-host-deps", HOST_DEPS)?;
    let log = cache_dir.join("install-host-deps.log");
    run("checking host packages", &["bash".as_ref(), script.as_os_str()], &log, progress)
}

pub(super) fn kernel(cache_dir: &Path, out_dir: &Path, progress: &Progress) -> Result<(), ImageError> {
    let _lock = lock(cache_dir, "kernel")?;
    if out_dir.join("vmlinux").is_file() {
        return Ok(());
    }
    let script = script_path(cache_dir, "kernel-build.sh", KERNEL_BUILD)?;
    let fragment = script_path(cache_dir, "clade.config", KERNEL_FRAGMENT)?;
    let tmp = staging(out_dir)?;
    let work = cache_dir.join("kernel").join("work");
    let log = cache_dir.join("kernel").join("build.log");
    run(
        "building the guest kernel",
        &["bash".as_ref(), script.as_os_str(), fragment.as_os_str(), work.as_os_str(), tmp.as_os_str()],
        &log,
        progress,
    )?;
    publish(&tmp, out_dir)
}

/// Builds a package tree: debootstrap and `packages` (build.sh), or a copy
/// of `parent_tree` with `packages` on top and then `setup` inside it
/// (extend.sh).
pub(super) fn rootfs_tree(
    cache_dir: &Path,
    out_dir: &Path,
    name: &str,
    packages: &str,
    parent_tree: Option<&Path>,
    setup: Option<&str>,
    progress: &Progress,
) -> Result<(), ImageError> {
    let _lock = lock(cache_dir, "rootfs")?;
    if out_dir.join("tree").is_dir() {
        return Ok(());
    }
    let packages_file = script_path(cache_dir, "packages", packages)?;
    let tmp = staging(out_dir)?;
    let log = cache_dir.join("rootfs").join(format!("build-{name}.log"));
    // Downloaded packages (Debian's, npm's, PyPI's) are kept for the next
    // build: a rebuild pays for what changed, not for the network.
    let package_cache = std::env::var_os("CLADE_PACKAGE_CACHE").map_or_else(|| cache_dir.join("packages"), PathBuf::from);
    std::fs::create_dir_all(&package_cache).map_err(io_err(format!("creating {}", package_cache.display())))?;
    let mut cache_env = std::ffi::OsString::from("CLADE_PACKAGE_CACHE=");
    cache_env.push(&package_cache);
    match parent_tree {
        None => {
            let script = script_path(cache_dir, "rootfs-build.sh", ROOTFS_BUILD)?;
            let argv =
                ["env".as_ref(), cache_env.as_os_str(), "bash".as_ref(), script.as_os_str(), packages_file.as_os_str(), tmp.as_os_str()];
            run(&format!("building the {name} root filesystem (debootstrap)"), &argv, &log, progress)?;
        }
        Some(parent) => {
            let script = script_path(cache_dir, "rootfs-extend.sh", ROOTFS_EXTEND)?;
            let setup_file = setup.map(|body| script_path(cache_dir, &format!("{name}-setup.sh"), body)).transpose()?;
            let mut argv: Vec<&std::ffi::OsStr> = vec![
                "env".as_ref(),
                cache_env.as_os_str(),
                "bash".as_ref(),
                script.as_os_str(),
                parent.as_os_str(),
                packages_file.as_os_str(),
                tmp.as_os_str(),
            ];
            argv.extend(setup_file.as_deref().map(Path::as_os_str));
            run(&format!("building the {name} root filesystem on {}", parent.display()), &argv, &log, progress)?;
        }
    }
    publish(&tmp, out_dir)
}

/// Assembles the ext4 image: the package tree plus the agent, via `mkfs.ext4 -d`
/// on a hard-linked copy of the tree (no loop device, the cached tree untouched).
pub(super) fn image(
    cache_dir: &Path,
    tree_dir: &Path,
    guestd: &Path,
    out_dir: &Path,
    size: &str,
    progress: &Progress,
) -> Result<(), ImageError> {
    let _lock = lock(cache_dir, "image")?;
    let image = out_dir.join("rootfs.ext4");
    if image.is_file() {
        return Ok(());
    }
    let tmp = staging(out_dir)?;
    let staged_tree = tmp.join("tree");
    let log = cache_dir.join("images").join("assemble.log");
    run(
        "linking the root filesystem tree",
        &["cp".as_ref(), "-al".as_ref(), tree_dir.join("tree").as_os_str(), staged_tree.as_os_str()],
        &log,
        progress,
    )?;
    let target = staged_tree.join(GUESTD_PATH_IN_GUEST.trim_start_matches('/'));
    // /sbin is a symlink into /usr in Debian 12; resolve it inside the staged tree.
    let target = resolve_in_tree(&staged_tree, &target);
    std::fs::copy(guestd, &target).map_err(io_err(format!("copying {} into the image", guestd.display())))?;
    set_mode(&target, 0o755)?;
    let image_tmp = tmp.join("rootfs.ext4");
    mkfs_ext4(&staged_tree, &image_tmp, size, &log, progress)?;
    std::fs::remove_dir_all(&staged_tree).map_err(io_err("removing the staged tree"))?;
    // The base image is never written once built: every VM gets a qcow2 overlay.
    set_mode(&image_tmp, 0o444)?;
    publish(&tmp, out_dir)
}

/// Makes the ext4 file `image` of `size` (`4G`, `900M`) holding `tree`.
pub(super) fn mkfs_ext4(tree: &Path, image: &Path, size: &str, log: &Path, progress: &Progress) -> Result<(), ImageError> {
    run(
        "assembling the ext4 image",
        &[
            "mkfs.ext4".as_ref(),
            "-q".as_ref(),
            "-F".as_ref(),
            "-L".as_ref(),
            "clade-root".as_ref(),
            // Inode tables and journal zeroed here, once, rather than by the
            // kernel's lazy-init thread after mount: that thread would still
            // be working when the template is saved, and every sandbox
            // restored from it would go on writing zeroes into its own layer.
            "-E".as_ref(),
            "lazy_itable_init=0,lazy_journal_init=0".as_ref(),
            "-d".as_ref(),
            tree.as_os_str(),
            image.as_os_str(),
            size.as_ref(),
        ],
        log,
        progress,
    )
}

fn resolve_in_tree(tree: &Path, path: &Path) -> PathBuf {
    let parent = path.parent().expect("has a parent");
    match std::fs::read_link(parent) {
        Ok(link) if link.is_relative() => parent.parent().expect("in tree").join(link).join(path.file_name().expect("file")),
        Ok(link) => tree.join(link.strip_prefix("/").unwrap_or(&link)).join(path.file_name().expect("file")),
        Err(_) => path.to_path_buf(),
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_err(format!("chmod {}", path.display())))
}

/// A fresh temporary directory beside `out_dir`.
pub(super) fn staging(out_dir: &Path) -> Result<PathBuf, ImageError> {
    let tmp = out_dir.with_extension(format!("tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(format!("clearing {}", tmp.display())))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
    Ok(tmp)
}

pub(super) fn publish(tmp: &Path, out_dir: &Path) -> Result<(), ImageError> {
    std::fs::rename(tmp, out_dir).map_err(io_err(format!("publishing {}", out_dir.display())))
}
