//! A VM's disk made into a root filesystem image (issue 27's template
//! builds): its whole chain read into one raw ext4 file, which a custom
//! image is published from.

use std::ffi::OsString;
use std::path::Path;

use serde_json::{json, Value};

use super::error::{io_err, VmError};
use super::handle::Vm;
use super::runtime::VmRuntime;
use crate::qcow2::Layer;

impl VmRuntime {
    /// Writes what `vm`'s guest sees on its disk into the raw file `out`,
    /// at least `size_mb` MiB, its ext4 checked (a journal left by a live
    /// guest replayed) and grown to the size. The guest should be quiet:
    /// its writes synced, the VM paused or stopped.
    ///
    /// The chain is the one the records name (ADR 14): each layer and its
    /// backing are spelled out to `qemu-img`, which follows no name
    /// written in a layer a QEMU could have written.
    pub async fn export_disk(&self, vm: &Vm, out: &Path, size_mb: u32) -> Result<(), VmError> {
        let record = vm.record();
        let chain = self.disk_chain(&vm.dir().join(super::runtime::DISK_LAYER), &record)?;
        let spec = format!("json:{}", chain_spec(&chain));
        // `-U`: the VM's QEMU holds its layer open (and locked); paused, it
        // has flushed what it wrote, and nothing writes while this reads.
        let mut convert: Vec<OsString> = ["convert", "-U", "-O", "raw"].map(OsString::from).to_vec();
        convert.extend([spec.into(), out.into()]);
        run("qemu-img", &convert, &[0]).await?;
        // 1: errors corrected (a replayed journal); beyond that it failed.
        run("e2fsck", &["-f".into(), "-y".into(), out.into()], &[0, 1]).await?;
        let bytes = std::fs::metadata(out).map_err(io_err(format!("reading {}", out.display())))?.len();
        if u64::from(size_mb) << 20 > bytes {
            run("resize2fs", &[out.into(), format!("{size_mb}M").into()], &[0]).await?;
        }
        Ok(())
    }
}

/// A `qemu-img` JSON filename for `chain` (top first): each layer's file
/// and format, its backing the next one, the last one without.
fn chain_spec(chain: &[Layer]) -> Value {
    let mut spec = Value::Null;
    for layer in chain.iter().rev() {
        let mut node = json!({ "driver": layer.format.driver(), "file": { "driver": "file", "filename": layer.path } });
        if !spec.is_null() {
            node["backing"] = spec;
        } else if layer.format == crate::qcow2::Format::Qcow2 {
            node["backing"] = Value::Null;
        }
        spec = node;
    }
    spec
}

async fn run(program: &str, args: &[OsString], ok: &[i32]) -> Result<(), VmError> {
    let output = tokio::process::Command::new(program).args(args).output().await.map_err(io_err(format!("running {program}")))?;
    if output.status.code().is_some_and(|code| ok.contains(&code)) {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    Err(VmError::Io {
        context: format!("{program} failed ({}): {} {}", output.status, stderr.trim(), stdout.trim()),
        source: std::io::Error::other(program.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layer_names_its_backing_and_the_image_ends_the_chain() {
        let chain = [
            Layer::qcow2("/d/vms/a/disk.qcow2".into()),
            Layer::qcow2("/d/templates/t/disk.qcow2".into()),
            Layer { path: "/c/images/i/rootfs.ext4".into(), format: crate::qcow2::Format::Raw },
        ];
        let spec = chain_spec(&chain);
        assert_eq!(spec["driver"], "qcow2");
        assert_eq!(spec["file"]["filename"], "/d/vms/a/disk.qcow2");
        assert_eq!(spec["backing"]["file"]["filename"], "/d/templates/t/disk.qcow2");
        assert_eq!(
            spec["backing"]["backing"],
            json!({ "driver": "raw", "file": { "driver": "file", "filename": "/c/images/i/rootfs.ext4" } })
        );
    }
}
