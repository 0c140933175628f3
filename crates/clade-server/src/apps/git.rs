//! The host's side of a deployment: its repository fetched with the host's
//! `git` (https, ssh, and `file://` where the operator allows it), then
//! packed as a tar.gz of the tree to build, for the sandbox.
//!
//! `git` runs without the host's configuration and credentials (an empty
//! `HOME`, no system or global config, no prompt) and with only the
//! allowed transports: a tenant's URL must never reach the server's own
//! keys, local repositories or `ext::` commands.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;

/// How long a fetch may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// The most a deployment's source may be, packed.
pub const MAX_SOURCE_BYTES: u64 = 256 << 20;

/// How a private repository is reached (from the app's secrets).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// An https token: sent as the password of HTTP basic authentication.
    pub token: Option<String>,
    /// An ssh deploy key (the private key's text).
    pub ssh_key: Option<String>,
}

/// A fetched commit, checked out in a directory of its own (removed on drop).
#[derive(Debug)]
pub struct Checkout {
    dir: tempfile::TempDir,
    pub commit: String,
    pub subject: String,
}

/// Whether `url` is one a deployment may fetch: `https://`, `http://`,
/// `ssh://`, scp-like `user@host:path`, and `file://` when `allow_file`.
pub fn check_url(url: &str, allow_file: bool) -> Result<(), String> {
    let url = url.trim();
    if url.is_empty() || url.starts_with('-') || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("git_url {url:?} is not a repository URL"));
    }
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("https://") || lower.starts_with("http://") || lower.starts_with("ssh://") {
        return Ok(());
    }
    if lower.starts_with("file://") {
        return if allow_file {
            Ok(())
        } else {
            Err("file:// repositories are off on this server (the operator allows them with --apps-allow-file-urls)".into())
        };
    }
    // scp-like: user@host:path (no scheme, a colon before any slash).
    if let Some((authority, path)) = url.split_once(':') {
        if authority.contains('@') && !authority.contains('/') && !path.is_empty() && !path.starts_with("//") {
            return Ok(());
        }
    }
    Err(format!("git_url {url:?}: use an https://, ssh:// or user@host:path URL"))
}

/// Whether `git_ref` may be fetched: a branch, tag or commit name.
pub fn check_ref(git_ref: &str) -> Result<(), String> {
    let ok = !git_ref.is_empty()
        && git_ref.len() <= 255
        && !git_ref.starts_with(['-', '/', '.'])
        && !git_ref.contains("..")
        && git_ref.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if ok {
        Ok(())
    } else {
        Err(format!("git ref {git_ref:?} is not a branch, tag or commit name"))
    }
}

/// Whether `root` is a sub-directory a deployment may build in.
pub fn check_root(root: &str) -> Result<String, String> {
    let trimmed = root.trim().trim_matches('/');
    if trimmed.is_empty() || trimmed == "." {
        return Ok(String::new());
    }
    let ok = trimmed.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
        && !trimmed.chars().any(|c| c.is_control() || c == '\\' || c == ':');
    if ok {
        Ok(trimmed.to_string())
    } else {
        Err(format!("root_directory {root:?} must be a relative path inside the repository"))
    }
}

/// A place for checkouts under `work_dir`.
pub fn work_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("apps").join("checkouts")
}

/// Fetches `git_ref` of `url` (only that commit, when the server allows
/// it) into a new directory under `work_dir`. `log` gets git's output.
pub async fn fetch(
    work_dir: &Path,
    url: &str,
    git_ref: &str,
    credentials: &Credentials,
    allow_file: bool,
    log: &mut (dyn FnMut(&str) + Send),
) -> Result<Checkout, String> {
    std::fs::create_dir_all(work_dir).map_err(|e| format!("making {}: {e}", work_dir.display()))?;
    let dir = tempfile::Builder::new().prefix("checkout-").tempdir_in(work_dir).map_err(|e| format!("making a checkout directory: {e}"))?;
    let home = dir.path().join("home");
    let src = dir.path().join("src");
    std::fs::create_dir_all(&home).map_err(|e| format!("making a checkout directory: {e}"))?;
    let git = Git::new(&home, &src, credentials, allow_file)?;
    git.run(&["init", "-q", "."], log).await?;
    let shallow = git.run(&["fetch", "--depth", "1", "--no-tags", "--", url, git_ref], log).await;
    if let Err(first) = shallow {
        // A commit name the server will not send alone: fetch everything, then find it.
        let commitish = git_ref.len() >= 4 && git_ref.bytes().all(|b| b.is_ascii_hexdigit());
        if !commitish {
            return Err(first);
        }
        log("fetching the whole repository to find that commit\n");
        git.run(&["fetch", "--no-tags", "--", url, "+refs/heads/*:refs/remotes/origin/*"], log).await?;
        git.run(&["checkout", "-q", "--detach", git_ref], log).await?;
    } else {
        git.run(&["checkout", "-q", "--detach", "FETCH_HEAD"], log).await?;
    }
    let commit = git.output(&["rev-parse", "HEAD"]).await?.trim().to_string();
    let subject = git.output(&["log", "-1", "--format=%s"]).await?.trim().to_string();
    Ok(Checkout { dir, commit, subject })
}

impl Checkout {
    fn git(&self) -> Result<Git, String> {
        Git::new(&self.dir.path().join("home"), &self.src(), &Credentials::default(), false)
    }

    /// The checked-out tree.
    pub fn src(&self) -> PathBuf {
        self.dir.path().join("src")
    }

    /// Whether `root` (from [`check_root`]) is a directory of the commit.
    pub async fn has_directory(&self, root: &str) -> Result<bool, String> {
        if root.is_empty() {
            return Ok(true);
        }
        let kind = self.git()?.output(&["cat-file", "-t", &format!("HEAD:{root}")]).await;
        Ok(kind.is_ok_and(|k| k.trim() == "tree"))
    }

    /// `root` of the commit as a tar.gz (git's tracked files only), at
    /// most [`MAX_SOURCE_BYTES`].
    pub async fn archive(&self, root: &str) -> Result<Vec<u8>, String> {
        let tree = if root.is_empty() { "HEAD".to_string() } else { format!("HEAD:{root}") };
        let git = self.git()?;
        let mut child = git
            .command(&["archive", "--format=tar.gz", &tree])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running git archive: {e}"))?;
        let mut stdout = child.stdout.take().ok_or("git archive: no stdout")?;
        let mut packed = Vec::new();
        (&mut stdout).take(MAX_SOURCE_BYTES + 1).read_to_end(&mut packed).await.map_err(|e| format!("reading git archive: {e}"))?;
        if packed.len() as u64 > MAX_SOURCE_BYTES {
            let _ = child.kill().await;
            return Err(format!("the source is larger than {} MiB packed", MAX_SOURCE_BYTES >> 20));
        }
        let out = child.wait_with_output().await.map_err(|e| format!("running git archive: {e}"))?;
        if !out.status.success() {
            return Err(format!("git archive failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(packed)
    }
}

/// `git` in one directory, isolated from the host's configuration.
struct Git {
    home: PathBuf,
    dir: PathBuf,
    allowed: &'static str,
    token: Option<String>,
    ssh_command: Option<String>,
}

impl Git {
    fn new(home: &Path, dir: &Path, credentials: &Credentials, allow_file: bool) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("making {}: {e}", dir.display()))?;
        let mut ssh = "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile=/dev/null".to_string();
        if let Some(key) = credentials.ssh_key.as_deref().filter(|k| !k.trim().is_empty()) {
            let path = home.join("deploy_key");
            let mut text = key.trim().to_string();
            text.push('\n');
            write_private(&path, &text).map_err(|e| format!("writing the deploy key: {e}"))?;
            ssh.push_str(&format!(" -o IdentitiesOnly=yes -i {}", path.display()));
        }
        Ok(Self {
            home: home.to_path_buf(),
            dir: dir.to_path_buf(),
            allowed: if allow_file { "https:http:ssh:file" } else { "https:http:ssh" },
            token: credentials.token.clone().filter(|t| !t.trim().is_empty()),
            ssh_command: Some(ssh),
        })
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("git");
        command.current_dir(&self.dir).env_clear();
        command
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("HOME", &self.home)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_ALLOW_PROTOCOL", self.allowed)
            .env("LC_ALL", "C");
        if let Some(ssh) = &self.ssh_command {
            command.env("GIT_SSH_COMMAND", ssh);
        }
        command.args(["-c", "protocol.ext.allow=never", "-c", "advice.detachedHead=false"]);
        if let Some(token) = &self.token {
            use base64::Engine as _;
            let basic = base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{}", token.trim()));
            // Through the environment (GIT_CONFIG_*), not the command line that `ps` shows.
            command
                .env("GIT_CONFIG_COUNT", "1")
                .env("GIT_CONFIG_KEY_0", "http.extraHeader")
                .env("GIT_CONFIG_VALUE_0", format!("Authorization: Basic {basic}"));
        }
        command.args(args).stdin(Stdio::null()).kill_on_drop(true);
        command
    }

    /// Runs git; its output goes to `log`.
    async fn run(&self, args: &[&str], log: &mut (dyn FnMut(&str) + Send)) -> Result<(), String> {
        log(&format!("$ git {}\n", shown(args)));
        let out = tokio::time::timeout(FETCH_TIMEOUT, self.command(args).output())
            .await
            .map_err(|_| format!("git {} took longer than {} minutes", args[0], FETCH_TIMEOUT.as_secs() / 60))?
            .map_err(|e| format!("running git: {e} (is git installed on the host?)"))?;
        let printed = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !printed.is_empty() {
            log(&printed);
        }
        if out.status.success() {
            Ok(())
        } else {
            let last = printed.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
            Err(format!("git {} failed: {last}", args[0]))
        }
    }

    async fn output(&self, args: &[&str]) -> Result<String, String> {
        let out = self.command(args).output().await.map_err(|e| format!("running git: {e}"))?;
        if !out.status.success() {
            return Err(format!("git {} failed: {}", args[0], String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The arguments as logged: a URL's password is not.
fn shown(args: &[&str]) -> String {
    args.iter()
        .map(|arg| match arg.split_once("://").and_then(|(scheme, rest)| Some((scheme, rest.split_once('@')?))) {
            Some((scheme, (_, host))) => format!("{scheme}://***@{host}"),
            None => arg.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_refs_and_roots_are_checked() {
        for url in ["https://example.com/a.git", "http://h/x", "ssh://git@h/x.git", "git@github.com:me/site.git"] {
            assert_eq!(check_url(url, false), Ok(()), "{url}");
        }
        assert!(check_url("file:///srv/repo", true).is_ok());
        assert!(check_url("file:///srv/repo", false).unwrap_err().contains("--apps-allow-file-urls"));
        for url in ["", "-uhttps://x", "/srv/repo", "ext::sh -c id", "ftp://h/x", "a b", "c:\\repo", "host:path"] {
            assert!(check_url(url, true).is_err(), "{url}");
        }
        for git_ref in ["main", "v1.2.3", "feature/x", "0a1b2c3d"] {
            assert_eq!(check_ref(git_ref), Ok(()), "{git_ref}");
        }
        for git_ref in ["", "-x", "--upload-pack=x", "a..b", "a b", "/x", "a;b"] {
            assert!(check_ref(git_ref).is_err(), "{git_ref}");
        }
        assert_eq!(check_root("").unwrap(), "");
        assert_eq!(check_root("./").unwrap(), "");
        assert_eq!(check_root("/web/app/").unwrap(), "web/app");
        assert!(check_root("../x").is_err() && check_root("a/../b").is_err());
        assert_eq!(shown(&["fetch", "https://u:secret@h/x", "main"]), "fetch https://***@h/x main");
    }
}
