//! Where a client command finds its server and key.
//!
//! Precedence, per setting: the flag (`--api-url`, `--api-key`), then the
//! environment (`CLADE_API_URL`, `CLADE_API_KEY`), then the config file
//! (`$XDG_CONFIG_HOME/clade/config.json`, else `~/.config/clade/config.json`;
//! `CLADE_CONFIG` names another file), then the default URL
//! `http://127.0.0.1:8080`. There is no default key.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Deserialize;

pub const DEFAULT_API_URL: &str = "http://127.0.0.1:8080";

/// The flags every client command takes.
#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// The server, e.g. http://127.0.0.1:8080. Env: CLADE_API_URL.
    #[arg(long, global = true)]
    pub api_url: Option<String>,
    /// An API key (`clade_…`). Env: CLADE_API_KEY.
    #[arg(long, global = true)]
    pub api_key: Option<String>,
    /// Print machine-readable JSON on stdout.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The config file. Keys are those of PandaStack's file where they exist
/// (`api_url`, `token`), plus `api_key`.
#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    api_url: Option<String>,
    api_key: Option<String>,
    token: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a JSON object with api_url / api_key")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "no API key: pass --api-key, set CLADE_API_KEY, or write {{\"api_url\": \"…\", \"api_key\": \"clade_…\"}} \
         to {path} (a local server's first key is in DATA_DIR/admin.key)"
    )]
    NoKey { path: String },
}

/// What a client talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub key: String,
}

/// The config file's path, from the environment.
pub fn config_path() -> Option<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("CLADE_CONFIG")
        .or_else(|| env("XDG_CONFIG_HOME").map(|d| d.join("clade/config.json")))
        .or_else(|| env("HOME").map(|d| d.join(".config/clade/config.json")))
}

fn read_file(path: &Path) -> Result<ConfigFile, ConfigError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| ConfigError::Parse { path: path.into(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ConfigFile::default()),
        Err(source) => Err(ConfigError::Read { path: path.into(), source }),
    }
}

impl ApiArgs {
    /// The endpoint, by flag > environment > file > default.
    pub fn endpoint(&self) -> Result<Endpoint, ConfigError> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let path = config_path();
        let file = match &path {
            Some(path) => read_file(path)?,
            None => ConfigFile::default(),
        };
        resolve(
            [self.api_url.clone(), env("CLADE_API_URL"), file.api_url],
            [self.api_key.clone(), env("CLADE_API_KEY"), file.api_key.or(file.token)],
        )
        .ok_or_else(|| ConfigError::NoKey { path: path.map_or_else(|| "~/.config/clade/config.json".into(), |p| p.display().to_string()) })
    }
}

/// The first non-empty of each list; `None` without a key.
fn resolve(urls: [Option<String>; 3], keys: [Option<String>; 3]) -> Option<Endpoint> {
    let first = |list: [Option<String>; 3]| list.into_iter().flatten().map(|v| v.trim().to_string()).find(|v| !v.is_empty());
    let url = first(urls).unwrap_or_else(|| DEFAULT_API_URL.to_string());
    Some(Endpoint { url, key: first(keys)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Option<String> {
        Some(v.to_string())
    }

    #[test]
    fn flags_win_over_env_over_file() {
        let e = resolve([s("http://flag"), s("http://env"), s("http://file")], [None, s("k-env"), s("k-file")]).unwrap();
        assert_eq!(e, Endpoint { url: "http://flag".into(), key: "k-env".into() });
        let e = resolve([None, None, s("http://file")], [None, s(" "), s("k-file")]).unwrap();
        assert_eq!(e, Endpoint { url: "http://file".into(), key: "k-file".into() });
        let e = resolve([None, None, None], [s("k"), None, None]).unwrap();
        assert_eq!(e.url, DEFAULT_API_URL);
        assert!(resolve([s("http://x"), None, None], [None, None, None]).is_none());
    }

    #[test]
    fn the_file_takes_pandastack_keys_too() {
        let f: ConfigFile = serde_json::from_str(r#"{"api_url":"http://h","token":"t","other":1}"#).unwrap();
        assert_eq!((f.api_url.as_deref(), f.api_key.or(f.token).as_deref()), (Some("http://h"), Some("t")));
    }
}
