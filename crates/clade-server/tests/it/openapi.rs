//! `docs/openapi.json` is the document the server's types generate. When
//! the API changes, regenerate it with
//! `CLADE_UPDATE_OPENAPI=1 cargo test -p clade-server --test it openapi`
//! (or `clade openapi > docs/openapi.json`) and commit it with the change.

use std::path::PathBuf;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

#[test]
fn the_committed_document_is_the_generated_one() {
    let generated = clade_server::openapi::document();
    let path = committed_path();
    if std::env::var_os("CLADE_UPDATE_OPENAPI").is_some_and(|v| !v.is_empty() && v != "0") {
        std::fs::write(&path, &generated).expect("writing docs/openapi.json");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let line = committed.lines().zip(generated.lines()).position(|(a, b)| a != b).map_or_else(
            || format!("lengths differ: {} vs {} lines", committed.lines().count(), generated.lines().count()),
            |i| format!("first difference at line {}", i + 1),
        );
        panic!(
            "docs/openapi.json is stale ({line}): the server's API types changed.\n\
             Regenerate it with `CLADE_UPDATE_OPENAPI=1 cargo test -p clade-server --test it openapi` and commit it."
        );
    }
}

#[test]
fn the_document_covers_the_api() {
    let document: serde_json::Value = serde_json::from_str(&clade_server::openapi::document()).unwrap();
    assert_eq!(document["openapi"], "3.1.0");
    let paths = document["paths"].as_object().unwrap();
    // The router and the document come from one route list; a few of each kind.
    for path in [
        "/healthz",
        "/openapi.json",
        "/v1/sandboxes/{id}",
        "/v1/sandboxes/{id}/stop",
        "/v1/sandboxes/{id}/proxy/{port}/{path}",
        "/v1/sandboxes/{id}/repl/sessions/{sid}/run",
        "/v1/volumes/{name}",
        "/v1/databases/{id}/proxy",
        "/v1/functions/{id}/invoke",
        "/v1/schedules/{id}/trigger",
        "/v1/apps/{id}/deploys/{dep}/logs",
        "/v1/apps/{id}/rollback",
    ] {
        assert!(paths.contains_key(path), "{path} is not in the document");
    }
    // What answers 501 is not documented as an operation.
    assert!(!paths.contains_key("/v1/apps/{id}/domains") && !paths.contains_key("/v1/preview-repos"));
    assert_eq!(paths.len(), 81, "a path the test does not know: {:?}", paths.keys().collect::<Vec<_>>());
    let operations: Vec<&str> =
        paths.values().flat_map(|item| item.as_object().unwrap().values()).filter_map(|op| op["operationId"].as_str()).collect();
    let unique: std::collections::BTreeSet<&str> = operations.iter().copied().collect();
    assert_eq!(unique.len(), operations.len(), "operation ids repeat: {operations:?}");
    let scheme = &document["components"]["securitySchemes"]["api_key"];
    assert_eq!(scheme["scheme"], "bearer");
    assert_eq!(document["security"][0]["api_key"], serde_json::json!([]));
    assert!(document["components"]["schemas"]["ErrorBody"].is_object());
    // Each request body is its own schema (two structs of one name once
    // left createSandbox documented with the volume's body).
    let body_of = |path: &str| {
        let reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap();
        document["components"]["schemas"][reference.rsplit('/').next().unwrap()]["properties"].clone()
    };
    assert!(body_of("/v1/sandboxes")["template"].is_object(), "{}", body_of("/v1/sandboxes"));
    assert!(body_of("/v1/volumes")["size_mb"].is_object(), "{}", body_of("/v1/volumes"));
    assert!(document["components"]["schemas"]["CreateDatabaseBody"]["properties"]["always_on"].is_object());
    // The unauthenticated routes say so.
    for path in ["/healthz", "/version", "/metrics", "/openapi.json"] {
        assert_eq!(paths[path]["get"]["security"], serde_json::json!([{}]), "{path}");
    }
}
