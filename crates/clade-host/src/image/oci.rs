//! OCI images (issue 27): what an image is made of (its manifest, its
//! config, its layers) and how its layers become one root filesystem.
//!
//! Two ways in share this: a registry pull (the server's `registry`, which
//! speaks the distribution protocol and hands the blobs it fetched here) and
//! an archive a user uploads, `docker save`'s (`manifest.json`) or an OCI
//! image layout's (`oci-layout`, `index.json`, `blobs/`).
//!
//! Layers are applied in order into one tree. Nothing in them is trusted:
//! every path is resolved inside the tree (a link a lower layer made never
//! leads a later write, or a whiteout's removal, out of it), and a layer's
//! whiteouts (`.wh.NAME` removes NAME, `.wh..wh..opq` empties its
//! directory) act on the layers below it only, so they are applied before
//! the layer's own files.

use std::collections::BTreeMap;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use clade_proto::ImageDefaults;
use serde::Deserialize;

use super::{io_err, ImageError};

/// Media types a manifest or an index may be served as.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

/// A content descriptor: what a manifest or an index points at.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// An image manifest, or an index (a manifest list) of them, as served.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    #[serde(default)]
    pub media_type: Option<String>,
    /// Set in an index.
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
    /// Set in an image manifest.
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

impl Manifest {
    pub fn parse(bytes: &[u8]) -> Result<Self, ImageError> {
        serde_json::from_slice(bytes).map_err(|e| ImageError::Invalid(format!("the image's manifest is not valid: {e}")))
    }

    /// Whether it is an index (a list of manifests per platform).
    pub fn is_index(&self) -> bool {
        self.config.is_none() && !self.manifests.is_empty()
    }

    /// The entry of an index for this host's platform (Linux, this CPU).
    pub fn for_this_platform(&self) -> Result<&Descriptor, ImageError> {
        let arch = host_architecture();
        self.manifests
            .iter()
            .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == arch))
            .or_else(|| match self.manifests.as_slice() {
                // A single entry without a platform is the image itself.
                [only] if only.platform.is_none() => Some(only),
                _ => None,
            })
            .ok_or_else(|| {
                let offered: Vec<String> =
                    self.manifests.iter().filter_map(|d| d.platform.as_ref().map(|p| format!("{}/{}", p.os, p.architecture))).collect();
                ImageError::Invalid(format!("the image has no linux/{arch} variant (it has: {})", offered.join(", ")))
            })
    }

    /// An image manifest's config and layers, checked to be that.
    pub fn image_parts(&self) -> Result<(&Descriptor, &[Descriptor]), ImageError> {
        let config = self.config.as_ref().ok_or_else(|| ImageError::Invalid("the image's manifest names no config".into()))?;
        for layer in &self.layers {
            if layer.media_type.contains("nondistributable") || layer.media_type.contains("foreign") {
                return Err(ImageError::Invalid(format!("layer {} is non-distributable ({})", layer.digest, layer.media_type)));
            }
        }
        Ok((config, &self.layers))
    }
}

/// The platform's architecture as OCI names it.
pub fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The hex of a `sha256:` digest, checked (it names a file).
pub fn sha256_hex(digest: &str) -> Result<&str, ImageError> {
    digest
        .strip_prefix("sha256:")
        .filter(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .ok_or_else(|| ImageError::Invalid(format!("{digest:?} is not a sha256 digest")))
}

/// What an image's config says its containers run with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `NAME=VALUE` each.
    pub env: Vec<(String, String)>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub exposed_ports: Vec<u16>,
    pub labels: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
struct ConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

impl ImageConfig {
    /// From an image config blob (`application/vnd.oci.image.config.v1+json`).
    pub fn parse(bytes: &[u8]) -> Result<Self, ImageError> {
        let file: ConfigFile =
            serde_json::from_slice(bytes).map_err(|e| ImageError::Invalid(format!("the image's config is not valid: {e}")))?;
        let config = file.config.unwrap_or_default();
        let env = config
            .env
            .unwrap_or_default()
            .into_iter()
            .filter_map(|pair| pair.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .filter(|(k, _)| !k.is_empty())
            .collect();
        let ports = config.exposed_ports.unwrap_or_default().into_keys();
        Ok(Self {
            env,
            working_dir: config.working_dir.filter(|d| d.starts_with('/')),
            user: config.user.filter(|u| !u.is_empty()),
            entrypoint: config.entrypoint.unwrap_or_default(),
            cmd: config.cmd.unwrap_or_default(),
            exposed_ports: ports.filter_map(|p| p.split('/').next().and_then(|n| n.parse().ok())).collect(),
            labels: config.labels.unwrap_or_default(),
        })
    }

    /// What every command in the image gets unless it says otherwise.
    pub fn defaults(&self) -> ImageDefaults {
        ImageDefaults { env: self.env.clone(), workdir: self.working_dir.clone(), user: self.user.clone() }
    }
}

/// An image whose blobs are files here: its config and its layers, bottom first.
#[derive(Debug, Clone)]
pub struct ImageLayout {
    pub config: ImageConfig,
    pub layers: Vec<PathBuf>,
}

/// Whether an unpacked archive is an image (`docker save`'s or an OCI
/// layout's) rather than a root filesystem.
pub fn is_image_archive(dir: &Path) -> bool {
    dir.join("manifest.json").is_file() || (dir.join("oci-layout").is_file() && dir.join("index.json").is_file())
}

/// Reads an unpacked image archive: an OCI layout (`index.json`, blobs by
/// digest) or `docker save`'s (`manifest.json` naming its files).
pub fn read_archive(dir: &Path) -> Result<ImageLayout, ImageError> {
    let read = |path: &Path| std::fs::read(path).map_err(io_err(format!("reading {}", path.display())));
    if dir.join("oci-layout").is_file() && dir.join("index.json").is_file() {
        let blob = |d: &Descriptor| -> Result<PathBuf, ImageError> { Ok(dir.join("blobs/sha256").join(sha256_hex(&d.digest)?)) };
        let mut manifest = Manifest::parse(&read(&dir.join("index.json"))?)?;
        // An index may point at another index; a few hops at most.
        for _ in 0..4 {
            if !manifest.is_index() {
                break;
            }
            let entry = manifest.for_this_platform()?.clone();
            manifest = Manifest::parse(&read(&blob(&entry)?)?)?;
        }
        let (config, layers) = manifest.image_parts()?;
        let config = ImageConfig::parse(&read(&inside_archive(dir, &blob(config)?)?)?)?;
        let layers = layers.iter().map(|l| inside_archive(dir, &blob(l)?)).collect::<Result<Vec<_>, _>>()?;
        return Ok(ImageLayout { config, layers });
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct SavedImage {
        config: String,
        layers: Vec<String>,
    }
    let saved: Vec<SavedImage> = serde_json::from_slice(&read(&dir.join("manifest.json"))?)
        .map_err(|e| ImageError::Invalid(format!("the archive's manifest.json is not docker save's: {e}")))?;
    let image = saved.into_iter().next().ok_or_else(|| ImageError::Invalid("the archive's manifest.json names no image".into()))?;
    let inside = |name: &str| -> Result<PathBuf, ImageError> {
        let relative = Path::new(name);
        if relative.components().all(|c| matches!(c, Component::Normal(_))) {
            inside_archive(dir, &dir.join(relative))
        } else {
            Err(ImageError::Invalid(format!("the archive's manifest.json names {name:?}, outside the archive")))
        }
    };
    let config = ImageConfig::parse(&read(&inside(&image.config)?)?)?;
    let layers = image.layers.iter().map(|l| inside(l)).collect::<Result<Vec<_>, _>>()?;
    Ok(ImageLayout { config, layers })
}

/// `path`, a file of the unpacked archive `dir`, resolved through the
/// archive's links (`docker save` links a layer's old name to its file) and
/// refused when it leads out of the archive: an upload names only its own files.
fn inside_archive(dir: &Path, path: &Path) -> Result<PathBuf, ImageError> {
    let root = dir.canonicalize().map_err(io_err(format!("resolving {}", dir.display())))?;
    let shown = path.strip_prefix(dir).unwrap_or(path).display().to_string();
    let resolved = path.canonicalize().map_err(|_| ImageError::Invalid(format!("the archive has no file {shown}")))?;
    if !resolved.starts_with(&root) || !resolved.is_file() {
        return Err(ImageError::Invalid(format!("{shown} is not a file of the archive")));
    }
    Ok(resolved)
}

/// Applies `layers` (tar, gzip or zstd files), bottom first, into `tree`.
/// Blocking.
pub fn apply_layers(tree: &Path, layers: &[PathBuf]) -> Result<(), ImageError> {
    std::fs::create_dir_all(tree).map_err(io_err(format!("creating {}", tree.display())))?;
    let root = tree.canonicalize().map_err(io_err(format!("resolving {}", tree.display())))?;
    for (i, layer) in layers.iter().enumerate() {
        let what = format!("layer {} of {}", i + 1, layers.len());
        apply_whiteouts(&root, layer).map_err(|e| in_layer(&what, e))?;
        unpack_layer(&root, layer).map_err(|e| in_layer(&what, e))?;
    }
    Ok(())
}

fn in_layer(what: &str, e: ImageError) -> ImageError {
    match e {
        ImageError::Invalid(message) => ImageError::Invalid(format!("{what}: {message}")),
        ImageError::Io { context, source } => ImageError::Io { context: format!("{what}: {context}"), source },
        other => other,
    }
}

/// A layer's tar stream, decompressed as its first bytes say.
fn open_layer(path: &Path) -> Result<tar::Archive<Box<dyn Read>>, ImageError> {
    let mut file = BufReader::new(std::fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?);
    let magic = std::io::BufRead::fill_buf(&mut file).map_err(io_err(format!("reading {}", path.display())))?;
    let stream: Box<dyn Read> = match magic {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::MultiGzDecoder::new(file)),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Box::new(
            ruzstd::decoding::StreamingDecoder::new(file)
                .map_err(|e| ImageError::Invalid(format!("{} is not a zstd stream: {e}", path.display())))?,
        ),
        _ => Box::new(file),
    };
    Ok(tar::Archive::new(stream))
}

/// A layer member's path, relative and plain; `None` for the root itself
/// or a path that climbs (`..`), which is skipped as GNU tar does.
fn member_path(entry: &tar::Entry<'_, Box<dyn Read>>) -> Result<Option<PathBuf>, ImageError> {
    let path = entry.path().map_err(|e| ImageError::Invalid(format!("a member's path is not valid: {e}")))?;
    let mut relative = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(name) => relative.push(name),
            Component::ParentDir => return Ok(None),
            _ => {}
        }
    }
    Ok((!relative.as_os_str().is_empty()).then_some(relative))
}

fn bad_member(e: std::io::Error) -> ImageError {
    ImageError::Invalid(format!("the layer is not a valid tar stream: {e}"))
}

/// Removes what the layer's whiteouts name from the layers below.
fn apply_whiteouts(root: &Path, layer: &Path) -> Result<(), ImageError> {
    let mut archive = open_layer(layer)?;
    for entry in archive.entries().map_err(bad_member)? {
        let entry = entry.map_err(bad_member)?;
        let Some(path) = member_path(&entry)? else { continue };
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) else { continue };
        let dir = path.parent().unwrap_or(Path::new(""));
        // A directory whose path leads out of the tree (through a link) or
        // is not there has nothing of the layers below to remove.
        let Some(dir) = resolve_inside(root, dir) else { continue };
        if !dir.is_dir() {
            continue;
        }
        if name == OPAQUE_WHITEOUT {
            for child in std::fs::read_dir(&dir).map_err(io_err(format!("reading {}", dir.display())))?.flatten() {
                remove_any(&child.path())?;
            }
        } else if !hidden.is_empty() {
            remove_any(&dir.join(hidden))?;
        }
    }
    Ok(())
}

/// Unpacks the layer's files (not its whiteouts): an entry replaces what is
/// at its path, except a directory over a directory, whose contents merge.
fn unpack_layer(root: &Path, layer: &Path) -> Result<(), ImageError> {
    let mut archive = open_layer(layer)?;
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    for entry in archive.entries().map_err(bad_member)? {
        let mut entry = entry.map_err(bad_member)?;
        let Some(path) = member_path(&entry)? else { continue };
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(WHITEOUT_PREFIX)) {
            continue;
        }
        let is_dir = entry.header().entry_type().is_dir();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Some(existing) = resolve_inside(root, parent).map(|dir| dir.join(path.file_name().unwrap_or_default())) {
                match std::fs::symlink_metadata(&existing) {
                    Ok(meta) if meta.is_dir() && is_dir => {}
                    Ok(_) => remove_any(&existing)?,
                    Err(_) => {}
                }
            }
        } else {
            let existing = root.join(&path);
            match std::fs::symlink_metadata(&existing) {
                Ok(meta) if meta.is_dir() && is_dir => {}
                Ok(_) => remove_any(&existing)?,
                Err(_) => {}
            }
        }
        // `unpack_in` resolves the parent and refuses one outside the tree.
        entry.unpack_in(root).map_err(|e| {
            ImageError::Invalid(format!("/{} cannot be unpacked inside the root filesystem: {}", path.display(), causes(&e)))
        })?;
    }
    Ok(())
}

/// An error and its causes, on one line.
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// `relative` (a directory) resolved through the tree's links, if it stays
/// inside the tree and exists.
fn resolve_inside(root: &Path, relative: &Path) -> Option<PathBuf> {
    let resolved = root.join(relative).canonicalize().ok()?;
    resolved.starts_with(root).then_some(resolved)
}

/// Removes a file, a link (not what it points at) or a directory tree.
fn remove_any(path: &Path) -> Result<(), ImageError> {
    let removed = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(_) => return Ok(()),
    };
    removed.map_err(io_err(format!("removing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer file of `(path, content)`: `None` content is a directory,
    /// `Some("->target")` a symlink.
    fn layer(dir: &Path, name: &str, members: &[(&str, Option<&str>)], gzip: bool) -> PathBuf {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, content) in members {
            let mut header = tar::Header::new_gnu();
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            match content {
                None => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(0o755);
                    header.set_size(0);
                    builder.append_data(&mut header, path, std::io::empty()).unwrap();
                }
                Some(target) if target.starts_with("->") => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    builder.append_link(&mut header, path, &target[2..]).unwrap();
                }
                Some(text) => {
                    header.set_mode(0o644);
                    header.set_size(text.len() as u64);
                    builder.append_data(&mut header, path, text.as_bytes()).unwrap();
                }
            }
        }
        let bytes = builder.into_inner().unwrap();
        let path = dir.join(name);
        let bytes = if gzip {
            let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut encoder, &bytes).unwrap();
            encoder.finish().unwrap()
        } else {
            bytes
        };
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn whiteouts_remove_from_the_layers_below_only() {
        let dir = tempfile::tempdir().unwrap();
        let lower = layer(
            dir.path(),
            "1",
            &[("etc", None), ("etc/gone", Some("x")), ("etc/kept", Some("k")), ("opt/dir/a", Some("a")), ("opt/dir/b", Some("b"))],
            true,
        );
        let upper = layer(
            dir.path(),
            "2",
            &[("etc/.wh.gone", Some("")), ("opt/dir/c", Some("c")), ("opt/dir/.wh..wh..opq", Some("")), ("etc/kept", Some("new"))],
            false,
        );
        let tree = dir.path().join("tree");
        apply_layers(&tree, &[lower, upper]).unwrap();
        assert_eq!(names(&tree.join("etc")), ["kept"]);
        assert_eq!(std::fs::read_to_string(tree.join("etc/kept")).unwrap(), "new");
        assert_eq!(names(&tree.join("opt/dir")), ["c"], "the opaque directory keeps only its own layer's files");
    }

    #[test]
    fn a_later_entry_replaces_one_of_another_kind() {
        let dir = tempfile::tempdir().unwrap();
        let lower = layer(dir.path(), "1", &[("x", None), ("x/inner", Some("i")), ("y", Some("file"))], false);
        let upper = layer(dir.path(), "2", &[("x", Some("now a file")), ("y", None), ("y/z", Some("z"))], false);
        let tree = dir.path().join("tree");
        apply_layers(&tree, &[lower, upper]).unwrap();
        assert_eq!(std::fs::read_to_string(tree.join("x")).unwrap(), "now a file");
        assert_eq!(std::fs::read_to_string(tree.join("y/z")).unwrap(), "z");
    }

    #[test]
    fn no_layer_writes_or_removes_through_a_link_out_of_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("victim"), "keep me").unwrap();
        let escape = format!("->{}", outside.display());
        let lower = layer(dir.path(), "1", &[("link", Some(&escape)), ("etc", Some("->../../"))], false);
        let whiteout = layer(dir.path(), "2", &[("link/.wh.victim", Some(""))], false);
        let tree = dir.path().join("tree");
        apply_layers(&tree, &[lower.clone(), whiteout]).unwrap();
        assert!(outside.join("victim").exists(), "a whiteout through a link removes nothing outside");
        let write = layer(dir.path(), "3", &[("link/planted", Some("x"))], false);
        let err = apply_layers(&tree, &[write]).unwrap_err();
        assert!(err.to_string().contains("inside the root filesystem"), "{err}");
        assert_eq!(names(&outside), ["victim"], "nothing written outside");
    }

    #[test]
    fn an_oci_layout_and_a_docker_save_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let config = br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin","A=b=c"],"WorkingDir":"/srv","User":"app","Cmd":["sh"],"ExposedPorts":{"8080/tcp":{}}}}"#;
        let parsed = ImageConfig::parse(config).unwrap();
        assert_eq!(parsed.env, [("PATH".to_string(), "/bin".to_string()), ("A".to_string(), "b=c".to_string())]);
        assert_eq!((parsed.working_dir.as_deref(), parsed.user.as_deref()), (Some("/srv"), Some("app")));
        assert_eq!(parsed.exposed_ports, [8080]);

        let saved = dir.path().join("saved");
        std::fs::create_dir_all(saved.join("abc")).unwrap();
        std::fs::write(saved.join("abc/layer.tar"), b"").unwrap();
        std::fs::write(saved.join("cfg.json"), config).unwrap();
        std::fs::write(saved.join("manifest.json"), br#"[{"Config":"cfg.json","RepoTags":["x:1"],"Layers":["abc/layer.tar"]}]"#).unwrap();
        assert!(is_image_archive(&saved));
        let layout = read_archive(&saved).unwrap();
        assert_eq!(layout.layers, [saved.join("abc/layer.tar")]);
        assert_eq!(layout.config, parsed);
        std::fs::write(saved.join("manifest.json"), br#"[{"Config":"../cfg.json","Layers":[]}]"#).unwrap();
        assert!(read_archive(&saved).is_err(), "a path out of the archive");
        std::os::unix::fs::symlink("/etc/hostname", saved.join("host.json")).unwrap();
        std::fs::write(saved.join("manifest.json"), br#"[{"Config":"host.json","Layers":[]}]"#).unwrap();
        assert!(read_archive(&saved).unwrap_err().to_string().contains("not a file of the archive"), "a link out of the archive");

        let oci = dir.path().join("oci");
        let blobs = oci.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        let (c, l, m) = ("c".repeat(64), "a".repeat(64), "b".repeat(64));
        std::fs::write(blobs.join(&c), config).unwrap();
        std::fs::write(blobs.join(&l), b"").unwrap();
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"digest":"sha256:{c}","size":1}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:{l}","size":1}}]}}"#
        );
        std::fs::write(blobs.join(&m), manifest).unwrap();
        std::fs::write(oci.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"digest":"sha256:{m}","size":1,"platform":{{"os":"linux","architecture":"s390x"}}}},{{"digest":"sha256:{m}","size":1,"platform":{{"os":"linux","architecture":"{}"}}}}]}}"#,
            host_architecture()
        );
        std::fs::write(oci.join("index.json"), index).unwrap();
        let layout = read_archive(&oci).unwrap();
        assert_eq!(layout.layers, [blobs.join(&l)]);
        assert_eq!(layout.config.cmd, ["sh"]);
        assert!(sha256_hex("sha256:../../etc").is_err());
    }
}
