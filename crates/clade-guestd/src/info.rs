//! `Info` and `Ping`: what the guest knows about itself, from /proc and /sys.

use std::path::Path;

use clade_proto::GuestInfo;

#[derive(Debug, thiserror::Error)]
pub enum InfoError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot parse {0}")]
    Parse(&'static str),
    #[error("statvfs /")]
    Statvfs(#[source] nix::Error),
}

fn read(path: &'static str) -> Result<String, InfoError> {
    std::fs::read_to_string(path).map_err(|source| InfoError::Read { path: path.into(), source })
}

/// Time since boot, from /proc/uptime.
pub fn uptime_ms() -> Result<u64, InfoError> {
    parse_uptime(&read("/proc/uptime")?).ok_or(InfoError::Parse("/proc/uptime"))
}

/// Collects a [`GuestInfo`].
pub fn collect(agent_version: &str) -> Result<GuestInfo, InfoError> {
    let meminfo = read("/proc/meminfo")?;
    let mem = |key| parse_meminfo_kib(&meminfo, key).ok_or(InfoError::Parse("/proc/meminfo"));
    let root = nix::sys::statvfs::statvfs("/").map_err(InfoError::Statvfs)?;
    let fragment = root.fragment_size() as u64;
    let hostname = nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(GuestInfo {
        agent_version: agent_version.to_string(),
        kernel_release: read("/proc/sys/kernel/osrelease")?.trim().to_string(),
        hostname,
        uptime_ms: uptime_ms()?,
        cpus: online_cpus(),
        load_avg: parse_loadavg(&read("/proc/loadavg")?).ok_or(InfoError::Parse("/proc/loadavg"))?,
        mem_total_bytes: mem("MemTotal")? * 1024,
        mem_available_bytes: mem("MemAvailable")? * 1024,
        disk_total_bytes: root.blocks() as u64 * fragment,
        disk_available_bytes: root.blocks_available() as u64 * fragment,
        processes: count_processes(Path::new("/proc")),
    })
}

fn parse_uptime(text: &str) -> Option<u64> {
    let secs: f64 = text.split_whitespace().next()?.parse().ok()?;
    Some((secs * 1000.0) as u64)
}

fn parse_loadavg(text: &str) -> Option<[f64; 3]> {
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().ok());
    Some([fields.next()??, fields.next()??, fields.next()??])
}

fn parse_meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Online CPUs from /sys (a list such as `0-3,6`); the affinity-based count as a fallback.
fn online_cpus() -> u32 {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|list| parse_cpu_list(&list))
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1))
}

fn parse_cpu_list(list: &str) -> Option<u32> {
    let mut count = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        count += match part.split_once('-') {
            Some((a, b)) => b.parse::<u32>().ok()?.checked_sub(a.parse::<u32>().ok()?)? + 1,
            None => {
                part.parse::<u32>().ok()?;
                1
            }
        };
    }
    (count > 0).then_some(count)
}

fn count_processes(proc: &Path) -> u32 {
    let Ok(dir) = std::fs::read_dir(proc) else {
        return 0;
    };
    dir.filter_map(Result::ok).filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))).count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        assert_eq!(parse_uptime("12.34 56.78\n"), Some(12340));
        assert_eq!(parse_loadavg("0.50 0.25 1.00 1/123 456\n"), Some([0.5, 0.25, 1.0]));
        let meminfo = "MemTotal:        2048 kB\nMemFree:  10 kB\nMemAvailable:    1024 kB\n";
        assert_eq!(parse_meminfo_kib(meminfo, "MemTotal"), Some(2048));
        assert_eq!(parse_meminfo_kib(meminfo, "MemAvailable"), Some(1024));
        assert_eq!(parse_meminfo_kib(meminfo, "Mem"), None);
        assert_eq!(parse_cpu_list("0-3,6\n"), Some(5));
        assert_eq!(parse_cpu_list("0\n"), Some(1));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn collects_from_this_machine() {
        let info = collect("test").unwrap();
        assert!(info.cpus >= 1 && info.mem_total_bytes > 0 && info.processes > 0);
        assert!(!info.kernel_release.is_empty());
    }
}
