//! Volumes and their attachments against both backends (issue 29).

use clade_store::{AttachmentMode, AttachmentRow, StoreError, VolumeRow};
use clade_testkit::pg::TestDb;

fn volume(id: &str, workspace_id: &str, name: &str, size_mb: u32, created_at: i64) -> VolumeRow {
    VolumeRow { id: id.into(), workspace_id: workspace_id.into(), name: name.into(), size_mb, host_id: "h1".into(), created_at }
}

fn attachment(volume_id: &str, sandbox_id: &str, mode: AttachmentMode, slot: u32, mount_path: Option<&str>) -> AttachmentRow {
    AttachmentRow { volume_id: volume_id.into(), sandbox_id: sandbox_id.into(), mode, slot, mount_path: mount_path.map(str::to_string) }
}

#[tokio::test]
async fn a_volume_name_is_taken_once_per_workspace_and_usage_sums_its_volumes() {
    for db in TestDb::all() {
        let store = db.open().await;
        let a = store.create_workspace("a").await.unwrap();
        let b = store.create_workspace("b").await.unwrap();
        assert_eq!(store.volume_usage(&a.id).await.unwrap(), (0, 0), "{}: no volumes yet", db.name());

        let data = volume("aa01", &a.id, "data", 1024, 2000);
        assert!(store.create_volume(&data).await.unwrap(), "{}", db.name());
        assert!(!store.create_volume(&volume("aa02", &a.id, "data", 10, 3000)).await.unwrap(), "{}: the name is taken", db.name());
        assert_eq!(store.volume(&a.id, "data").await.unwrap(), Some(data.clone()), "the first one is kept");
        assert_eq!(store.volume_by_id("aa02").await.unwrap(), None, "the refused one left no row");
        // Another workspace may use the name; it does not see a's.
        assert_eq!(store.volume(&b.id, "data").await.unwrap(), None);
        let theirs = volume("bb01", &b.id, "data", 512, 2000);
        assert!(store.create_volume(&theirs).await.unwrap(), "{}", db.name());
        assert_eq!(store.volume_by_id("bb01").await.unwrap(), Some(theirs));

        // Listed oldest first, then by name; sizes beyond i32 survive.
        store.create_volume(&volume("aa03", &a.id, "cache", 4_000_000_000, 1000)).await.unwrap();
        store.create_volume(&volume("aa04", &a.id, "blobs", 256, 2000)).await.unwrap();
        let names: Vec<String> = store.volumes(&a.id).await.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["cache", "blobs", "data"], "{}", db.name());
        assert_eq!(store.volume(&a.id, "cache").await.unwrap().unwrap().size_mb, 4_000_000_000);
        assert_eq!(store.volume_usage(&a.id).await.unwrap(), (3, 4_000_000_000 + 256 + 1024), "{}", db.name());
        assert_eq!(store.volume_usage(&b.id).await.unwrap(), (1, 512));

        // Resized and deleted by workspace and name only.
        assert!(!store.set_volume_size(&b.id, "cache", 1).await.unwrap());
        assert!(store.set_volume_size(&a.id, "data", 2048).await.unwrap());
        assert_eq!(store.volume(&a.id, "data").await.unwrap().unwrap().size_mb, 2048);
        assert!(!store.delete_volume(&b.id, "cache").await.unwrap(), "{}: not b's", db.name());
        assert!(store.delete_volume(&a.id, "cache").await.unwrap());
        assert!(!store.delete_volume(&a.id, "cache").await.unwrap(), "deleting twice finds nothing");
        assert_eq!(store.volume(&a.id, "cache").await.unwrap(), None);
        assert_eq!(store.volume_usage(&a.id).await.unwrap(), (2, 256 + 2048));
        // The name is free again, for a volume with a new id.
        assert!(store.create_volume(&volume("aa05", &a.id, "cache", 64, 5000)).await.unwrap(), "{}", db.name());
        store.close().await;
    }
}

#[tokio::test]
async fn of_concurrent_creates_of_one_name_exactly_one_wins() {
    for db in TestDb::all() {
        let store = db.open().await;
        let ws = store.create_workspace("a").await.unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let (store, row) = (store.clone(), volume(&format!("race{i}"), &ws.id, "shared", 100, 1000));
                tokio::spawn(async move { store.create_volume(&row).await })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            won += usize::from(task.await.unwrap().unwrap_or_else(|e| panic!("{}: {e:?}", db.name())));
        }
        assert_eq!(won, 1, "{}", db.name());
        assert_eq!(store.volume_usage(&ws.id).await.unwrap(), (1, 100));
        store.close().await;
    }
}

#[tokio::test]
async fn attachments_are_recorded_all_or_none_listed_by_slot_or_sandbox_and_removed_with_their_sandbox() {
    use AttachmentMode::{Fork, ReadOnly, ReadWrite};
    for db in TestDb::all() {
        let store = db.open().await;
        let ws = store.create_workspace("a").await.unwrap();
        for (id, name) in [("v1", "data"), ("v2", "models")] {
            store.create_volume(&volume(id, &ws.id, name, 100, 1000)).await.unwrap();
        }
        store.add_attachments(&[]).await.unwrap();
        // Given out of slot order: listed in it.
        store
            .add_attachments(&[
                attachment("v2", "sb-parent", ReadOnly, 1, None),
                attachment("v1", "sb-parent", ReadWrite, 0, Some("/data")),
            ])
            .await
            .unwrap();
        // A fork's child holds its own layer over the parent's volume.
        store.add_attachments(&[attachment("v1", "sb-child", Fork, 0, Some("/data"))]).await.unwrap();

        assert_eq!(
            store.attachments_of_sandbox("sb-parent").await.unwrap(),
            [attachment("v1", "sb-parent", ReadWrite, 0, Some("/data")), attachment("v2", "sb-parent", ReadOnly, 1, None)],
            "{}",
            db.name()
        );
        let holders: Vec<(String, AttachmentMode)> =
            store.attachments_of_volume("v1").await.unwrap().into_iter().map(|a| (a.sandbox_id, a.mode)).collect();
        assert_eq!(holders, [("sb-child".to_string(), Fork), ("sb-parent".to_string(), ReadWrite)], "{}", db.name());

        // A batch with a volume the sandbox already holds records nothing.
        let clash = store
            .add_attachments(&[attachment("v2", "sb-child", ReadOnly, 1, None), attachment("v1", "sb-child", ReadOnly, 2, None)])
            .await;
        assert!(matches!(clash, Err(StoreError::Conflict(_))), "{}: {clash:?}", db.name());
        assert_eq!(store.attachments_of_sandbox("sb-child").await.unwrap().len(), 1, "{}: the batch was rolled back", db.name());

        assert_eq!(store.remove_attachments("sb-parent").await.unwrap(), 2, "{}", db.name());
        assert_eq!(store.remove_attachments("sb-parent").await.unwrap(), 0);
        assert!(store.attachments_of_sandbox("sb-parent").await.unwrap().is_empty());
        assert!(store.attachments_of_volume("v2").await.unwrap().is_empty());
        assert_eq!(store.attachments_of_volume("v1").await.unwrap().len(), 1, "the child's stays");
        store.close().await;
    }
}

#[test]
fn attachment_modes_are_stored_as_short_words_and_unknown_ones_are_corrupt() {
    for mode in [AttachmentMode::ReadWrite, AttachmentMode::ReadOnly, AttachmentMode::Fork] {
        assert_eq!(AttachmentMode::parse(mode.as_str()).unwrap(), mode);
    }
    assert_eq!(
        [AttachmentMode::ReadWrite.as_str(), AttachmentMode::ReadOnly.as_str(), AttachmentMode::Fork.as_str()],
        ["rw", "ro", "fork"]
    );
    assert!(matches!(AttachmentMode::parse("RW"), Err(StoreError::Corrupt { .. })));
}
