//! `clade sandbox run-code`: a cell of code in a code context (issue 28),
//! its output streamed as it runs, its text results printed and its images
//! saved to files.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use base64::Engine as _;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{Client, ClientError, SseReader};
use crate::output;

/// What `run-code` was asked.
#[derive(Debug, clap::Args)]
pub struct RunCodeArgs {
    pub id: String,
    /// python, javascript, typescript or bash (for a new context).
    #[arg(long, short, default_value = "python")]
    pub language: String,
    /// The context to run in (it keeps its state between runs); without,
    /// one is made for this run and ended after it, unless --keep.
    #[arg(long)]
    pub context: Option<String>,
    /// Keep the context made for this run (its id is printed on stderr).
    #[arg(long, conflicts_with = "context")]
    pub keep: bool,
    /// Interrupt the cell after this many seconds (the context keeps its state).
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Where images the cell displays are saved.
    #[arg(long, default_value = ".")]
    pub out_dir: PathBuf,
    /// The code, or `-` to read it from stdin.
    pub code: String,
}

pub async fn run(client: &Client, args: RunCodeArgs, json_out: bool) -> anyhow::Result<ExitCode> {
    let code = if args.code == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).context("reading the code from stdin")?;
        text
    } else {
        args.code.clone()
    };
    let (context, made) = match &args.context {
        Some(context) => (context.clone(), false),
        None => {
            let request =
                client.request(Method::POST, &["sandboxes", &args.id, "repl", "sessions"]).json(&json!({ "language": args.language }));
            let made = client.json(request).await?;
            (made["id"].as_str().context("the context answer has no id")?.to_string(), true)
        }
    };
    let outcome = run_cell(client, &args, &context, &code, json_out).await;
    if made && !args.keep {
        let _ = client.send(client.request(Method::DELETE, &["sandboxes", &args.id, "repl", "sessions", &context])).await;
    } else if made {
        eprintln!("context {context}");
    }
    outcome
}

async fn run_cell(client: &Client, args: &RunCodeArgs, context: &str, code: &str, json_out: bool) -> anyhow::Result<ExitCode> {
    let mut body = json!({ "code": code });
    if let Some(seconds) = args.timeout {
        body["timeout_ms"] = json!(seconds * 1000);
    }
    let request = client
        .request(Method::POST, &["sandboxes", &args.id, "repl", "sessions", context, "run"])
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .json(&body);
    let mut events = SseReader::new(client.send(request).await?);
    let mut images = 0usize;
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        match event.event.as_str() {
            "stdout" if !json_out => {
                print!("{}", data["text"].as_str().unwrap_or_default());
                std::io::stdout().flush()?;
            }
            "stderr" if !json_out => eprint!("{}", data["text"].as_str().unwrap_or_default()),
            "result" if !json_out => show_result(&data, &args.out_dir, context, &mut images)?,
            "error" if !json_out => {
                let traceback = data["traceback"].as_str().filter(|t| !t.is_empty());
                eprintln!(
                    "{}",
                    traceback
                        .map_or_else(|| format!("{}: {}", output::field(&data, "name"), output::field(&data, "value")), str::to_string)
                );
            }
            "execution" => {
                if json_out {
                    output::json(&data);
                }
                let code = data["exit_code"].as_i64().unwrap_or(1);
                return Ok(if code == 0 { ExitCode::SUCCESS } else { ExitCode::from(code.clamp(1, 255) as u8) });
            }
            _ => {}
        }
    }
    anyhow::bail!("the stream ended before the cell's outcome")
}

/// A result: its images saved (and said), else its text printed.
fn show_result(bundle: &Value, out_dir: &Path, context: &str, images: &mut usize) -> anyhow::Result<()> {
    let mut saved = false;
    for (mime, extension) in [("image/png", "png"), ("image/jpeg", "jpg"), ("image/svg+xml", "svg")] {
        let Some(data) = bundle[mime].as_str() else { continue };
        let bytes = match extension {
            "svg" => data.as_bytes().to_vec(),
            _ => base64::engine::general_purpose::STANDARD.decode(data.trim()).context("an image result is not base64")?,
        };
        *images += 1;
        std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
        let path = out_dir.join(format!("{context}-{images}.{extension}"));
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("saved {mime} to {}", path.display());
        saved = true;
        break;
    }
    if !saved {
        if let Some(text) = bundle["text/plain"].as_str() {
            println!("{text}");
        }
    }
    Ok(())
}
