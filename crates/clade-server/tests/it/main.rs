//! The server's integration tests, one binary: a real server over HTTP,
//! real VMs, real SQLite and PostgreSQL (skipped without root, QEMU or the
//! images; failed instead under `CI`).

mod basics;
mod builds;
mod capacity;
mod cluster;
mod databases;
mod hostile;
mod hosts;
mod idempotency;
mod network;
mod openapi;
mod ports;
mod postgres;
mod sandboxes;
mod snapshots_fork;
mod standby;
mod stream;
mod support;
mod terminal;
mod tls;
mod transfers;
