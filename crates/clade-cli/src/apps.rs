//! `clade app …`: the apps of a Clade server, deployed from git, over its
//! API (`/v1/apps`). `deploy` follows the deployment's log until it ends
//! and exits 1 when it failed.

use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{Client, ClientError, SseReader};
use crate::output;

#[derive(Subcommand)]
pub enum AppCommand {
    /// Record an app (deploy it with `clade app deploy`).
    Create {
        /// Its host name's first label: the app answers at NAME.<preview suffix>.
        name: String,
        /// The repository: https://, ssh:// or user@host:path.
        git_url: String,
        #[arg(long, default_value = "main")]
        branch: String,
        /// nextjs, vite, node, python, static or custom (default: detected).
        #[arg(long)]
        framework: Option<String>,
        #[arg(long)]
        install_command: Option<String>,
        #[arg(long)]
        build_command: Option<String>,
        /// Run under sh in the app's directory, with $PORT set.
        #[arg(long)]
        start_command: Option<String>,
        /// The sub-directory of the repository to build and run.
        #[arg(long)]
        root_directory: Option<String>,
        /// The port the app listens on (default 3000).
        #[arg(long)]
        port: Option<u16>,
        #[arg(long)]
        template: Option<String>,
        /// KEY=VALUE in its environment (repeatable; secrets: `clade app env set --secret`).
        #[arg(long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// Hibernate after --idle-timeout seconds without requests; the next request wakes it.
        #[arg(long)]
        auto_hibernate: bool,
        #[arg(long)]
        idle_timeout: Option<u32>,
    },
    /// Deploy the app's branch (or --ref) and follow the log until it is live or failed.
    Deploy {
        app: String,
        /// A branch, tag or commit.
        #[arg(long = "ref")]
        git_ref: Option<String>,
        /// Answer at once with the queued deployment.
        #[arg(long)]
        no_wait: bool,
    },
    /// A deployment's log (the newest deployment's by default), until it ends.
    Logs {
        app: String,
        deployment: Option<String>,
        /// What the live deployment's process printed instead.
        #[arg(long)]
        runtime: bool,
    },
    /// The app's deployments, newest first.
    Deployments {
        app: String,
    },
    /// Put the deployment before the live one back (kept hibernated: about a second).
    Rollback {
        app: String,
    },
    /// The app's environment: ls, set, unset, import.
    Env {
        #[command(subcommand)]
        command: EnvCommand,
    },
    /// List the apps of your workspace.
    #[command(alias = "list")]
    Ls,
    Get {
        app: String,
    },
    /// Delete apps: their host names stop answering, their sandboxes go.
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        apps: Vec<String>,
    },
}

#[derive(Subcommand)]
pub enum EnvCommand {
    #[command(alias = "list")]
    Ls { app: String },
    /// Set a variable (its next deployment gets it).
    Set {
        app: String,
        key: String,
        value: String,
        /// Never shown again (masked).
        #[arg(long)]
        secret: bool,
    },
    #[command(alias = "rm")]
    Unset { app: String, key: String },
    /// Set every KEY=value of a .env file (`-`: stdin).
    Import {
        app: String,
        file: String,
        #[arg(long)]
        secret: bool,
    },
}

pub async fn run(command: AppCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        AppCommand::Create {
            name,
            git_url,
            branch,
            framework,
            install_command,
            build_command,
            start_command,
            root_directory,
            port,
            template,
            env,
            auto_hibernate,
            idle_timeout,
        } => {
            let env = crate::functions::parse_env(&env)?;
            let body = json!({
                "name": name, "git_url": git_url, "git_branch": branch, "framework": framework,
                "install_command": install_command, "build_command": build_command, "start_command": start_command,
                "root_directory": root_directory, "port": port, "template": template, "env": env,
                "auto_hibernate": auto_hibernate, "idle_timeout_seconds": idle_timeout,
            });
            let app = client.json(client.request(Method::POST, &["apps"]).json(&body)).await?;
            print_app(&app, json_out);
        }
        AppCommand::Deploy { app, git_ref, no_wait } => {
            let deployment =
                client.json(client.request(Method::POST, &["apps", &app, "deploys"]).json(&json!({ "git_ref": git_ref }))).await?;
            let id = output::field(&deployment, "id");
            if no_wait {
                print_deployments(std::slice::from_ref(&deployment), json_out);
                return Ok(ExitCode::SUCCESS);
            }
            if !json_out {
                eprintln!("deployment {id}");
            }
            follow(client, &app, &id, !json_out).await?;
            let done = client.json(client.request(Method::GET, &["apps", &app, "deploys", &id])).await?;
            if json_out {
                output::json(&done);
            } else if done["status"] == "live" {
                let shown = client.json(client.request(Method::GET, &["apps", &app])).await?;
                println!("live: {}", output::field(&shown, "url"));
            } else {
                eprintln!("deployment {id} {}: {}", output::field(&done, "status"), output::field(&done, "error"));
            }
            return Ok(if done["status"] == "live" { ExitCode::SUCCESS } else { ExitCode::FAILURE });
        }
        AppCommand::Logs { app, deployment, runtime } => {
            if runtime {
                let text = client.send(client.request(Method::GET, &["apps", &app, "runtime-logs"])).await?.text().await?;
                print!("{text}");
                return Ok(ExitCode::SUCCESS);
            }
            let id = match deployment {
                Some(id) => id,
                None => {
                    let listed = client.json(client.request(Method::GET, &["apps", &app, "deploys"])).await?;
                    let newest = listed["items"].as_array().and_then(|items| items.first()).cloned();
                    output::field(&newest.with_context(|| format!("app {app} has no deployment yet"))?, "id")
                }
            };
            follow(client, &app, &id, true).await?;
        }
        AppCommand::Deployments { app } => {
            let listed = client.json(client.request(Method::GET, &["apps", &app, "deploys"])).await?;
            print_deployments(listed["items"].as_array().map(Vec::as_slice).unwrap_or_default(), json_out);
        }
        AppCommand::Rollback { app } => {
            let live = client.json(client.request(Method::POST, &["apps", &app, "rollback"])).await?;
            print_deployments(std::slice::from_ref(&live), json_out);
        }
        AppCommand::Env { command } => return run_env(command, client, json_out).await,
        AppCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["apps"])).await?;
            if json_out {
                output::json(&listed);
            } else {
                print!("{}", app_table(listed["items"].as_array().map(Vec::as_slice).unwrap_or_default()));
            }
        }
        AppCommand::Get { app } => {
            let found = client.json(client.request(Method::GET, &["apps", &app])).await?;
            print_app(&found, json_out);
        }
        AppCommand::Rm { apps } => {
            for app in &apps {
                client.send(client.request(Method::DELETE, &["apps", app])).await?;
                if !json_out {
                    println!("deleted {app}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": apps }));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_env(command: EnvCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    let (shown, said) = match command {
        EnvCommand::Ls { app } => {
            let listed = client.json(client.request(Method::GET, &["apps", &app, "env"])).await?;
            if json_out {
                output::json(&listed);
            } else {
                let rows: Vec<Vec<String>> = listed["env"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .map(|v| {
                        vec![output::field(v, "key"), output::field(v, "value"), output::field(v, "secret"), output::field(v, "scope")]
                    })
                    .collect();
                print!("{}", output::table(&["KEY", "VALUE", "SECRET", "SCOPE"], &rows));
            }
            return Ok(ExitCode::SUCCESS);
        }
        EnvCommand::Set { app, key, value, secret } => {
            let body = json!({ "value": value, "secret": secret });
            let set = client.json(client.request(Method::PUT, &["apps", &app, "env", &key]).json(&body)).await?;
            (set, format!("set {key}{}", if secret { " (secret)" } else { "" }))
        }
        EnvCommand::Unset { app, key } => {
            client.send(client.request(Method::DELETE, &["apps", &app, "env", &key])).await?;
            (json!({ "key": key }), format!("unset {key}"))
        }
        EnvCommand::Import { app, file, secret } => {
            let text = if file == "-" {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).context("reading stdin")?;
                text
            } else {
                std::fs::read_to_string(&file).with_context(|| format!("reading {file}"))?
            };
            let body = json!({ "dotenv": text, "secret": secret });
            let imported = client.json(client.request(Method::POST, &["apps", &app, "env", "import"]).json(&body)).await?;
            let said = format!("imported {} (the app has {})", output::field(&imported, "imported"), output::field(&imported, "total"));
            (imported, said)
        }
    };
    if json_out {
        output::json(&shown);
    } else {
        println!("{said}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints (or, `print` false, only waits through) a deployment's log until the server says `done`.
async fn follow(client: &Client, app: &str, deployment: &str, print: bool) -> anyhow::Result<()> {
    let request = client.request(Method::GET, &["apps", app, "deploys", deployment, "logs"]).header("accept", "text/event-stream");
    let mut events = SseReader::new(client.send(request).await?);
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        if event.event == "done" {
            break;
        }
        if print {
            println!("{}", event.data);
        }
    }
    Ok(())
}

fn print_app(app: &Value, json_out: bool) {
    if json_out {
        output::json(app);
    } else {
        print!("{}", app_table(std::slice::from_ref(app)));
    }
}

fn app_table(apps: &[Value]) -> String {
    let rows: Vec<Vec<String>> = apps
        .iter()
        .map(|a| {
            vec![
                output::field(a, "id"),
                output::field(a, "name"),
                output::field(a, "status"),
                output::field(a, "framework"),
                output::field(a, "url"),
                output::field(a, "git_url"),
            ]
        })
        .collect();
    output::table(&["ID", "NAME", "STATUS", "FRAMEWORK", "URL", "GIT"], &rows)
}

fn print_deployments(deployments: &[Value], json_out: bool) {
    if json_out {
        output::json(&Value::Array(deployments.to_vec()));
        return;
    }
    let rows: Vec<Vec<String>> = deployments
        .iter()
        .map(|d| {
            let commit = output::field(d, "git_commit");
            vec![
                output::field(d, "id"),
                output::field(d, "status"),
                output::field(d, "git_ref"),
                commit.chars().take(12).collect(),
                output::field(d, "created_at"),
                output::field(d, "error"),
            ]
        })
        .collect();
    print!("{}", output::table(&["ID", "STATUS", "REF", "COMMIT", "CREATED", "ERROR"], &rows));
}
