//! An app's environment: variable names, scopes, and `.env` text.

/// What every answer shows instead of a secret's value.
pub const SECRET_MASK: &str = "••••••••";
/// The scopes a variable may have. Apps have no previews here, so `all`
/// and `production` reach every deployment and `preview` none.
pub const SCOPES: [&str; 3] = ["all", "production", "preview"];
/// The most variables an app may have, and the longest value.
pub const MAX_VARIABLES: usize = 500;
pub const MAX_VALUE_BYTES: usize = 64 << 10;

/// Secrets the deployment uses to fetch a private repository; never given
/// to the app's process.
pub const GIT_TOKEN: &str = "CLADE_GIT_TOKEN";
pub const GIT_SSH_KEY: &str = "CLADE_GIT_SSH_KEY";

pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 256
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a variable name (letters, digits and _, not beginning with a digit)"))
    }
}

pub fn check_value(name: &str, value: &str) -> Result<(), String> {
    if value.contains('\0') {
        return Err(format!("the value of {name} contains a NUL byte"));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!("the value of {name} is longer than {} KiB", MAX_VALUE_BYTES >> 10));
    }
    Ok(())
}

pub fn check_scope(scope: &str) -> Result<(), String> {
    if SCOPES.contains(&scope) {
        Ok(())
    } else {
        Err(format!("scope must be one of {}", SCOPES.join(", ")))
    }
}

/// Whether a variable of `scope` reaches a deployment.
pub fn reaches_deployments(scope: &str) -> bool {
    scope != "preview"
}

/// Whether the deployment's sandbox gets the variable (the git secrets stay with the host).
pub fn given_to_the_app(name: &str) -> bool {
    name != GIT_TOKEN && name != GIT_SSH_KEY
}

/// The `KEY=value` lines of `.env` text: `#` comments and blank lines
/// skipped, an `export ` prefix allowed, values in single quotes taken as
/// they are, in double quotes with `\n`, `\t`, `\"` and `\\` escapes (and
/// spanning lines), bare ones trimmed and cut at ` #`.
pub fn parse_dotenv(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").map(str::trim_start).unwrap_or(line);
        let (name, rest) = line.split_once('=').ok_or_else(|| format!("line {}: expected KEY=value", index + 1))?;
        let name = name.trim();
        check_name(name).map_err(|e| format!("line {}: {e}", index + 1))?;
        let rest = rest.trim_start();
        let value = if let Some(quoted) = rest.strip_prefix('\'') {
            let (value, _) = quoted.split_once('\'').ok_or_else(|| format!("line {}: the ' is not closed", index + 1))?;
            value.to_string()
        } else if let Some(quoted) = rest.strip_prefix('"') {
            let mut value = String::new();
            let mut text = quoted.to_string();
            loop {
                let mut chars = text.chars();
                let mut closed = false;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => {
                            closed = true;
                            break;
                        }
                        '\\' => match chars.next() {
                            Some('n') => value.push('\n'),
                            Some('t') => value.push('\t'),
                            Some('r') => value.push('\r'),
                            Some(other) => value.push(other),
                            None => value.push('\\'),
                        },
                        other => value.push(other),
                    }
                }
                if closed {
                    break;
                }
                let (_, next) = lines.next().ok_or_else(|| format!("line {}: the \" is not closed", index + 1))?;
                value.push('\n');
                text = next.to_string();
            }
            value
        } else {
            let bare = match rest.find(" #") {
                Some(at) => &rest[..at],
                None => rest,
            };
            bare.trim().to_string()
        };
        check_value(name, &value).map_err(|e| format!("line {}: {e}", index + 1))?;
        pairs.push((name.to_string(), value));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotenv_text_is_read_as_shells_and_tools_write_it() {
        let text =
            "# settings\n\nA=1\nexport B = two words # note\nC='single # kept'\nD=\"line\\nnext \\\"q\\\"\"\nE=\"multi\nline\"\nF=\n";
        let pairs = parse_dotenv(text).unwrap();
        let expect = [("A", "1"), ("B", "two words"), ("C", "single # kept"), ("D", "line\nnext \"q\""), ("E", "multi\nline"), ("F", "")];
        assert_eq!(pairs, expect.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>());
        assert!(parse_dotenv("NOVALUE\n").unwrap_err().starts_with("line 1"));
        assert!(parse_dotenv("1X=y").unwrap_err().contains("not a variable name"));
        assert!(parse_dotenv("X=\"open").unwrap_err().contains("not closed"));
        assert!(check_scope("preview").is_ok() && check_scope("staging").is_err());
        assert!(!given_to_the_app(GIT_TOKEN) && given_to_the_app("TOKEN"));
    }
}
