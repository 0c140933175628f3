//! Managed databases' rows against both backends (issue 33).

use clade_store::{DatabaseRow, DatabaseStatus};
use clade_testkit::pg::TestDb;

fn database(id: &str, workspace_id: &str, created_at: i64) -> DatabaseRow {
    DatabaseRow {
        id: id.into(),
        workspace_id: workspace_id.into(),
        sandbox_id: None,
        label: Some("orders".into()),
        size: "1g".into(),
        cpu: 1,
        memory_mb: 512,
        always_on: false,
        status: DatabaseStatus::Provisioning,
        error: None,
        password: "pw1".into(),
        broker_token: "pds_pg_1".into(),
        cloned_from: None,
        backup_host_id: None,
        backup_copy_host_id: None,
        created_at,
        updated_at: created_at,
    }
}

#[tokio::test]
async fn a_database_is_its_workspaces_and_keeps_what_changes() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let first = database("db-1", &a.id, 1000);
        store.insert_database(&first).await.unwrap();
        store.insert_database(&database("db-2", &a.id, 2000)).await.unwrap();
        assert_eq!(store.database(&a.id, "db-1").await.unwrap(), Some(first.clone()), "{}", db.name());
        // Another workspace sees none of it, but the endpoint's lookup by id does.
        assert_eq!(store.database(&b.id, "db-1").await.unwrap(), None, "{}", db.name());
        assert!(store.databases(&b.id).await.unwrap().is_empty());
        assert_eq!(store.database_by_id("db-1").await.unwrap().map(|d| d.workspace_id), Some(a.id.clone()));
        assert_eq!(store.count_databases(&a.id).await.unwrap(), 2);

        let mut ready = DatabaseRow {
            sandbox_id: Some("sb1".into()),
            status: DatabaseStatus::Ready,
            password: "pw2".into(),
            broker_token: "pds_pg_2".into(),
            always_on: true,
            ..first.clone()
        };
        assert!(store.update_database(&ready).await.unwrap(), "{}", db.name());
        let read = store.database(&a.id, "db-1").await.unwrap().unwrap();
        assert!(read.updated_at >= ready.updated_at);
        ready.updated_at = read.updated_at;
        assert_eq!(read, ready, "{}", db.name());
        assert_eq!(store.databases_in(DatabaseStatus::Provisioning).await.unwrap().len(), 1);
        // The backup host is written by its own query, and an update of the rest keeps it.
        assert!(store.set_database_backup_host("db-1", "host-a").await.unwrap());
        assert!(store.update_database(&ready).await.unwrap());
        let read = store.database(&a.id, "db-1").await.unwrap().unwrap();
        assert_eq!(read.backup_host_id.as_deref(), Some("host-a"), "{}", db.name());
        assert!(store.set_database_backup_copy_host("db-1", "host-b").await.unwrap());
        let read = store.database(&a.id, "db-1").await.unwrap().unwrap();
        assert_eq!(read.backup_copy_host_id.as_deref(), Some("host-b"), "{}", db.name());
        ready = DatabaseRow {
            updated_at: read.updated_at,
            backup_host_id: read.backup_host_id.clone(),
            backup_copy_host_id: read.backup_copy_host_id.clone(),
            ..ready
        };
        assert!(!store.set_database_backup_host("db-none", "host-a").await.unwrap());
        // Workspace b can neither change nor delete a's.
        assert!(!store.update_database(&DatabaseRow { workspace_id: b.id.clone(), ..ready.clone() }).await.unwrap());
        assert!(!store.delete_database(&b.id, "db-1").await.unwrap(), "{}", db.name());
        let ids: Vec<String> = store.databases(&a.id).await.unwrap().into_iter().map(|d| d.id).collect();
        assert_eq!(ids, ["db-1", "db-2"], "oldest first");
        assert!(store.delete_database(&a.id, "db-1").await.unwrap());
        assert_eq!(store.database_by_id("db-1").await.unwrap(), None);
        store.close().await;
    }
}
