//! A stand-in for the internet, for network tests: a network namespace of
//! this test's own with documentation-range addresses (198.51.100.0/24),
//! routed from the host, where a TCP server answers on port 80 of every
//! address and a DNS server answers from a table. Nothing a test sends to it
//! can leave the machine: its addresses are on a veth pair whose route
//! exists before the first packet.

#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// On the first server: sends zeros until the client closes (throughput).
pub const BULK_PORT: u16 = 81;
/// On the first server: sends a line every 50 ms until the client closes.
pub const TICK_PORT: u16 = 82;

/// Addresses per test internet (a /28: the host side, then servers).
const SERVERS: u8 = 5;

#[derive(Debug)]
pub struct TestInternet {
    netns: String,
    veth: String,
    /// The host's address on the link to it.
    pub gateway: Ipv4Addr,
    /// Where the TCP servers listen (port 80); the first also serves DNS.
    pub servers: Vec<Ipv4Addr>,
    pub dns: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TestInternet {
    /// Starts one; `names` are the DNS records (A, TTL 60 s) its resolver
    /// has, each naming one of its servers by index.
    pub fn start(names: &[(&str, usize)]) -> Result<Self, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let k = (NEXT.fetch_add(1, Ordering::Relaxed) + std::process::id()) % 16;
        let base = 16 * k as u8;
        let netns = format!("clade-ti-{k}");
        let veth = format!("clti{k}");
        let gateway = Ipv4Addr::new(198, 51, 100, base + 1);
        let servers: Vec<Ipv4Addr> = (0..SERVERS).map(|i| Ipv4Addr::new(198, 51, 100, base + 2 + i)).collect();
        let _ = run(&["ip", "link", "del", &veth]);
        let _ = run(&["ip", "netns", "del", &netns]);
        run(&["ip", "netns", "add", &netns])?;
        run(&["ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns])?;
        run(&["ip", "addr", "add", &format!("{gateway}/28"), "dev", &veth])?;
        run(&["ip", "link", "set", &veth, "up"])?;
        run(&["ip", "-n", &netns, "link", "set", "lo", "up"])?;
        for server in &servers {
            run(&["ip", "-n", &netns, "addr", "add", &format!("{server}/28"), "dev", "eth0"])?;
        }
        run(&["ip", "-n", &netns, "link", "set", "eth0", "up"])?;
        run(&["ip", "-n", &netns, "route", "add", "default", "via", &gateway.to_string()])?;
        let stop = Arc::new(AtomicBool::new(false));
        let records: Vec<(String, Ipv4Addr)> = names.iter().map(|(n, i)| (n.to_ascii_lowercase(), servers[*i])).collect();
        let dns = SocketAddr::from((servers[0], 53));
        let internet = Self { netns, veth, gateway, servers: servers.clone(), dns, stop: stop.clone() };
        for server in servers {
            let listener = in_netns(&internet.netns, move || TcpListener::bind((server, 80)))?;
            listener.set_nonblocking(true).map_err(|e| e.to_string())?;
            let stop = stop.clone();
            std::thread::spawn(move || serve_tcp(listener, server, stop));
        }
        let first = internet.servers[0];
        let bulk = in_netns(&internet.netns, move || TcpListener::bind((first, BULK_PORT)))?;
        bulk.set_nonblocking(true).map_err(|e| e.to_string())?;
        let bulk_stop = stop.clone();
        std::thread::spawn(move || serve_bulk(bulk, bulk_stop, None));
        let ticks = in_netns(&internet.netns, move || TcpListener::bind((first, TICK_PORT)))?;
        ticks.set_nonblocking(true).map_err(|e| e.to_string())?;
        let tick_stop = stop.clone();
        std::thread::spawn(move || serve_bulk(ticks, tick_stop, Some(Duration::from_millis(50))));
        let socket = in_netns(&internet.netns, move || UdpSocket::bind(dns))?;
        socket.set_read_timeout(Some(Duration::from_millis(100))).map_err(|e| e.to_string())?;
        std::thread::spawn(move || serve_dns(socket, records, stop));
        Ok(internet)
    }
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = run(&["ip", "link", "del", &self.veth]);
        let _ = run(&["ip", "netns", "del", &self.netns]);
    }
}

fn run(args: &[&str]) -> Result<(), String> {
    let output = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args[0]))?;
    if !output.status.success() {
        return Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim()));
    }
    Ok(())
}

/// Runs `open` on a thread that has entered the namespace: the socket it
/// makes lives there for good, whichever thread uses it later.
fn in_netns<T: Send + 'static>(netns: &str, open: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> Result<T, String> {
    let path = format!("/run/netns/{netns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: setns on this short-lived thread only; the fd is valid for the call.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
            return Err(format!("setns {path}: {}", std::io::Error::last_os_error()));
        }
        open().map_err(|e| format!("binding in {path}: {e}"))
    })
    .join()
    .map_err(|_| "the namespace thread panicked".to_string())?
}

/// Answers every connection with `internet <address>` and the first line
/// the client sent, then closes it.
fn serve_tcp(listener: TcpListener, address: Ipv4Addr, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                std::thread::spawn(move || {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut buf = [0u8; 256];
                    let n = stream.read(&mut buf).unwrap_or(0);
                    let first = String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or("").to_string();
                    let _ = stream.write_all(format!("internet {address} {first}\n").as_bytes());
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Zeros as fast as the client takes them, or a line per `tick`.
fn serve_bulk(listener: TcpListener, stop: Arc<AtomicBool>, tick: Option<Duration>) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
                    let zeros = vec![0u8; 256 * 1024];
                    while !stop.load(Ordering::SeqCst) {
                        let sent = match tick {
                            Some(every) => {
                                std::thread::sleep(every);
                                stream.write_all(b"tick\n")
                            }
                            None => stream.write_all(&zeros),
                        };
                        if sent.is_err() {
                            break;
                        }
                    }
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A minimal authoritative DNS server: A records from `records`, NXDOMAIN
/// for other names, an empty answer for other types.
fn serve_dns(socket: UdpSocket, records: Vec<(String, Ipv4Addr)>, stop: Arc<AtomicBool>) {
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, peer)) = socket.recv_from(&mut buf) else { continue };
        if let Some(reply) = dns_reply(&buf[..n], &records) {
            let _ = socket.send_to(&reply, peer);
        }
    }
}

fn dns_reply(query: &[u8], records: &[(String, Ipv4Addr)]) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    let mut labels = Vec::new();
    let mut at = 12;
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question = &query[12..at + 4];
    let name = labels.join(".");
    let found = records.iter().find(|(n, _)| *n == name).map(|(_, a)| *a);
    let mut reply = Vec::with_capacity(64);
    reply.extend_from_slice(&query[..2]);
    let rcode = if found.is_some() { 0 } else { 3 };
    reply.extend_from_slice(&[0x85, 0x80 | rcode]);
    let answers = u16::from(found.is_some() && qtype == 1);
    reply.extend_from_slice(&[0, 1, 0, answers as u8, 0, 0, 0, 0]);
    reply.extend_from_slice(question);
    if let (Some(address), 1) = (found, answers) {
        reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        reply.extend_from_slice(&address.octets());
    }
    Some(reply)
}
