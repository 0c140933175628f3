//! The HTTP query broker's engine (`POST /v1/databases/{id}/proxy`): logs in
//! to a database's PostgreSQL over a byte stream, runs one SQL statement
//! with JSON parameters and answers its rows as JSON.
//!
//! It speaks the extended query protocol itself, on postgres-protocol (the
//! message codec and SCRAM of rust-postgres): tokio-postgres's client does
//! not tell the command tag this answers with (`INSERT 0 1`), and asks for
//! every result column in binary, numeric included.
//!
//! - Parameters go in text format, each with the type PostgreSQL inferred
//!   for it: `null` is NULL, a string goes as it is, a number or a boolean as
//!   its JSON text, an array or an object as its JSON text (so `$1::jsonb`
//!   takes `{"a": 1}` and `$1::int` takes `5` or `"5"`).
//! - The statement is described before it runs, so that a wrong number of
//!   parameters or a column type this cannot show is refused before it does
//!   anything.
//! - Results come in binary and are decoded by column type, except numeric,
//!   asked for in text and answered as a JSON string (its exact decimal
//!   form, which a JSON number would round). See [`Decoder`] for each type.
//! - The statement runs in its own implicit transaction, committed only
//!   once all its rows are read: a result past the limits is refused and
//!   nothing the statement did is kept.
//!
//! This module owns the wire protocol of one request; it must not know how
//! the stream is opened or which database it reaches.

use std::io;
use std::time::Duration;

use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{DataRowBody, ErrorResponseBody, Message};
use postgres_protocol::message::frontend;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use utoipa::ToSchema;

/// Who the broker logs in as.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub user: String,
    pub password: String,
    pub database: String,
}

/// One SQL statement and its parameters (`$1`, `$2`, …).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct QueryRequest {
    pub sql: String,
    /// In order: `params[0]` is `$1`. `null` is NULL; strings, numbers and
    /// booleans go as their text, arrays and objects as JSON text, and
    /// PostgreSQL reads each as the type it inferred for its placeholder.
    #[serde(default)]
    pub params: Vec<serde_json::Value>,
}

/// What a statement answered.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct QueryResult {
    /// Empty for a statement that returns no rows (DDL, INSERT without
    /// RETURNING).
    pub columns: Vec<Column>,
    /// One array per row, in the order of `columns`. Numbers and booleans
    /// are JSON's; numeric, bytea (`\x…` hex), uuid and the date and time
    /// types (ISO 8601; timestamptz in UTC with `Z`) are strings; json and
    /// jsonb are JSON.
    pub rows: Vec<Vec<serde_json::Value>>,
    /// Rows returned or affected, as the command tag counts them.
    pub row_count: u64,
    /// PostgreSQL's command tag: `SELECT 2`, `INSERT 0 1`, `CREATE TABLE`.
    pub command: String,
}

/// A result column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Column {
    pub name: String,
    /// PostgreSQL's name of its type: `int4`, `text`, `timestamptz`, …
    pub type_name: String,
}

/// Bounds of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrokerLimits {
    /// For everything, login included; the server is also told (as its
    /// `statement_timeout`), so that a statement given up on stops there too.
    pub timeout: Duration,
    /// Rows a result may have.
    pub max_rows: usize,
    /// Bytes of row data a result may have, as PostgreSQL sends them.
    pub max_bytes: usize,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(30), max_rows: 10_000, max_bytes: 8 << 20 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The stream failed: the database is unreachable or went away.
    #[error("talking to the database")]
    Connect(#[source] io::Error),
    /// What came over the stream was not what PostgreSQL sends.
    #[error("the database server broke the protocol: {0}")]
    Protocol(String),
    /// The server refused the login (a wrong password: `28P01`).
    #[error("the database refused the login: {message} (SQLSTATE {sqlstate})")]
    Login { sqlstate: String, message: String },
    /// The server asked for an authentication the broker does not speak.
    #[error("the database asks for {0} authentication, which the broker does not speak")]
    Authentication(&'static str),
    /// The statement failed, as PostgreSQL said.
    #[error("{}", sql_error_text(message, sqlstate, detail.as_deref(), hint.as_deref()))]
    Sql {
        sqlstate: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
        /// Where in the SQL (1-based, in characters), when PostgreSQL says.
        position: Option<u32>,
    },
    /// The request cannot be run or answered as it is.
    #[error(transparent)]
    BadRequest(BadRequest),
    /// The whole request took longer than [`BrokerLimits::timeout`].
    #[error("the query did not finish within {0:?}")]
    Timeout(Duration),
}

/// What is wrong with a request (the caller's to fix).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    #[error("the SQL contains a NUL character, which PostgreSQL cannot take")]
    NulInSql,
    #[error("the statement takes {expected} parameters and {given} were given")]
    ParameterCount { expected: usize, given: usize },
    /// `number` is the placeholder's: 1 for `$1`.
    #[error("parameter ${number} cannot be sent: {reason}")]
    Parameter { number: usize, reason: &'static str },
    #[error("column {column:?} is of type {type_name}, which cannot be shown as JSON: cast it to text in the SQL (`expression::text`)")]
    UnsupportedColumn { column: String, type_name: String },
    #[error("the result has more than {max} rows: add a LIMIT (nothing the statement did was kept)")]
    TooManyRows { max: usize },
    #[error("the result has more than {max} bytes: select fewer rows or columns (nothing the statement did was kept)")]
    TooManyBytes { max: usize },
    #[error("COPY cannot run through the broker: connect with a PostgreSQL client for it")]
    Copy,
}

impl From<BadRequest> for BrokerError {
    fn from(bad: BadRequest) -> Self {
        Self::BadRequest(bad)
    }
}

fn sql_error_text(message: &str, sqlstate: &str, detail: Option<&str>, hint: Option<&str>) -> String {
    let mut text = format!("{message} (SQLSTATE {sqlstate})");
    for (label, value) in [("detail", detail), ("hint", hint)] {
        if let Some(value) = value {
            text.push_str(&format!("; {label}: {value}"));
        }
    }
    text
}

/// Runs `request` over `stream`, a connection to a PostgreSQL server that
/// speaks plain PostgreSQL (no TLS; its password check SCRAM-SHA-256, MD5
/// or cleartext), logging in with `credentials`. The stream is closed after.
pub async fn run<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    credentials: &Credentials,
    request: &QueryRequest,
    limits: &BrokerLimits,
) -> Result<QueryResult, BrokerError> {
    let exchange = async {
        let mut wire = Wire::new(stream, limits);
        wire.log_in(credentials).await?;
        let result = wire.query(request).await?;
        wire.terminate().await;
        Ok(result)
    };
    tokio::time::timeout(limits.timeout, exchange).await.map_err(|_| BrokerError::Timeout(limits.timeout))?
}

/// A connection: the stream, what was read of it and not parsed yet, and
/// what is to be sent.
struct Wire<'a, S> {
    stream: S,
    read: BytesMut,
    write: BytesMut,
    limits: &'a BrokerLimits,
}

/// The largest message other than a row accepted from the server (an error
/// with a long detail, a row description of many columns).
const MAX_MESSAGE: usize = 1 << 20;

/// Format codes of the protocol.
const TEXT: i16 = 0;
const BINARY: i16 = 1;

impl<'a, S: AsyncRead + AsyncWrite + Unpin> Wire<'a, S> {
    fn new(stream: S, limits: &'a BrokerLimits) -> Self {
        Self { stream, read: BytesMut::with_capacity(8 << 10), write: BytesMut::with_capacity(1 << 10), limits }
    }

    async fn send(&mut self) -> Result<(), BrokerError> {
        self.stream.write_all(&self.write).await.map_err(BrokerError::Connect)?;
        self.stream.flush().await.map_err(BrokerError::Connect)?;
        self.write.clear();
        Ok(())
    }

    /// The next message that matters (notices and parameter changes are
    /// skipped).
    async fn receive(&mut self) -> Result<Message, BrokerError> {
        loop {
            self.check_next_length()?;
            match Message::parse(&mut self.read).map_err(|e| BrokerError::Protocol(e.to_string()))? {
                Some(Message::NoticeResponse(_) | Message::ParameterStatus(_) | Message::NotificationResponse(_)) => continue,
                Some(message) => return Ok(message),
                None => {}
            }
            let read = self.stream.read_buf(&mut self.read).await.map_err(BrokerError::Connect)?;
            if read == 0 {
                return Err(BrokerError::Connect(io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// Refuses a message too large before buffering it whole: a row larger
    /// than the result may be, anything else larger than [`MAX_MESSAGE`].
    fn check_next_length(&self) -> Result<(), BrokerError> {
        let Some(&[tag, l0, l1, l2, l3]) = self.read.get(..5) else {
            return Ok(());
        };
        let length = usize::try_from(u32::from_be_bytes([l0, l1, l2, l3])).unwrap_or(usize::MAX);
        match tag {
            b'D' if length > self.limits.max_bytes => Err(BadRequest::TooManyBytes { max: self.limits.max_bytes }.into()),
            b'D' => Ok(()),
            _ if length > MAX_MESSAGE => Err(BrokerError::Protocol(format!("a message of {length} bytes"))),
            _ => Ok(()),
        }
    }

    async fn log_in(&mut self, credentials: &Credentials) -> Result<(), BrokerError> {
        let statement_timeout = self.limits.timeout.as_millis().to_string();
        let parameters = [
            ("user", credentials.user.as_str()),
            ("database", credentials.database.as_str()),
            ("application_name", "clade-broker"),
            ("client_encoding", "UTF8"),
            ("statement_timeout", statement_timeout.as_str()),
        ];
        frontend::startup_message(parameters, &mut self.write).map_err(encoding)?;
        self.send().await?;
        let mut scram = None;
        loop {
            match self.receive().await? {
                Message::AuthenticationOk | Message::BackendKeyData(_) => {}
                Message::AuthenticationCleartextPassword => {
                    frontend::password_message(credentials.password.as_bytes(), &mut self.write).map_err(encoding)?;
                    self.send().await?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let hash = postgres_protocol::authentication::md5_hash(
                        credentials.user.as_bytes(),
                        credentials.password.as_bytes(),
                        body.salt(),
                    );
                    frontend::password_message(hash.as_bytes(), &mut self.write).map_err(encoding)?;
                    self.send().await?;
                }
                Message::AuthenticationSasl(body) => {
                    let mechanisms: Vec<String> =
                        body.mechanisms().map(|m| Ok(m.to_string())).collect().map_err(|e| BrokerError::Protocol(e.to_string()))?;
                    if !mechanisms.iter().any(|m| m == "SCRAM-SHA-256") {
                        return Err(BrokerError::Authentication("SASL (other than SCRAM-SHA-256)"));
                    }
                    // Channel binding needs TLS, which this stream is not.
                    let started = ScramSha256::new(credentials.password.as_bytes(), ChannelBinding::unsupported());
                    frontend::sasl_initial_response("SCRAM-SHA-256", started.message(), &mut self.write).map_err(encoding)?;
                    self.send().await?;
                    scram = Some(started);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let scram = scram.as_mut().ok_or_else(|| unexpected("a SASL continuation"))?;
                    scram.update(body.data()).map_err(|e| BrokerError::Protocol(format!("SCRAM: {e}")))?;
                    frontend::sasl_response(scram.message(), &mut self.write).map_err(encoding)?;
                    self.send().await?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let scram = scram.as_mut().ok_or_else(|| unexpected("a SASL final message"))?;
                    // Checks the server's signature: that it knew the password.
                    scram.finish(body.data()).map_err(|e| BrokerError::Protocol(format!("SCRAM: {e}")))?;
                }
                Message::AuthenticationGss | Message::AuthenticationGssContinue(_) => return Err(BrokerError::Authentication("GSSAPI")),
                Message::AuthenticationSspi => return Err(BrokerError::Authentication("SSPI")),
                Message::AuthenticationKerberosV5 => return Err(BrokerError::Authentication("Kerberos V5")),
                Message::AuthenticationScmCredential => return Err(BrokerError::Authentication("SCM credential")),
                Message::ErrorResponse(body) => {
                    let error = ServerError::of(&body)?;
                    return Err(BrokerError::Login { sqlstate: error.sqlstate, message: error.message });
                }
                Message::ReadyForQuery(_) => return Ok(()),
                _ => return Err(unexpected("a message other than authentication")),
            }
        }
    }

    async fn query(&mut self, request: &QueryRequest) -> Result<QueryResult, BrokerError> {
        let described = self.describe(&request.sql).await?;
        if described.parameters != request.params.len() {
            return Err(BadRequest::ParameterCount { expected: described.parameters, given: request.params.len() }.into());
        }
        let params = request.params.iter().enumerate().map(|(i, value)| parameter_text(i + 1, value)).collect::<Result<Vec<_>, _>>()?;
        let mut decoders = Vec::with_capacity(described.columns.len());
        for column in &described.columns {
            match Decoder::of(column.type_oid) {
                Some(decoder) => decoders.push(decoder),
                None => {
                    let type_name = self.type_name(column.type_oid).await;
                    return Err(BadRequest::UnsupportedColumn { column: column.name.clone(), type_name }.into());
                }
            }
        }

        let result_formats = decoders.iter().map(|decoder| decoder.format());
        frontend::bind("", "", [TEXT], params.iter().map(Option::as_deref), write_parameter, result_formats, &mut self.write).map_err(
            |e| match e {
                frontend::BindError::Conversion(e) => BrokerError::Protocol(format!("encoding a parameter: {e}")),
                frontend::BindError::Serialization(e) => encoding(e),
            },
        )?;
        frontend::execute("", 0, &mut self.write).map_err(encoding)?;
        // A flush and not yet a sync: the statement's transaction commits at
        // the sync, sent once every row is read; a result refused before
        // then closes the connection and rolls it back.
        frontend::flush(&mut self.write);
        self.send().await?;

        let mut rows = Vec::new();
        let mut bytes = 0usize;
        let command = loop {
            match self.receive().await? {
                Message::BindComplete => {}
                Message::DataRow(row) => {
                    if rows.len() == self.limits.max_rows {
                        return Err(BadRequest::TooManyRows { max: self.limits.max_rows }.into());
                    }
                    bytes = bytes.saturating_add(row.buffer().len());
                    if bytes > self.limits.max_bytes {
                        return Err(BadRequest::TooManyBytes { max: self.limits.max_bytes }.into());
                    }
                    rows.push(decode_row(&row, &described.columns, &decoders)?);
                }
                Message::CommandComplete(body) => break body.tag().map_err(|e| BrokerError::Protocol(e.to_string()))?.to_string(),
                Message::EmptyQueryResponse => break String::new(),
                Message::ErrorResponse(body) => return Err(ServerError::of(&body)?.into()),
                Message::CopyInResponse(_) | Message::CopyOutResponse(_) => return Err(BadRequest::Copy.into()),
                _ => return Err(unexpected("a message other than rows")),
            }
        };
        frontend::sync(&mut self.write);
        self.send().await?;
        // A deferred constraint fails at the commit, here.
        self.until_ready().await?;

        let row_count = command.rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or(rows.len() as u64);
        let columns = described
            .columns
            .into_iter()
            .zip(&decoders)
            .map(|(column, decoder)| Column { name: column.name, type_name: decoder.type_name().to_string() })
            .collect();
        Ok(QueryResult { columns, rows, row_count, command })
    }

    /// Parses the statement and asks what it takes and returns, without
    /// running it.
    async fn describe(&mut self, sql: &str) -> Result<Described, BrokerError> {
        if sql.contains('\0') {
            return Err(BadRequest::NulInSql.into());
        }
        // No parameter types: the server infers each from its use.
        frontend::parse("", sql, std::iter::empty(), &mut self.write).map_err(encoding)?;
        frontend::describe(b'S', "", &mut self.write).map_err(encoding)?;
        frontend::sync(&mut self.write);
        self.send().await?;
        let mut parameters = None;
        let mut columns = None;
        loop {
            match self.receive().await? {
                Message::ParseComplete => {}
                Message::ParameterDescription(body) => {
                    parameters = Some(body.parameters().count().map_err(|e| BrokerError::Protocol(e.to_string()))?);
                }
                Message::RowDescription(body) => {
                    let described = body
                        .fields()
                        .map(|field| Ok(DescribedColumn { name: field.name().to_string(), type_oid: field.type_oid() }))
                        .collect()
                        .map_err(|e| BrokerError::Protocol(e.to_string()))?;
                    columns = Some(described);
                }
                Message::NoData => columns = Some(Vec::new()),
                Message::ErrorResponse(body) => return Err(ServerError::of(&body)?.into()),
                Message::ReadyForQuery(_) => break,
                _ => return Err(unexpected("a message other than a description")),
            }
        }
        match (parameters, columns) {
            (Some(parameters), Some(columns)) => Ok(Described { parameters, columns }),
            _ => Err(unexpected("a description without its parameters or columns")),
        }
    }

    /// The name of type `oid` for an error message, from the server (a
    /// simple query: the oid is a number, nothing to quote).
    async fn type_name(&mut self, oid: u32) -> String {
        let asked = async {
            frontend::query(&format!("SELECT format_type({oid}, NULL)"), &mut self.write).map_err(encoding)?;
            self.send().await?;
            let mut name = None;
            loop {
                match self.receive().await? {
                    Message::DataRow(row) => {
                        if let Some(Some(range)) = row.ranges().next().map_err(|e| BrokerError::Protocol(e.to_string()))? {
                            name = Some(String::from_utf8_lossy(&row.buffer()[range]).into_owned());
                        }
                    }
                    Message::ReadyForQuery(_) => return Ok::<_, BrokerError>(name),
                    _ => {}
                }
            }
        };
        match asked.await {
            Ok(Some(name)) => name,
            _ => format!("oid {oid}"),
        }
    }

    /// Reads up to the server's ReadyForQuery, failing on its error.
    async fn until_ready(&mut self) -> Result<(), BrokerError> {
        let mut failed = None;
        loop {
            match self.receive().await? {
                Message::ReadyForQuery(_) => return failed.map_or(Ok(()), Err),
                Message::ErrorResponse(body) => failed = Some(ServerError::of(&body)?.into()),
                _ => {}
            }
        }
    }

    /// Says goodbye; the server would notice the closed stream anyway.
    async fn terminate(&mut self) {
        frontend::terminate(&mut self.write);
        let _ = self.send().await;
        let _ = self.stream.shutdown().await;
    }
}

struct Described {
    parameters: usize,
    columns: Vec<DescribedColumn>,
}

struct DescribedColumn {
    name: String,
    type_oid: u32,
}

/// An ErrorResponse's fields.
struct ServerError {
    sqlstate: String,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
    position: Option<u32>,
}

impl ServerError {
    fn of(body: &ErrorResponseBody) -> Result<Self, BrokerError> {
        let mut error = Self { sqlstate: String::new(), message: String::new(), detail: None, hint: None, position: None };
        let mut fields = body.fields();
        while let Some(field) = fields.next().map_err(|e| BrokerError::Protocol(e.to_string()))? {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'C' => error.sqlstate = value,
                b'M' => error.message = value,
                b'D' => error.detail = Some(value),
                b'H' => error.hint = Some(value),
                b'P' => error.position = value.parse().ok(),
                _ => {}
            }
        }
        Ok(error)
    }
}

impl From<ServerError> for BrokerError {
    fn from(error: ServerError) -> Self {
        let ServerError { sqlstate, message, detail, hint, position } = error;
        Self::Sql { sqlstate, message, detail, hint, position }
    }
}

fn encoding(e: io::Error) -> BrokerError {
    BrokerError::Protocol(format!("encoding a message: {e}"))
}

fn unexpected(what: &str) -> BrokerError {
    BrokerError::Protocol(format!("{what} where it was not expected"))
}

/// A JSON parameter as the text PostgreSQL parses (`None`: NULL).
fn parameter_text(number: usize, value: &serde_json::Value) -> Result<Option<String>, BadRequest> {
    use serde_json::Value;
    let text = match value {
        Value::Null => return Ok(None),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        Value::Array(_) | Value::Object(_) => value.to_string(),
    };
    match text.contains('\0') {
        true => Err(BadRequest::Parameter { number, reason: "it contains a NUL character, which PostgreSQL's text cannot hold" }),
        false => Ok(Some(text)),
    }
}

fn write_parameter(text: Option<&str>, out: &mut BytesMut) -> Result<postgres_protocol::IsNull, Box<dyn std::error::Error + Sync + Send>> {
    match text {
        None => Ok(postgres_protocol::IsNull::Yes),
        Some(text) => {
            out.extend_from_slice(text.as_bytes());
            Ok(postgres_protocol::IsNull::No)
        }
    }
}

/// How a column's values become JSON, by its type (its oid, which is fixed
/// for the built-in types). Anything else is refused with its name, and a
/// `::text` cast shows it. A domain over one of these has an oid of its
/// own, and is refused too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decoder {
    /// `true`/`false`.
    Bool,
    /// Numbers.
    Int2,
    Int4,
    Int8,
    Oid,
    /// Numbers, or `"NaN"`, `"Infinity"`, `"-Infinity"` (JSON has none).
    Float4,
    Float8,
    /// Its text, as a string (asked for in text format).
    Numeric,
    /// Strings.
    Text(&'static str),
    Json,
    Jsonb,
    /// `"xxxxxxxx-xxxx-…"`.
    Uuid,
    /// `"\x…"` hex, as PostgreSQL writes it.
    Bytea,
    /// `"2024-05-06"`; `"infinity"`, `"-infinity"`; a year outside 0..9999
    /// has a sign (ISO 8601's expanded form: `-0043` is 44 BC).
    Date,
    /// `"2024-05-06T07:08:09.123456"` (the fraction only when there is one).
    Timestamp,
    /// The same in UTC, with `Z`.
    Timestamptz,
    /// `null`: what a function returning nothing (`pg_sleep`) answers.
    Void,
}

impl Decoder {
    fn of(type_oid: u32) -> Option<Self> {
        Some(match type_oid {
            16 => Self::Bool,
            17 => Self::Bytea,
            19 => Self::Text("name"),
            20 => Self::Int8,
            21 => Self::Int2,
            23 => Self::Int4,
            25 => Self::Text("text"),
            26 => Self::Oid,
            114 => Self::Json,
            700 => Self::Float4,
            701 => Self::Float8,
            705 => Self::Text("unknown"),
            1042 => Self::Text("bpchar"),
            1043 => Self::Text("varchar"),
            1082 => Self::Date,
            1114 => Self::Timestamp,
            1184 => Self::Timestamptz,
            1700 => Self::Numeric,
            2950 => Self::Uuid,
            3802 => Self::Jsonb,
            2278 => Self::Void,
            _ => return None,
        })
    }

    fn type_name(self) -> &'static str {
        match self {
            Self::Bool => "bool",
            Self::Int2 => "int2",
            Self::Int4 => "int4",
            Self::Int8 => "int8",
            Self::Oid => "oid",
            Self::Float4 => "float4",
            Self::Float8 => "float8",
            Self::Numeric => "numeric",
            Self::Text(name) => name,
            Self::Json => "json",
            Self::Jsonb => "jsonb",
            Self::Uuid => "uuid",
            Self::Bytea => "bytea",
            Self::Date => "date",
            Self::Timestamp => "timestamp",
            Self::Timestamptz => "timestamptz",
            Self::Void => "void",
        }
    }

    /// The format asked of the server for this column.
    fn format(self) -> i16 {
        match self {
            Self::Numeric => TEXT,
            _ => BINARY,
        }
    }

    /// A value in [`Self::format`] as JSON; `Err` says what is wrong with it.
    fn decode(self, raw: &[u8]) -> Result<serde_json::Value, String> {
        use serde_json::Value;
        let fixed = |n: usize| -> Result<&[u8], String> {
            match raw.len() == n {
                true => Ok(raw),
                false => Err(format!("{} bytes for a {}", raw.len(), self.type_name())),
            }
        };
        let utf8 = |bytes: &[u8]| String::from_utf8(bytes.to_vec()).map_err(|_| format!("a {} that is not UTF-8", self.type_name()));
        Ok(match self {
            Self::Bool => Value::Bool(fixed(1)?[0] != 0),
            Self::Int2 => Value::from(i16::from_be_bytes(array(fixed(2)?))),
            Self::Int4 => Value::from(i32::from_be_bytes(array(fixed(4)?))),
            Self::Int8 => Value::from(i64::from_be_bytes(array(fixed(8)?))),
            Self::Oid => Value::from(u32::from_be_bytes(array(fixed(4)?))),
            // Through f32's own shortest text: 0.1f32 is 0.1, not 0.100000001….
            Self::Float4 => float(f32::from_be_bytes(array(fixed(4)?)).to_string().parse().unwrap_or(f64::NAN)),
            Self::Float8 => float(f64::from_be_bytes(array(fixed(8)?))),
            Self::Numeric | Self::Text(_) => Value::String(utf8(raw)?),
            Self::Json => serde_json::from_slice(raw).map_err(|e| format!("json: {e}"))?,
            Self::Jsonb => match raw.split_first() {
                Some((1, json)) => serde_json::from_slice(json).map_err(|e| format!("jsonb: {e}"))?,
                _ => return Err("a jsonb of an unknown version".into()),
            },
            Self::Uuid => {
                let hex = hex::encode(fixed(16)?);
                Value::String(format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]))
            }
            Self::Bytea => Value::String(format!("\\x{}", hex::encode(raw))),
            Self::Date => Value::String(date_text(i32::from_be_bytes(array(fixed(4)?)))),
            Self::Timestamp => Value::String(timestamp_text(i64::from_be_bytes(array(fixed(8)?)), "")),
            Self::Timestamptz => Value::String(timestamp_text(i64::from_be_bytes(array(fixed(8)?)), "Z")),
            Self::Void => Value::Null,
        })
    }
}

/// A slice already checked to be `N` bytes long as an array.
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(bytes);
    out
}

fn float(x: f64) -> serde_json::Value {
    match serde_json::Number::from_f64(x) {
        Some(n) => serde_json::Value::Number(n),
        None if x.is_nan() => "NaN".into(),
        None if x > 0.0 => "Infinity".into(),
        None => "-Infinity".into(),
    }
}

fn decode_row(row: &DataRowBody, columns: &[DescribedColumn], decoders: &[Decoder]) -> Result<Vec<serde_json::Value>, BrokerError> {
    let mut values = Vec::with_capacity(decoders.len());
    let mut ranges = row.ranges();
    while let Some(range) = ranges.next().map_err(|e| BrokerError::Protocol(e.to_string()))? {
        let (Some(decoder), Some(column)) = (decoders.get(values.len()), columns.get(values.len())) else {
            return Err(unexpected("a row longer than its description"));
        };
        let value = match range {
            None => serde_json::Value::Null,
            Some(range) => {
                decoder.decode(&row.buffer()[range]).map_err(|e| BrokerError::Protocol(format!("column {:?}: {e}", column.name)))?
            }
        };
        values.push(value);
    }
    match values.len() == decoders.len() {
        true => Ok(values),
        false => Err(unexpected("a row shorter than its description")),
    }
}

/// Days from 1970-01-01 to PostgreSQL's epoch, 2000-01-01.
const POSTGRES_EPOCH_DAYS: i64 = 10_957;
const MICROS_PER_DAY: i64 = 86_400_000_000;

/// A date (days since 2000-01-01) in ISO 8601.
fn date_text(days: i32) -> String {
    match days {
        i32::MAX => "infinity".into(),
        i32::MIN => "-infinity".into(),
        days => civil_date_text(i64::from(days) + POSTGRES_EPOCH_DAYS),
    }
}

/// A timestamp (microseconds since 2000-01-01 00:00) in ISO 8601.
fn timestamp_text(micros: i64, zone: &str) -> String {
    match micros {
        i64::MAX => "infinity".into(),
        i64::MIN => "-infinity".into(),
        micros => {
            let (days, of_day) = (micros.div_euclid(MICROS_PER_DAY), micros.rem_euclid(MICROS_PER_DAY));
            let seconds = of_day / 1_000_000;
            let fraction = match of_day % 1_000_000 {
                0 => String::new(),
                fraction => format!(".{fraction:06}"),
            };
            format!(
                "{}T{:02}:{:02}:{:02}{fraction}{zone}",
                civil_date_text(days + POSTGRES_EPOCH_DAYS),
                seconds / 3600,
                seconds / 60 % 60,
                seconds % 60
            )
        }
    }
}

/// Days since 1970-01-01 as a proleptic Gregorian date, `YYYY-MM-DD`
/// (Howard Hinnant's `civil_from_days`). Years outside 0..=9999 get a sign
/// and year 0 is 1 BC, as ISO 8601 counts them.
fn civil_date_text(days: i64) -> String {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let year = match year {
        0..=9999 => format!("{year:04}"),
        year if year < 0 => format!("-{:04}", -year),
        year => format!("+{year}"),
    };
    format!("{year}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dates_and_timestamps_are_iso_8601() {
        assert_eq!(date_text(0), "2000-01-01");
        assert_eq!(date_text(-1), "1999-12-31");
        assert_eq!(date_text(59), "2000-02-29");
        assert_eq!(date_text(-10_957), "1970-01-01");
        assert_eq!(date_text(i32::MAX), "infinity");
        assert_eq!(date_text(i32::MIN), "-infinity");
        // 0001-01-01 is 730 119 days before 2000-01-01; a day before is 1 BC, year 0.
        assert_eq!(date_text(-730_119), "0001-01-01");
        assert_eq!(date_text(-730_120), "0000-12-31");
        assert_eq!(date_text(-730_120 - 366), "-0001-12-31", "year 0 is a leap year");
        // 8000 years are 20 cycles of 146 097 days.
        assert_eq!(date_text(2_921_939), "9999-12-31");
        assert_eq!(date_text(2_921_940), "+10000-01-01");

        assert_eq!(timestamp_text(0, ""), "2000-01-01T00:00:00");
        assert_eq!(timestamp_text(-1, "Z"), "1999-12-31T23:59:59.999999Z");
        assert_eq!(timestamp_text(MICROS_PER_DAY + 3_723_000_500, "Z"), "2000-01-02T01:02:03.000500Z");
        assert_eq!(timestamp_text(i64::MAX, ""), "infinity");
    }

    #[test]
    fn parameters_go_as_their_text() {
        assert_eq!(parameter_text(1, &json!(null)), Ok(None));
        assert_eq!(parameter_text(1, &json!("it's")), Ok(Some("it's".into())));
        assert_eq!(parameter_text(1, &json!(42)), Ok(Some("42".into())));
        assert_eq!(parameter_text(1, &json!(-1.5)), Ok(Some("-1.5".into())));
        assert_eq!(parameter_text(1, &json!(true)), Ok(Some("true".into())));
        assert_eq!(parameter_text(1, &json!({"a": [1, "b"]})), Ok(Some(r#"{"a":[1,"b"]}"#.into())));
        assert!(matches!(parameter_text(3, &json!("a\0b")), Err(BadRequest::Parameter { number: 3, .. })));
    }

    #[test]
    fn values_decode_by_type() {
        assert_eq!(Decoder::Float4.decode(&0.1f32.to_be_bytes()), Ok(json!(0.1)));
        assert_eq!(Decoder::Float8.decode(&f64::NEG_INFINITY.to_be_bytes()), Ok(json!("-Infinity")));
        assert_eq!(Decoder::Float8.decode(&f64::NAN.to_be_bytes()), Ok(json!("NaN")));
        assert_eq!(Decoder::Int8.decode(&(-7i64).to_be_bytes()), Ok(json!(-7)));
        assert_eq!(Decoder::Bytea.decode(&[0xde, 0xad]), Ok(json!("\\xdead")));
        assert_eq!(Decoder::Jsonb.decode(b"\x01{\"a\": 1}"), Ok(json!({"a": 1})));
        let uuid: Vec<u8> = (0..16).collect();
        assert_eq!(Decoder::Uuid.decode(&uuid), Ok(json!("00010203-0405-0607-0809-0a0b0c0d0e0f")));
        assert!(Decoder::Int4.decode(&[0, 1]).is_err());
        assert_eq!(Decoder::of(1186), None, "interval is not shown");
    }
}
