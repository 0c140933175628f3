//! What a guest keeps on its own disk for the next cold boot of that disk
//! (a filesystem-only hibernation, issue 32): the default environment its
//! post-restore hooks set, and its machine id. Both live in the guest's
//! memory otherwise (the hook's variables in the agent, the identity in a
//! tmpfs), so a reboot would lose them; the host cannot give them back,
//! because a fork or a create from a snapshot inherits them in memory.
//!
//! The agent writes the file when asked ([`crate::Request::SaveBootState`])
//! and reads it when it starts. Its text has [`crate::ImageDefaults`]'
//! form: `env=NAME=VALUE` and `machine-id=HEX` lines, values escaped.

use crate::image_defaults::{env_line, env_of, escape};

/// Where the guest keeps it (root's only: the variables may be secrets).
pub const BOOT_STATE_PATH: &str = "/var/lib/clade/boot-state";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BootState {
    /// In order; a later one of a name wins.
    pub env: Vec<(String, String)>,
    pub machine_id: Option<String>,
}

impl BootState {
    /// The file's text.
    pub fn to_text(&self) -> String {
        let mut text = String::from("# Written by the Clade agent for the next cold boot of this disk.\n");
        for (name, value) in &self.env {
            text.push_str(&env_line(name, value));
        }
        if let Some(id) = &self.machine_id {
            text.push_str(&format!("machine-id={}\n", escape(id)));
        }
        text
    }

    /// Reads the file's text; lines it does not know are skipped.
    pub fn parse(text: &str) -> Self {
        let mut state = Self::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else { continue };
            match key {
                "env" => state.env.extend(env_of(value)),
                // Hex digits only: nothing to unescape.
                "machine-id" if !value.is_empty() => state.machine_id = Some(value.to_string()),
                _ => {}
            }
        }
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_reads_back_as_written() {
        let state = BootState {
            env: vec![("TOKEN".into(), "a=b\nc\\d".into()), ("CLADE_SANDBOX_ID".into(), "0123".into())],
            machine_id: Some("0123456789abcdef0123456789abcdef".into()),
        };
        assert_eq!(BootState::parse(&state.to_text()), state);
        assert_eq!(BootState::parse(""), BootState::default());
        assert_eq!(BootState::parse("workdir=/x\nmachine-id=\nenv==1\n"), BootState::default());
    }
}
