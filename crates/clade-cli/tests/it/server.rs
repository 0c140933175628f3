//! `clade server`, `clade keys` and `clade host ls` as a user runs them: the real binary, a
//! real database, HTTP over a socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

fn clade(data_dir: &std::path::Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_clade"));
    command.env("CLADE_DATA_DIR", data_dir).env_remove("CLADE_DATABASE_URL").env_remove("CLADE_LISTEN");
    command
}

fn run(command: &mut Command) -> String {
    let out = command.output().unwrap();
    assert!(out.status.success(), "{:?}: {}", command, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// One HTTP/1.1 GET; returns the status code.
fn get(addr: &str, path: &str, key: &str) -> u16 {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

#[test]
fn keys_create_list_and_revoke_on_the_local_database() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(clade(dir.path()).args(["keys", "create", "--workspace", "team", "--name", "ci"]));
    let key = out.lines().last().unwrap();
    assert!(key.starts_with("clade_") && key.len() == 70, "{out}");

    let list = run(clade(dir.path()).args(["keys", "list"]));
    let row = list.lines().find(|l| l.contains("\tteam\tci\t")).unwrap_or_else(|| panic!("{list}"));
    assert!(row.ends_with("\tactive"), "{row}");
    assert!(!list.contains(key), "a listed key never shows its secret");
    let id = row.split('\t').next().unwrap();

    run(clade(dir.path()).args(["keys", "revoke", id]));
    let list = run(clade(dir.path()).args(["keys", "list", "--workspace", "team"]));
    assert!(list.lines().any(|l| l.starts_with(id) && l.ends_with("\trevoked")), "{list}");
    let missing = clade(dir.path()).args(["keys", "revoke", "key_nope"]).output().unwrap();
    assert!(!missing.status.success());

    // A key may be given a lifetime, which the listing shows.
    run(clade(dir.path()).args(["keys", "create", "--workspace", "team", "--name", "week", "--expires-in-days", "7"]));
    let list = run(clade(dir.path()).args(["keys", "list", "--workspace", "team"]));
    let row = list.lines().find(|l| l.contains("\tweek\t")).unwrap_or_else(|| panic!("{list}"));
    let columns: Vec<&str> = row.split('\t').collect();
    assert_eq!(columns[7], "active", "{row}");
    assert_ne!(columns[6], "never", "{row}");
    let refused = clade(dir.path()).args(["keys", "create", "--expires-in-days", "0"]).output().unwrap();
    assert!(!refused.status.success());
}

#[test]
fn server_prints_its_first_key_serves_it_and_accepts_keys_made_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let mut server =
        clade(dir.path()).args(["server", "--listen", "127.0.0.1:0"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let admin = BufReader::new(server.stdout.take().unwrap()).lines().next().unwrap().unwrap();
    assert_eq!(std::fs::read_to_string(dir.path().join("admin.key")).unwrap().trim(), admin);
    let mut stderr = BufReader::new(server.stderr.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the server exited before listening");
        if let Some(rest) = line.trim().strip_prefix("clade server: listening on http://") {
            break rest.to_string();
        }
    };
    assert_eq!(get(&addr, "/v1/me", &admin), 200);
    assert_eq!(get(&addr, "/v1/me", "clade_nope"), 401);

    // A key made on the database while the server runs works at once.
    let out = run(clade(dir.path()).args(["keys", "create", "--name", "later"]));
    assert_eq!(get(&addr, "/v1/me", out.lines().last().unwrap()), 200);

    // The server registered this machine as a host, kept in the database.
    let hosts = || -> serde_json::Value { serde_json::from_str(&run(clade(dir.path()).args(["host", "ls", "--json"]))).unwrap() };
    let listed = hosts();
    let host_id = std::fs::read_to_string(dir.path().join("host.id")).unwrap().trim().to_string();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!((listed[0]["id"].as_str(), listed[0]["state"].as_str()), (Some(host_id.as_str()), Some("up")), "{listed}");
    assert_eq!(listed[0]["capacity_sandboxes"], 64, "{listed}");
    assert!(listed[0]["capacity_memory_mb"].as_u64().is_some_and(|mb| mb > 0), "{listed}");
    let table = run(clade(dir.path()).args(["host", "ls"]));
    assert!(table.starts_with("ID\tNAME\tSTATE") && table.contains(&host_id), "{table}");

    let pid = server.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = server.wait().unwrap();
    assert!(status.success(), "SIGTERM is a clean stop: {status}");
    let listed = hosts();
    assert_eq!((listed[0]["state"].as_str(), listed[0]["state_reason"].as_str()), (Some("down"), Some("it stopped")), "{listed}");
}
