//! Creating a sandbox: the template's image, a VM restored from its template
//! snapshot (persistent, so it outlives this process), then its row.

use std::collections::BTreeMap;
use std::time::Instant;

use clade_host::image::Progress;
use clade_host::vm::BootKind;
use clade_host::{Lifetime, VmSpec};
use clade_store::{NewSandbox, SandboxRow, SandboxState, Workspace};

use super::{vm_error, watchdog, Entry, SandboxService, Slot};
use crate::error::{chain, ApiError};

#[derive(Debug, Clone)]
pub struct CreateParams {
    pub template: String,
    pub metadata: BTreeMap<String, String>,
    pub ttl_seconds: Option<u64>,
    pub persistent: bool,
}

/// How the VM of a new sandbox came to run.
#[derive(Debug, Clone)]
pub struct Boot {
    pub ms: u64,
    pub mode: &'static str,
}

impl SandboxService {
    pub async fn create(&self, workspace: &Workspace, params: CreateParams) -> Result<(SandboxRow, Boot), ApiError> {
        let started = Instant::now();
        let images = self.runtime().images().clone();
        let name = params.template.clone();
        // Instant when the image is built; the first use on a host builds it (minutes).
        let image = tokio::task::spawn_blocking(move || images.ensure(&name, &Progress::Quiet))
            .await
            .map_err(|e| ApiError::internal("preparing the template failed", e))?
            .map_err(|e| vm_error("preparing the template", e.into()))?;
        let settings = self.settings();
        let spec = VmSpec {
            memory_mb: settings.memory_mb,
            vcpus: settings.vcpus,
            lifetime: Lifetime::Persistent,
            watchdog: watchdog(),
            ..VmSpec::new(image)
        };
        let vm = self.runtime().create(spec).await.map_err(|e| vm_error("creating the sandbox", e))?;
        let id = vm.id();
        let boot = Boot {
            ms: started.elapsed().as_millis() as u64,
            mode: match vm.boot_kind() {
                BootKind::Cold => "cold",
                BootKind::FromSnapshot { .. } => "snapshot",
                _ => "template-snapshot",
            },
        };
        let new = NewSandbox {
            id: id.clone(),
            workspace_id: workspace.id.clone(),
            template: params.template.clone(),
            state: SandboxState::Running,
            metadata: params.metadata,
            cpu: settings.vcpus,
            memory_mb: settings.memory_mb,
            ttl_seconds: params.ttl_seconds.unwrap_or(settings.default_ttl_seconds),
            persistent: params.persistent,
            fork_tree_id: None,
        };
        let row = match self.store().insert_sandbox(new).await {
            Ok(row) => row,
            Err(e) => {
                // Nothing may be left half-made: no row, no VM.
                if let Err(stop) = vm.stop().await {
                    tracing::error!(sandbox = %id, "removing the VM of a failed create: {}", chain(&stop));
                }
                return Err(e.into());
            }
        };
        let entry = Entry::new(&id, &workspace.id, Slot { state: SandboxState::Running, reason: None, vm: None, watcher: None }, row.created_at);
        {
            let mut slot = entry.slot.write().await;
            slot.watcher = Some(self.watch(&entry, &vm));
            slot.vm = Some(vm);
        }
        self.insert(entry.clone());
        let detail = serde_json::json!({ "template": row.template, "boot_ms": boot.ms, "boot_mode": boot.mode });
        self.record(&entry, "created", detail).await;
        tracing::info!(sandbox = %id, workspace = %workspace.name, boot_ms = boot.ms, "sandbox created");
        Ok((row, boot))
    }
}
