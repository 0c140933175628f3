//! The host library's integration tests, one binary: real VMs booted
//! through the library (skipped without root, QEMU or the images; failed
//! instead under `CI`). One VM is shared by the tests that only run things
//! in it (`support::shared`).

mod exec;
mod files;
mod lifecycle;
mod network;
mod ports;
mod snapshot;
mod support;
mod volumes;
