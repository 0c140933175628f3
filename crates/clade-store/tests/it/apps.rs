//! Apps, their deployments and their environment against both backends (issue 34).

use clade_store::{AppEnvRow, AppRow, DeploymentRow, DeploymentStatus, StoreError};
use clade_testkit::pg::TestDb;

fn app(id: &str, workspace_id: &str, name: &str) -> AppRow {
    AppRow {
        id: id.into(),
        workspace_id: workspace_id.into(),
        name: name.into(),
        git_url: "https://example.test/site.git".into(),
        git_branch: "main".into(),
        framework: Some("python".into()),
        install_command: None,
        build_command: Some("make".into()),
        start_command: None,
        root_directory: Some("web".into()),
        port: 8080,
        template: None,
        cpu: Some(2),
        memory_mb: None,
        auto_hibernate: true,
        idle_timeout_seconds: 600,
        keep_deployments: 1,
        active_deployment_id: None,
        created_at: 1000,
        updated_at: 1000,
    }
}

fn deployment(id: &str, app: &AppRow, created_at: i64) -> DeploymentRow {
    DeploymentRow {
        id: id.into(),
        app_id: app.id.clone(),
        workspace_id: app.workspace_id.clone(),
        status: DeploymentStatus::Queued,
        git_ref: "main".into(),
        git_commit: None,
        framework: None,
        sandbox_id: None,
        logs: String::new(),
        error: None,
        created_at,
        updated_at: created_at,
        finished_at: None,
    }
}

/// A deployment that got as far as a sandbox, gone live.
async fn live(store: &clade_store::Store, app: &AppRow, id: &str, created_at: i64) -> clade_store::Switched {
    let mut row = deployment(id, app, created_at);
    store.insert_deployment(&row).await.unwrap();
    row.status = DeploymentStatus::Deploying;
    row.sandbox_id = Some(format!("sb-{id}"));
    row.logs = "cloned\nbuilt\n".into();
    assert!(store.update_deployment(&row).await.unwrap());
    store.go_live(id, "cloned\nbuilt\nlive\n").await.unwrap().expect("it goes live")
}

#[tokio::test]
async fn an_app_is_its_workspaces_but_its_name_is_the_servers() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let shop = app("app-1", &a.id, "shop");
        store.insert_app(&shop).await.unwrap();
        assert_eq!(store.app(&a.id, "app-1").await.unwrap(), Some(shop.clone()), "{}", db.name());
        assert_eq!(store.app(&a.id, "shop").await.unwrap(), Some(shop.clone()), "by name, {}", db.name());
        assert_eq!(store.app(&b.id, "app-1").await.unwrap(), None, "{}", db.name());
        assert_eq!(store.app_by_name("shop").await.unwrap(), Some(shop.clone()));
        // The name is a host name: no other workspace may take it.
        assert!(matches!(store.insert_app(&app("app-2", &b.id, "shop")).await, Err(StoreError::Conflict(_))), "{}", db.name());
        store.insert_app(&app("app-2", &b.id, "blog")).await.unwrap();
        let mut renamed = shop.clone();
        renamed.name = "blog".into();
        assert!(matches!(store.update_app(&renamed).await, Err(StoreError::Conflict(_))));
        renamed.name = "store".into();
        renamed.port = 3000;
        renamed.cpu = None;
        assert!(store.update_app(&renamed).await.unwrap());
        let got = store.app(&a.id, "store").await.unwrap().unwrap();
        assert_eq!((got.port, got.cpu, got.root_directory.as_deref()), (3000, None, Some("web")));
        assert_eq!(store.count_apps(&a.id).await.unwrap(), 1);

        let env = |name: &str, value: &str, secret: bool| AppEnvRow {
            app_id: "app-1".into(),
            name: name.into(),
            value: value.into(),
            secret,
            scope: "all".into(),
            updated_at: 5,
        };
        store.put_app_env(&[env("B", "2", false), env("A", "1", true)]).await.unwrap();
        store.put_app_env(&[env("B", "3", false)]).await.unwrap();
        assert_eq!(store.app_env("app-1").await.unwrap(), [env("A", "1", true), env("B", "3", false)], "{}", db.name());
        assert!(store.delete_app_env("app-1", "A").await.unwrap());
        assert!(!store.delete_app_env("app-1", "A").await.unwrap());

        assert!(!store.delete_app(&b.id, "app-1").await.unwrap(), "another workspace's");
        assert!(store.delete_app(&a.id, "app-1").await.unwrap());
        assert!(store.app_env("app-1").await.unwrap().is_empty());
        assert_eq!(store.app_by_name("store").await.unwrap(), None);
    }
}

#[tokio::test]
async fn going_live_supersedes_the_live_one_and_a_rollback_switches_back() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let shop = app("app-1", &a.id, "shop");
        store.insert_app(&shop).await.unwrap();
        assert_eq!(store.roll_back(&a.id, "app-1").await.unwrap(), None, "nothing live yet, {}", db.name());

        let first = live(&store, &shop, "d1", 10).await;
        assert_eq!((first.live.status, first.replaced.as_deref()), (DeploymentStatus::Live, None));
        assert_eq!(store.deployment_by_id("d1").await.unwrap().unwrap().logs, "cloned\nbuilt\nlive\n");
        let second = live(&store, &shop, "d2", 20).await;
        assert_eq!(second.replaced.as_deref(), Some("d1"));
        let status = |id: &'static str| {
            let store = store.clone();
            async move { store.deployment_by_id(id).await.unwrap().unwrap().status }
        };
        assert_eq!((status("d1").await, status("d2").await), (DeploymentStatus::Superseded, DeploymentStatus::Live));
        assert_eq!(store.app(&a.id, "app-1").await.unwrap().unwrap().active_deployment_id.as_deref(), Some("d2"));
        // A deployment that ends after a newer one went live does not take its place.
        let mut late = deployment("d0", &shop, 5);
        store.insert_deployment(&late).await.unwrap();
        assert_eq!(store.go_live("d0", "late\n").await.unwrap(), None, "{}", db.name());
        assert_eq!(status("d0").await, DeploymentStatus::Superseded);
        late.status = DeploymentStatus::Building;
        assert!(!store.update_deployment(&late).await.unwrap(), "an ended deployment is not moved on");
        assert_eq!(store.deployments("app-1").await.unwrap().iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["d2", "d1", "d0"]);
        assert_eq!(store.kept_deployments().await.unwrap().iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["d1"]);

        let back = store.roll_back(&a.id, "app-1").await.unwrap().expect("d1 is kept");
        assert_eq!((back.live.id.as_str(), back.replaced.as_deref()), ("d1", Some("d2")));
        assert_eq!((status("d1").await, status("d2").await), (DeploymentStatus::Live, DeploymentStatus::RolledBack));
        assert_eq!(store.app(&a.id, "app-1").await.unwrap().unwrap().active_deployment_id.as_deref(), Some("d1"));
        // Nothing superseded keeps a sandbox now: no further back.
        assert_eq!(store.roll_back(&a.id, "app-1").await.unwrap(), None, "{}", db.name());
        store.clear_deployment_sandbox("d2").await.unwrap();
        assert!(store.kept_deployments().await.unwrap().is_empty());

        // A deleted app's deployments wait for the sweep to remove their sandboxes.
        let mut working = deployment("d3", &shop, 30);
        store.insert_deployment(&working).await.unwrap();
        assert_eq!(store.deployments_in_progress().await.unwrap().iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["d3"]);
        assert!(store.delete_app(&a.id, "app-1").await.unwrap());
        working.status = DeploymentStatus::Deploying;
        assert!(store.update_deployment(&working).await.unwrap());
        assert_eq!(store.go_live("d3", "").await.unwrap(), None, "its app is gone, {}", db.name());
        let mut orphans: Vec<String> = store.orphan_deployments().await.unwrap().into_iter().map(|d| d.id).collect();
        orphans.sort();
        assert_eq!(orphans, ["d0", "d1", "d2", "d3"]);
        for id in orphans {
            store.forget_deployment(&id).await.unwrap();
        }
        assert!(store.orphan_deployments().await.unwrap().is_empty());
    }
}
