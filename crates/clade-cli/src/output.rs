//! What client commands print: JSON for scripts, aligned tables for people,
//! and a spinner on stderr for operations that take a moment.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Pretty JSON on stdout.
pub fn json(value: &Value) {
    println!("{}", serde_json::to_string_pretty(value).expect("a Value serializes"));
}

/// Columns padded to their widest cell; the last one is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = line(&widths, headers);
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        out.push_str(&line(&widths, &cells));
    }
    out
}

fn line(widths: &[usize], cells: &[&str]) -> String {
    let mut out = String::new();
    for (i, cell) in cells.iter().enumerate() {
        if i + 1 == cells.len() {
            out.push_str(cell);
        } else {
            let pad = widths[i].saturating_sub(cell.chars().count());
            out.push_str(cell);
            out.push_str(&" ".repeat(pad + 2));
        }
    }
    out.trim_end().to_string() + "\n"
}

/// A string field of a JSON object, or "".
pub fn field(value: &Value, key: &str) -> String {
    match &value[key] {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `k=v,k2=v2` of a JSON object of strings.
pub fn metadata(value: &Value) -> String {
    value
        .as_object()
        .map(|m| m.iter().map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or(&v.to_string()))).collect::<Vec<_>>().join(","))
        .unwrap_or_default()
}

/// A Unix time in milliseconds as RFC 3339 UTC, to the second.
pub fn utc_time(unix_ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A spinner with the elapsed time on stderr while an operation runs; only
/// when stderr is a terminal (scripts get clean output). Cleared on drop.
pub struct Progress {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    pub fn start(message: &str) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self { task: None };
        }
        let message = message.to_string();
        let task = tokio::spawn(async move {
            const FRAMES: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];
            let started = Instant::now();
            let mut interval = tokio::time::interval(Duration::from_millis(100));
            for frame in FRAMES.iter().cycle() {
                interval.tick().await;
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{frame} {message}… {:.1}s", started.elapsed().as_secs_f64());
                let _ = err.flush();
            }
        });
        Self { task: Some(task) }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
        }
    }
}

/// Standard base64 with padding (for binary content in `--json` output).
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let t = table(&["ID", "STATUS"], &[vec!["abc".into(), "running".into()], vec!["a".into(), "x".into()]]);
        assert_eq!(t, "ID   STATUS\nabc  running\na    x\n");
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
    }

    #[test]
    fn sizes() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
