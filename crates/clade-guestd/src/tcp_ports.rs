//! The guest's TCP ports: which sockets listen in the guest (`ListeningPorts`, from
//! /proc/net/tcp and tcp6), and connections to them for the host
//! (`Connect`: the substream becomes a byte pipe to `127.0.0.1:port`).
//!
//! Only loopback is dialled: the host reaches guest services the way a
//! process inside the guest would, whatever address they bound.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use clade_proto::mux::Substream;
use clade_proto::{write_frame, ErrorKind, GuestError, GuestFrame, ListeningPort, Reply};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::agent::drain_until_closed;

/// The `st` column of a listening socket in /proc/net/tcp*.
const TCP_LISTEN: &str = "0A";

/// Connects to the port, answers `Done` (or the error), then relays bytes
/// both ways until both directions are closed or the session ends.
pub async fn connect(mut stream: Substream, port: u16, session: CancellationToken) {
    let tcp = match dial(port).await {
        Ok(tcp) => tcp,
        Err(e) => {
            let error = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                GuestError::new(ErrorKind::ConnectionRefused, format!("nothing listens on port {port}"))
            } else {
                GuestError::from_io(&e, &format!("connecting to port {port}"))
            };
            let _ = write_frame(&mut stream, &GuestFrame::Error(error)).await;
            let _ = stream.shutdown().await;
            drain_until_closed(&mut stream, &session).await;
            return;
        }
    };
    if write_frame(&mut stream, &GuestFrame::Reply(Reply::Done)).await.is_err() {
        return;
    }
    let _ = tcp.set_nodelay(true);
    let mut tcp = tcp;
    tokio::select! {
        outcome = tokio::io::copy_bidirectional(&mut stream, &mut tcp) => {
            if let Err(e) = outcome {
                tracing::debug!(port, "port connection ended: {e}");
            }
        }
        _ = session.cancelled() => {}
    }
}

/// `127.0.0.1:port`, else `[::1]:port` (a server bound to IPv6 loopback
/// only); the first error when neither answers.
async fn dial(port: u16) -> std::io::Result<TcpStream> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpStream::connect(v4).await {
        Ok(tcp) => Ok(tcp),
        Err(first) => match TcpStream::connect(SocketAddr::from((Ipv6Addr::LOCALHOST, port))).await {
            Ok(tcp) => Ok(tcp),
            Err(_) => Err(first),
        },
    }
}

/// Every listening TCP socket, sorted by port then address, with its owner
/// where /proc tells it.
pub fn listening() -> Result<Reply, GuestError> {
    listening_in(Path::new("/proc")).map(Reply::ListeningPorts)
}

fn listening_in(proc: &Path) -> Result<Vec<ListeningPort>, GuestError> {
    let mut sockets = Vec::new();
    for (file, v6) in [("net/tcp", false), ("net/tcp6", true)] {
        let path = proc.join(file);
        match std::fs::read_to_string(&path) {
            Ok(text) => sockets.extend(parse_proc_net_tcp(&text, v6)),
            // A kernel without IPv6 has no tcp6.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && v6 => {}
            Err(e) => return Err(GuestError::from_io(&e, &path.display().to_string())),
        }
    }
    let owners = if sockets.is_empty() { HashMap::new() } else { socket_owners(proc) };
    let mut ports: Vec<ListeningPort> = sockets
        .into_iter()
        .map(|s| {
            let owner = owners.get(&s.inode);
            ListeningPort {
                port: s.port,
                address: s.address,
                process: owner.map(|(_, name)| name.clone()),
                pid: owner.map(|(pid, _)| *pid),
            }
        })
        .collect();
    ports.sort_by(|a, b| (a.port, &a.address).cmp(&(b.port, &b.address)));
    ports.dedup_by(|a, b| a.port == b.port && a.address == b.address);
    Ok(ports)
}

#[derive(Debug, PartialEq, Eq)]
struct Socket {
    port: u16,
    address: String,
    inode: u64,
}

/// The listening sockets of one /proc/net/tcp{,6} table.
fn parse_proc_net_tcp(text: &str, v6: bool) -> Vec<Socket> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&TCP_LISTEN) {
                return None;
            }
            let (address, port) = fields.get(1)?.split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let address = if v6 { parse_ipv6(address)?.to_string() } else { parse_ipv4(address)?.to_string() };
            let inode = fields.get(9)?.parse().ok()?;
            Some(Socket { port, address, inode })
        })
        .collect()
}

/// The kernel prints the address as one 32-bit word in host byte order.
fn parse_ipv4(hex: &str) -> Option<Ipv4Addr> {
    let word = u32::from_str_radix(hex, 16).ok()?;
    Some(Ipv4Addr::from(word.to_ne_bytes()))
}

/// Four 32-bit words, each in host byte order.
fn parse_ipv6(hex: &str) -> Option<Ipv6Addr> {
    if hex.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (i, chunk) in bytes.chunks_mut(4).enumerate() {
        let word = u32::from_str_radix(&hex[i * 8..i * 8 + 8], 16).ok()?;
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Some(Ipv6Addr::from(bytes))
}

/// Socket inode → (pid, comm), from every process's open descriptors. A
/// guest has few processes; ones that vanish or hide their fds are skipped.
fn socket_owners(proc: &Path) -> HashMap<u64, (u32, String)> {
    let mut owners = HashMap::new();
    let Ok(dir) = std::fs::read_dir(proc) else {
        return owners;
    };
    for entry in dir.filter_map(Result::ok) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let mut name = None;
        for fd in fds.filter_map(Result::ok) {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            let name = name.get_or_insert_with(|| {
                std::fs::read_to_string(entry.path().join("comm")).map(|c| c.trim().to_string()).unwrap_or_default()
            });
            owners.entry(inode).or_insert_with(|| (pid, name.clone()));
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{next, Harness};
    use clade_proto::Request;
    use tokio::io::AsyncReadExt;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F40 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 20 4 30 10 -1
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn parses_listening_sockets_only() {
        assert_eq!(
            parse_proc_net_tcp(TCP, false),
            vec![
                Socket { port: 8000, address: "127.0.0.1".into(), inode: 12345 },
                Socket { port: 22, address: "0.0.0.0".into(), inode: 222 },
            ]
        );
        assert_eq!(
            parse_proc_net_tcp(TCP6, true),
            vec![Socket { port: 8080, address: "::".into(), inode: 444 }, Socket { port: 80, address: "::1".into(), inode: 555 }]
        );
    }

    #[tokio::test]
    async fn lists_a_listener_of_this_process() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let h = Harness::start().await;
        let ports = match h.call(Request::ListeningPorts).await {
            GuestFrame::Reply(Reply::ListeningPorts(ports)) => ports,
            other => panic!("unexpected {other:?}"),
        };
        let ours = ports.iter().find(|p| p.port == port).unwrap_or_else(|| panic!("{port} not in {ports:?}"));
        assert_eq!(ours.address, "127.0.0.1");
        assert_eq!(ours.pid, Some(std::process::id()), "{ours:?}");
        assert!(ours.process.as_deref().is_some_and(|p| !p.is_empty()), "{ours:?}");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn connect_pipes_bytes_both_ways_and_passes_on_eof() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        // An echo server that says goodbye after the client's EOF.
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            conn.read_to_end(&mut got).await.unwrap();
            conn.write_all(&got).await.unwrap();
            conn.write_all(b"|bye").await.unwrap();
        });
        let h = Harness::start().await;
        let mut stream = h.open(&Request::Connect { port }).await;
        assert_eq!(next(&mut stream).await, Some(GuestFrame::Reply(Reply::Done)));
        let payload: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
        stream.write_all(&payload).await.unwrap();
        stream.shutdown().await.unwrap();
        let mut back = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(30), stream.read_to_end(&mut back)).await.unwrap().unwrap();
        assert_eq!(back.len(), payload.len() + 4);
        assert!(back.starts_with(&payload) && back.ends_with(b"|bye"));
        server.await.unwrap();
        h.shutdown().await;
    }

    #[tokio::test]
    async fn connect_to_a_closed_port_is_refused() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let h = Harness::start().await;
        match h.call(Request::Connect { port }).await {
            GuestFrame::Error(e) => assert_eq!(e.kind, ErrorKind::ConnectionRefused, "{e:?}"),
            other => panic!("unexpected {other:?}"),
        }
        // The agent carries on.
        assert!(matches!(h.call(Request::Ping).await, GuestFrame::Reply(Reply::Pong { .. })));
        h.shutdown().await;
    }
}
