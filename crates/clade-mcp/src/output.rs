//! What a tool answers, shaped for a model's context: long command output
//! cut to its tail with a note of what was dropped, and files as text when
//! they are UTF-8, else base64. Pure functions, unit-tested.

use base64::Engine as _;
use schemars::JsonSchema;
use serde::Deserialize;

/// How much of each stream (stdout, stderr) a result keeps: the last this many characters.
pub const KEPT_CHARS: usize = 20_000;

/// The tail of a stream as it arrives: at most [`KEPT_CHARS`] characters
/// at the end, and how many were dropped before them.
#[derive(Debug, Default, Clone)]
pub struct Tail {
    text: String,
    dropped: usize,
}

impl Tail {
    pub fn push(&mut self, chunk: &str) {
        self.text.push_str(chunk);
        // Trimmed in batches: a char count per chunk would be quadratic.
        if self.text.len() > 4 * KEPT_CHARS {
            self.trim();
        }
    }

    fn trim(&mut self) {
        let (kept, dropped) = keep_tail(&self.text, KEPT_CHARS);
        self.dropped += dropped;
        self.text = kept.to_string();
    }

    /// The kept text and how many characters were dropped before it.
    pub fn finish(mut self) -> (String, usize) {
        self.trim();
        (self.text, self.dropped)
    }
}

/// The last `keep` characters of `text`, and how many characters came before them.
pub fn keep_tail(text: &str, keep: usize) -> (&str, usize) {
    let total = text.chars().count();
    if total <= keep {
        return (text, 0);
    }
    let dropped = total - keep;
    let start = text.char_indices().nth(dropped).map_or(text.len(), |(at, _)| at);
    (&text[start..], dropped)
}

/// A stream's section of a result: its kept text, after a note when some was dropped.
pub fn stream_section(name: &str, text: &str, dropped: usize) -> String {
    let mut section = format!("--- {name} ---\n");
    if dropped > 0 {
        section.push_str(&format!("[{dropped} earlier characters of {name} dropped; the last {KEPT_CHARS} follow]\n"));
    }
    if text.is_empty() && dropped == 0 {
        section.push_str("(empty)\n");
    } else {
        section.push_str(text);
        if !text.ends_with('\n') {
            section.push('\n');
        }
    }
    section
}

/// A finished command as the model reads it.
pub fn command_report(exit_code: i64, stdout: Tail, stderr: Tail, note: Option<&str>) -> String {
    let (out, out_dropped) = stdout.finish();
    let (err, err_dropped) = stderr.finish();
    let mut report = format!("exit code: {exit_code}\n");
    if let Some(note) = note {
        report.push_str(note);
        report.push('\n');
    }
    report.push_str(&stream_section("stdout", &out, out_dropped));
    report.push_str(&stream_section("stderr", &err, err_dropped));
    report
}

/// How `write_file`'s `content` is spelled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// The content is the file's text.
    #[default]
    Utf8,
    /// The content is the file's bytes in standard base64.
    Base64,
}

/// The bytes `content` stands for.
pub fn decode_content(content: &str, encoding: Encoding) -> Result<Vec<u8>, String> {
    match encoding {
        Encoding::Utf8 => Ok(content.as_bytes().to_vec()),
        Encoding::Base64 => {
            let compact: String = content.chars().filter(|c| !c.is_ascii_whitespace()).collect();
            base64::engine::general_purpose::STANDARD.decode(compact).map_err(|e| format!("content is not valid base64: {e}"))
        }
    }
}

/// A file's bytes as a tool or resource answers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileContent {
    Text(String),
    Base64(String),
}

/// Text when the bytes are valid UTF-8, else base64.
pub fn file_content(bytes: Vec<u8>) -> FileContent {
    match String::from_utf8(bytes) {
        Ok(text) => FileContent::Text(text),
        Err(e) => FileContent::Base64(base64::engine::general_purpose::STANDARD.encode(e.into_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_kept_whole() {
        assert_eq!(keep_tail("hello", 10), ("hello", 0));
        let mut tail = Tail::default();
        tail.push("42\n");
        assert_eq!(tail.finish(), ("42\n".to_string(), 0));
    }

    #[test]
    fn long_output_keeps_its_last_characters_and_counts_the_rest() {
        let text: String = "é".repeat(KEPT_CHARS + 5);
        let (kept, dropped) = keep_tail(&text, KEPT_CHARS);
        assert_eq!((kept.chars().count(), dropped), (KEPT_CHARS, 5));
        let mut tail = Tail::default();
        for _ in 0..10 {
            tail.push(&"x".repeat(KEPT_CHARS));
        }
        tail.push("end");
        let (kept, dropped) = tail.finish();
        assert_eq!((kept.chars().count(), dropped), (KEPT_CHARS, 10 * KEPT_CHARS + 3 - KEPT_CHARS));
        assert!(kept.ends_with("xend"));
    }

    #[test]
    fn a_report_says_what_was_dropped() {
        let mut out = Tail::default();
        out.push(&"a".repeat(KEPT_CHARS + 7));
        let report = command_report(0, out, Tail::default(), None);
        assert!(report.starts_with("exit code: 0\n"), "{report}");
        assert!(report.contains("[7 earlier characters of stdout dropped; the last 20000 follow]"), "{report}");
        assert!(report.contains("--- stderr ---\n(empty)\n"), "{report}");
    }

    #[test]
    fn files_are_text_when_utf8_else_base64() {
        assert_eq!(file_content(b"hi\n".to_vec()), FileContent::Text("hi\n".into()));
        assert_eq!(file_content(vec![0xff, 0x00, 0x01]), FileContent::Base64("/wAB".into()));
    }

    #[test]
    fn content_decodes_by_its_encoding() {
        assert_eq!(decode_content("/wAB", Encoding::Base64).unwrap(), vec![0xff, 0, 1]);
        assert_eq!(decode_content("/w\nAB", Encoding::Base64).unwrap(), vec![0xff, 0, 1]);
        assert_eq!(decode_content("/wAB", Encoding::Utf8).unwrap(), b"/wAB".to_vec());
        assert!(decode_content("not base64!", Encoding::Base64).is_err());
        let encoding: Encoding = serde_json::from_str("\"base64\"").unwrap();
        assert_eq!(encoding, Encoding::Base64);
    }
}
