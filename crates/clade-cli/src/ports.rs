//! `clade sandbox ports` (what listens in a sandbox, and its labels) and
//! `clade sandbox port-forward` (a local TCP port that leads to a port in the
//! sandbox).
//!
//! Port-forward listens on 127.0.0.1 only. Each accepted connection opens
//! its own WebSocket to `GET /v1/sandboxes/{id}/ports/{port}/connect`:
//! binary frames carry the bytes both ways, an empty binary frame says the
//! local side finished sending (half-close), and the server closes the
//! socket when the connection in the sandbox ends.

use std::process::ExitCode;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::client::{error_message, Client, ClientError};
use crate::output;

/// `clade sandbox ports ID`.
pub async fn list(client: &Client, id: &str, json_out: bool) -> anyhow::Result<ExitCode> {
    let listed = client.json(client.request(Method::GET, &["sandboxes", id, "ports"])).await?;
    // §3.10: a list, or `{"ports": [...]}`.
    let items = match listed {
        Value::Object(mut o) => o.remove("ports").unwrap_or(Value::Array(Vec::new())),
        other => other,
    };
    if json_out {
        output::json(&items);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = items
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|p| {
            let listening = if p["listening"] == Value::Bool(true) { "yes" } else { "no" };
            vec![
                output::field(p, "port"),
                listening.to_string(),
                output::field(p, "source"),
                output::field(p, "label"),
                output::field(p, "address"),
                output::field(p, "process"),
                output::field(p, "preview_url"),
            ]
        })
        .collect();
    print!("{}", output::table(&["PORT", "LISTENING", "SOURCE", "LABEL", "ADDRESS", "PROCESS", "PREVIEW"], &rows));
    Ok(ExitCode::SUCCESS)
}

/// `LOCAL:REMOTE`, or one port for both; LOCAL 0 picks a free port.
fn parse_mapping(spec: &str) -> anyhow::Result<(u16, u16)> {
    let parse =
        |s: &str| s.trim().parse::<u16>().map_err(|_| anyhow::anyhow!("{spec:?}: expected LOCAL:REMOTE port numbers, e.g. 8000:8000"));
    let (local, remote) = match spec.split_once(':') {
        Some((local, remote)) => (parse(local)?, parse(remote)?),
        None => {
            let port = parse(spec)?;
            (port, port)
        }
    };
    if remote == 0 {
        anyhow::bail!("{spec:?}: the remote port must be between 1 and 65535");
    }
    Ok((local, remote))
}

/// `clade sandbox port-forward ID LOCAL:REMOTE`: until interrupted.
pub async fn forward(client: &Client, id: &str, mapping: &str) -> anyhow::Result<ExitCode> {
    let (local, remote) = parse_mapping(mapping)?;
    // An unknown sandbox is reported now, not at the first connection.
    client.send(client.request(Method::GET, &["sandboxes", id])).await?;
    let listener = TcpListener::bind(("127.0.0.1", local)).await.with_context(|| format!("listening on 127.0.0.1:{local}"))?;
    let bound = listener.local_addr()?.port();
    eprintln!("Forwarding from 127.0.0.1:{bound} to port {remote} of sandbox {id} (Ctrl-C to stop)");
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = accepted.context("accepting a connection")?;
                let client = client.clone();
                let id = id.to_string();
                tokio::spawn(async move {
                    if let Err(e) = forward_one(&client, &id, remote, tcp).await {
                        eprintln!("clade: connection from {peer}: {e:#}");
                    }
                });
            }
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        }
    }
}

async fn forward_one(client: &Client, id: &str, remote: u16, tcp: TcpStream) -> anyhow::Result<()> {
    let _ = tcp.set_nodelay(true);
    let mut url = client.url(&["sandboxes", id, "ports", &remote.to_string(), "connect"]);
    let scheme = if url.scheme() == "https" { "wss" } else { "ws" };
    url.set_scheme(scheme).expect("ws and wss are valid schemes for an http(s) URL");
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
    let (mut from_local, mut to_local) = tcp.into_split();
    let upload = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = from_local.read(&mut buf).await?;
            // An empty frame: the local side is done sending.
            sink.send(Message::Binary(buf[..n].to_vec().into())).await?;
            if n == 0 {
                return anyhow::Ok(sink);
            }
        }
    });
    let download = async {
        while let Some(message) = stream.next().await {
            match message.context("the connection failed")? {
                Message::Binary(data) => to_local.write_all(&data).await?,
                Message::Close(_) => break,
                _ => {}
            }
        }
        to_local.shutdown().await?;
        anyhow::Ok(())
    };
    let outcome = download.await;
    upload.abort();
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings() {
        assert_eq!(parse_mapping("9000:8000").unwrap(), (9000, 8000));
        assert_eq!(parse_mapping("8000").unwrap(), (8000, 8000));
        assert_eq!(parse_mapping("0:8000").unwrap(), (0, 8000));
        assert!(parse_mapping("8000:0").is_err());
        assert!(parse_mapping("a:b").is_err());
        assert!(parse_mapping("70000:1").is_err());
    }
}
