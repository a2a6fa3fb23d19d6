//! Everything that can go wrong with a request, as the client sees it, whatever the
//! front: [`ApiError`], with OpenAI's error body (`{"error": {"message", "type", "param",
//! "code"}}`) and a stable code. The HTTP front gives each its status code
//! (`crate::http::error`); the NATS API sends the body with its code in `Baton-Error`.
//!
//! An unknown model has code `model_not_found` (404 over HTTP, as OpenAI answers). A
//! missing or unknown API key is `invalid_api_key`; an API key on an admin route
//! `insufficient_permissions`; a key over `max_streams_per_key` `rate_limit_exceeded`.

use baton_common::ids::WorkerId;
use baton_common::protocol::{ErrorKind, WireError};
use serde::Serialize;

use crate::actors::router::RouteError;
use crate::dispatch::DispatchError;
use crate::nats::SubmitError;
use crate::sessions::AttachError;

/// Everything that can go wrong with a request, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON of the expected shape.
    #[error("We could not parse the JSON body of your request: {0}")]
    MalformedJson(String),
    /// A required field is absent.
    #[error("you must provide a `{0}` parameter")]
    MissingField(&'static str),
    /// A field is out of range or unsupported.
    #[error("{message}")]
    InvalidRequest {
        /// The field, when one is to blame.
        param: Option<&'static str>,
        /// What is wrong.
        message: String,
    },
    /// No live worker serves the model.
    #[error("The model `{}` does not exist", clip(.0))]
    ModelNotFound(String),
    /// The prompt (with the output it asks for) does not fit the model's context.
    #[error("{0}")]
    ContextLengthExceeded(String),
    /// The body is larger than `max_body_bytes`.
    #[error("request body is larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The request would not fit in one message to a worker (NATS `max_payload`).
    #[error("{0}")]
    RequestTooLarge(String),
    /// The worker is full; retry later.
    #[error("the server is overloaded, retry later: {0}")]
    Overloaded(String),
    /// No URL here.
    #[error("unknown route: {0}")]
    UnknownRoute(String),
    /// The coordinator has not heard from any worker yet.
    #[error("the coordinator has not heard from any worker yet (not synced)")]
    NotSynced,
    /// No worker is alive.
    #[error("no live workers")]
    NoLiveWorkers,
    /// Workers serve the model but none can take the request now (draining, gone).
    #[error("no worker can take a request for `{}` now", clip(.0))]
    ModelUnavailable(String),
    /// A worker did not accept the request in time.
    #[error("{0}")]
    WorkerTimeout(String),
    /// The stream received nothing for `stream_timeout_ms`.
    #[error("the stream received nothing for {0} ms")]
    StreamTimeout(u64),
    /// A worker failed or answered something unusable.
    #[error("worker error: {0}")]
    WorkerFailed(String),
    /// A fault of the coordinator itself.
    #[error("internal error: {0}")]
    Internal(String),
    /// The shared checkpoints (JetStream) did not answer in time; retry.
    #[error("the checkpoints are unavailable now, retry: {0}")]
    CheckpointsUnavailable(String),
    /// A reconnect names a stream this coordinator does not have.
    #[error("{0}")]
    StreamNotFound(String),
    /// A reconnect's `Last-Event-ID` names a chain hash the stream does not have at that
    /// position: the client holds another text than the stream's.
    #[error("{0}")]
    StreamDiverged(String),
    /// An admin request names a worker nobody answers for.
    #[error("{0}")]
    WorkerNotFound(String),
    /// An admin order names a model the worker does not serve (the worker's words).
    #[error("{0}")]
    ModelNotServed(String),
    /// An admin order reached a worker that is draining (the worker's words).
    #[error("{0}")]
    WorkerDraining(String),
    /// API keys are configured and the request carries none.
    #[error(
        "You didn't provide an API key. Send it in the Authorization header \
         (`Authorization: Bearer <key>`)."
    )]
    MissingApiKey,
    /// The request's API key is not one of this server's.
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    /// The route needs an admin key and the request's key is an API key.
    #[error("{0} needs an admin key; the API key provided is not one")]
    AdminKeyRequired(String),
    /// The client's address holds `max_connections_per_client` connections already.
    #[error(
        "this address holds more than {limit} connections to the server, its limit \
         (max_connections_per_client); close some and retry"
    )]
    TooManyConnections {
        /// `max_connections_per_client`.
        limit: usize,
    },
    /// The body did not arrive within `body_timeout_ms`.
    #[error("the request body did not arrive within {0} ms")]
    BodyTimeout(u64),
    /// The URL exists, for other methods.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The request's key holds `max_streams_per_key` open streams.
    #[error(
        "this API key holds {limit} open streams, its limit (max_streams_per_key); \
         retry when one of them ends"
    )]
    TooManyStreams {
        /// `max_streams_per_key`.
        limit: u32,
    },
}

/// Longest client-given name an error repeats whole.
const NAME_SHOWN: usize = 64;

/// A client-given name as an error shows it: whole when short, else its start and its
/// length (a 100 KB model name is not sent back).
pub fn clip(name: &str) -> String {
    if name.len() <= NAME_SHOWN {
        return name.to_string();
    }
    let mut end = NAME_SHOWN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &name[..end], name.len())
}

/// OpenAI's error body.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Inside [`ErrorBody`].
#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    /// For people.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, …).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field to blame, if any.
    pub param: Option<&'static str>,
    /// A stable code, if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// OpenAI's error type: whose fault, and whether to wait.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::Overloaded(_)
            | ApiError::TooManyStreams { .. }
            | ApiError::TooManyConnections { .. } => "rate_limit_error",
            ApiError::MalformedJson(_)
            | ApiError::MissingField(_)
            | ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::ModelNotFound(_)
            | ApiError::UnknownRoute(_)
            | ApiError::StreamNotFound(_)
            | ApiError::StreamDiverged(_)
            | ApiError::WorkerNotFound(_)
            | ApiError::ModelNotServed(_)
            | ApiError::WorkerDraining(_)
            | ApiError::BodyTooLarge { .. }
            | ApiError::RequestTooLarge(_)
            | ApiError::BodyTimeout(_)
            | ApiError::MethodNotAllowed(_)
            | ApiError::MissingApiKey
            | ApiError::InvalidApiKey
            | ApiError::AdminKeyRequired(_) => "invalid_request_error",
            ApiError::Internal(_)
            | ApiError::CheckpointsUnavailable(_)
            | ApiError::WorkerFailed(_)
            | ApiError::NotSynced
            | ApiError::NoLiveWorkers
            | ApiError::ModelUnavailable(_)
            | ApiError::WorkerTimeout(_)
            | ApiError::StreamTimeout(_) => "server_error",
        }
    }

    /// A stable code for the body and for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::MalformedJson(_) => "invalid_json",
            ApiError::MissingField(_) => "missing_required_parameter",
            ApiError::InvalidRequest { .. } => "invalid_value",
            ApiError::ContextLengthExceeded(_) => "context_length_exceeded",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::UnknownRoute(_) => "unknown_url",
            ApiError::StreamNotFound(_) => "stream_not_found",
            ApiError::StreamDiverged(_) => "stream_diverged",
            ApiError::WorkerNotFound(_) => "worker_not_found",
            ApiError::ModelNotServed(_) => "model_not_found",
            ApiError::WorkerDraining(_) => "worker_draining",
            ApiError::BodyTooLarge { .. } => "request_too_large",
            ApiError::RequestTooLarge(_) => "request_too_large",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Internal(_) => "internal_error",
            ApiError::CheckpointsUnavailable(_) => "checkpoints_unavailable",
            ApiError::WorkerFailed(_) => "worker_error",
            ApiError::NotSynced => "not_synced",
            ApiError::NoLiveWorkers => "no_live_workers",
            ApiError::ModelUnavailable(_) => "model_unavailable",
            ApiError::WorkerTimeout(_) => "worker_timeout",
            ApiError::StreamTimeout(_) => "stream_timeout",
            ApiError::MissingApiKey => "invalid_api_key",
            ApiError::InvalidApiKey => "invalid_api_key",
            ApiError::AdminKeyRequired(_) => "insufficient_permissions",
            ApiError::TooManyStreams { .. } => "rate_limit_exceeded",
            ApiError::TooManyConnections { .. } => "too_many_connections",
            ApiError::BodyTimeout(_) => "request_timeout",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
        }
    }

    /// The request field to blame, if any.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            ApiError::MissingField(field) => Some(field),
            ApiError::InvalidRequest { param, .. } => *param,
            ApiError::ModelNotFound(_) | ApiError::ModelNotServed(_) => Some("model"),
            _ => None,
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.error_type(),
                param: self.param(),
                code: Some(self.code()),
            },
        }
    }

    /// The error a worker's refusal or failure of a request for `model` becomes.
    pub fn from_worker(error: WireError, model: &str) -> Self {
        match error.kind {
            ErrorKind::InvalidRequest => ApiError::InvalidRequest {
                param: None,
                message: error.message,
            },
            ErrorKind::PromptTooLong => ApiError::ContextLengthExceeded(error.message),
            ErrorKind::UnknownModel => ApiError::ModelNotFound(model.to_string()),
            ErrorKind::Overloaded => ApiError::Overloaded(error.message),
            ErrorKind::Draining => ApiError::ModelUnavailable(model.to_string()),
            ErrorKind::Internal | ErrorKind::ChainMismatch => ApiError::WorkerFailed(error.message),
        }
    }

    /// The error of a new stream that no worker took.
    pub fn from_dispatch(e: DispatchError, model: &str) -> Self {
        match e {
            DispatchError::Route(e) => e.into(),
            DispatchError::Submit(e) => e.into(),
            DispatchError::Refused(e) => ApiError::from_worker(e, model),
            DispatchError::Mailbox(e) => e.into(),
            DispatchError::TooLarge { .. } => ApiError::RequestTooLarge(e.to_string()),
        }
    }

    /// The error of an order to `worker` (a drain, a model load) that got no usable
    /// answer: nobody answering is an unknown worker, whatever the front.
    pub fn from_drain(worker: WorkerId, e: SubmitError) -> Self {
        match e {
            SubmitError::NoResponders => {
                ApiError::WorkerNotFound(format!("no worker {worker} answers"))
            }
            other => other.into(),
        }
    }

    /// The refusal of a model load or unload: the worker's reason, blamed on `param`.
    pub fn from_model_order(param: &'static str, e: baton_common::protocol::WireError) -> Self {
        match e.kind {
            ErrorKind::Internal => ApiError::WorkerFailed(e.message),
            ErrorKind::UnknownModel => ApiError::ModelNotServed(e.message),
            ErrorKind::Draining => ApiError::WorkerDraining(e.message),
            _ => ApiError::invalid(param, e.message),
        }
    }

    /// A field out of range.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            param: Some(param),
            message: message.into(),
        }
    }
}

impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::NotSynced => ApiError::NotSynced,
            RouteError::NoLiveWorkers => ApiError::NoLiveWorkers,
            RouteError::UnknownModel(model) => ApiError::ModelNotFound(model),
            RouteError::ModelUnavailable(model) => ApiError::ModelUnavailable(model),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Timeout(_) => ApiError::WorkerTimeout(e.to_string()),
            SubmitError::NoResponders
            | SubmitError::Request(_)
            | SubmitError::TooLarge(_)
            | SubmitError::Decode(_)
            | SubmitError::Unexpected(_) => ApiError::WorkerFailed(e.to_string()),
        }
    }
}

impl From<AttachError> for ApiError {
    fn from(e: AttachError) -> Self {
        match e {
            AttachError::Unknown(_) => ApiError::StreamNotFound(e.to_string()),
            AttachError::Diverged(..) => ApiError::StreamDiverged(e.to_string()),
            AttachError::Store(m) => ApiError::Internal(m),
            AttachError::Unavailable(m) => ApiError::CheckpointsUnavailable(m),
        }
    }
}

impl From<actix::MailboxError> for ApiError {
    fn from(e: actix::MailboxError) -> Self {
        ApiError::Internal(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_openai_shape() {
        let body =
            serde_json::to_value(ApiError::ModelNotFound("gpt-9".into()).body()).expect("json");
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "The model `gpt-9` does not exist",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
        );
        let e = serde_json::to_value(ApiError::NoLiveWorkers.body()).expect("json");
        assert_eq!(e["error"]["type"], "server_error");
        assert_eq!(e["error"]["param"], serde_json::Value::Null);
        let e = ApiError::TooManyStreams { limit: 3 };
        assert!(e.to_string().contains("max_streams_per_key"));
        assert_eq!(e.error_type(), "rate_limit_error");
    }

    #[test]
    fn long_names_are_clipped() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(100);
        let shown = clip(&long);
        assert!(
            shown.len() < 100 && shown.ends_with("(200 bytes)"),
            "{shown}"
        );
    }
}
