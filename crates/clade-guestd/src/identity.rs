//! Who the guest is: its hostname (from the kernel command line at boot,
//! from the post-restore hook after a restore) and machine id, and the
//! files programs read them from. `/etc/hostname` and `/etc/machine-id` are
//! links into `/run/clade`, a tmpfs, made once at boot (before a template is
//! saved), so that the hook after each restore writes memory, not the disk.

use std::io;
use std::path::{Path, PathBuf};

/// Used when the kernel command line has no `clade.hostname=`.
pub const DEFAULT_HOSTNAME: &str = "sandbox";

/// `clade.hostname=NAME` from the kernel command line, if it is a valid hostname.
pub fn hostname_from_cmdline(cmdline: &str) -> String {
    // The last occurrence wins, as for kernel parameters.
    cmdline
        .split_whitespace()
        .rev()
        .filter_map(|arg| arg.strip_prefix("clade.hostname="))
        .find(|name| valid_hostname(name))
        .unwrap_or(DEFAULT_HOSTNAME)
        .to_string()
}

pub fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !name.starts_with(['-', '.'])
}

#[derive(Debug, thiserror::Error)]
#[error("preparing the identity file {path}")]
pub struct IdentityError {
    path: PathBuf,
    #[source]
    source: io::Error,
}

/// Where the guest's identity files are: `etc` holds the names programs
/// read, `run` (a tmpfs) what they link to.
#[derive(Debug, Clone)]
pub struct IdentityFiles {
    pub etc: PathBuf,
    pub run: PathBuf,
}

impl IdentityFiles {
    pub fn system() -> Self {
        Self { etc: "/etc".into(), run: "/run/clade".into() }
    }

    pub fn hostname(&self) -> PathBuf {
        self.etc.join("hostname")
    }

    pub fn machine_id(&self) -> PathBuf {
        self.etc.join("machine-id")
    }

    /// At boot: fills `run` (the hostname given; the machine id `saved` for
    /// the next boot, else the image's, else a fresh one) and makes the
    /// `etc` names links to it. A read-only root leaves the files where
    /// they are; the hook then writes the disk.
    pub fn prepare(&self, hostname: &str, saved_machine_id: Option<&str>) -> Result<(), IdentityError> {
        let at = |path: &Path| {
            let path = path.to_path_buf();
            move |source| IdentityError { path, source }
        };
        std::fs::create_dir_all(&self.run).map_err(at(&self.run))?;
        let machine_id = saved_machine_id
            .map(str::to_string)
            .or_else(|| std::fs::read_to_string(self.machine_id()).ok())
            .map(|id| id.trim().to_string())
            .filter(|id| valid_machine_id(id))
            .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        for (name, content) in [("hostname", hostname), ("machine-id", machine_id.as_str())] {
            let target = self.run.join(name);
            std::fs::write(&target, format!("{content}\n")).map_err(at(&target))?;
            let link = self.etc.join(name);
            link_to(&link, &target).map_err(at(&link))?;
        }
        Ok(())
    }
}

/// Replaces `link` with a symlink to `target` (unless it is one already), by
/// a rename so that no reader ever finds the name missing.
fn link_to(link: &Path, target: &Path) -> io::Result<()> {
    if std::fs::read_link(link).is_ok_and(|current| current == target) {
        return Ok(());
    }
    let name = link.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let staged = link.with_file_name(format!(".{name}.clade-link"));
    let _ = std::fs::remove_file(&staged);
    std::os::unix::fs::symlink(target, &staged)?;
    std::fs::rename(&staged, link)
}

pub fn valid_machine_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostname_comes_from_the_command_line() {
        assert_eq!(hostname_from_cmdline("console=ttyS0 clade.hostname=box-1 quiet"), "box-1");
        assert_eq!(hostname_from_cmdline("console=ttyS0"), DEFAULT_HOSTNAME);
        assert_eq!(hostname_from_cmdline("clade.hostname=bad/name"), DEFAULT_HOSTNAME);
        assert_eq!(hostname_from_cmdline("clade.hostname="), DEFAULT_HOSTNAME);
    }

    #[test]
    fn identity_files_become_links_into_run_and_survive_a_reboot() {
        let root = tempfile::tempdir().unwrap();
        let files = IdentityFiles { etc: root.path().join("etc"), run: root.path().join("run/clade") };
        std::fs::create_dir_all(&files.etc).unwrap();
        std::fs::write(files.hostname(), "image\n").unwrap();
        std::fs::write(files.machine_id(), "0123456789abcdef0123456789abcdef\n").unwrap();

        files.prepare("box-1", None).unwrap();
        for name in ["hostname", "machine-id"] {
            assert_eq!(std::fs::read_link(files.etc.join(name)).unwrap(), files.run.join(name));
        }
        assert_eq!(std::fs::read_to_string(files.hostname()).unwrap(), "box-1\n");
        // The image's machine id is kept; written through the link, it lands in run.
        assert_eq!(std::fs::read_to_string(files.machine_id()).unwrap(), "0123456789abcdef0123456789abcdef\n");
        std::fs::write(files.machine_id(), "ffffffffffffffffffffffffffffffff\n").unwrap();
        assert_eq!(std::fs::read_to_string(files.run.join("machine-id")).unwrap(), "ffffffffffffffffffffffffffffffff\n");

        // Booting again (a fresh tmpfs) keeps the links and makes a new id
        // for an image whose link points nowhere yet.
        std::fs::remove_dir_all(&files.run).unwrap();
        files.prepare("box-2", None).unwrap();
        let id = std::fs::read_to_string(files.machine_id()).unwrap();
        assert!(valid_machine_id(id.trim()), "{id:?}");
        assert_eq!(std::fs::read_to_string(files.hostname()).unwrap(), "box-2\n");

        // A boot after a filesystem-only hibernation: the saved id is the one.
        std::fs::remove_dir_all(&files.run).unwrap();
        files.prepare("box-3", Some("ffffffffffffffffffffffffffffffff")).unwrap();
        assert_eq!(std::fs::read_to_string(files.machine_id()).unwrap(), "ffffffffffffffffffffffffffffffff\n");
        let leftovers: Vec<_> = std::fs::read_dir(&files.etc).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers.len(), 2, "{leftovers:?}");
    }
}
