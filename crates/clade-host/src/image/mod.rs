//! Guest images: the kernel and the root filesystem images VMs boot from.
//!
//! Every artifact is built by a script that ships inside this binary (from
//! `images/` in the repository) and is cached under `cache_dir` by the hash of
//! everything that shapes it, so it is rebuilt exactly when an input changes:
//!
//! ```text
//! kernel/<hash>/vmlinux         config fragment + build script + linux-source version
//! rootfs/<hash>/tree/           package list + build script + injected CAs
//! images/<hash>/rootfs.ext4     rootfs hash + clade-guestd binary  (read-only)
//! ```
//!
//! Builds take a lock per artifact kind, so concurrent first uses build once.
//! Results are written under a temporary name and renamed into place: an
//! interrupted build never leaves a half-made artifact behind.

mod build;
mod custom;
pub mod oci;
mod prune;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

pub use build::Progress;
pub use custom::{CUSTOM_PREFIX, MAX_SIZE_MB, MIN_SIZE_MB};
pub use prune::PrunedImage;

const KERNEL_FRAGMENT: &str = include_str!("../../../../images/kernel/clade.config");
const KERNEL_BUILD: &str = include_str!("../../../../images/kernel/build.sh");
const ROOTFS_BUILD: &str = include_str!("../../../../images/rootfs/build.sh");
const ROOTFS_EXTEND: &str = include_str!("../../../../images/rootfs/extend.sh");
const HOST_DEPS: &str = include_str!("../../../../scripts/install-host-deps");

/// A root filesystem this build knows how to make (`images/rootfs/<name>/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recipe {
    pub name: &'static str,
    /// Debian packages, one per line (on top of `parent`'s, if any).
    packages: &'static str,
    /// The recipe whose finished tree this one starts from, instead of debootstrap.
    parent: Option<&'static str>,
    /// Run inside the tree after the packages (npm, PyPI).
    setup: Option<&'static str>,
    /// What it is, in a few words (`GET /v1/templates`' `label`).
    pub label: &'static str,
    pub description: &'static str,
    pub category: &'static str,
    /// What a sandbox of it finds on PATH, beyond a shell's basics.
    pub tools: &'static [&'static str],
}

impl Recipe {
    /// The image this one is built on.
    pub fn parent(&self) -> Option<&'static str> {
        self.parent
    }
}

/// Root filesystem recipes known to this build.
const RECIPES: &[Recipe] = &[
    Recipe {
        name: "base",
        packages: include_str!("../../../../images/rootfs/base/packages"),
        parent: None,
        setup: None,
        label: "Debian 12 with Python 3",
        description: "Debian 12 (bookworm) minbase with bash, coreutils, curl, git, jq and Python 3 with pip and venv",
        category: "base",
        tools: &["bash", "curl", "git", "jq", "python3", "pip"],
    },
    Recipe {
        name: "code-interpreter",
        packages: include_str!("../../../../images/rootfs/code-interpreter/packages"),
        parent: Some("base"),
        setup: None,
        label: "Debian 12 with Python 3's data stack, a Jupyter kernel and Node.js",
        description: "base plus numpy, pandas, matplotlib, scipy, requests, ipykernel and jupyter_client (Debian's), Node.js 18 and npm",
        category: "code-interpreter",
        tools: &["python3", "ipykernel", "numpy", "pandas", "matplotlib", "scipy", "node", "npm"],
    },
    Recipe {
        name: "agent",
        packages: include_str!("../../../../images/rootfs/agent/packages"),
        parent: Some("base"),
        setup: Some(include_str!("../../../../images/rootfs/agent/setup.sh")),
        label: "Debian 12 for coding agents: Node.js 22, git, ripgrep, build tools, Claude Code and Codex",
        description: "base plus Node.js 22 LTS and npm, gcc and make, ripgrep, fd, uv, and the Claude Code (claude) and Codex (codex) CLIs",
        category: "agent",
        tools: &["node", "npm", "git", "rg", "fd", "jq", "gcc", "make", "python3", "uv", "claude", "codex"],
    },
    Recipe {
        name: "postgres",
        packages: include_str!("../../../../images/rootfs/postgres/packages"),
        parent: Some("base"),
        setup: Some(include_str!("../../../../images/rootfs/postgres/setup.sh")),
        label: "Debian 12 with PostgreSQL 15, running",
        description: "base plus Debian's PostgreSQL 15, started by the template's bake so that every sandbox is restored with it \
                      accepting connections: cluster 15/main on port 5432, SCRAM over TCP, WAL archived for point-in-time \
                      recovery, role and database clade (no password until one is set)",
        category: "database",
        tools: &["psql", "pg_ctlcluster", "pg_isready", "pg_dump", "pg_restore", "pg_basebackup", "python3"],
    },
];

/// Apparent size of a root filesystem image (sparse: only data takes space).
const IMAGE_SIZE: &str = "4G";

/// Where the agent lives inside every image (and the kernel's `init=`).
pub const GUESTD_PATH_IN_GUEST: &str = "/sbin/clade-guestd";

/// An image's own step of its template's bake, when the image has it and it
/// is executable: run as root after the warm-up and before the quiesce, so
/// that what it starts (the `postgres` image's server) is running in every
/// sandbox restored from the template. A non-zero exit fails the bake.
pub const BAKE_HOOK_PATH_IN_GUEST: &str = "/etc/clade/bake";

/// An image's way to start what its bake hook started, for a guest that
/// booted from its disk instead of being restored from the template's
/// memory (a disk-only wake). Optional; Clade's bake does not run it.
pub const START_HOOK_PATH_IN_GUEST: &str = "/etc/clade/start";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("unknown image {name:?}; available: {available}")]
    UnknownImage { name: String, available: String },
    /// What a user gave to build from cannot be made into an image.
    #[error("{0}")]
    Invalid(String),
    #[error("clade-guestd was not found (set CLADE_GUESTD, or build it with scripts/build)")]
    GuestdMissing,
    #[error("{what} failed (exit {code:?}); its output is in {log}")]
    BuildFailed { what: String, code: Option<i32>, log: PathBuf },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// A bootable guest: a kernel and a root filesystem image, both read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestImage {
    pub name: String,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    /// Content hash of kernel + image: what a snapshot of this guest depends on.
    pub id: String,
}

/// An image's root filesystem, in its directory under `images/`.
const ROOTFS_FILE: &str = "rootfs.ext4";

#[derive(Debug, Clone)]
pub struct ImageStore {
    cache_dir: PathBuf,
    guestd: Option<PathBuf>,
}

impl ImageStore {
    pub fn new(cache_dir: impl Into<PathBuf>, guestd: Option<PathBuf>) -> Self {
        Self { cache_dir: cache_dir.into(), guestd }
    }

    /// Whether `path` is the root filesystem of an image in this cache
    /// (built or not, current or superseded): the base of every disk chain.
    pub fn is_image_rootfs(&self, path: &Path) -> bool {
        let images = std::path::absolute(self.cache_dir.join("images")).unwrap_or_default();
        let path = std::path::absolute(path).unwrap_or_default();
        path.file_name() == Some(std::ffi::OsStr::new(ROOTFS_FILE))
            && path.parent().and_then(Path::parent) == Some(images.as_path())
            && !path.components().any(|c| c == std::path::Component::ParentDir)
    }

    pub fn available() -> Vec<&'static str> {
        RECIPES.iter().map(|recipe| recipe.name).collect()
    }

    /// The recipe of an image this build knows.
    pub fn recipe(name: &str) -> Option<&'static Recipe> {
        RECIPES.iter().find(|recipe| recipe.name == name)
    }

    /// The image, if everything it needs is already built: a recipe's by
    /// name, or a custom image by its key.
    pub fn cached(&self, name: &str) -> Result<Option<GuestImage>, ImageError> {
        if Self::is_custom(name) {
            return self.custom(name);
        }
        let plan = self.plan(name)?;
        Ok(plan.is_built().then(|| plan.image()))
    }

    /// The image, building whatever is missing (minutes the first time).
    /// Blocking: call it from a blocking context.
    pub fn ensure(&self, name: &str, progress: &Progress) -> Result<GuestImage, ImageError> {
        if Self::is_custom(name) {
            // Built by its template build, never here.
            return self
                .custom(name)?
                .ok_or_else(|| ImageError::UnknownImage { name: name.to_string(), available: Self::available().join(", ") });
        }
        let plan = self.plan(name)?;
        if plan.is_built() {
            return Ok(plan.image());
        }
        build::host_deps(&self.cache_dir, progress)?;
        // The kernel version is only known once linux-source is installed.
        let plan = self.plan(name)?;
        build::kernel(&self.cache_dir, &plan.kernel_dir, progress)?;
        // What it starts from first (base's tree for code-interpreter's).
        let parent_tree = match plan.recipe.parent {
            Some(parent) => {
                let parent = self.plan(parent)?;
                self.tree(&parent, None, progress)?;
                Some(parent.tree_dir.join("tree"))
            }
            None => None,
        };
        self.tree(&plan, parent_tree.as_deref(), progress)?;
        build::image(&self.cache_dir, &plan.tree_dir, &plan.guestd, &plan.image_dir, IMAGE_SIZE, progress)?;
        Ok(plan.image())
    }

    /// Builds a plan's package tree unless it is there.
    fn tree(&self, plan: &Plan, parent_tree: Option<&Path>, progress: &Progress) -> Result<(), ImageError> {
        let recipe = plan.recipe;
        build::rootfs_tree(&self.cache_dir, &plan.tree_dir, recipe.name, recipe.packages, parent_tree, recipe.setup, progress)
    }

    fn plan(&self, name: &str) -> Result<Plan, ImageError> {
        let recipe = Self::recipe(name)
            .ok_or_else(|| ImageError::UnknownImage { name: name.to_string(), available: Self::available().join(", ") })?;
        let guestd = self.guestd.clone().or_else(find_guestd).ok_or(ImageError::GuestdMissing)?;
        let guestd_digest = guestd_digest(&guestd).map_err(io_err(format!("reading {}", guestd.display())))?;

        let kernel_key = hash(&[b"kernel/1", KERNEL_FRAGMENT.as_bytes(), KERNEL_BUILD.as_bytes(), linux_source_version().as_bytes()]);
        let tree_key = self.tree_key(recipe);
        let image_key = hash(&[b"image/3", tree_key.as_bytes(), guestd_digest.as_bytes(), IMAGE_SIZE.as_bytes()]);
        Ok(Plan {
            name: name.to_string(),
            recipe,
            guestd,
            kernel_dir: self.cache_dir.join("kernel").join(&kernel_key),
            tree_dir: self.cache_dir.join("rootfs").join(&tree_key),
            image_dir: self.cache_dir.join("images").join(&image_key),
            id: hash(&[kernel_key.as_bytes(), image_key.as_bytes()]),
        })
    }
}

struct Plan {
    name: String,
    recipe: &'static Recipe,
    guestd: PathBuf,
    kernel_dir: PathBuf,
    tree_dir: PathBuf,
    image_dir: PathBuf,
    id: String,
}

impl ImageStore {
    /// What a recipe's package tree is made of: its packages and the build
    /// script with the injected CAs; or, on a parent, the parent's tree,
    /// its packages, its setup and the script that extends.
    fn tree_key(&self, recipe: &Recipe) -> String {
        match recipe.parent.and_then(Self::recipe) {
            None => hash(&[b"rootfs/1", recipe.packages.as_bytes(), ROOTFS_BUILD.as_bytes(), &injected_ca_bytes()]),
            Some(parent) => hash(&[
                b"rootfs-extend/1",
                self.tree_key(parent).as_bytes(),
                recipe.packages.as_bytes(),
                recipe.setup.unwrap_or_default().as_bytes(),
                ROOTFS_EXTEND.as_bytes(),
            ]),
        }
    }
}

impl Plan {
    fn is_built(&self) -> bool {
        self.kernel_dir.join("vmlinux").is_file() && self.image_dir.join(ROOTFS_FILE).is_file()
    }

    fn image(&self) -> GuestImage {
        GuestImage {
            name: self.name.clone(),
            kernel: self.kernel_dir.join("vmlinux"),
            rootfs: self.image_dir.join(ROOTFS_FILE),
            id: self.id.clone(),
        }
    }
}

fn hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    hex::encode(&h.finalize()[..12])
}

/// What a file's contents are taken to be unchanged by: a replaced or
/// rewritten file gets a new inode or modification time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    path: PathBuf,
    len: u64,
    modified: std::time::SystemTime,
    inode: u64,
}

impl FileStamp {
    fn of(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok(Self { path: path.to_path_buf(), len: meta.len(), modified: meta.modified()?, inode: meta.ino() })
    }
}

/// Every lookup of an image by name plans it (each fork child, each wake,
/// each create from a snapshot), and the plan's two slow inputs, the agent
/// binary's digest (~20 MB hashed) and the linux-source version (a
/// dpkg-query process), cost ~25 ms together. Each is remembered for as
/// long as the file it comes from is unchanged.
///
/// A file modified less than a second before it was read is not remembered:
/// modification times are coarse, so a second write in the same tick
/// (same size, same inode) could not be told apart (git's "racy" entries).
fn remembered(
    memo: &Mutex<Option<(FileStamp, String)>>,
    source: &Path,
    compute: impl FnOnce() -> std::io::Result<String>,
) -> std::io::Result<String> {
    let stamp = FileStamp::of(source).ok();
    if let (Some(stamp), Some((seen, value))) = (&stamp, &*memo.lock().unwrap_or_else(|p| p.into_inner())) {
        if stamp == seen {
            return Ok(value.clone());
        }
    }
    let value = compute()?;
    let settled = |stamp: &FileStamp| {
        std::time::SystemTime::now().duration_since(stamp.modified).is_ok_and(|age| age >= std::time::Duration::from_secs(1))
    };
    *memo.lock().unwrap_or_else(|p| p.into_inner()) = stamp.filter(settled).map(|stamp| (stamp, value.clone()));
    Ok(value)
}

fn guestd_digest(path: &Path) -> std::io::Result<String> {
    static MEMO: Mutex<Option<(FileStamp, String)>> = Mutex::new(None);
    remembered(&MEMO, path, || Ok(hex::encode(Sha256::digest(std::fs::read(path)?))))
}

/// The installed linux-source-6.1 package version ("" when not installed).
fn linux_source_version() -> String {
    static MEMO: Mutex<Option<(FileStamp, String)>> = Mutex::new(None);
    // dpkg rewrites its status file whenever a package is installed or removed.
    remembered(&MEMO, Path::new("/var/lib/dpkg/status"), || Ok(query_linux_source_version())).unwrap_or_default()
}

fn query_linux_source_version() -> String {
    std::process::Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "linux-source-6.1"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The host CAs an image build injects (see images/rootfs/build.sh), so a
/// changed CA rebuilds the image.
fn injected_ca_bytes() -> Vec<u8> {
    if std::env::var("CLADE_INJECT_HOST_CA").as_deref() == Ok("0") {
        return b"no-ca".to_vec();
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir("/usr/local/share/ca-certificates")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "crt"))
        .collect();
    files.sort();
    files.iter().flat_map(|p| std::fs::read(p).unwrap_or_default()).collect()
}

/// The static `clade-guestd` of a source checkout
/// (`target/x86_64-unknown-linux-gnu/release`, what `scripts/build` makes),
/// else one installed next to the running binary. The checkout's plain
/// `target/release/clade-guestd` (a dynamically linked workspace build) is
/// never taken.
fn find_guestd() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let static_build = exe.ancestors().skip(1).find_map(|dir| {
        [dir.join("x86_64-unknown-linux-gnu/release/clade-guestd"), dir.join("target/x86_64-unknown-linux-gnu/release/clade-guestd")]
            .into_iter()
            .find(|candidate| candidate.is_file())
    });
    let in_checkout = exe.ancestors().any(|dir| dir.file_name().is_some_and(|n| n == "target"));
    static_build.or_else(|| {
        let installed = exe.parent()?.join("clade-guestd");
        (!in_checkout && installed.is_file()).then_some(installed)
    })
}

pub(crate) fn script_path(cache_dir: &Path, name: &str, body: &str) -> Result<PathBuf, ImageError> {
    let dir = cache_dir.join("scripts");
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let path = dir.join(format!("{}-{name}", hash(&[body.as_bytes()])));
    if !path.exists() {
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, body).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io_err(format!("writing {}", path.display())))?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remembered_digest_is_used_only_for_a_settled_unchanged_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agent");
        let memo = Mutex::new(None);
        let computed = std::cell::Cell::new(0);
        let digest = || {
            remembered(&memo, &file, || {
                computed.set(computed.get() + 1);
                Ok(hex::encode(Sha256::digest(std::fs::read(&file)?)))
            })
            .unwrap()
        };
        std::fs::write(&file, b"v1").unwrap();
        let fresh = digest();
        // Just written: read again each time, so a rewrite in the same
        // timestamp tick is never missed.
        std::fs::write(&file, b"v2").unwrap();
        assert_ne!(digest(), fresh);
        assert_eq!(computed.get(), 2);
        // Settled (a second old): read once, then remembered until it changes.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(5);
        std::fs::File::options().write(true).open(&file).unwrap().set_modified(old).unwrap();
        let settled = digest();
        assert_eq!(digest(), settled);
        assert_eq!(computed.get(), 3, "the second lookup of a settled file is remembered");
        std::fs::write(&file, b"v3").unwrap();
        assert_ne!(digest(), settled);
    }

    #[test]
    fn keys_change_with_any_input_and_unknown_images_are_refused() {
        assert_ne!(hash(&[b"a", b"bc"]), hash(&[b"ab", b"c"]));
        let dir = tempfile::tempdir().unwrap();
        let guestd = dir.path().join("guestd");
        std::fs::write(&guestd, b"v1").unwrap();
        let store = ImageStore::new(dir.path(), Some(guestd.clone()));
        let first = store.plan("base").unwrap();
        std::fs::write(&guestd, b"v2").unwrap();
        let second = store.plan("base").unwrap();
        assert_eq!(first.kernel_dir, second.kernel_dir, "the agent does not shape the kernel");
        assert_eq!(first.tree_dir, second.tree_dir, "nor the package tree");
        assert_ne!(first.image_dir, second.image_dir, "but it does shape the image");
        assert!(store.cached("base").unwrap().is_none());
        let err = store.plan("nope").err().unwrap();
        assert!(err.to_string().contains("available: base, code-interpreter, agent, postgres"), "{err}");
    }

    #[test]
    fn images_on_base_have_trees_of_their_own_keyed_by_bases() {
        let dir = tempfile::tempdir().unwrap();
        let guestd = dir.path().join("guestd");
        std::fs::write(&guestd, b"v1").unwrap();
        let store = ImageStore::new(dir.path(), Some(guestd));
        let (base, code, agent, postgres) = (
            store.plan("base").unwrap(),
            store.plan("code-interpreter").unwrap(),
            store.plan("agent").unwrap(),
            store.plan("postgres").unwrap(),
        );
        assert_eq!(code.kernel_dir, base.kernel_dir, "one kernel for all");
        assert_eq!(postgres.kernel_dir, base.kernel_dir);
        assert!(base.tree_dir != code.tree_dir && code.tree_dir != agent.tree_dir && base.image_dir != agent.image_dir);
        assert!(postgres.tree_dir != base.tree_dir && postgres.tree_dir != agent.tree_dir && postgres.image_dir != base.image_dir);
        assert_eq!(ImageStore::recipe("agent").unwrap().parent(), Some("base"));
        assert_eq!(ImageStore::recipe("postgres").unwrap().parent(), Some("base"));
        // The same packages on no parent are another tree.
        let alone = Recipe { parent: None, ..*ImageStore::recipe("code-interpreter").unwrap() };
        assert_ne!(store.tree_key(&alone), code.tree_dir.file_name().unwrap().to_str().unwrap());
    }
}
