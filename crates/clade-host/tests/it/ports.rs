//! Ports in a real VM: the agent lists what listens, and connects to it
//! (raw bytes both ways, refusals told apart). (Skipped without
//! root/QEMU, failed in CI.)

use std::time::{Duration, Instant};

use crate::support::{block_on, sh, shared};
use clade_host::AgentError;
use clade_proto::ErrorKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[test]
fn listening_ports_and_connections_into_the_guest() {
    let Some(s) = shared() else { return };
    block_on(async {
        let agent = s.vm.agent();
        // Nothing on 8123 yet: refused, not a failure of the session.
        match agent.connect_port(8123).await {
            Err(AgentError::Guest(e)) => assert_eq!(e.kind, ErrorKind::ConnectionRefused, "{e}"),
            other => panic!("expected a refusal, got {:?}", other.map(|_| "a stream")),
        }
        let started =
            s.vm.run(sh("cd /tmp && echo hello-port > index.html && \
                     (setsid python3 -m http.server 8123 --bind 127.0.0.1 >/tmp/http.log 2>&1 &)"))
                .await
                .unwrap();
        assert_eq!(started.exit_code(), 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let listener = loop {
            let ports = agent.listening_ports().await.unwrap();
            if let Some(p) = ports.into_iter().find(|p| p.port == 8123) {
                break p;
            }
            assert!(Instant::now() < deadline, "http.server never listened");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(listener.address, "127.0.0.1");
        assert!(listener.process.as_deref().is_some_and(|p| p.starts_with("python3")), "{listener:?}");

        let mut stream = agent.connect_port(8123).await.unwrap();
        stream.write_all(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await.unwrap().unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
        assert!(answer.ends_with("hello-port\n"), "{answer}");

        // Several at once, on one session.
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let agent = agent.clone();
            tasks.push(tokio::spawn(async move {
                let mut stream = agent.connect_port(8123).await.unwrap();
                stream.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").await.unwrap();
                let mut answer = Vec::new();
                stream.read_to_end(&mut answer).await.unwrap();
                answer
            }));
        }
        for task in tasks {
            assert!(String::from_utf8_lossy(&task.await.unwrap()).ends_with("hello-port\n"));
        }
        s.vm.run(sh("pkill -f 'http.server 8123'")).await.unwrap();
        agent.ping().await.unwrap();
    });
}
