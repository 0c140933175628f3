//! The guest's side of `clade_proto::boot_state`: written to the disk
//! before a filesystem-only hibernation, read back when the agent starts.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use clade_proto::{BootState, GuestError};

use crate::identity::{valid_machine_id, IdentityFiles};

/// What the file at `path` holds; nothing when there is none (every boot
/// but one after a filesystem-only hibernation) or it cannot be read.
pub fn load(path: &Path) -> BootState {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let mut state = BootState::parse(&text);
            state.machine_id = state.machine_id.filter(|id| valid_machine_id(id));
            state
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BootState::default(),
        Err(e) => {
            tracing::warn!("reading the boot state {}: {e}", path.display());
            BootState::default()
        }
    }
}

/// Writes `env` and the machine id `identity` holds to `path`, replacing
/// the file whole (a new name, then a rename), readable by root only.
pub fn save(path: &Path, env: Vec<(String, String)>, identity: &IdentityFiles) -> Result<(), GuestError> {
    let failed = |e: std::io::Error| GuestError::from_io(&e, &path.display().to_string());
    let machine_id = std::fs::read_to_string(identity.machine_id()).ok().map(|id| id.trim().to_string()).filter(|id| valid_machine_id(id));
    let text = BootState { env, machine_id }.to_text();
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(failed)?;
    }
    let staged = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&staged).map_err(failed)?;
    file.write_all(text.as_bytes()).map_err(failed)?;
    drop(file);
    std::fs::rename(&staged, path).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_saved_is_loaded_and_only_root_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let identity = IdentityFiles { etc: dir.path().join("etc"), run: dir.path().join("run") };
        std::fs::create_dir_all(&identity.etc).unwrap();
        std::fs::write(identity.machine_id(), "0123456789abcdef0123456789abcdef\n").unwrap();
        let path = dir.path().join("var/lib/clade/boot-state");
        assert_eq!(load(&path), BootState::default(), "no file: nothing");
        let env = vec![("TOKEN".to_string(), "s3cret\nline".to_string())];
        save(&path, env.clone(), &identity).unwrap();
        let loaded = load(&path);
        assert_eq!(loaded, BootState { env, machine_id: Some("0123456789abcdef0123456789abcdef".into()) });
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
        // A machine id that is not one is not used.
        std::fs::write(&path, "machine-id=nothex\n").unwrap();
        assert_eq!(load(&path).machine_id, None);
    }
}
