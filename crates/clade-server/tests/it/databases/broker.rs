//! The HTTP query broker's engine against a real PostgreSQL: statements
//! with parameters, every type it shows, its errors and its limits.

use std::path::Path;
use std::time::Duration;

use clade_server::databases::broker::{self, BadRequest, BrokerError, BrokerLimits, Credentials, QueryRequest, QueryResult};
use serde_json::{json, Value};
use tokio::net::UnixStream;

use super::{cluster, socket, SUPERUSER};

fn superuser() -> Credentials {
    Credentials { user: SUPERUSER.into(), password: String::new(), database: "postgres".into() }
}

async fn run_with(
    socket: &Path,
    credentials: &Credentials,
    sql: &str,
    params: Vec<Value>,
    limits: &BrokerLimits,
) -> Result<QueryResult, BrokerError> {
    let stream = UnixStream::connect(socket).await.expect("connects to the cluster");
    broker::run(stream, credentials, &QueryRequest { sql: sql.into(), params }, limits).await
}

async fn run(socket: &Path, sql: &str, params: Vec<Value>) -> Result<QueryResult, BrokerError> {
    run_with(socket, &superuser(), sql, params, &BrokerLimits::default()).await
}

#[tokio::test]
async fn a_statement_runs_with_its_parameters_and_answers_every_type_as_json() {
    let Some(cluster) = cluster() else { return };
    let socket = socket(&cluster);

    let created = run(&socket, "CREATE TABLE notes (id int PRIMARY KEY, body text, doc jsonb)", vec![]).await.unwrap();
    assert_eq!((created.command.as_str(), created.row_count, created.columns.len(), created.rows.len()), ("CREATE TABLE", 0, 0, 0));

    let inserted =
        run(&socket, "INSERT INTO notes VALUES ($1, $2, $3)", vec![json!(1), json!("it's"), json!({"tags": ["a", 1]})]).await.unwrap();
    assert_eq!((inserted.command.as_str(), inserted.row_count), ("INSERT 0 1", 1));
    let returned =
        run(&socket, "INSERT INTO notes VALUES ($1, $2, $3) RETURNING id", vec![json!("2"), json!(null), json!(null)]).await.unwrap();
    assert_eq!(
        (returned.command.as_str(), returned.row_count, returned.rows),
        ("INSERT 0 1", 1, vec![vec![json!(2)]]),
        "\"2\" parsed as int"
    );

    let selected = run(
        &socket,
        r#"SELECT id, body, doc, true AS yes, 2::int2 AS small, 9007199254740993::int8 AS big, 0.1::float4 AS f4,
                  'NaN'::float8 AS nan, '-Infinity'::float8 AS minus_inf, 12.340::numeric AS exact, 'v'::varchar AS v,
                  'ab'::char(3) AS padded, 'nm'::name AS nm, '{"k": null}'::json AS j,
                  'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid AS u, '\xDEAD'::bytea AS bytes, '2024-02-29'::date AS d,
                  '2024-02-29 13:14:15.5'::timestamp AS ts, '2024-02-29 13:14:15+02'::timestamptz AS tz,
                  'infinity'::date AS forever, NULL::text AS nothing, 'x' AS literal
           FROM notes WHERE id = $1"#,
        vec![json!(1)],
    )
    .await
    .unwrap();
    assert_eq!((selected.command.as_str(), selected.row_count), ("SELECT 1", 1));
    let types: Vec<(&str, &str)> = selected.columns.iter().map(|c| (c.name.as_str(), c.type_name.as_str())).collect();
    assert_eq!(
        types,
        [
            ("id", "int4"),
            ("body", "text"),
            ("doc", "jsonb"),
            ("yes", "bool"),
            ("small", "int2"),
            ("big", "int8"),
            ("f4", "float4"),
            ("nan", "float8"),
            ("minus_inf", "float8"),
            ("exact", "numeric"),
            ("v", "varchar"),
            ("padded", "bpchar"),
            ("nm", "name"),
            ("j", "json"),
            ("u", "uuid"),
            ("bytes", "bytea"),
            ("d", "date"),
            ("ts", "timestamp"),
            ("tz", "timestamptz"),
            ("forever", "date"),
            ("nothing", "text"),
            ("literal", "text"),
        ]
    );
    assert_eq!(
        selected.rows,
        vec![vec![
            json!(1),
            json!("it's"),
            json!({"tags": ["a", 1]}),
            json!(true),
            json!(2),
            json!(9007199254740993i64),
            json!(0.1),
            json!("NaN"),
            json!("-Infinity"),
            json!("12.340"),
            json!("v"),
            json!("ab "),
            json!("nm"),
            json!({"k": null}),
            json!("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
            json!("\\xdead"),
            json!("2024-02-29"),
            json!("2024-02-29T13:14:15.500000"),
            json!("2024-02-29T11:14:15Z"),
            json!("infinity"),
            json!(null),
            json!("x"),
        ]]
    );

    let updated = run(&socket, "UPDATE notes SET body = $1 WHERE id >= $2", vec![json!("b"), json!(1)]).await.unwrap();
    assert_eq!((updated.command.as_str(), updated.row_count), ("UPDATE 2", 2));
    let none = run(&socket, "SELECT id FROM notes WHERE doc @> $1", vec![json!({"tags": ["z"]})]).await.unwrap();
    assert_eq!((none.command.as_str(), none.row_count, none.rows.len(), none.columns.len()), ("SELECT 0", 0, 0, 1));
    let slept = run(&socket, "SELECT pg_sleep(0)", vec![]).await.unwrap();
    assert_eq!((slept.columns[0].type_name.as_str(), slept.rows), ("void", vec![vec![json!(null)]]));
    let empty = run(&socket, "", vec![]).await.unwrap();
    assert_eq!((empty.command.as_str(), empty.row_count), ("", 0));
}

#[tokio::test]
async fn a_failing_statement_answers_its_sqlstate_and_a_bad_request_says_what_is_wrong() {
    let Some(cluster) = cluster() else { return };
    let socket = socket(&cluster);

    match run(&socket, "SELECT * FROM missing", vec![]).await {
        Err(BrokerError::Sql { sqlstate, message, position, .. }) => {
            assert_eq!((sqlstate.as_str(), position), ("42P01", Some(15)));
            assert!(message.contains("\"missing\" does not exist"), "{message}");
        }
        other => panic!("an SQL error, not {other:?}"),
    }
    match run(&socket, "SELECT 1; SELECT 2", vec![]).await {
        Err(BrokerError::Sql { sqlstate, .. }) => assert_eq!(sqlstate, "42601", "one statement at a time"),
        other => panic!("an SQL error, not {other:?}"),
    }
    match run(&socket, "SELECT 1/$1::int", vec![json!(0)]).await {
        Err(e @ BrokerError::Sql { .. }) => assert!(e.to_string().contains("(SQLSTATE 22012)"), "{e}"),
        other => panic!("an SQL error, not {other:?}"),
    }
    assert!(matches!(
        run(&socket, "SELECT $1::int + $2::int", vec![json!(1)]).await,
        Err(BrokerError::BadRequest(BadRequest::ParameterCount { expected: 2, given: 1 }))
    ));
    assert!(matches!(
        run(&socket, "SELECT $1::text", vec![json!("a\0b")]).await,
        Err(BrokerError::BadRequest(BadRequest::Parameter { number: 1, .. }))
    ));
    assert!(matches!(run(&socket, "SELECT 1\0", vec![]).await, Err(BrokerError::BadRequest(BadRequest::NulInSql))));
    match run(&socket, "SELECT interval '1 day' AS span", vec![]).await {
        Err(BrokerError::BadRequest(bad @ BadRequest::UnsupportedColumn { .. })) => {
            assert_eq!(bad, BadRequest::UnsupportedColumn { column: "span".into(), type_name: "interval".into() });
            assert!(bad.to_string().contains("::text"), "{bad}");
        }
        other => panic!("an unsupported column, not {other:?}"),
    }
    let cast = run(&socket, "SELECT interval '1 day'::text AS span", vec![]).await.unwrap();
    assert_eq!(cast.rows, vec![vec![json!("1 day")]]);
}

#[tokio::test]
async fn a_role_with_a_password_logs_in_by_scram_and_a_wrong_password_is_refused() {
    let Some(cluster) = cluster() else { return };
    let socket = socket(&cluster);
    run(&socket, "CREATE ROLE app LOGIN PASSWORD 'right horse battery'", vec![]).await.unwrap();
    run(&socket, "CREATE TABLE owned (n int)", vec![]).await.unwrap();
    run(&socket, "GRANT ALL ON owned TO app", vec![]).await.unwrap();
    // The cluster trusts everyone: make its role `app` give a password.
    let hba = socket.parent().unwrap().join("data/pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(&hba, format!("local all app scram-sha-256\n{rules}")).unwrap();
    run(&socket, "SELECT pg_reload_conf()", vec![]).await.unwrap();

    let app = |password: &str| Credentials { user: "app".into(), password: password.into(), database: "postgres".into() };
    let limits = BrokerLimits::default();
    // The postmaster rereads the rules when it gets to its signal.
    let mut refused = None;
    for _ in 0..100 {
        match run_with(&socket, &app("wrong"), "SELECT 1", vec![], &limits).await {
            Err(BrokerError::Login { sqlstate, message }) => {
                refused = Some((sqlstate, message));
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("a login error, not {e:?}"),
        }
    }
    let (sqlstate, message) = refused.expect("the wrong password is refused once the rules are reloaded");
    assert_eq!(sqlstate, "28P01");
    assert!(message.contains("password authentication failed"), "{message}");

    let inserted =
        run_with(&socket, &app("right horse battery"), "INSERT INTO owned VALUES ($1) RETURNING current_user", vec![json!(7)], &limits)
            .await
            .unwrap();
    assert_eq!(inserted.rows, vec![vec![json!("app")]]);
    assert_eq!(inserted.command, "INSERT 0 1");
}

#[tokio::test]
async fn a_result_past_the_limits_is_refused_and_what_the_statement_did_is_not_kept() {
    let Some(cluster) = cluster() else { return };
    let socket = socket(&cluster);
    run(&socket, "CREATE TABLE numbers (n int)", vec![]).await.unwrap();
    let limits = BrokerLimits { max_rows: 5, ..BrokerLimits::default() };

    let within = run_with(&socket, &superuser(), "SELECT generate_series(1, 5)", vec![], &limits).await.unwrap();
    assert_eq!(within.row_count, 5);
    let past = run_with(&socket, &superuser(), "INSERT INTO numbers SELECT generate_series(1, 10) RETURNING n", vec![], &limits).await;
    assert!(matches!(past, Err(BrokerError::BadRequest(BadRequest::TooManyRows { max: 5 }))), "{past:?}");
    let bytes = BrokerLimits { max_bytes: 1000, ..BrokerLimits::default() };
    let past = run_with(&socket, &superuser(), "SELECT repeat('x', 600) FROM generate_series(1, 2)", vec![], &bytes).await;
    assert!(matches!(past, Err(BrokerError::BadRequest(BadRequest::TooManyBytes { max: 1000 }))), "{past:?}");
    let past = run_with(&socket, &superuser(), "SELECT repeat('x', 2000)", vec![], &bytes).await;
    assert!(matches!(past, Err(BrokerError::BadRequest(BadRequest::TooManyBytes { max: 1000 }))), "one row too large: {past:?}");

    let count = run(&socket, "SELECT count(*) FROM numbers", vec![]).await.unwrap();
    assert_eq!(count.rows, vec![vec![json!(0)]], "the refused INSERT was rolled back");

    let quick = BrokerLimits { timeout: Duration::from_millis(300), ..BrokerLimits::default() };
    let slow = run_with(&socket, &superuser(), "SELECT pg_sleep(5)", vec![], &quick).await;
    assert!(matches!(slow, Err(BrokerError::Timeout(_))), "{slow:?}");
}
