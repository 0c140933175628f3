//! `clade sandbox shell`: an interactive terminal in a sandbox over the
//! server's WebSocket (`GET /v1/sandboxes/{id}/ssh`, wire spec §3.18):
//! stdin goes out as binary frames, window changes as
//! `{"resize":{"rows":N,"cols":M}}` text frames; binary frames coming back
//! are the terminal's output, and a text frame `{"exit":N}` ends the session
//! with that exit code (`{"error":"…"}` ends it as a clade failure).

use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::process::ExitCode;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::client::{error_message, Client, ClientError};
use crate::term;

pub async fn run(client: &Client, id: &str, command: &[String]) -> anyhow::Result<ExitCode> {
    let size = term::size(std::io::stdout().as_fd()).unwrap_or(clade_proto::PtySize { rows: 24, cols: 80 });
    let mut url = client.url(&["sandboxes", id, "ssh"]);
    let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
    url.set_scheme(scheme).expect("ws and wss are valid schemes for an http(s) URL");
    {
        let mut query = url.query_pairs_mut();
        query.append_pair("rows", &size.rows.to_string()).append_pair("cols", &size.cols.to_string());
        if !command.is_empty() {
            query.append_pair("cmd", &shell_command(command));
        }
        if let Ok(term) = std::env::var("TERM") {
            query.append_pair("term", &term);
        }
    }
    let mut request = url.as_str().into_client_request().context("building the WebSocket request")?;
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {}", client.key()).parse().context("the API key is not a valid header value")?);
    let socket = match tokio_tungstenite::connect_async(request).await {
        Ok((socket, _)) => socket,
        Err(tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            let body = response.body().as_deref().map(String::from_utf8_lossy).unwrap_or_default();
            return Err(ClientError::Status { status, message: error_message(status, &body) }.into());
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("connecting to {url}"))),
    };
    let (mut sink, mut stream) = socket.split();

    let raw = if std::io::stdin().is_terminal() { Some(term::RawMode::enable()?) } else { None };
    let (stdin_tx, mut stdin_rx) = mpsc::channel::<Vec<u8>>(16);
    tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 || stdin_tx.send(buf[..n].to_vec()).await.is_err() {
                break;
            }
        }
    });
    let mut winch = signal(SignalKind::window_change())?;
    let mut stdout = tokio::io::stdout();
    let mut stdin_open = true;
    let mut exit = 0;
    let mut failure = None;
    loop {
        tokio::select! {
            data = stdin_rx.recv(), if stdin_open => match data {
                Some(data) => sink.send(Message::Binary(data.into())).await.context("sending input")?,
                // With a terminal there is no end of input; a pipe's end is
                // left to the remote side (it reads what was sent, then exits).
                None => stdin_open = false,
            },
            _ = winch.recv() => {
                if let Some(size) = term::size(std::io::stdout().as_fd()) {
                    let resize = json!({ "resize": { "rows": size.rows, "cols": size.cols } }).to_string();
                    sink.send(Message::Text(resize.into())).await.context("sending a resize")?;
                }
            }
            message = stream.next() => match message {
                Some(Ok(Message::Binary(data))) => {
                    stdout.write_all(&data).await?;
                    stdout.flush().await?;
                }
                Some(Ok(Message::Text(text))) => {
                    let parsed: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
                    if let Some(code) = parsed["exit"].as_i64() {
                        exit = code;
                    } else if let Some(error) = parsed["error"].as_str() {
                        failure = Some(error.to_string());
                    }
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(anyhow::Error::new(e).context("the terminal connection failed")),
            },
        }
    }
    drop(raw);
    match failure {
        Some(error) => anyhow::bail!("{error}"),
        None => Ok(ExitCode::from(exit.clamp(0, 255) as u8)),
    }
}

/// The command line as one shell string: a single argument as it is, several
/// quoted so that the guest's shell sees the same words.
pub fn shell_command(args: &[String]) -> String {
    match args {
        [single] => single.clone(),
        many => many.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "),
    }
}

fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%^".contains(&b));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_keep_their_words() {
        assert_eq!(shell_command(&["echo a; exit 3".into()]), "echo a; exit 3");
        assert_eq!(shell_command(&["ls".into(), "-la".into(), "/my dir".into(), "it's".into()]), r"ls -la '/my dir' 'it'\''s'");
        assert_eq!(shell_command(&["echo".into(), "".into()]), "echo ''");
    }
}
