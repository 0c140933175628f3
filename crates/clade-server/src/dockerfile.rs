//! Dockerfiles, parsed into the steps of a template build (issue 27): no
//! I/O. One stage (`FROM` a Clade template); `RUN`, `COPY`/`ADD` from the
//! build context, `ENV`, `ARG`, `WORKDIR`, `USER`, `EXPOSE`, `LABEL`, `CMD`
//! and `ENTRYPOINT`. Lines continue with a trailing `\`; `#` starts a
//! comment at the start of a line. `$NAME` and `${NAME}` (and
//! `${NAME:-default}`) are replaced in the arguments of every instruction
//! but `RUN`, `CMD` and `ENTRYPOINT`, whose shell sees the variables
//! itself, from the `ARG`s and `ENV`s before it.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Dockerfile line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

/// How a command is given: to `/bin/sh -c`, or as argv.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum CommandForm {
    Shell(String),
    Exec(Vec<String>),
}

impl CommandForm {
    /// Its argv: a shell form runs under `/bin/sh -c`.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Self::Shell(line) => vec!["/bin/sh".into(), "-c".into(), line.clone()],
            Self::Exec(argv) => argv.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    Run(CommandForm),
    /// Sources in the context (`.` is all of it), and where they go.
    Copy {
        sources: Vec<String>,
        dest: String,
        chown: Option<String>,
    },
    Env(Vec<(String, String)>),
    Arg {
        name: String,
        default: Option<String>,
    },
    Workdir(String),
    User(String),
    Expose(Vec<u16>),
    Label(Vec<(String, String)>),
    Cmd(CommandForm),
    Entrypoint(CommandForm),
}

/// A parsed Dockerfile: the template it starts from and its steps, each
/// with the text it was written as (what the step's cache key hashes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    pub from: String,
    pub steps: Vec<(String, Instruction)>,
}

const SUPPORTED: &str = "FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, EXPOSE, LABEL, CMD, ENTRYPOINT";

pub fn parse(text: &str) -> Result<Dockerfile, ParseError> {
    let mut from = None;
    let mut steps = Vec::new();
    // ARG before FROM, and ARG/ENV as they come: what `$NAME` means.
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    for (line, logical) in logical_lines(text) {
        let err = |message: String| ParseError { line, message };
        let (keyword, rest) = logical.split_once(char::is_whitespace).unwrap_or((logical.as_str(), ""));
        let rest = rest.trim();
        let keyword = keyword.to_ascii_uppercase();
        if from.is_none() && keyword != "FROM" && keyword != "ARG" {
            return Err(err(format!("{keyword} before FROM: a Dockerfile starts with FROM")));
        }
        if rest.is_empty() {
            return Err(err(format!("{keyword} needs arguments")));
        }
        let instruction = match keyword.as_str() {
            "FROM" => {
                if from.is_some() {
                    return Err(err("a second FROM: multi-stage builds are not supported".into()));
                }
                let words: Vec<&str> = rest.split_whitespace().filter(|w| !w.starts_with("--")).collect();
                let image = substitute(words.first().copied().unwrap_or_default(), &vars);
                if words.len() > 1 && !(words.len() == 3 && words[1].eq_ignore_ascii_case("as")) {
                    return Err(err(format!("FROM takes an image and an optional AS name, not {rest:?}")));
                }
                from = Some(image);
                continue;
            }
            "RUN" => Instruction::Run(command_form(rest).map_err(err)?),
            "CMD" => Instruction::Cmd(command_form(rest).map_err(err)?),
            "ENTRYPOINT" => Instruction::Entrypoint(command_form(rest).map_err(err)?),
            "COPY" | "ADD" => {
                let mut words = match json_array(rest) {
                    Some(words) => words,
                    None => rest.split_whitespace().map(str::to_string).collect(),
                };
                let mut chown = None;
                while words.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = words.remove(0);
                    match flag.split_once('=') {
                        Some(("--chown", owner)) => chown = Some(substitute(owner, &vars)),
                        _ => return Err(err(format!("{keyword} {flag} is not supported (only --chown)"))),
                    }
                }
                if words.len() < 2 {
                    return Err(err(format!("{keyword} needs at least one source and a destination")));
                }
                let dest = substitute(&words.pop().expect("two or more"), &vars);
                let sources: Vec<String> = words.iter().map(|w| substitute(w, &vars)).collect();
                if let Some(url) = sources.iter().find(|s| s.contains("://")) {
                    return Err(err(format!("{keyword} from a URL ({url}) is not supported: RUN curl it instead")));
                }
                Instruction::Copy { sources, dest, chown }
            }
            "ENV" => {
                let pairs = key_values(rest, &vars).map_err(err)?;
                vars.extend(pairs.iter().cloned());
                Instruction::Env(pairs)
            }
            "LABEL" => Instruction::Label(key_values(rest, &vars).map_err(err)?),
            "ARG" => {
                let (name, default) = match rest.split_once('=') {
                    Some((name, default)) => (name.trim().to_string(), Some(substitute(&unquote(default.trim()), &vars))),
                    None => (rest.to_string(), None),
                };
                if !is_name(&name) {
                    return Err(err(format!("ARG {name:?} is not a variable name")));
                }
                if let Some(default) = &default {
                    vars.insert(name.clone(), default.clone());
                }
                if from.is_none() {
                    continue;
                }
                Instruction::Arg { name, default }
            }
            "WORKDIR" => Instruction::Workdir(substitute(rest, &vars)),
            "USER" => Instruction::User(substitute(rest, &vars)),
            "EXPOSE" => {
                let mut ports = Vec::new();
                for word in rest.split_whitespace() {
                    let word = substitute(word, &vars);
                    let port = word.split('/').next().unwrap_or_default();
                    ports.push(port.parse::<u16>().map_err(|_| err(format!("EXPOSE {word:?} is not a port")))?);
                }
                Instruction::Expose(ports)
            }
            other => return Err(err(format!("{other} is not supported; supported: {SUPPORTED}"))),
        };
        steps.push((logical.clone(), instruction));
    }
    let from = from.ok_or(ParseError { line: 1, message: "no FROM: a Dockerfile starts with FROM".into() })?;
    Ok(Dockerfile { from, steps })
}

/// Instructions with their first line number: continuations joined,
/// comments and blank lines dropped.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (continues, body) = match trimmed.strip_suffix('\\') {
            Some(body) => (true, body),
            None => (false, trimmed),
        };
        let entry = current.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() && !body.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body.trim());
        if !continues {
            lines.extend(current.take());
        }
    }
    lines.extend(current.filter(|(_, text)| !text.is_empty()));
    lines
}

fn command_form(rest: &str) -> Result<CommandForm, String> {
    if rest.starts_with('[') {
        return match json_array(rest) {
            Some(argv) if !argv.is_empty() => Ok(CommandForm::Exec(argv)),
            _ => Err(format!("{rest:?} is not a JSON array of strings")),
        };
    }
    Ok(CommandForm::Shell(rest.to_string()))
}

fn json_array(text: &str) -> Option<Vec<String>> {
    serde_json::from_str::<Vec<String>>(text.trim()).ok()
}

/// `K=V K2="v 2"`, or the old `K V…` form (one pair).
fn key_values(rest: &str, vars: &BTreeMap<String, String>) -> Result<Vec<(String, String)>, String> {
    // The old form: no `=` before the first space.
    if rest.split_once('=').is_none_or(|(first, _)| first.contains(char::is_whitespace)) {
        let (key, value) = rest.split_once(char::is_whitespace).ok_or_else(|| format!("{rest:?} is not KEY=VALUE"))?;
        return Ok(vec![(key.to_string(), substitute(value.trim(), vars))]);
    }
    let mut pairs = Vec::new();
    for word in shell_words(rest)? {
        let (key, value) = word.split_once('=').ok_or_else(|| format!("{word:?} is not KEY=VALUE"))?;
        pairs.push((key.to_string(), substitute(value, vars)));
    }
    Ok(pairs)
}

/// Words split on whitespace outside quotes, the quotes removed.
fn shell_words(text: &str) -> Result<Vec<String>, String> {
    let (mut words, mut word, mut quote, mut in_word) = (Vec::new(), String::new(), None::<char>, false);
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (_, '\\') => {
                word.extend(chars.next());
                in_word = true;
            }
            (_, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err(format!("an unclosed quote in {text:?}"));
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

fn unquote(text: &str) -> String {
    shell_words(text).ok().and_then(|w| w.into_iter().next()).unwrap_or_else(|| text.to_string())
}

fn is_name(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `$NAME`, `${NAME}` and `${NAME:-default}` from `vars` (unset: empty).
pub fn substitute(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(braced) = after.strip_prefix('{') {
            if let Some(end) = braced.find('}') {
                let inner = &braced[..end];
                let (name, default) = match inner.split_once(":-") {
                    Some((name, default)) => (name, Some(default)),
                    None => (inner, None),
                };
                let value = vars.get(name).filter(|v| !v.is_empty()).cloned().or(default.map(str::to_string)).unwrap_or_default();
                out.push_str(&value);
                rest = &braced[end + 1..];
                continue;
            }
        }
        let len = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').map(char::len_utf8).sum::<usize>();
        if len == 0 {
            out.push('$');
            rest = after;
            continue;
        }
        out.push_str(vars.get(&after[..len]).map_or("", String::as_str));
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dockerfile_becomes_steps_with_their_text() {
        let parsed = parse(
            "# a comment\n\
             ARG PY=python3\n\
             FROM base AS build\n\
             ENV APP=/srv/app MODE=\"two words\"\n\
             WORKDIR $APP\n\
             COPY --chown=user:user req.txt src/ ./\n\
             RUN pip install \\\n    --break-system-packages six\n\
             RUN [\"${PY}\", \"-c\", \"print(1)\"]\n\
             EXPOSE 8080 9000/tcp\n\
             USER user\n\
             LABEL team=ml\n\
             CMD [\"python3\", \"app.py\"]\n",
        )
        .unwrap();
        assert_eq!(parsed.from, "base");
        let instructions: Vec<&Instruction> = parsed.steps.iter().map(|(_, i)| i).collect();
        assert_eq!(
            instructions,
            [
                &Instruction::Env(vec![("APP".into(), "/srv/app".into()), ("MODE".into(), "two words".into())]),
                &Instruction::Workdir("/srv/app".into()),
                &Instruction::Copy { sources: vec!["req.txt".into(), "src/".into()], dest: "./".into(), chown: Some("user:user".into()) },
                &Instruction::Run(CommandForm::Shell("pip install --break-system-packages six".into())),
                &Instruction::Run(CommandForm::Exec(vec!["${PY}".into(), "-c".into(), "print(1)".into()])),
                &Instruction::Expose(vec![8080, 9000]),
                &Instruction::User("user".into()),
                &Instruction::Label(vec![("team".into(), "ml".into())]),
                &Instruction::Cmd(CommandForm::Exec(vec!["python3".into(), "app.py".into()])),
            ]
        );
        assert_eq!(parsed.steps[3].0, "RUN pip install --break-system-packages six", "continuations joined");
    }

    #[test]
    fn what_is_not_supported_is_refused_with_its_line() {
        let cases = [
            ("RUN true", 1, "RUN before FROM"),
            ("FROM base\nFROM agent", 2, "multi-stage"),
            ("FROM base\nHEALTHCHECK CMD true", 2, "HEALTHCHECK is not supported; supported: FROM, RUN"),
            ("FROM base\nADD https://example.com/x /x", 2, "from a URL"),
            ("FROM base\nCOPY --from=build /a /b", 2, "--from=build is not supported"),
            ("FROM base\nCOPY onlyone", 2, "at least one source"),
            ("FROM base\nEXPOSE http", 2, "not a port"),
            ("FROM base\nRUN [\"unclosed\"", 2, "not a JSON array"),
            ("# nothing", 1, "no FROM"),
        ];
        for (text, line, needle) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.line, line, "{text}: {err}");
            assert!(err.message.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn variables_are_replaced_with_defaults_and_unset_ones_empty() {
        let vars = BTreeMap::from([("A".to_string(), "1".to_string()), ("E".to_string(), String::new())]);
        assert_eq!(substitute("$A-${A}-${B:-2}-${E:-3}-$B-$-x$", &vars), "1-1-2-3--$-x$");
    }
}
