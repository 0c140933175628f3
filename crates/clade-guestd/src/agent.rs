//! The agent's state, shared by every session and operation: how it was
//! set up ([`AgentConfig`]), its reaper and cgroups, its own files, the
//! default environment the post-restore hook sets, and the execs a later
//! session may re-attach to. Below `server` (which
//! serves sessions) and the operations it dispatches to.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::io::AsyncRead;
use tokio_util::sync::CancellationToken;

use crate::cgroup::{CgroupError, Cgroups};
use crate::reaper::{ReapScope, Reaper, ReaperError};
use crate::reattach::Reattachable;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Reaper(#[from] ReaperError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

/// How the agent is set up.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// [`ReapScope::AnyChild`] only when the agent is PID 1.
    pub reap_scope: ReapScope,
    /// Where a cgroup v2 hierarchy may be mounted; execs get a cgroup each when it is.
    pub cgroup_root: Option<PathBuf>,
    /// Holds user commands to limits (see `cgroup`): only the guest's own
    /// agent, whose cgroup tree is the guest's.
    pub limit_user_commands: bool,
    /// The agent's own files (long commands' scripts): a tmpfs in the guest.
    pub run_dir: PathBuf,
    /// The image's defaults for every command (`clade_proto::image_defaults`),
    /// read once at start; none when absent.
    pub image_defaults: Option<PathBuf>,
    /// What a cold boot of this disk gets back (`clade_proto::boot_state`):
    /// read at start, written when the host asks; none keeps nothing.
    pub boot_state: Option<PathBuf>,
}

impl AgentConfig {
    /// As PID 1 of a guest.
    pub fn init() -> Self {
        Self {
            reap_scope: ReapScope::AnyChild,
            cgroup_root: Some("/sys/fs/cgroup".into()),
            limit_user_commands: true,
            run_dir: "/run/clade".into(),
            image_defaults: Some(clade_proto::IMAGE_DEFAULTS_PATH.into()),
            boot_state: Some(clade_proto::BOOT_STATE_PATH.into()),
        }
    }

    /// As an ordinary process (development, tests): reaps only its own children.
    pub fn unprivileged() -> Self {
        Self {
            reap_scope: ReapScope::Registered,
            cgroup_root: Some("/sys/fs/cgroup".into()),
            limit_user_commands: false,
            run_dir: std::env::temp_dir().join(format!("clade-guestd-{}", std::process::id())),
            image_defaults: None,
            boot_state: None,
        }
    }
}

/// State shared by every session and operation.
pub struct Agent {
    version: String,
    reaper: Reaper,
    cgroups: Option<Cgroups>,
    run_dir: PathBuf,
    /// Environment set by the post-restore hook, under each command's own.
    default_env: std::sync::Mutex<Vec<(String, String)>>,
    /// The image's environment, working directory and user, under the
    /// hook's and each command's own.
    image_defaults: clade_proto::ImageDefaults,
    /// Execs that outlive their host, for a later session to re-attach to.
    reattachable: Arc<Reattachable>,
    /// Where the boot state is kept (see [`AgentConfig::boot_state`]).
    boot_state: Option<PathBuf>,
}

impl Agent {
    /// Starts the reaper; must be called inside a tokio runtime.
    pub fn new(config: AgentConfig) -> Result<Arc<Self>, AgentError> {
        let cgroups = match &config.cgroup_root {
            Some(root) => Cgroups::detect(root)?,
            None => None,
        };
        match &cgroups {
            None => tracing::info!("no cgroup v2 hierarchy: execs are tracked by process group only"),
            Some(cgroups) if config.limit_user_commands => match cgroups.limit_user_commands() {
                Ok(limits) => tracing::debug!(?limits, "user commands are limited"),
                // The agent still serves; commands run unlimited, as before limits existed.
                Err(e) => tracing::warn!("user commands run without limits: {}", crate::error_chain(&e)),
            },
            Some(_) => {}
        }
        let image_defaults = match &config.image_defaults {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => clade_proto::ImageDefaults::parse(&text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => clade_proto::ImageDefaults::default(),
                Err(e) => {
                    tracing::warn!("reading the image's defaults {}: {e}", path.display());
                    clade_proto::ImageDefaults::default()
                }
            },
            None => clade_proto::ImageDefaults::default(),
        };
        // A cold boot of a disk a filesystem-only hibernation left: the
        // variables the sandbox's hooks had set are its defaults again.
        let saved = config.boot_state.as_deref().map(crate::boot_state::load).unwrap_or_default();
        Ok(Arc::new(Self {
            version: crate::VERSION.to_string(),
            reaper: Reaper::start(config.reap_scope)?,
            cgroups,
            run_dir: config.run_dir,
            default_env: std::sync::Mutex::new(saved.env),
            image_defaults,
            reattachable: Arc::default(),
            boot_state: config.boot_state,
        }))
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub(crate) fn reaper(&self) -> &Reaper {
        &self.reaper
    }

    pub(crate) fn cgroups(&self) -> Option<&Cgroups> {
        self.cgroups.as_ref()
    }

    pub(crate) fn run_dir(&self) -> &std::path::Path {
        &self.run_dir
    }

    /// Every command's environment under its own: the image's, then the
    /// post-restore hook's.
    pub(crate) fn default_env(&self) -> Vec<(String, String)> {
        let mut env = self.image_defaults.env.clone();
        env.extend(self.default_env.lock().expect("env lock").iter().cloned());
        env
    }

    pub(crate) fn reattachable(&self) -> &Arc<Reattachable> {
        &self.reattachable
    }

    pub(crate) fn image_defaults(&self) -> &clade_proto::ImageDefaults {
        &self.image_defaults
    }

    /// Writes what the next cold boot of this disk needs (see
    /// `boot_state`): the hooks' variables and the machine id in force.
    pub(crate) fn save_boot_state(&self) -> Result<(), clade_proto::GuestError> {
        let Some(path) = &self.boot_state else {
            return Err(clade_proto::GuestError::new(clade_proto::ErrorKind::Io, "this agent keeps no boot state"));
        };
        let env = self.default_env.lock().expect("env lock").clone();
        crate::boot_state::save(path, env, &crate::identity::IdentityFiles::system())
    }

    /// Merges a post-restore hook's variables into the default environment:
    /// a wake's hook names none and changes nothing; a copy's (fork, a
    /// create from a snapshot) replaces `CLADE_SANDBOX_ID` and keeps the
    /// variables its source was created with.
    pub(crate) fn set_default_env(&self, env: Vec<(String, String)>) {
        let mut default_env = self.default_env.lock().expect("env lock");
        for (name, value) in env {
            match default_env.iter_mut().find(|(existing, _)| *existing == name) {
                Some(slot) => slot.1 = value,
                None => default_env.push((name, value)),
            }
        }
    }
}

/// Reads and drops whatever the host still sends until it closes the
/// substream. A host may send a whole upload before reading the answer
/// (for instance a refusal): if we stopped reading, yamux flow control
/// would block its writes forever.
pub(crate) async fn drain_until_closed<R: AsyncRead + Unpin>(stream: &mut R, session: &CancellationToken) {
    let mut sink = tokio::io::sink();
    tokio::select! {
        _ = tokio::io::copy(stream, &mut sink) => {}
        _ = session.cancelled() => {}
    }
}
