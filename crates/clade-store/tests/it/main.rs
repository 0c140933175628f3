//! The store's integration tests, one binary: SQLite and a real
//! PostgreSQL cluster (`clade_testkit::pg`).

mod apps;
mod databases;
mod functions;
mod store;
mod volumes;
