//! In a cluster, a copy of each database's backups on a second host
//! (ADR 31 §13): the backups themselves are files of the host of the
//! database's sandbox, lost with it; the copy is what a failover rebuilds
//! the database from on the copy's host while that host is down.
//!
//! After each base backup and each ship of WAL, the host that took them
//! makes the copy the same as its own files: it lists the copy's files
//! (`GET /internal/v1/db-backups/{id}`), sends each it lacks (`PUT
//! …/files?name=`, streamed; a base's archive before the `.start` that
//! says it is whole) and removes those it pruned. Files never change once
//! written, so a name and length say what a copy has.

use axum::body::Body;
use axum::http::Method;
use clade_store::{DatabaseRow, HostRow, HostState};

use super::backup::BackupFile;
use super::DatabaseService;
use crate::error::{chain, ApiError};
use crate::peer::{Peer, PeerError};
use crate::sandbox::reachable;

impl DatabaseService {
    /// Brings the copy of `row`'s backups up to date (choosing its host
    /// first when it has none, or that one is down); nothing on a single
    /// host or when no other host is up. Failures are logged: the next
    /// round tries again.
    pub(super) async fn copy_backups(&self, row: &DatabaseRow) {
        let Some(secret) = self.sandboxes.cluster().cloned() else { return };
        let copied = async {
            let Some(holder) = self.copy_holder(row).await? else { return Ok(0) };
            let peer = Peer::new(holder, secret);
            sync(self, &peer, &row.id).await.map_err(|e| ApiError::Unavailable { message: e.to_string(), retry_after: None })
        };
        match copied.await {
            Ok(0) => {}
            Ok(sent) => tracing::debug!(database = %row.id, sent, "backups copied"),
            Err(e) => tracing::warn!(database = %row.id, "copying its backups to another host: {}", chain(&e)),
        }
    }

    /// The host that keeps the copy: the recorded one while it is up and
    /// not this one, else the least loaded other live host (recorded).
    async fn copy_holder(&self, row: &DatabaseRow) -> Result<Option<HostRow>, ApiError> {
        let here = self.sandboxes.host_id();
        let hosts = self.store().hosts().await?;
        let usable = |host: &&HostRow| host.id != here && host.state == HostState::Up && reachable(host);
        if let Some(current) = hosts.iter().filter(usable).find(|h| Some(h.id.as_str()) == row.backup_copy_host_id.as_deref()) {
            return Ok(Some(current.clone()));
        }
        let Some(chosen) = hosts.iter().filter(usable).min_by_key(|h| h.load.running_vms).cloned() else { return Ok(None) };
        self.store().set_database_backup_copy_host(&row.id, &chosen.id).await?;
        tracing::info!(database = %row.id, host = %chosen.id, "its backups are copied to this host from now on");
        Ok(Some(chosen))
    }

    /// Removes the copy of a deleted database's backups (best effort: a
    /// copy left behind holds nobody's data any one can reach).
    pub(super) async fn drop_copy(&self, row: &DatabaseRow) {
        let (Some(secret), Some(holder)) = (self.sandboxes.cluster(), row.backup_copy_host_id.as_deref()) else { return };
        if holder == self.sandboxes.host_id() {
            return;
        }
        let host = match self.store().host(holder).await {
            Ok(Some(host)) if reachable(&host) => host,
            _ => return,
        };
        if let Err(e) = Peer::new(host, secret.clone()).call(Method::DELETE, &format!("/db-backups/{}", row.id), None).await {
            tracing::warn!(database = %row.id, "removing the copy of its backups: {e}");
        }
    }
}

/// Makes `peer`'s copy of database `id`'s backups the same as this
/// host's: how many files were sent.
async fn sync(service: &DatabaseService, peer: &Peer, id: &str) -> Result<usize, PeerError> {
    let theirs: Vec<BackupFile> = peer.call_json(Method::GET, &format!("/db-backups/{id}"), None).await?;
    let ours = service.backups.files(id);
    let mut sent = 0;
    for file in ours.iter().filter(|file| !theirs.contains(file)) {
        let Some(path) = service.backups.file_path(id, &file.name) else { continue };
        let opened = match tokio::fs::File::open(&path).await {
            Ok(opened) => opened,
            // Pruned since it was listed.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(PeerError::Exchange { host: peer.id().to_string(), detail: format!("{}: {e}", path.display()) }),
        };
        let body = Body::from_stream(tokio_util::io::ReaderStream::new(opened));
        peer.send(Method::PUT, &format!("/db-backups/{id}/files?name={}", file.name), "application/octet-stream", body).await?;
        sent += 1;
    }
    for file in theirs.iter().filter(|file| !ours.iter().any(|o| o.name == file.name)) {
        peer.call(Method::DELETE, &format!("/db-backups/{id}/files?name={}", file.name), None).await?;
    }
    Ok(sent)
}
