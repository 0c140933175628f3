//! The store against both backends: SQLite and a real PostgreSQL.

use std::collections::BTreeMap;

use clade_store::{
    KeyCheck, KeyFormat, LifecycleChange, NewSandbox, SandboxState, SnapshotRow, Store, StoreError, E2B_KEY_PREFIX, KEY_PREFIX,
};
use clade_testkit::pg::TestDb;

#[tokio::test]
async fn workspaces_are_unique_by_name_and_ensure_is_idempotent() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("alpha").await.unwrap();
        assert!(matches!(store.create_workspace("alpha").await, Err(StoreError::Conflict(_))), "{}", db.name());
        assert_eq!(store.ensure_workspace("alpha").await.unwrap(), a);
        let b = store.ensure_workspace("beta").await.unwrap();
        assert_ne!(a.id, b.id);
        assert_eq!(store.workspace(&b.id).await.unwrap(), Some(b.clone()));
        assert_eq!(store.workspace_by_name("gamma").await.unwrap(), None);
        let names: Vec<String> = store.list_workspaces().await.unwrap().into_iter().map(|w| w.name).collect();
        assert_eq!(names, ["alpha", "beta"], "{}", db.name());
        store.close().await;
    }
}

#[tokio::test]
async fn keys_are_stored_hashed_authenticate_and_revoke() {
    for db in TestDb::all() {
        let store = db.open().await;
        let ws = store.create_workspace("default").await.unwrap();
        let new = store.create_key(&ws.id, "admin").await.unwrap();
        assert!(new.secret.starts_with(KEY_PREFIX));
        assert_eq!(new.secret.len(), KEY_PREFIX.len() + 64, "32 random bytes in hex");
        assert!(new.secret.starts_with(&new.key.prefix));

        let KeyCheck::Valid(found) = store.authenticate(&new.secret).await.unwrap() else { panic!("the key authenticates") };
        assert_eq!(found.id, new.key.id);
        assert_eq!(found.workspace_id, ws.id);
        assert!(found.last_used_at.is_some(), "use is recorded");
        // A different key of the same shape, and a truncated one, do not.
        let mut wrong = new.secret.clone();
        wrong.replace_range(wrong.len() - 1.., if wrong.ends_with('0') { "1" } else { "0" });
        assert_eq!(store.authenticate(&wrong).await.unwrap(), KeyCheck::Unknown);
        assert_eq!(store.authenticate(&new.key.prefix).await.unwrap(), KeyCheck::Unknown);
        assert_eq!(store.authenticate("").await.unwrap(), KeyCheck::Unknown);

        // Revocation is scoped to the workspace, by id or prefix.
        let other = store.create_workspace("other").await.unwrap();
        assert!(matches!(store.revoke_key(Some(&other.id), &new.key.id).await, Err(StoreError::NotFound(_))));
        // Listed by creation time: a later millisecond than the first.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        let second = store.create_key(&ws.id, "ci").await.unwrap();
        let revoked = store.revoke_key(Some(&ws.id), &second.key.prefix).await.unwrap();
        assert!(revoked.is_revoked());
        assert_eq!(store.authenticate(&second.secret).await.unwrap(), KeyCheck::Unknown, "{}", db.name());
        assert!(matches!(store.authenticate(&new.secret).await.unwrap(), KeyCheck::Valid(_)), "other keys still work");
        store.revoke_key(None, &second.key.id).await.expect("revoking twice is fine");

        // An expiring key works until its instant, then is told apart from an unknown one.
        let later = store.create_key_expiring(&ws.id, "later", Some(clade_store::now_ms() + 60_000)).await.unwrap();
        assert!(matches!(store.authenticate(&later.secret).await.unwrap(), KeyCheck::Valid(_)));
        assert!(store.live_key(&ws.id, &later.key.id).await.unwrap().is_some());
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        let past = store.create_key_expiring(&ws.id, "past", Some(clade_store::now_ms() - 1)).await.unwrap();
        let KeyCheck::Expired(expired) = store.authenticate(&past.secret).await.unwrap() else { panic!("the key is expired") };
        assert_eq!(expired.expires_at, past.key.expires_at);
        assert!(expired.last_used_at.is_none(), "an expired key is not marked as used");
        assert!(store.live_key(&ws.id, &past.key.id).await.unwrap().is_none(), "nor trusted by a host");
        for key in [&later, &past] {
            store.revoke_key(Some(&ws.id), &key.key.id).await.unwrap();
        }

        // A key spelled as E2B's SDKs expect is the same kind of key.
        let e2b = store.create_key_in_format(&ws.id, "e2b", None, KeyFormat::E2b).await.unwrap();
        assert!(e2b.secret.starts_with(E2B_KEY_PREFIX) && e2b.secret.len() == E2B_KEY_PREFIX.len() + 40, "{}", e2b.secret);
        assert!(e2b.secret[E2B_KEY_PREFIX.len()..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(matches!(store.authenticate(&e2b.secret).await.unwrap(), KeyCheck::Valid(found) if found.id == e2b.key.id));
        store.revoke_key(Some(&ws.id), &e2b.key.id).await.unwrap();

        let listed = store.list_keys(Some(&ws.id)).await.unwrap();
        assert_eq!(listed.iter().map(|k| k.name.as_str()).collect::<Vec<_>>(), ["admin", "ci", "later", "past", "e2b"]);
        assert!(listed[1].is_revoked() && !listed[0].is_revoked());
        assert!(store.list_keys(Some(&other.id)).await.unwrap().is_empty());
        assert_eq!(store.key_count().await.unwrap(), 5);
        store.close().await;
    }
}

#[tokio::test]
async fn the_secret_is_never_stored() {
    // Only SQLite: the file is easy to scan for the secret.
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&Store::default_url(dir.path())).await.unwrap();
    let ws = store.create_workspace("default").await.unwrap();
    let new = store.create_key(&ws.id, "admin").await.unwrap();
    store.close().await;
    let secret_hex = &new.secret[KEY_PREFIX.len()..];
    for entry in std::fs::read_dir(dir.path()).unwrap().flatten() {
        // SQLite may remove its -wal or -shm file just after the listing.
        let bytes = match std::fs::read(entry.path()) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            read => read.unwrap(),
        };
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains(secret_hex), "{} holds the key", entry.path().display());
    }
}

#[tokio::test]
async fn the_sqlite_file_and_its_wal_are_private_even_in_an_open_directory() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    // A data directory other users may search, as /var/lib/clade is.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let db = dir.path().join("clade.db");
    let store = Store::open(&Store::default_url(dir.path())).await.unwrap();
    store.create_workspace("default").await.unwrap();
    for file in [db.clone(), dir.path().join("clade.db-wal"), dir.path().join("clade.db-shm")] {
        assert_eq!(mode(&file), 0o600, "{} while open", file.display());
    }
    store.close().await;

    // A database an older version left readable by all is tightened.
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let store = Store::open(&Store::default_url(dir.path())).await.unwrap();
    assert_eq!(mode(&db), 0o600);
    assert_eq!(store.list_workspaces().await.unwrap().len(), 1, "the data is kept");
    store.close().await;
}

fn new_sandbox(id: &str, workspace_id: &str) -> NewSandbox {
    NewSandbox {
        id: id.into(),
        workspace_id: workspace_id.into(),
        template: "base".into(),
        state: SandboxState::Running,
        metadata: BTreeMap::from([("owner".to_string(), "me".to_string()), ("ünï".to_string(), "cødé".to_string())]),
        cpu: 1,
        memory_mb: 512,
        ttl_seconds: 300,
        hibernate_after_seconds: None,
        hibernate_memory: true,
        persistent: false,
        fork_tree_id: None,
        from_snapshot: None,
        preview_auth: false,
        idempotency_key: None,
        host_id: "h1".into(),
    }
}

#[tokio::test]
async fn sandboxes_are_scoped_to_their_workspace_and_keep_state() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let row = store.insert_sandbox(new_sandbox("0123456789ab", &a.id)).await.unwrap();
        assert_eq!(store.sandbox(&a.id, &row.id).await.unwrap(), Some(row.clone()), "{}", db.name());
        assert_eq!(store.sandbox(&b.id, &row.id).await.unwrap(), None, "another workspace does not see it");
        assert!(store.list_sandboxes(&b.id).await.unwrap().is_empty());

        store.set_sandbox_state(&row.id, SandboxState::Failed, Some("QEMU exited")).await.unwrap();
        let failed = store.sandbox(&a.id, &row.id).await.unwrap().unwrap();
        assert_eq!((failed.state, failed.state_reason.as_deref()), (SandboxState::Failed, Some("QEMU exited")));
        store.set_sandbox_lifecycle(&row.id, LifecycleChange { ttl_seconds: Some(60), ..Default::default() }).await.unwrap();
        store.set_sandbox_lifecycle(&row.id, LifecycleChange { persistent: Some(true), ..Default::default() }).await.unwrap();
        store.set_sandbox_lifecycle(&row.id, LifecycleChange { hibernate_after_seconds: Some(90), ..Default::default() }).await.unwrap();
        store.set_sandbox_lifecycle(&row.id, LifecycleChange { hibernate_memory: Some(false), ..Default::default() }).await.unwrap();
        let changed = store.sandbox(&a.id, &row.id).await.unwrap().unwrap();
        assert_eq!(
            (changed.ttl_seconds, changed.persistent, changed.hibernate_after_seconds, changed.hibernate_memory),
            (60, true, Some(90), false)
        );
        let made = NewSandbox { hibernate_after_seconds: Some(30), hibernate_memory: false, ..new_sandbox("hib1", &a.id) };
        let made = store.insert_sandbox(made).await.unwrap();
        let read = store.sandbox(&a.id, &made.id).await.unwrap().unwrap();
        assert_eq!((read.hibernate_after_seconds, read.hibernate_memory), (Some(30), false), "{}", db.name());
        store.set_sandbox_state(&made.id, SandboxState::Deleted, None).await.unwrap();
        store.touch_sandbox(&row.id, changed.last_activity_at + 5000).await.unwrap();
        store.touch_sandbox(&row.id, changed.last_activity_at + 1000).await.unwrap(); // never goes back
        let touched = store.sandbox(&a.id, &row.id).await.unwrap().unwrap();
        assert_eq!(touched.last_activity_at, changed.last_activity_at + 5000);

        let second = store.insert_sandbox(new_sandbox("ba9876543210", &a.id)).await.unwrap();
        store.set_sandbox_state(&row.id, SandboxState::Deleted, None).await.unwrap();
        assert_eq!(store.sandbox(&a.id, &row.id).await.unwrap(), None, "deleted rows are not served");
        let listed = store.list_sandboxes(&a.id).await.unwrap();
        assert_eq!(listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), [second.id.as_str()]);
        let live = store.sandboxes_of_host("h1", &[SandboxState::Running, SandboxState::Hibernated]).await.unwrap();
        assert_eq!(live.len(), 1);
        assert!(matches!(store.set_sandbox_state("nope", SandboxState::Running, None).await, Err(StoreError::NotFound(_))));
        store.close().await;
    }
}

#[tokio::test]
async fn fork_trees_and_snapshot_origins_are_kept_per_workspace() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let child = |id: &str, ws: &str, tree: &str| NewSandbox { fork_tree_id: Some(tree.into()), ..new_sandbox(id, ws) };
        store.insert_sandbox(child("c1", &a.id, "t1")).await.unwrap();
        store.insert_sandbox(child("c2", &a.id, "t1")).await.unwrap();
        store.insert_sandbox(child("c3", &a.id, "t2")).await.unwrap();
        store.insert_sandbox(child("c4", &b.id, "t1")).await.unwrap();
        let from = NewSandbox { from_snapshot: Some("snap1".into()), ..new_sandbox("r1", &a.id) };
        store.insert_sandbox(from).await.unwrap();
        let tree: Vec<String> = store.sandboxes_in_tree(&a.id, "t1").await.unwrap().into_iter().map(|s| s.id).collect();
        assert_eq!(tree, ["c1", "c2"], "{}: only this workspace's tree", db.name());
        store.set_sandbox_state("c2", SandboxState::Deleted, None).await.unwrap();
        assert_eq!(store.sandboxes_in_tree(&a.id, "t1").await.unwrap().len(), 1, "deleted members are not listed");
        let restored = store.sandbox(&a.id, "r1").await.unwrap().unwrap();
        assert_eq!((restored.from_snapshot.as_deref(), restored.fork_tree_id), (Some("snap1"), None));
        store.close().await;
    }
}

#[tokio::test]
async fn events_and_snapshots_round_trip() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        for (i, kind) in ["created", "exec", "hibernated", "woken"].iter().enumerate() {
            store.record_event(&a.id, "sb1", kind, serde_json::json!({ "n": i })).await.unwrap();
        }
        let events = store.events(&a.id, "sb1", 3).await.unwrap();
        assert_eq!(events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(), ["exec", "hibernated", "woken"]);
        assert_eq!(events[2].detail, serde_json::json!({ "n": 3 }));
        assert!(events.windows(2).all(|w| w[0].id < w[1].id));
        assert!(store.events(&b.id, "sb1", 10).await.unwrap().is_empty(), "{}", db.name());
        // A follower's next page: after the one it saw, in order, another workspace's never.
        let after = store.events_after(&a.id, "sb1", events[0].id, 10).await.unwrap();
        assert_eq!(after.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(), ["hibernated", "woken"]);
        assert_eq!(store.events_after(&a.id, "sb1", events[0].id, 1).await.unwrap().len(), 1);
        assert!(store.events_after(&a.id, "sb1", events[2].id, 10).await.unwrap().is_empty());
        assert!(store.events_after(&b.id, "sb1", 0, 10).await.unwrap().is_empty());

        for (id, at, name) in [("s1", 1000, Some("first")), ("s2", 2000, None), ("s3", 3000, None)] {
            let row = SnapshotRow {
                id: id.into(),
                workspace_id: a.id.clone(),
                sandbox_id: "sb1".into(),
                template: "base".into(),
                size_bytes: 1 << 33,
                created_at: at,
                name: name.map(str::to_string),
            };
            store.insert_snapshot(&row).await.unwrap();
        }
        let all = store.list_snapshots(&a.id, None, None).await.unwrap();
        assert_eq!(all.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["s3", "s2", "s1"], "newest first");
        assert_eq!(all[0].size_bytes, 1 << 33);
        assert_eq!(store.list_snapshots(&a.id, Some("sb1"), None).await.unwrap().len(), 3);
        assert!(store.list_snapshots(&a.id, Some("other"), None).await.unwrap().is_empty(), "{}", db.name());
        // A name: unique in its workspace, a way to find the snapshot, a filter.
        let named = store.list_snapshots(&a.id, None, Some("first")).await.unwrap();
        assert_eq!(named.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["s1"]);
        assert_eq!(store.snapshot(&a.id, "first").await.unwrap().map(|s| s.id), Some("s1".to_string()));
        assert_eq!(store.snapshot(&b.id, "first").await.unwrap(), None);
        let taken = SnapshotRow { id: "s4".into(), created_at: 4000, ..named[0].clone() };
        assert!(matches!(store.insert_snapshot(&taken).await, Err(StoreError::Conflict(_))), "{}", db.name());
        let elsewhere = SnapshotRow { workspace_id: b.id.clone(), ..taken };
        store.insert_snapshot(&elsewhere).await.unwrap();
        assert!(store.delete_snapshot(&b.id, "s4").await.unwrap());
        assert_eq!(store.snapshot(&b.id, "s1").await.unwrap(), None);
        assert!(!store.delete_snapshot(&b.id, "s1").await.unwrap());
        assert!(store.delete_snapshot(&a.id, "s1").await.unwrap());
        assert_eq!(store.snapshot(&a.id, "s1").await.unwrap(), None);
        store.close().await;
    }
}

#[tokio::test]
async fn port_labels_preview_auth_and_server_secrets() {
    for db in TestDb::all() {
        let store = db.open().await;
        let ws = store.create_workspace("default").await.unwrap();
        let row = store.insert_sandbox(NewSandbox { preview_auth: true, ..new_sandbox("p1", &ws.id) }).await.unwrap();
        assert!(row.preview_auth);
        assert!(store.sandbox(&ws.id, "p1").await.unwrap().unwrap().preview_auth, "{}", db.name());
        store.set_sandbox_preview_auth("p1", false).await.unwrap();
        assert!(!store.sandbox_by_id("p1").await.unwrap().unwrap().preview_auth);
        assert!(matches!(store.set_sandbox_preview_auth("nope", true).await, Err(StoreError::NotFound(_))));

        // Labels: set (again: changed), listed by port, copied, removed.
        store.set_port_label("p1", 8000, Some("web")).await.unwrap();
        store.set_port_label("p1", 3000, None).await.unwrap();
        let changed = store.set_port_label("p1", 8000, Some("site")).await.unwrap();
        assert_eq!(changed.label.as_deref(), Some("site"));
        let labels = store.port_labels("p1").await.unwrap();
        let listed: Vec<(u16, Option<&str>)> = labels.iter().map(|l| (l.port, l.label.as_deref())).collect();
        assert_eq!(listed, [(3000, None), (8000, Some("site"))], "{}", db.name());
        store.copy_port_labels("p1", "p2").await.unwrap();
        assert_eq!(store.port_labels("p2").await.unwrap().len(), 2);
        assert!(store.remove_port_label("p1", 3000).await.unwrap());
        assert!(!store.remove_port_label("p1", 3000).await.unwrap());
        assert_eq!(store.port_labels("p1").await.unwrap().len(), 1);

        // A secret is made once and kept.
        let secret = store.server_secret("preview").await.unwrap();
        assert_eq!(secret.len(), 64);
        assert_eq!(store.server_secret("preview").await.unwrap(), secret, "{}", db.name());
        assert_ne!(store.server_secret("other").await.unwrap(), secret);
        store.close().await;
    }
}

#[tokio::test]
async fn reopening_keeps_data_and_does_not_migrate_twice() {
    for db in TestDb::all() {
        let store = db.open().await;
        let ws = store.create_workspace("keep").await.unwrap();
        store.close().await;
        let again = db.open().await;
        assert_eq!(again.workspace_by_name("keep").await.unwrap(), Some(ws), "{}", db.name());
        again.close().await;
    }
}

#[tokio::test]
async fn unsupported_urls_are_refused() {
    assert!(matches!(Store::open("mysql://x").await, Err(StoreError::UnsupportedUrl(_))));
}

#[tokio::test]
async fn an_idempotency_key_is_held_once_answered_once_and_taken_over_when_its_holder_dies() {
    use clade_store::{Claim, StoredAnswer};
    for db in TestDb::all() {
        let store = db.open().await;
        let (a, b) = (store.create_workspace("a").await.unwrap(), store.create_workspace("b").await.unwrap());
        let stale = 60_000;
        let Claim::Held(hold) = store.claim_idempotency_key(&a.id, "k1", "f1", stale).await.unwrap() else { panic!("{}", db.name()) };
        // The same key is a workspace's own: b holds its own.
        assert!(matches!(store.claim_idempotency_key(&b.id, "k1", "f1", stale).await.unwrap(), Claim::Held(_)));
        assert_eq!(store.claim_idempotency_key(&a.id, "k1", "f2", stale).await.unwrap(), Claim::InProgress { fingerprint: "f1".into() });
        assert!(store.beat_idempotency_key(&hold).await.unwrap());
        let answer = StoredAnswer { status: 201, content_type: Some("application/json".into()), body: "{\"id\":\"x\"}".into() };
        assert!(store.complete_idempotency_key(&hold, &answer).await.unwrap());
        assert!(!store.beat_idempotency_key(&hold).await.unwrap(), "a completed key has no holder");
        assert_eq!(
            store.claim_idempotency_key(&a.id, "k1", "f1", stale).await.unwrap(),
            Claim::Answered { fingerprint: "f1".into(), answer: answer.clone() }
        );

        // Released: the next claim acts again.
        let Claim::Held(released) = store.claim_idempotency_key(&a.id, "k2", "f", stale).await.unwrap() else { panic!() };
        store.release_idempotency_key(&released).await.unwrap();
        let Claim::Held(second) = store.claim_idempotency_key(&a.id, "k2", "f", stale).await.unwrap() else { panic!() };

        // A holder that stopped beating loses the key to a retry of the same request, not to another one.
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        assert!(matches!(store.claim_idempotency_key(&a.id, "k2", "other", 10).await.unwrap(), Claim::InProgress { .. }));
        let Claim::Held(taken) = store.claim_idempotency_key(&a.id, "k2", "f", 10).await.unwrap() else { panic!("{}", db.name()) };
        assert!(!store.complete_idempotency_key(&second, &answer).await.unwrap(), "the old holder lost it");
        assert!(store.complete_idempotency_key(&taken, &answer).await.unwrap());

        // The sandbox a keyed create made is found by its key, in its workspace only.
        store.insert_sandbox(NewSandbox { idempotency_key: Some("k3".into()), ..new_sandbox("made", &a.id) }).await.unwrap();
        assert_eq!(store.sandbox_by_idempotency_key(&a.id, "k3").await.unwrap().map(|r| r.id), Some("made".into()));
        assert_eq!(store.sandbox_by_idempotency_key(&b.id, "k3").await.unwrap(), None);
        let twice = store.insert_sandbox(NewSandbox { idempotency_key: Some("k3".into()), ..new_sandbox("again", &a.id) }).await;
        assert!(twice.is_err(), "one sandbox per key");
        store.close().await;
    }
}

#[tokio::test]
async fn hosts_register_keep_a_lease_with_their_load_and_go_down_when_it_runs_out() {
    use clade_store::{HostLoad, HostRegistration, HostState};
    for db in TestDb::all() {
        let store = db.open().await;
        let register = |id: &str| HostRegistration {
            id: id.into(),
            name: format!("machine-{id}"),
            address: Some(format!("https://{id}.internal:7443")),
            capacity_vms: 64,
            capacity_memory_mb: 24 * 1024,
        };
        let a = store.register_host(&register("a"), 60_000).await.unwrap();
        assert_eq!((a.state, a.load, a.capacity_vms), (HostState::Up, HostLoad::default(), 64), "{}", db.name());
        store.register_host(&register("b"), 1).await.unwrap();

        let load = HostLoad { running_vms: 3, used_memory_mb: 1536 };
        assert!(store.renew_host_lease("a", load, &[], 60_000).await.unwrap());
        assert!(!store.renew_host_lease("nobody", load, &[], 60_000).await.unwrap());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        // b's lease ran out: whoever looks marks it down, once; its late renewal fails.
        assert_eq!(store.expire_host_leases().await.unwrap(), ["b"]);
        assert_eq!(store.expire_host_leases().await.unwrap(), Vec::<String>::new());
        assert!(!store.renew_host_lease("b", load, &[], 60_000).await.unwrap());
        let hosts = store.hosts().await.unwrap();
        let states: Vec<(&str, HostState, u32)> = hosts.iter().map(|h| (h.id.as_str(), h.state, h.load.running_vms)).collect();
        assert_eq!(states, [("a", HostState::Up, 3), ("b", HostState::Down, 0)], "{}", db.name());
        assert_eq!(hosts[1].state_reason.as_deref(), Some("its lease ran out"));

        // Registering again brings it back; draining is a state of its own.
        assert_eq!(store.register_host(&register("b"), 60_000).await.unwrap().state, HostState::Up);
        assert!(store.set_host_state("a", HostState::Draining, Some("clade host drain")).await.unwrap());
        assert!(store.renew_host_lease("a", load, &[], 60_000).await.unwrap(), "a draining host keeps its lease");
        assert_eq!(store.host("a").await.unwrap().unwrap().state, HostState::Draining);
        store.close().await;
    }
}

#[tokio::test]
async fn placement_takes_the_least_loaded_host_then_one_holding_the_template_and_a_hibernated_sandbox_changes_host_once() {
    use clade_store::{HostLoad, HostRegistration};
    for db in TestDb::all() {
        let store = db.open().await;
        for id in ["a", "b", "c"] {
            let host = HostRegistration {
                id: id.into(),
                name: id.into(),
                address: Some(format!("http://{id}:8081")),
                capacity_vms: 2,
                capacity_memory_mb: 1024,
            };
            store.register_host(&host, 60_000).await.unwrap();
        }
        let holds = |tokens: &[&str]| tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>();
        let one = HostLoad { running_vms: 1, used_memory_mb: 512 };
        store.renew_host_lease("a", one, &holds(&["base", "bake:aaaa"]), 60_000).await.unwrap();
        store.renew_host_lease("b", one, &holds(&["base", "bake:bbbb"]), 60_000).await.unwrap();
        assert_eq!(store.host("b").await.unwrap().unwrap().templates, ["base", "bake:bbbb"]);
        let place = |prefer: Option<&'static str>| {
            let store = store.clone();
            async move { store.place_sandbox(&[], prefer).await.unwrap().map(|h| h.id) }
        };
        // The least loaded first, whatever it holds (c: 0 of 2)…
        assert_eq!(place(Some("bake:bbbb")).await.as_deref(), Some("c"), "{}", db.name());
        // …then, among hosts as loaded (all 1 of 2), the holder; a prefix is not a token.
        assert_eq!(place(Some("bake:bbbb")).await.as_deref(), Some("b"), "{}", db.name());
        assert_eq!(place(Some("bake:bb")).await.as_deref(), Some("a"), "{}", db.name());
        assert_eq!(place(Some("bake:aaaa")).await.as_deref(), Some("c"), "a is full: {}", db.name());
        assert_eq!(place(None).await, None, "every host is full: {}", db.name());

        let ws = store.ensure_workspace("default").await.unwrap();
        store.insert_sandbox(NewSandbox { host_id: "a".into(), ..new_sandbox("s1", &ws.id) }).await.unwrap();
        assert!(!store.move_sandbox("s1", "a", "b").await.unwrap(), "only a hibernated sandbox moves");
        store.set_sandbox_state("s1", SandboxState::Hibernated, None).await.unwrap();
        assert!(!store.set_sandbox_replica("s1", "b", "c").await.unwrap(), "a copy of it as on the host it is not on");
        assert!(store.set_sandbox_replica("s1", "a", "c").await.unwrap());
        store.set_sandbox_state("s1", SandboxState::Hibernated, None).await.unwrap();
        assert_eq!(store.sandbox_by_id("s1").await.unwrap().unwrap().replica_host_id.as_deref(), Some("c"), "still as copied");
        assert!(!store.take_over_sandbox("s1", "a", "b").await.unwrap(), "b keeps no copy");
        assert!(store.take_over_sandbox("s1", "a", "c").await.unwrap());
        let row = store.sandbox_by_id("s1").await.unwrap().unwrap();
        assert_eq!((row.host_id.as_deref(), row.replica_host_id), (Some("c"), None));
        assert!(store.move_sandbox("s1", "c", "b").await.unwrap());
        assert!(!store.move_sandbox("s1", "c", "a").await.unwrap(), "it is b's now");
        // A copy is let go by any change but a hibernation.
        assert!(store.set_sandbox_replica("s1", "b", "a").await.unwrap());
        store.set_sandbox_state("s1", SandboxState::Running, None).await.unwrap();
        assert_eq!(store.sandbox_by_id("s1").await.unwrap().unwrap().replica_host_id, None);
        store.close().await;
    }
}

#[tokio::test]
async fn builds_and_templates_are_kept_per_workspace_and_unfinished_builds_fail() {
    use clade_store::{BuildRow, BuildStatus, TemplateRow};
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let build = |id: &str, at: i64| BuildRow {
            id: id.into(),
            workspace_id: a.id.clone(),
            name: "py".into(),
            mode: "dockerfile".into(),
            status: BuildStatus::Queued,
            error: None,
            host_id: "h1".into(),
            size_mb: 2048,
            cpu: 2,
            memory_mb: 1024,
            image_ref: None,
            replace: false,
            bytes: None,
            started_at: at,
            ended_at: None,
        };
        store.insert_build(&build("bld1", 1000)).await.unwrap();
        store.insert_build(&build("bld2", 2000)).await.unwrap();
        let listed = store.list_builds(&a.id).await.unwrap();
        assert_eq!(listed.iter().map(|b| b.id.as_str()).collect::<Vec<_>>(), ["bld2", "bld1"], "newest first");
        assert_eq!(listed[1], build("bld1", 1000), "{}", db.name());
        assert_eq!(store.build(&b.id, "bld1").await.unwrap(), None, "another workspace's is not found");
        assert!(store.list_builds(&b.id).await.unwrap().is_empty());

        store.set_build_status("bld1", BuildStatus::Running, None, None).await.unwrap();
        store.set_build_status("bld1", BuildStatus::Done, None, Some(5 << 30)).await.unwrap();
        let done = store.build(&a.id, "bld1").await.unwrap().unwrap();
        assert_eq!((done.status, done.bytes), (BuildStatus::Done, Some(5 << 30)));
        assert!(done.ended_at.is_some());
        // A restart ends what was under way on its host, and only that.
        assert_eq!(store.fail_unfinished_builds("h1", "the server restarted").await.unwrap(), ["bld2"]);
        let failed = store.build(&a.id, "bld2").await.unwrap().unwrap();
        assert_eq!((failed.status, failed.error.as_deref()), (BuildStatus::Failed, Some("the server restarted")));
        assert!(store.fail_unfinished_builds("h1", "again").await.unwrap().is_empty());

        let template = TemplateRow {
            workspace_id: a.id.clone(),
            name: "py".into(),
            build_id: "bld1".into(),
            host_id: "h1".into(),
            image_key: "custom-abc".into(),
            size_mb: 2048,
            cpu: 2,
            memory_mb: 1024,
            config: "{}".into(),
            created_at: 3000,
        };
        store.put_template(&template).await.unwrap();
        let replaced = TemplateRow { build_id: "bld3".into(), image_key: "custom-def".into(), ..template.clone() };
        store.put_template(&replaced).await.unwrap();
        assert_eq!(store.template(&a.id, "py").await.unwrap(), Some(replaced.clone()), "{}", db.name());
        assert_eq!(store.list_templates(&a.id).await.unwrap(), [replaced]);
        assert_eq!(store.template(&b.id, "py").await.unwrap(), None);
        assert_eq!(store.template_images_on("h1").await.unwrap(), ["custom-def"]);
        assert!(!store.delete_template(&b.id, "py").await.unwrap());
        assert!(store.delete_template(&a.id, "py").await.unwrap());
        assert!(store.list_templates(&a.id).await.unwrap().is_empty());
        store.close().await;
    }
}
