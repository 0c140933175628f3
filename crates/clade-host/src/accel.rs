//! Choosing the accelerator: KVM on hosts with hardware virtualization, TCG
//! (QEMU's software CPU) elsewhere — including hosts whose /dev/kvm is PVM,
//! which boots only PVM-patched guest kernels.

use std::fmt;
use std::str::FromStr;
use std::sync::Once;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccelChoice {
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "kvm" => Ok(Self::Kvm),
            "tcg" => Ok(Self::Tcg),
            other => Err(format!("accel must be auto, kvm or tcg, not {other:?}")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// What the host offers, read from /proc and /sys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostVirt {
    pub cpu_has_vmx_or_svm: bool,
    pub kvm_pvm_loaded: bool,
    pub dev_kvm_usable: bool,
}

impl HostVirt {
    pub fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Self {
            cpu_has_vmx_or_svm: cpu_flags_have_virt(&cpuinfo),
            kvm_pvm_loaded: std::path::Path::new("/sys/module/kvm_pvm").exists(),
            dev_kvm_usable: std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok(),
        }
    }

    /// Why KVM cannot be used, or `None` when it can.
    pub fn kvm_unusable_reason(&self) -> Option<&'static str> {
        if self.kvm_pvm_loaded {
            Some("/dev/kvm is PVM (kvm_pvm), which boots only PVM-patched guest kernels")
        } else if !self.cpu_has_vmx_or_svm {
            Some("the CPU exposes no vmx/svm (no hardware virtualization)")
        } else if !self.dev_kvm_usable {
            Some("/dev/kvm cannot be opened read-write")
        } else {
            None
        }
    }
}

fn cpu_flags_have_virt(cpuinfo: &str) -> bool {
    cpuinfo.lines().filter(|l| l.starts_with("flags")).any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// Resolves a choice against the host. `Auto` falls back to TCG with one
/// warning per process; an explicit `kvm` on a host without it is an error.
pub fn resolve(choice: AccelChoice, host: &HostVirt) -> Result<Accel, String> {
    match (choice, host.kvm_unusable_reason()) {
        (AccelChoice::Tcg, _) => Ok(Accel::Tcg),
        (AccelChoice::Kvm | AccelChoice::Auto, None) => Ok(Accel::Kvm),
        (AccelChoice::Kvm, Some(reason)) => Err(format!("accel=kvm requested but {reason}")),
        (AccelChoice::Auto, Some(reason)) => {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                tracing::warn!("using TCG (software CPU, much slower than KVM): {reason}");
            });
            Ok(Accel::Tcg)
        }
    }
}

/// The host TSC frequency in kHz, which TCG guests need on their command line
/// (`tsc_early_khz=`): microvm has no HPET or PM timer to calibrate against.
pub fn host_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz = cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse::<f64>().ok()?;
    Some((mhz * 1000.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(virt: bool, pvm: bool, dev: bool) -> HostVirt {
        HostVirt { cpu_has_vmx_or_svm: virt, kvm_pvm_loaded: pvm, dev_kvm_usable: dev }
    }

    #[test]
    fn auto_picks_kvm_only_with_hardware_virtualization_and_no_pvm() {
        assert_eq!(resolve(AccelChoice::Auto, &host(true, false, true)), Ok(Accel::Kvm));
        assert_eq!(resolve(AccelChoice::Auto, &host(true, true, true)), Ok(Accel::Tcg));
        assert_eq!(resolve(AccelChoice::Auto, &host(false, false, true)), Ok(Accel::Tcg));
        assert_eq!(resolve(AccelChoice::Auto, &host(true, false, false)), Ok(Accel::Tcg));
    }

    #[test]
    fn explicit_choices_are_honoured_or_refused() {
        assert_eq!(resolve(AccelChoice::Tcg, &host(true, false, true)), Ok(Accel::Tcg));
        assert!(resolve(AccelChoice::Kvm, &host(false, true, true)).unwrap_err().contains("PVM"));
        assert_eq!("kvm".parse::<AccelChoice>(), Ok(AccelChoice::Kvm));
        assert!("fast".parse::<AccelChoice>().is_err());
    }

    #[test]
    fn cpu_flags_are_matched_as_words() {
        assert!(cpu_flags_have_virt("flags\t\t: fpu vme svm lm\n"));
        assert!(!cpu_flags_have_virt("flags\t\t: fpu vmxfoo\n"));
    }
}
