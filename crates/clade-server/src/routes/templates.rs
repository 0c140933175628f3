//! `GET /v1/templates`, `GET`/`DELETE /v1/templates/{name}` (§3.11): the
//! first-party images this build makes (`base`, `code-interpreter`,
//! `agent`, `postgres`), global, the aliases that resolve to them, and the caller's
//! workspace's own templates (`routes::builds` makes them).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use clade_host::ImageStore;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::AppState;

/// A template a sandbox can be created from (§3.11).
#[derive(Debug, Serialize, ToSchema)]
pub struct Template {
    pub name: String,
    /// vCPUs and memory of its sandboxes.
    pub cpu: u32,
    pub memory_mb: u32,
    /// The root filesystem's apparent size when built on this host, else 0.
    pub size_bytes: u64,
    /// First-party, visible to every workspace (and not deletable).
    pub is_global: bool,
    /// Built and cached on this host: a create from it does not wait for a build.
    pub ready: bool,
    pub label: String,
    pub description: String,
    pub category: String,
    /// The template it is built on; for an alias, the one it resolves to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// What a sandbox of it finds on PATH beyond a shell's basics.
    pub tools: Vec<String>,
    /// `{"alias_of": NAME}` for an alias (the operator's `--template-alias`);
    /// for a workspace's own template, what its build recorded (`build_id`,
    /// `env`, `workdir`, `user`, `ports`, `start_command`, `labels`).
    #[schema(value_type = Object)]
    pub meta: serde_json::Value,
    /// The workspace a template of its own belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
}

/// Every template a workspace sees: the images, the aliases, then its own
/// (global ones first, as §3.11 orders them).
async fn all(state: &AppState, workspace_id: &str) -> Result<Vec<Template>, ApiError> {
    let own = state.store.list_templates(workspace_id).await?;
    let mut templates = global(state).await?;
    let images = state.service.runtime().images().clone();
    let built: Vec<bool> = {
        let keys: Vec<String> = own.iter().map(|t| t.image_key.clone()).collect();
        tokio::task::spawn_blocking(move || keys.iter().map(|k| images.cached(k).ok().flatten().is_some()).collect())
            .await
            .map_err(|e| ApiError::internal("listing templates failed", e))?
    };
    for (row, ready) in own.into_iter().zip(built) {
        let mut meta: serde_json::Value = serde_json::from_str(&row.config).unwrap_or_else(|_| serde_json::json!({}));
        let base = meta["base"].as_str().map(str::to_string);
        meta["build_id"] = serde_json::Value::String(row.build_id.clone());
        templates.push(Template {
            name: row.name.clone(),
            cpu: row.cpu,
            memory_mb: row.memory_mb,
            size_bytes: u64::from(row.size_mb) << 20,
            is_global: false,
            ready,
            label: match &base {
                Some(base) => format!("built from a Dockerfile FROM {base}"),
                None => "built from a root filesystem".to_string(),
            },
            description: format!("the workspace's own template, build {}", row.build_id),
            category: "custom".into(),
            base,
            tools: Vec::new(),
            meta,
            workspace: Some(row.workspace_id),
        });
    }
    Ok(templates)
}

/// The first-party images, then the aliases, by name.
async fn global(state: &AppState) -> Result<Vec<Template>, ApiError> {
    let images = state.service.runtime().images().clone();
    let settings = state.service.settings().clone();
    tokio::task::spawn_blocking(move || {
        let image = |name: &str| {
            let recipe = ImageStore::recipe(name)?;
            let built = images.cached(name).ok().flatten();
            let size_bytes = built.as_ref().and_then(|i| std::fs::metadata(&i.rootfs).ok()).map_or(0, |m| m.len());
            Some(Template {
                name: name.to_string(),
                cpu: settings.vcpus,
                memory_mb: settings.memory_mb,
                size_bytes,
                is_global: true,
                ready: built.is_some(),
                label: recipe.label.to_string(),
                description: recipe.description.to_string(),
                category: recipe.category.to_string(),
                base: recipe.parent().map(str::to_string),
                tools: recipe.tools.iter().map(|t| t.to_string()).collect(),
                meta: serde_json::json!({}),
                workspace: None,
            })
        };
        let mut templates: Vec<Template> = ImageStore::available().into_iter().filter_map(image).collect();
        // An alias's listing is its image's, renamed.
        for (alias, target) in &settings.template_aliases {
            let Some(resolved) = image(target) else { continue };
            templates.push(Template {
                name: alias.clone(),
                label: format!("{} (alias of {target})", resolved.label),
                base: Some(target.clone()),
                meta: serde_json::json!({ "alias_of": target }),
                ..resolved
            });
        }
        templates
    })
    .await
    .map_err(|e| ApiError::internal("listing templates failed", e))
}

/// The templates this server runs: a bare array (§3.11), global ones first.
#[utoipa::path(get, operation_id = "listTemplates", path = "/v1/templates", tag = "templates",
    responses((status = 200, description = "The templates", body = Vec<Template>)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Vec<Template>>, ApiError> {
    Ok(Json(all(&state, &caller.workspace.id).await?))
}

#[utoipa::path(get, operation_id = "getTemplate", path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "The template's name")),
    responses((status = 200, description = "The template", body = Template),
        (status = 404, description = "No such template", body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(name): Path<String>) -> Result<Json<Template>, ApiError> {
    all(&state, &caller.workspace.id)
        .await?
        .into_iter()
        .find(|t| t.name == name)
        .map(Json)
        .ok_or_else(|| ApiError::not_found("template not found"))
}

/// Deletes one of the workspace's templates (sandboxes made from it keep
/// running; its image goes once nothing stands on it); first-party ones
/// are global and stay (403).
#[utoipa::path(delete, operation_id = "deleteTemplate", path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "The template's name")),
    responses((status = 204, description = "Deleted"),
        (status = 403, description = "A global template", body = ErrorBody),
        (status = 404, description = "No such template", body = ErrorBody)))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    if state.service.delete_own_template(&caller.workspace.id, &name).await? {
        return Ok(StatusCode::NO_CONTENT);
    }
    match global(&state).await?.into_iter().find(|t| t.name == name) {
        Some(_) => Err(ApiError::Forbidden("global templates cannot be deleted".into())),
        None => Err(ApiError::not_found("template not found")),
    }
}
