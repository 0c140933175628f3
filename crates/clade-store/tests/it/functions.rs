//! Functions, their runs and their schedules' rows against both backends (issue 34).

use clade_store::{FunctionRow, FunctionRunRow, FunctionStatus, ScheduleRow, StoreError, RUNS_KEPT};
use clade_testkit::pg::TestDb;

fn function(id: &str, workspace_id: &str, name: &str) -> FunctionRow {
    FunctionRow {
        id: id.into(),
        workspace_id: workspace_id.into(),
        name: name.into(),
        runtime: "python".into(),
        entrypoint: "handler.py".into(),
        template: "code-interpreter".into(),
        env: r#"{"A":"1"}"#.into(),
        public: false,
        timeout_seconds: 300,
        // Every byte value, as a bundle has them.
        code: Some((0..=255u8).collect()),
        code_size: 256,
        version: 1,
        status: FunctionStatus::Deploying,
        error: None,
        deploy_log: None,
        snapshot_id: None,
        host_id: None,
        created_at: 1000,
        updated_at: 1000,
    }
}

fn run(id: &str, workspace_id: &str, function_id: &str, schedule_id: Option<&str>, started_at: i64) -> FunctionRunRow {
    FunctionRunRow {
        id: id.into(),
        workspace_id: workspace_id.into(),
        function_id: function_id.into(),
        schedule_id: schedule_id.map(str::to_string),
        sandbox_id: Some("sb".into()),
        invoked_by: "invoke".into(),
        status: "success".into(),
        exit_code: Some(0),
        stdout: Some("out\n".into()),
        stderr: None,
        output: Some(r#"{"ok":true}"#.into()),
        duration_ms: Some(12),
        cold_start: true,
        started_at,
        ended_at: Some(started_at + 12),
    }
}

fn schedule(id: &str, workspace_id: &str, function_id: &str, next_run_at: Option<i64>) -> ScheduleRow {
    ScheduleRow {
        id: id.into(),
        workspace_id: workspace_id.into(),
        name: format!("name-{id}"),
        function_id: function_id.into(),
        cron: "* * * * *".into(),
        timezone: "UTC".into(),
        paused: false,
        input: None,
        last_run_at: None,
        next_run_at,
        created_at: 1000,
        updated_at: 1000,
    }
}

#[tokio::test]
async fn a_function_is_its_workspaces_and_a_deploy_counts_only_for_its_version() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        let first = function("fn-1", &a.id, "greeter");
        store.insert_function(&first).await.unwrap();
        assert_eq!(store.function(&a.id, "fn-1").await.unwrap(), Some(first.clone()), "{}", db.name());
        assert_eq!(store.function(&a.id, "greeter").await.unwrap(), Some(first.clone()), "by name, {}", db.name());
        assert_eq!(store.function(&b.id, "fn-1").await.unwrap(), None, "{}", db.name());
        assert!(matches!(store.insert_function(&function("fn-2", &a.id, "greeter")).await, Err(StoreError::Conflict(_))));
        store.insert_function(&function("fn-2", &b.id, "greeter")).await.unwrap();
        assert_eq!(store.count_functions(&a.id).await.unwrap(), 1);

        // A deploy of version 1 lands; one of a version since replaced does not.
        assert!(store.set_function_deployment("fn-1", 1, FunctionStatus::Ready, None, Some("log"), Some(("snap-1", "h1"))).await.unwrap());
        let mut newer = store.function(&a.id, "fn-1").await.unwrap().unwrap();
        assert_eq!(
            (newer.status, newer.snapshot_id.as_deref(), newer.host_id.as_deref()),
            (FunctionStatus::Ready, Some("snap-1"), Some("h1"))
        );
        newer.version = 2;
        newer.status = FunctionStatus::Deploying;
        assert!(store.update_function(&newer).await.unwrap());
        assert!(!store.set_function_deployment("fn-1", 1, FunctionStatus::Ready, None, None, Some(("snap-late", "h2"))).await.unwrap());
        // A failed deploy keeps the snapshot of the version before it.
        assert!(store.set_function_deployment("fn-1", 2, FunctionStatus::Failed, Some("pip"), Some("log2"), None).await.unwrap());
        let failed = store.function(&a.id, "fn-1").await.unwrap().unwrap();
        assert_eq!(
            (failed.status, failed.error.as_deref(), failed.snapshot_id.as_deref()),
            (FunctionStatus::Failed, Some("pip"), Some("snap-1"))
        );
        assert_eq!(store.functions_in(FunctionStatus::Failed).await.unwrap().len(), 1);

        // Deleting it takes its runs and schedules; the other workspace's stays.
        store.put_function_run(&run("r1", &a.id, "fn-1", None, 5)).await.unwrap();
        store.insert_schedule(&schedule("s1", &a.id, "fn-1", Some(60_000))).await.unwrap();
        assert!(!store.delete_function(&b.id, "fn-1").await.unwrap());
        assert!(store.delete_function(&a.id, "fn-1").await.unwrap());
        assert!(store.function_runs(&a.id, Some("fn-1"), None, 10).await.unwrap().is_empty());
        assert_eq!(store.schedule(&a.id, "s1").await.unwrap(), None);
        assert!(store.function_by_id("fn-2").await.unwrap().is_some());
    }
}

#[tokio::test]
async fn runs_are_listed_newest_first_updated_in_place_and_the_oldest_dropped() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let total = RUNS_KEPT + 3;
        for i in 0..total {
            store.put_function_run(&run(&format!("r{i:05}"), &a.id, "fn-1", (i % 2 == 0).then_some("s1"), 1000 + i)).await.unwrap();
        }
        let runs = store.function_runs(&a.id, Some("fn-1"), None, RUNS_KEPT + 10).await.unwrap();
        assert_eq!(runs.len() as i64, RUNS_KEPT, "{}", db.name());
        assert_eq!(runs[0].id, format!("r{:05}", total - 1));
        assert_eq!(runs.last().unwrap().id, "r00003", "the three oldest are gone, {}", db.name());
        assert_eq!(runs[0], run(&runs[0].id, &a.id, "fn-1", runs[0].schedule_id.as_deref(), 1000 + total - 1));
        let by_schedule = store.function_runs(&a.id, None, Some("s1"), 5).await.unwrap();
        assert!(by_schedule.len() == 5 && by_schedule.iter().all(|r| r.schedule_id.as_deref() == Some("s1")));
        // The end of a run replaces its start.
        let mut running = run("r-live", &a.id, "fn-1", None, 1000 + total);
        running.status = "running".into();
        running.ended_at = None;
        store.put_function_run(&running).await.unwrap();
        assert!(store.function_runs_since(&a.id, "fn-1", 1000 + total).await.unwrap().is_empty(), "unfinished runs are no metric");
        running.status = "error".into();
        running.ended_at = Some(1000 + total + 5);
        store.put_function_run(&running).await.unwrap();
        let since = store.function_runs_since(&a.id, "fn-1", 1000 + total).await.unwrap();
        assert_eq!(since, [running.clone()], "{}", db.name());
        let other = store.create_workspace("b").await.unwrap();
        assert!(store.function_runs(&other.id, Some("fn-1"), None, 10).await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn a_due_run_is_claimed_once_and_a_skip_leaves_the_last_run() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        store.insert_schedule(&schedule("s1", &a.id, "fn-1", Some(60_000))).await.unwrap();
        store.insert_schedule(&schedule("s2", &a.id, "fn-1", Some(120_000))).await.unwrap();
        let mut paused = schedule("s3", &a.id, "fn-1", None);
        paused.paused = true;
        store.insert_schedule(&paused).await.unwrap();
        assert!(matches!(store.insert_schedule(&schedule("s1b", &a.id, "fn-1", None)).await, Ok(())));
        let mut taken = schedule("s4", &a.id, "fn-1", None);
        taken.name = "name-s1".into();
        assert!(matches!(store.insert_schedule(&taken).await, Err(StoreError::Conflict(_))), "{}", db.name());

        let due: Vec<String> = store.due_schedules(100_000).await.unwrap().into_iter().map(|s| s.id).collect();
        assert_eq!(due, ["s1"], "{}", db.name());
        // Two claimants of the same due run, as two hosts would be: one wins.
        let (first, second) = tokio::join!(
            store.claim_schedule_run("s1", 60_000, Some(120_000), true),
            store.claim_schedule_run("s1", 60_000, Some(120_000), true)
        );
        assert_eq!([first.unwrap(), second.unwrap()].iter().filter(|won| **won).count(), 1, "{}", db.name());
        let s1 = store.schedule(&a.id, "s1").await.unwrap().unwrap();
        assert_eq!((s1.last_run_at, s1.next_run_at), (Some(60_000), Some(120_000)));
        // A skipped run moves the claim on and leaves the last run as it was.
        assert!(store.claim_schedule_run("s2", 120_000, Some(300_000), false).await.unwrap());
        let s2 = store.schedule(&a.id, "s2").await.unwrap().unwrap();
        assert_eq!((s2.last_run_at, s2.next_run_at), (None, Some(300_000)));
        // A paused schedule is never claimed.
        assert!(!store.claim_schedule_run("s3", 0, Some(1), true).await.unwrap());
        store.note_schedule_ran("s2", 200_000).await.unwrap();
        assert_eq!(store.schedule(&a.id, "name-s2").await.unwrap().unwrap().last_run_at, Some(200_000));
        assert_eq!(store.count_schedules(&a.id).await.unwrap(), 4);
        let other = store.create_workspace("b").await.unwrap();
        assert_eq!(store.schedule(&other.id, "s1").await.unwrap(), None);
        assert!(!store.delete_schedule(&other.id, "s1").await.unwrap());
        assert!(store.delete_schedule(&a.id, "s1").await.unwrap());
    }
}
