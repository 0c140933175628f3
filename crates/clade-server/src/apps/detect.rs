//! What a deployment runs: the framework (pinned, or detected from the
//! files of the checkout) and its install, build and start commands, each
//! replaced by the app's own when it sets one. Commands run under `sh` in
//! the app's directory with `PORT` set to the app's port.

use std::path::Path;

/// The frameworks an app may pin, and detection finds.
pub const FRAMEWORKS: [&str; 6] = ["nextjs", "vite", "node", "python", "static", "custom"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framework {
    Nextjs,
    Vite,
    Node,
    /// A Python web app: ASGI (FastAPI, Starlette, Quart), WSGI (Flask), or a script.
    Python,
    /// Files served as they are.
    Static,
    /// Nothing detected: the app's own commands.
    Custom,
}

impl Framework {
    pub fn parse(name: &str) -> Result<Self, String> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "nextjs" | "next" | "next.js" => Self::Nextjs,
            "vite" => Self::Vite,
            "node" | "nodejs" | "express" => Self::Node,
            "python" | "fastapi" | "flask" | "asgi" | "wsgi" => Self::Python,
            "static" | "html" => Self::Static,
            "custom" => Self::Custom,
            other => return Err(format!("framework {other:?} is not one of {}", FRAMEWORKS.join(", "))),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nextjs => "nextjs",
            Self::Vite => "vite",
            Self::Node => "node",
            Self::Python => "python",
            Self::Static => "static",
            Self::Custom => "custom",
        }
    }

    /// The template a deployment runs in unless the app names one: Node.js
    /// and npm are in `agent`; Python and the rest in `base`.
    pub fn template(self) -> &'static str {
        match self {
            Self::Nextjs | Self::Vite | Self::Node => "agent",
            Self::Python | Self::Static | Self::Custom => "base",
        }
    }
}

/// The commands of a deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub framework: Framework,
    pub install: Option<String>,
    pub build: Option<String>,
    pub start: String,
}

/// The app's own commands, each replacing the framework's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub install: Option<String>,
    pub build: Option<String>,
    pub start: Option<String>,
}

/// The plan for the app in `dir` (its root directory in the checkout).
pub fn plan(dir: &Path, pinned: Option<Framework>, overrides: &Overrides) -> Result<Plan, String> {
    let framework = match pinned {
        Some(framework) => framework,
        None => detect(dir).unwrap_or(Framework::Custom),
    };
    let defaults = defaults(dir, framework);
    let own = |command: &Option<String>| command.as_deref().map(str::trim).filter(|c| !c.is_empty()).map(str::to_string);
    let start = own(&overrides.start).or(defaults.start).ok_or_else(|| match framework {
        Framework::Custom => "could not tell the framework (no package.json, requirements.txt, pyproject.toml, Python app or \
                              index.html at the root): set framework or start_command"
            .to_string(),
        other => format!("no start command for this {} app: set start_command", other.as_str()),
    })?;
    Ok(Plan { framework, install: own(&overrides.install).or(defaults.install), build: own(&overrides.build).or(defaults.build), start })
}

/// The framework of the files in `dir`, if one is recognised.
pub fn detect(dir: &Path) -> Option<Framework> {
    if let Some(package) = package_json(dir) {
        let has = |name: &str| ["dependencies", "devDependencies"].iter().any(|deps| package.get(deps).and_then(|d| d.get(name)).is_some());
        return Some(if has("next") {
            Framework::Nextjs
        } else if has("vite") {
            Framework::Vite
        } else {
            Framework::Node
        });
    }
    if ["requirements.txt", "pyproject.toml"].iter().any(|f| dir.join(f).is_file()) || python_entry(dir).is_some() {
        return Some(Framework::Python);
    }
    if dir.join("index.html").is_file() {
        return Some(Framework::Static);
    }
    None
}

struct Defaults {
    install: Option<String>,
    build: Option<String>,
    start: Option<String>,
}

fn defaults(dir: &Path, framework: Framework) -> Defaults {
    let npm_install = || {
        Some(
            if dir.join("package-lock.json").is_file() { "npm ci --no-audit --no-fund" } else { "npm install --no-audit --no-fund" }
                .to_string(),
        )
    };
    let script = |name: &str| package_json(dir).and_then(|p| p.get("scripts").and_then(|s| s.get(name)).map(|_| ())).is_some();
    match framework {
        Framework::Nextjs => Defaults {
            install: npm_install(),
            build: Some("npm run build".into()),
            start: Some("npx --no-install next start -H 0.0.0.0 -p \"$PORT\"".into()),
        },
        Framework::Vite => Defaults {
            install: npm_install(),
            build: Some("npm run build".into()),
            start: Some("npx --no-install vite preview --host 0.0.0.0 --port \"$PORT\" --strictPort".into()),
        },
        Framework::Node => {
            let main = package_json(dir)
                .and_then(|p| p.get("main").and_then(|m| m.as_str()).map(str::to_string))
                .or_else(|| ["server.js", "index.js", "app.js", "main.js"].iter().find(|f| dir.join(f).is_file()).map(|f| f.to_string()));
            Defaults {
                install: package_json(dir).is_some().then(npm_install).flatten(),
                build: script("build").then(|| "npm run build".to_string()),
                start: if script("start") { Some("npm start".into()) } else { main.map(|m| format!("node {}", shell_word(&m))) },
            }
        }
        Framework::Python => {
            let needs = dir.join("requirements.txt").is_file();
            let (server_package, start) = match python_entry(dir) {
                Some(PythonEntry { module, variable, kind: PythonKind::Asgi }) => {
                    (Some("uvicorn"), Some(format!("python3 -m uvicorn {module}:{variable} --host 0.0.0.0 --port \"$PORT\"")))
                }
                Some(PythonEntry { module, variable, kind: PythonKind::Wsgi }) => {
                    (Some("gunicorn"), Some(format!("python3 -m gunicorn --bind \"0.0.0.0:$PORT\" {module}:{variable}")))
                }
                Some(PythonEntry { module, kind: PythonKind::Script, .. }) => (None, Some(format!("python3 {module}.py"))),
                None => (None, None),
            };
            // Debian's Python is "externally managed": the sandbox is the
            // app's alone, so its packages go into the system's.
            let pip = "python3 -m pip install --break-system-packages --no-warn-script-location --disable-pip-version-check";
            let mut steps = Vec::new();
            if needs {
                steps.push(format!("{pip} -r requirements.txt"));
            } else if dir.join("pyproject.toml").is_file() {
                steps.push(format!("{pip} ."));
            }
            if let Some(package) = server_package {
                steps.push(format!("python3 -c 'import {package}' 2>/dev/null || {pip} {package}"));
            }
            Defaults { install: (!steps.is_empty()).then(|| steps.join(" && ")), build: None, start }
        }
        Framework::Static => {
            let root = ["dist", "build", "public", "out"]
                .iter()
                .find(|d| dir.join(d).join("index.html").is_file() && !dir.join("index.html").is_file());
            let serve = match root {
                Some(sub) => format!("python3 -m http.server \"$PORT\" --bind 0.0.0.0 --directory {sub}"),
                None => "python3 -m http.server \"$PORT\" --bind 0.0.0.0".to_string(),
            };
            Defaults { install: None, build: None, start: Some(serve) }
        }
        Framework::Custom => Defaults { install: None, build: None, start: None },
    }
}

fn package_json(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("package.json")).ok()?;
    serde_json::from_str(&text).ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PythonKind {
    Asgi,
    Wsgi,
    Script,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PythonEntry {
    module: String,
    variable: String,
    kind: PythonKind,
}

/// The Python file that is the app: the first of the usual names, with the
/// variable that holds an ASGI or WSGI application if it makes one.
fn python_entry(dir: &Path) -> Option<PythonEntry> {
    const FILES: [&str; 6] = ["main", "app", "server", "asgi", "wsgi", "application"];
    const ASGI: [&str; 4] = ["FastAPI", "Starlette", "Quart", "Litestar"];
    const WSGI: [&str; 2] = ["Flask", "Bottle"];
    for module in FILES {
        let Ok(source) = std::fs::read_to_string(dir.join(format!("{module}.py"))) else { continue };
        for line in source.lines() {
            // `app = FastAPI(...)`: a module-level assignment of a constructor call.
            let Some((variable, value)) = line.split_once('=') else { continue };
            let variable = variable.trim();
            if line.starts_with(char::is_whitespace) || variable.is_empty() || !variable.chars().all(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let call = value.trim().split('(').next().unwrap_or("").rsplit('.').next().unwrap_or("");
            let kind = if ASGI.contains(&call) {
                PythonKind::Asgi
            } else if WSGI.contains(&call) {
                PythonKind::Wsgi
            } else {
                continue;
            };
            return Some(PythonEntry { module: module.to_string(), variable: variable.to_string(), kind });
        }
        if source.contains("__main__") {
            return Some(PythonEntry { module: module.to_string(), variable: String::new(), kind: PythonKind::Script });
        }
    }
    None
}

/// `word` quoted for `sh` when it needs to be.
fn shell_word(word: &str) -> String {
    if word.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    fn planned(files: &[(&str, &str)]) -> Result<Plan, String> {
        plan(dir_with(files).path(), None, &Overrides::default())
    }

    #[test]
    fn node_apps_are_told_apart_by_their_dependencies() {
        let next = planned(&[("package.json", r#"{"dependencies": {"next": "14", "react": "18"}}"#)]).unwrap();
        assert_eq!((next.framework, next.build.as_deref()), (Framework::Nextjs, Some("npm run build")));
        assert!(next.start.contains("next start") && next.start.contains("$PORT"));
        let vite = planned(&[("package.json", r#"{"devDependencies": {"vite": "5"}}"#), ("package-lock.json", "{}")]).unwrap();
        assert_eq!((vite.framework, vite.install.as_deref()), (Framework::Vite, Some("npm ci --no-audit --no-fund")));
        let express = planned(&[("package.json", r#"{"scripts": {"start": "node srv.js"}}"#)]).unwrap();
        assert_eq!((express.framework, express.start.as_str(), express.build), (Framework::Node, "npm start", None));
        let bare = planned(&[("package.json", "{}"), ("server.js", "")]).unwrap();
        assert_eq!(bare.start, "node server.js");
        assert_eq!(Framework::Node.template(), "agent");
    }

    #[test]
    fn python_apps_start_with_their_server() {
        let fastapi = planned(&[("main.py", "from fastapi import FastAPI\napp = FastAPI()\n"), ("requirements.txt", "fastapi\n")]).unwrap();
        assert_eq!(fastapi.framework, Framework::Python);
        assert!(fastapi.start.starts_with("python3 -m uvicorn main:app "), "{}", fastapi.start);
        let install = fastapi.install.unwrap();
        assert!(install.contains("-r requirements.txt") && install.contains("uvicorn"), "{install}");
        let flask = planned(&[("app.py", "import flask\napplication = flask.Flask(__name__)\n")]).unwrap();
        assert!(flask.start.contains("gunicorn") && flask.start.ends_with("app:application"), "{}", flask.start);
        let script = planned(&[("server.py", "if __name__ == '__main__':\n    serve()\n")]).unwrap();
        assert_eq!((script.start.as_str(), script.install), ("python3 server.py", None));
        assert_eq!(Framework::Python.template(), "base");
    }

    #[test]
    fn static_sites_custom_commands_and_nothing_found() {
        let site = planned(&[("index.html", "<h1>hi</h1>")]).unwrap();
        assert_eq!(site.framework, Framework::Static);
        assert!(site.start.starts_with("python3 -m http.server \"$PORT\"") && !site.start.contains("--directory"));
        let built = planned(&[("dist/index.html", "")]).unwrap_err();
        assert!(built.contains("start_command"), "{built}");
        let dir = dir_with(&[("dist/index.html", "")]);
        let pinned = plan(dir.path(), Some(Framework::Static), &Overrides::default()).unwrap();
        assert!(pinned.start.ends_with("--directory dist"), "{}", pinned.start);
        let own = Overrides { start: Some("./run.sh".into()), ..Overrides::default() };
        let custom = plan(dir_with(&[("run.sh", "")]).path(), None, &own).unwrap();
        assert_eq!((custom.framework, custom.start.as_str()), (Framework::Custom, "./run.sh"));
        assert!(Framework::parse("rails").unwrap_err().contains("nextjs, vite"));
        assert_eq!(Framework::parse("Next.js").unwrap(), Framework::Nextjs);
    }
}
