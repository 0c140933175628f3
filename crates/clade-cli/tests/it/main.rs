//! The `clade` binary as a user runs it, one test binary: `clade vm`,
//! `clade server` and `clade keys`, and the client commands against a real
//! server.

mod client;
mod server;
mod vm;
