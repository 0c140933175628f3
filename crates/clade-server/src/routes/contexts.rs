//! Code contexts (§3.4, issue 28): `…/repl/sessions` — persistent Python
//! (a Jupyter kernel), JavaScript, TypeScript and bash contexts in a
//! sandbox, run cell by cell, with rich results (MIME bundles: charts,
//! tables). The contexts are kept by the guest's context daemon
//! (`sandbox::contexts`); these routes check and shape what goes to it
//! and what comes back, as JSON or, with `Accept: text/event-stream`, as
//! events while the cell runs.

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::contexts::{read_json, DaemonReply};
use crate::sse;
use crate::AppState;

/// A cell's timeout when the request names none (§3.4).
const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// The languages, and the templates that have their runtime.
const LANGUAGES: [(&str, &str); 4] = [
    ("python", "code-interpreter"),
    ("javascript", "code-interpreter or agent"),
    ("typescript", "agent"),
    ("bash", "any template with python3 (base, code-interpreter, agent)"),
];

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct CreateContextBody {
    /// `python` (default; also `py`, `python3`), `javascript` (`js`,
    /// `node`), `typescript` (`ts`) or `bash` (`sh`, `shell`).
    language: Option<String>,
    /// The context's working directory (default: the image's, else the user's home).
    cwd: Option<String>,
}

/// A code context.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CodeContext {
    pub id: String,
    pub sandbox_id: String,
    pub language: String,
    /// RFC 3339.
    pub created_at: String,
    /// Cells run so far (listing only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cells: Option<u64>,
    /// False once its kernel died (listing only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alive: Option<bool>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct RunCodeBody {
    /// The cell. Required, not blank.
    #[schema(required = true, value_type = String, min_length = 1)]
    code: Option<String>,
    /// Interrupt the cell after this long (default 30000); the context keeps its state.
    #[schema(minimum = 1)]
    timeout_ms: Option<u64>,
}

/// A cell's outcome (§3.4).
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Execution {
    pub stdout: String,
    pub stderr: String,
    /// 0, or 1 when the cell raised or was interrupted (bash: its status).
    pub exit: i32,
    pub exit_code: i32,
    pub duration_ms: u64,
    /// The formatted traceback (or `Name: value`) when the cell raised.
    pub error: Option<String>,
    /// One MIME bundle per display, the last expression's value included
    /// (`text/plain`, `text/html`, `text/markdown`, `image/png` and
    /// `image/jpeg` as base64, `image/svg+xml`, `application/json` as a string).
    #[schema(value_type = Vec<Object>)]
    pub results: Vec<Value>,
    /// Output beyond the cell's limits (1 MiB of text, 8 MiB of results) was dropped.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    #[serde(skip)]
    timed_out: bool,
}

/// `py` → `python`, …; 400 naming those known.
fn normalise(language: Option<&str>) -> Result<&'static str, ApiError> {
    let given = language.unwrap_or("python").trim().to_ascii_lowercase();
    Ok(match given.as_str() {
        "python" | "py" | "python3" => "python",
        "javascript" | "js" | "node" | "nodejs" => "javascript",
        "typescript" | "ts" => "typescript",
        "bash" | "sh" | "shell" => "bash",
        _ => {
            return Err(ApiError::bad_request(format!(
                "unknown language {given:?}; supported: python (py, python3), javascript (js), typescript (ts), bash (sh)"
            )))
        }
    })
}

/// Context ids are the daemon's (`ctx_` and hex): anything else is no context.
fn checked_context_id(sid: &str) -> Result<&str, ApiError> {
    if !sid.is_empty() && sid.len() <= 64 && sid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        Ok(sid)
    } else {
        Err(ApiError::not_found("session not found"))
    }
}

/// A daemon's refusal as the API's error.
fn refusal(status: StatusCode, body: &Value) -> ApiError {
    let message = body["error"].as_str().unwrap_or("the code-context daemon refused").to_string();
    match status.as_u16() {
        404 => ApiError::not_found("session not found"),
        400 => ApiError::bad_request(message),
        409 => ApiError::conflict(message),
        _ => ApiError::BadGateway(format!("the code-context daemon answered {status}: {message}")),
    }
}

#[utoipa::path(post, operation_id = "createCodeContext", path = "/v1/sandboxes/{id}/repl/sessions", tag = "code contexts",
    params(("id" = String, Path, description = "A sandbox id")), request_body = CreateContextBody,
    responses((status = 201, description = "The context, ready for cells", body = CodeContext),
        (status = 400, description = "An unknown language, or one the sandbox's template has no runtime for (the error names a template that has it)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CreateContextBody>,
) -> Result<(StatusCode, Json<CodeContext>), ApiError> {
    let language = normalise(body.language.as_deref())?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let mut request = json!({ "language": language });
    if let Some(cwd) = body.cwd.filter(|c| !c.is_empty()) {
        if !cwd.starts_with('/') {
            return Err(ApiError::bad_request(format!("cwd must be absolute, got {cwd:?}")));
        }
        request["cwd"] = json!(cwd);
    }
    let reply = state.service.start_context(&running, request).await?;
    let (status, answer) = read_json(reply).await?;
    if status == StatusCode::BAD_REQUEST && answer.get("available").is_some() {
        let has = LANGUAGES.iter().find(|(l, _)| *l == language).map_or("", |(_, t)| *t);
        let template = state.store.sandbox(&caller.workspace.id, &id).await?.map(|s| s.template).unwrap_or_default();
        return Err(ApiError::bad_request(format!("template {template} has no {language} runtime for code contexts; {has} has it")));
    }
    if !status.is_success() {
        return Err(refusal(status, &answer));
    }
    let context = CodeContext {
        id: answer["id"].as_str().unwrap_or_default().to_string(),
        sandbox_id: id,
        language: language.to_string(),
        created_at: answer["created_at"].as_str().unwrap_or_default().to_string(),
        cells: None,
        alive: None,
    };
    Ok((StatusCode::CREATED, Json(context)))
}

#[utoipa::path(get, operation_id = "listCodeContexts", path = "/v1/sandboxes/{id}/repl/sessions", tag = "code contexts",
    params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "The sandbox's contexts", body = Vec<CodeContext>),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn list(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Vec<CodeContext>>, ApiError> {
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let Some(reply) = state.service.context_request(&running, Method::GET, "/contexts", None, false).await? else {
        return Ok(Json(Vec::new()));
    };
    let (status, answer) = read_json(reply).await?;
    if !status.is_success() {
        return Err(refusal(status, &answer));
    }
    let contexts = answer.as_array().cloned().unwrap_or_default();
    Ok(Json(
        contexts
            .into_iter()
            .map(|c| CodeContext {
                id: c["id"].as_str().unwrap_or_default().to_string(),
                sandbox_id: id.clone(),
                language: c["language"].as_str().unwrap_or_default().to_string(),
                created_at: c["created_at"].as_str().unwrap_or_default().to_string(),
                cells: c["cells"].as_u64(),
                alive: c["alive"].as_bool(),
            })
            .collect(),
    ))
}

#[utoipa::path(delete, operation_id = "deleteCodeContext", path = "/v1/sandboxes/{id}/repl/sessions/{sid}", tag = "code contexts",
    params(("id" = String, Path, description = "A sandbox id"), ("sid" = String, Path, description = "A context id")),
    responses((status = 204, description = "The context ended (its kernel stopped)"),
        (status = 404, description = "No such sandbox or context", body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, sid)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let sid = checked_context_id(&sid)?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let Some(reply) = state.service.context_request(&running, Method::DELETE, &format!("/contexts/{sid}"), None, false).await? else {
        return Err(ApiError::not_found("session not found"));
    };
    let (status, answer) = read_json(reply).await?;
    if !status.is_success() {
        return Err(refusal(status, &answer));
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "runCode", path = "/v1/sandboxes/{id}/repl/sessions/{sid}/run", tag = "code contexts",
    params(("id" = String, Path, description = "A sandbox id"), ("sid" = String, Path, description = "A context id")),
    request_body = RunCodeBody,
    responses((status = 200, description = "The cell's outcome; with `Accept: text/event-stream`, events as it runs: \
            `stdout`/`stderr` `{\"text\"}`, `result` (a MIME bundle), `error` `{\"name\",\"value\",\"traceback\"}`, then `execution` (the Execution)",
            content((Execution = "application/json"), (sse::SseEvent = "text/event-stream"))),
        (status = 400, description = "No code", body = ErrorBody),
        (status = 404, description = "No such sandbox or context", body = ErrorBody),
        (status = 409, description = "The context's kernel died; create a new context", body = ErrorBody),
        (status = 504, description = "The cell ran past its timeout and was interrupted; the context keeps its state", body = ErrorBody)))]
pub async fn run(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, sid)): Path<(String, String)>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<RunCodeBody>,
) -> Result<Response, ApiError> {
    let sid = checked_context_id(&sid)?.to_string();
    let code = body.code.filter(|c| !c.trim().is_empty()).ok_or_else(|| ApiError::bad_request("code required"))?;
    let max_ms = state.limits.exec_max_timeout_s * 1000;
    let timeout_ms = match body.timeout_ms {
        None | Some(0) => DEFAULT_TIMEOUT_MS,
        Some(ms) if ms > max_ms => return Err(ApiError::bad_request(format!("timeout_ms may be at most {max_ms}"))),
        Some(ms) => ms,
    };
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let path = format!("/contexts/{sid}/run");
    let request = json!({ "code": code, "timeout_ms": timeout_ms });
    let Some(reply) = state.service.context_request(&running, Method::POST, &path, Some(request), false).await? else {
        return Err(ApiError::not_found("session not found"));
    };
    if !reply.status().is_success() {
        let (status, answer) = read_json(reply).await?;
        return Err(refusal(status, &answer));
    }
    let streaming = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("text/event-stream"));
    if !streaming {
        let execution = collect(reply, |_| async { true }).await?;
        if execution.timed_out {
            return Err(ApiError::Timeout(format!(
                "exec timeout: context deadline exceeded (the cell ran past {timeout_ms} ms and was interrupted; the context keeps its state)"
            )));
        }
        return Ok(Json(execution).into_response());
    }
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    tokio::spawn(async move {
        // Held while the cell runs: the sandbox is in use.
        let _running = running;
        let sent = tx.clone();
        let collecting = collect(reply, move |(name, data)| {
            let sent = sent.clone();
            async move { sent.send(sse::event(&name, &data)).await.is_ok() }
        });
        // A quiet cell sends nothing that would find the client gone: its
        // going is watched for, and drops the daemon's stream (the cell stops).
        let outcome = tokio::select! {
            outcome = collecting => outcome,
            () = tx.closed() => return,
        };
        let last = match outcome {
            Ok(execution) => sse::event("execution", &execution),
            Err(e) => sse::event("error", &json!({ "error": e.to_string() })),
        };
        let _ = tx.send(last).await;
    });
    Ok(sse::response(rx, state.stopping.clone()))
}

/// Reads the daemon's events (one JSON object per line) into the
/// Execution, passing each on to `each` as an SSE event (name, data) as it
/// comes. When `each` says the client went, the daemon's stream is dropped:
/// closing it is how the daemon learns to stop the cell.
async fn collect<F, Fut>(reply: DaemonReply, each: F) -> Result<Execution, ApiError>
where
    F: Fn((String, Value)) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut body = reply.into_body();
    let mut execution = Execution::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut ended = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::BadGateway(format!("the code-context daemon's stream broke: {e}")))?;
        let Some(chunk) = frame.data_ref() else { continue };
        pending.extend_from_slice(chunk);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Ok(event) = serde_json::from_slice::<Value>(&line) else { continue };
            let forward = apply(&mut execution, &event, &mut ended);
            if let Some(forward) = forward {
                if !each(forward).await {
                    return Err(ApiError::BadGateway("the client went away; the cell was stopped".into()));
                }
            }
        }
    }
    if !ended {
        return Err(ApiError::BadGateway("the code-context daemon's stream ended before the cell did (did the guest stop?)".into()));
    }
    Ok(execution)
}

/// Folds one daemon event into the Execution; the event to pass on, if any.
fn apply(execution: &mut Execution, event: &Value, ended: &mut bool) -> Option<(String, Value)> {
    match event["type"].as_str()? {
        kind @ ("stdout" | "stderr") => {
            let text = event["text"].as_str().unwrap_or_default();
            if kind == "stdout" {
                execution.stdout.push_str(text);
            } else {
                execution.stderr.push_str(text);
            }
            Some((kind.to_string(), json!({ "text": text })))
        }
        "result" => {
            let bundle: serde_json::Map<String, Value> = event["data"]
                .as_object()
                .map(|data| {
                    data.iter().map(|(k, v)| (k.clone(), Value::String(v.as_str().map_or_else(|| v.to_string(), str::to_string)))).collect()
                })
                .unwrap_or_default();
            execution.results.push(Value::Object(bundle.clone()));
            Some(("result".to_string(), Value::Object(bundle)))
        }
        "error" => {
            let (name, value) = (event["name"].as_str().unwrap_or("Error"), event["value"].as_str().unwrap_or_default());
            let traceback = event["traceback"].as_str().filter(|t| !t.trim().is_empty());
            execution.error = Some(traceback.map_or_else(|| format!("{name}: {value}"), str::to_string));
            Some(("error".to_string(), json!({ "name": name, "value": value, "traceback": traceback.unwrap_or_default() })))
        }
        "end" => {
            *ended = true;
            let status = event["status"].as_i64().or_else(|| event["exit"].as_i64()).unwrap_or(0) as i32;
            execution.exit = status;
            execution.exit_code = status;
            execution.duration_ms = event["duration_ms"].as_u64().unwrap_or(0);
            execution.truncated = event["truncated"].as_bool().unwrap_or(false);
            execution.timed_out = event["timed_out"].as_bool().unwrap_or(false);
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages_and_their_aliases() {
        for (given, want) in [("py", "python"), ("Python3", "python"), ("js", "javascript"), ("ts", "typescript"), ("sh", "bash")] {
            assert_eq!(normalise(Some(given)).unwrap(), want);
        }
        assert_eq!(normalise(None).unwrap(), "python");
        assert!(normalise(Some("cobol")).unwrap_err().to_string().contains("supported: python"));
    }

    #[test]
    fn daemon_events_fold_into_an_execution() {
        let mut execution = Execution::default();
        let mut ended = false;
        let events = [
            json!({"type": "stdout", "text": "a\n"}),
            json!({"type": "result", "data": {"text/plain": "42", "application/json": {"x": 1}}, "is_main": true}),
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": ""}),
            json!({"type": "end", "exit": 1, "duration_ms": 12, "timed_out": false, "truncated": true}),
        ];
        for event in &events {
            apply(&mut execution, event, &mut ended);
        }
        assert!(ended);
        assert_eq!(execution.stdout, "a\n");
        assert_eq!(execution.results[0]["application/json"], r#"{"x":1}"#, "values are strings");
        assert_eq!(execution.error.as_deref(), Some("ZeroDivisionError: division by zero"));
        assert_eq!((execution.exit, execution.duration_ms, execution.truncated), (1, 12, true));
    }

    #[test]
    fn context_ids_are_plain() {
        assert!(checked_context_id("ctx_0123abcd").is_ok());
        for bad in ["", "../x", "a/b", "x?y"] {
            assert!(checked_context_id(bad).is_err(), "{bad}");
        }
    }
}
