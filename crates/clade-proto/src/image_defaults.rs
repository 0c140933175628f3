//! What an image says every command in it gets unless the command says
//! otherwise: its environment, working directory and user (a Dockerfile's
//! `ENV`, `WORKDIR` and `USER`, an OCI image's config). The host writes it
//! into the image when it builds one ([`IMAGE_DEFAULTS_PATH`]); the agent
//! reads it once at boot, so a template's snapshot holds it and every
//! sandbox restored from it, on any host, applies it.
//!
//! The file is text, one `key=value` per line (`env=NAME=VALUE`,
//! `workdir=/path`, `user=name`), so that a person reading an image can tell
//! what it does; a value's backslashes and newlines are escaped (`\\`, `\n`).

/// Where an image keeps its defaults.
pub const IMAGE_DEFAULTS_PATH: &str = "/etc/clade/image-defaults";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageDefaults {
    /// In order; a later one of a name wins.
    pub env: Vec<(String, String)>,
    /// An absolute path.
    pub workdir: Option<String>,
    /// A user name or uid, as `USER` says it.
    pub user: Option<String>,
}

impl ImageDefaults {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.workdir.is_none() && self.user.is_none()
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut text = String::from("# Written by Clade when the image was built: every command's defaults.\n");
        for (name, value) in &self.env {
            text.push_str(&env_line(name, value));
        }
        if let Some(dir) = &self.workdir {
            text.push_str(&format!("workdir={}\n", escape(dir)));
        }
        if let Some(user) = &self.user {
            text.push_str(&format!("user={}\n", escape(user)));
        }
        text
    }

    /// Reads the file's text; lines it does not know (a newer host's) are
    /// skipped, so that an older agent still applies what it knows.
    pub fn parse(text: &str) -> Self {
        let mut defaults = Self::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else { continue };
            match key {
                "env" => defaults.env.extend(env_of(value)),
                "workdir" if value.starts_with('/') => defaults.workdir = Some(unescape(value)),
                "user" if !value.is_empty() => defaults.user = Some(unescape(value)),
                _ => {}
            }
        }
        defaults
    }
}

/// An `env=NAME=VALUE` line (the form this file and the boot state share).
pub(crate) fn env_line(name: &str, value: &str) -> String {
    format!("env={}={}\n", escape(name), escape(value))
}

/// The variable of an `env=` line's value (`NAME=VALUE`); none without a name.
pub(crate) fn env_of(line_value: &str) -> Option<(String, String)> {
    let (name, value) = line_value.split_once('=').filter(|(name, _)| !name.is_empty())?;
    Some((unescape(name), unescape(value)))
}

pub(crate) fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('\n', "\\n")
}

fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => out.push('\\'),
            },
            (c, false) => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_reads_back_as_written() {
        let defaults = ImageDefaults {
            env: vec![("PATH".into(), "/usr/bin:/bin".into()), ("MULTI".into(), "a\nb\\c=d".into())],
            workdir: Some("/srv/app".into()),
            user: Some("app".into()),
        };
        let text = defaults.to_text();
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 4, "{text}");
        assert_eq!(ImageDefaults::parse(&text), defaults);
        assert!(ImageDefaults::parse("").is_empty());
    }

    #[test]
    fn unknown_and_malformed_lines_are_skipped() {
        let parsed = ImageDefaults::parse("shell=/bin/zsh\nenv==x\nworkdir=relative\nuser=\nenv=A=1\n");
        assert_eq!(parsed, ImageDefaults { env: vec![("A".into(), "1".into())], ..Default::default() });
    }
}
