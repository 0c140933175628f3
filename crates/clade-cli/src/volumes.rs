//! `clade volume …`: the durable volumes of a Clade server, over its API
//! (`/v1/volumes`), and the `NAME[:PATH][:ro]` form in which
//! `clade sandbox create --volume` attaches them. It only speaks HTTP: what
//! a volume is on disk and how a guest mounts it is the server's business.

use std::process::ExitCode;

use clap::Subcommand;
use reqwest::Method;
use serde::Serialize;
use serde_json::{json, Value};

use crate::client::Client;
use crate::output;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Make an empty volume (the server formats it); prints it.
    Create {
        /// The volume's name, unique in the workspace.
        name: String,
        /// Its size, MiB (default: the server's).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        size_mb: Option<u64>,
    },
    /// List the volumes of your workspace and the sandboxes they are attached to.
    #[command(alias = "list")]
    Ls,
    /// Show one volume.
    Get { name: String },
    /// Grow a volume (it cannot shrink, nor change while attached).
    Resize {
        name: String,
        /// The new size, MiB.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        size_mb: u64,
    },
    /// Delete volumes and their data (refused while attached).
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

pub async fn run(command: VolumeCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        VolumeCommand::Create { name, size_mb } => {
            let mut body = json!({ "name": name });
            if let Some(size_mb) = size_mb {
                body["size_mb"] = json!(size_mb);
            }
            let volume = client.json(client.request(Method::POST, &["volumes"]).json(&body)).await?;
            print_volumes(std::slice::from_ref(&volume), &volume, json_out);
        }
        VolumeCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["volumes"])).await?;
            print_volumes(listed.as_array().map(Vec::as_slice).unwrap_or_default(), &listed, json_out);
        }
        VolumeCommand::Get { name } => {
            let volume = client.json(client.request(Method::GET, &["volumes", &name])).await?;
            print_volumes(std::slice::from_ref(&volume), &volume, json_out);
        }
        VolumeCommand::Resize { name, size_mb } => {
            let request = client.request(Method::PATCH, &["volumes", &name]).json(&json!({ "size_mb": size_mb }));
            let volume = client.json(request).await?;
            print_volumes(std::slice::from_ref(&volume), &volume, json_out);
        }
        VolumeCommand::Rm { names } => {
            for name in &names {
                client.send(client.request(Method::DELETE, &["volumes", name])).await?;
                if !json_out {
                    println!("deleted {name}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": names }));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The server's answer as it is (`--json`), else `volumes` as a table.
fn print_volumes(volumes: &[Value], answer: &Value, json_out: bool) {
    if json_out {
        output::json(answer);
    } else {
        print!("{}", table(volumes));
    }
}

fn table(volumes: &[Value]) -> String {
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            let size = v["size_bytes"].as_u64().or_else(|| v["size_mb"].as_u64().map(|mb| mb << 20));
            vec![
                output::field(v, "name"),
                size.map_or_else(|| "-".to_string(), output::human_bytes),
                attached_to(&v["attachments"]),
                output::field(v, "created_at"),
            ]
        })
        .collect();
    output::table(&["NAME", "SIZE", "ATTACHED TO", "CREATED"], &rows)
}

/// `sb_a (rw /mnt/data), sb_b (fork)`, or `-` when it is attached nowhere.
fn attached_to(attachments: &Value) -> String {
    let listed: Vec<String> = attachments
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|a| match a["mount_path"].as_str() {
            Some(path) => format!("{} ({} {path})", output::field(a, "sandbox_id"), output::field(a, "mode")),
            None => format!("{} ({})", output::field(a, "sandbox_id"), output::field(a, "mode")),
        })
        .collect();
    if listed.is_empty() {
        "-".to_string()
    } else {
        listed.join(", ")
    }
}

/// One volume of a sandbox to be created, as `POST /v1/sandboxes` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeMount {
    pub name: String,
    pub read_only: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount_path: Option<String>,
}

/// `NAME[:PATH][:ro]` (`--volume`): `data`, `data:/mnt/data`,
/// `data:/mnt/data:ro`, `data::ro` or `data:ro`. A PATH is absolute, so
/// `ro` (or `rw`) in second place is the mode. Paths cannot hold `:`.
pub fn parse_mount(spec: &str) -> Result<VolumeMount, String> {
    let mut parts = spec.split(':');
    let name = parts.next().unwrap_or_default();
    let (path, mode) = match (parts.next(), parts.next(), parts.next()) {
        (None, _, _) => (None, None),
        (Some(mode @ ("ro" | "rw")), None, _) => (None, Some(mode)),
        (Some(path), mode, None) => (Some(path), mode),
        (Some(_), _, Some(_)) => return Err("too many ':': expected NAME[:PATH][:ro] (a path cannot hold ':')".to_string()),
    };
    if name.is_empty() {
        return Err("no volume name: expected NAME[:PATH][:ro], e.g. data:/mnt/data".to_string());
    }
    let mount_path = match path.filter(|p| !p.is_empty()) {
        Some(path) if !path.starts_with('/') => {
            return Err(format!("the mount path {path:?} must be absolute (e.g. /mnt/{name}); `ro` there means read-only"))
        }
        path => path.map(str::to_string),
    };
    let read_only = match mode {
        None | Some("" | "rw") => false,
        Some("ro") => true,
        Some(other) => return Err(format!("{other:?} is not a mode: the last part is `ro` (read-only) or `rw`")),
    };
    Ok(VolumeMount { name: name.to_string(), read_only, mount_path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(name: &str, path: Option<&str>, read_only: bool) -> VolumeMount {
        VolumeMount { name: name.into(), read_only, mount_path: path.map(str::to_string) }
    }

    #[test]
    fn mounts_take_a_name_then_an_optional_absolute_path_then_an_optional_mode() {
        assert_eq!(parse_mount("data"), Ok(mount("data", None, false)));
        assert_eq!(parse_mount("data:/mnt/data"), Ok(mount("data", Some("/mnt/data"), false)));
        assert_eq!(parse_mount("data:/mnt/data:ro"), Ok(mount("data", Some("/mnt/data"), true)));
        assert_eq!(parse_mount("data:/mnt/data:rw"), Ok(mount("data", Some("/mnt/data"), false)));
        assert_eq!(parse_mount("data::ro"), Ok(mount("data", None, true)));
        assert_eq!(parse_mount("data:ro"), Ok(mount("data", None, true)));
        assert_eq!(parse_mount("data:rw"), Ok(mount("data", None, false)));
        assert_eq!(parse_mount("data:"), Ok(mount("data", None, false)));
        assert_eq!(parse_mount("data:/mnt/data:"), Ok(mount("data", Some("/mnt/data"), false)));
    }

    #[test]
    fn mounts_without_a_name_or_with_a_relative_path_are_refused_saying_why() {
        for (spec, why) in [
            ("", "no volume name"),
            (":/mnt/data", "no volume name"),
            ("::ro", "no volume name"),
            ("data:mnt/data", "must be absolute"),
            ("data:rox", "must be absolute"),
            ("data:mnt:ro", "must be absolute"),
            ("data:/mnt/data:r", "is not a mode"),
            ("data:/mnt/data:ro:x", "too many"),
        ] {
            let error = parse_mount(spec).expect_err(spec);
            assert!(error.contains(why), "{spec:?}: {error}");
        }
    }

    #[test]
    fn mounts_serialize_as_the_api_takes_them() {
        assert_eq!(serde_json::to_value(mount("data", None, true)).unwrap(), json!({"name": "data", "read_only": true}));
        assert_eq!(
            serde_json::to_value(mount("data", Some("/mnt/v"), false)).unwrap(),
            json!({"name": "data", "read_only": false, "mount_path": "/mnt/v"})
        );
    }

    #[test]
    fn the_table_shows_sizes_and_where_each_volume_is_attached() {
        let volumes = [
            json!({"name": "data", "size_mb": 1024, "size_bytes": 1_073_741_824u64, "created_at": "2026-12-06T10:00:00Z", "attachments": [
                {"sandbox_id": "sb_a", "mode": "rw", "mount_path": "/mnt/data"},
                {"sandbox_id": "sb_b", "mode": "fork", "mount_path": null},
            ]}),
            json!({"name": "cache", "size_mb": 64, "created_at": "2026-12-06T11:00:00Z", "attachments": []}),
        ];
        assert_eq!(
            table(&volumes),
            "NAME   SIZE      ATTACHED TO                       CREATED\n\
             data   1.0 GiB   sb_a (rw /mnt/data), sb_b (fork)  2026-12-06T10:00:00Z\n\
             cache  64.0 MiB  -                                 2026-12-06T11:00:00Z\n"
        );
    }
}
