//! The resources: the template list (`clade://templates`) and a sandbox's
//! files (`clade://sandboxes/{id}/files/{path}`, a resource template).
//! A resource that cannot be read is a protocol error (resources have no
//! tool-error form); its message is the API's.

use reqwest::Method;
use rmcp::model::{Resource, ResourceContents, ResourceTemplate};
use serde_json::Value;

use crate::api::Api;
use crate::error::ToolError;
use crate::output::{self, FileContent};
use crate::tools;

pub const TEMPLATES_URI: &str = "clade://templates";
pub const FILES_TEMPLATE: &str = "clade://sandboxes/{id}/files/{path}";

pub fn list() -> Vec<Resource> {
    vec![Resource::new(TEMPLATES_URI, "templates")
        .with_description("The templates a sandbox can be created from (create_sandbox's `template`), as JSON.")
        .with_mime_type("application/json")]
}

pub fn templates() -> Vec<ResourceTemplate> {
    vec![ResourceTemplate::new(FILES_TEMPLATE, "sandbox file").with_description(
        "A file of a sandbox: `id` is the sandbox's id, `path` the file's absolute path without its leading slash \
         (clade://sandboxes/ID/files/home/user/notes.txt). Text when UTF-8, else a base64 blob.",
    )]
}

/// What a resource URI names.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    Templates,
    File { sandbox_id: String, path: String },
}

/// Parses a resource URI; `None` for one this server does not serve.
pub fn parse(uri: &str) -> Option<Target> {
    if uri == TEMPLATES_URI {
        return Some(Target::Templates);
    }
    let rest = uri.strip_prefix("clade://sandboxes/")?;
    let (id, path) = rest.split_once("/files/")?;
    let path = percent_decode(path)?;
    let path = format!("/{}", path.trim_start_matches('/'));
    let sandbox_id = percent_decode(id)?;
    (!sandbox_id.is_empty() && path.len() > 1).then_some(Target::File { sandbox_id, path })
}

/// `%XX` escapes decoded (a client expanding `{path}` escapes its slashes).
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Reads the resource `target` names.
pub async fn read(api: &Api, uri: &str, target: Target) -> Result<ResourceContents, ToolError> {
    match target {
        Target::Templates => {
            let listed = api.json(api.request(Method::GET, &["templates"])).await?;
            let templates: Vec<Value> = listed
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| {
                    serde_json::json!({
                        "name": t["name"], "label": t["label"], "description": t["description"],
                        "ready": t["ready"], "cpu": t["cpu"], "memory_mb": t["memory_mb"], "tools": t["tools"],
                    })
                })
                .collect();
            let text = serde_json::to_string_pretty(&templates).unwrap_or_default();
            Ok(ResourceContents::text(text, uri).with_mime_type("application/json"))
        }
        Target::File { sandbox_id, path } => {
            let bytes = tools::read_bytes(api, &sandbox_id, &path).await?;
            Ok(match output::file_content(bytes) {
                FileContent::Text(text) => ResourceContents::text(text, uri).with_mime_type("text/plain"),
                FileContent::Base64(blob) => ResourceContents::blob(blob, uri).with_mime_type("application/octet-stream"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_name_templates_or_a_file() {
        assert_eq!(parse("clade://templates"), Some(Target::Templates));
        assert_eq!(
            parse("clade://sandboxes/sb1/files/home/user/a.txt"),
            Some(Target::File { sandbox_id: "sb1".into(), path: "/home/user/a.txt".into() })
        );
        assert_eq!(
            parse("clade://sandboxes/sb1/files/%2Fetc%2Fhostname"),
            Some(Target::File { sandbox_id: "sb1".into(), path: "/etc/hostname".into() })
        );
        assert_eq!(parse("clade://sandboxes/sb1/files/"), None);
        assert_eq!(parse("file:///etc/passwd"), None);
    }
}
