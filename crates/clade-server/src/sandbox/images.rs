//! The image a create's template names: the workspace's own template
//! (`builds`), or an image name with an alias resolved
//! (`SandboxSettings::template_aliases`), and, when this host has not built
//! that image yet, built in the background while creates are answered 503
//! with Retry-After (a first-party image takes minutes to build; no request
//! should hang that long).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use clade_host::image::{GuestImage, Progress};
use clade_store::TemplateRow;

use super::SandboxService;
use crate::error::{chain, vm_error, ApiError};

/// Seconds a client waits before asking again while an image builds.
const BUILDING_RETRY_AFTER: u32 = 30;

/// Images being built for creates, or whose build failed.
#[derive(Debug, Default)]
pub(super) struct ImageBuilds {
    state: Mutex<HashMap<String, Build>>,
}

#[derive(Debug)]
enum Build {
    Running {
        since: Instant,
    },
    /// Said to the next create, which then starts the build again.
    Failed(String),
}

/// What a template name stands for in a workspace.
#[derive(Debug)]
pub(super) enum TemplateChoice {
    /// The workspace's own template (built by `builds`).
    Own(TemplateRow),
    /// An image this build makes, an alias resolved.
    Image(String),
}

impl TemplateChoice {
    /// The name a sandbox of it records: its own template's, or the image's.
    pub fn name(&self) -> &str {
        match self {
            Self::Own(row) => &row.name,
            Self::Image(image) => image,
        }
    }
}

impl SandboxService {
    /// The image name a template name resolves to.
    pub(super) fn resolve_template<'a>(&'a self, template: &'a str) -> &'a str {
        self.settings().template_aliases.get(template).map_or(template, String::as_str)
    }

    /// What `name` stands for in the workspace: one lookup of its own templates.
    pub(super) async fn choose_template(&self, workspace_id: &str, name: &str) -> Result<TemplateChoice, ApiError> {
        Ok(match self.store().template(workspace_id, name).await? {
            Some(row) => TemplateChoice::Own(row),
            None => TemplateChoice::Image(self.resolve_template(name).to_string()),
        })
    }

    /// The built image of a template on this host (503 while a first-party
    /// image builds, or when the host lacks the workspace's template).
    pub(super) async fn image_of(&self, choice: &TemplateChoice) -> Result<GuestImage, ApiError> {
        let own = match choice {
            TemplateChoice::Image(image) => return self.built_image(image).await,
            TemplateChoice::Own(own) => own,
        };
        let images = self.runtime().images().clone();
        let key = own.image_key.clone();
        tokio::task::spawn_blocking(move || images.cached(&key))
            .await
            .map_err(|e| ApiError::internal("looking up the template failed", e))?
            .map_err(|e| vm_error("looking up the template", e.into()))?
            .ok_or_else(|| ApiError::Unavailable {
                message: format!("template {}'s image is not on this host", own.name),
                retry_after: Some(5),
            })
    }

    /// The built image of `name` (an image name), or 503 while it builds.
    async fn built_image(&self, name: &str) -> Result<GuestImage, ApiError> {
        let images = self.runtime().images().clone();
        let lookup = name.to_string();
        let cached = tokio::task::spawn_blocking(move || images.cached(&lookup))
            .await
            .map_err(|e| ApiError::internal("looking up the template failed", e))?
            .map_err(|e| vm_error("looking up the template", e.into()))?;
        if let Some(image) = cached {
            return Ok(image);
        }
        let builds = &self.inner.image_builds;
        let mut state = builds.state.lock().expect("image builds lock");
        match state.remove(name) {
            Some(Build::Running { since }) => {
                state.insert(name.to_string(), Build::Running { since });
                return Err(building(name, since));
            }
            Some(Build::Failed(why)) => {
                return Err(ApiError::internal(format!("building template {name} failed (the next create tries again)"), why));
            }
            None => {}
        }
        let since = Instant::now();
        state.insert(name.to_string(), Build::Running { since });
        drop(state);
        tracing::info!(template = name, "building the template's image (first use on this host)");
        let (service, building_name) = (self.clone(), name.to_string());
        tokio::spawn(async move {
            let name = building_name;
            let images = service.runtime().images().clone();
            let image = name.clone();
            let built = tokio::task::spawn_blocking(move || images.ensure(&image, &Progress::Quiet)).await;
            let mut state = service.inner.image_builds.state.lock().expect("image builds lock");
            match built {
                Ok(Ok(_)) => {
                    tracing::info!(template = %name, took = ?since.elapsed(), "template image built");
                    state.remove(&name);
                }
                Ok(Err(e)) => {
                    tracing::warn!(template = %name, "building the template's image failed: {}", chain(&e));
                    state.insert(name, Build::Failed(chain(&e)));
                }
                Err(e) => {
                    state.insert(name, Build::Failed(e.to_string()));
                }
            }
        });
        Err(building(name, since))
    }
}

fn building(name: &str, since: Instant) -> ApiError {
    ApiError::Unavailable {
        message: format!(
            "template {name} is being built on this host (its first use; started {} s ago, a first-party image takes minutes); retry",
            since.elapsed().as_secs()
        ),
        retry_after: Some(BUILDING_RETRY_AFTER),
    }
}
