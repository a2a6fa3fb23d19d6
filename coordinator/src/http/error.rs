//! The one place where errors become HTTP status codes.
//!
//! Every failure a client can see is an [`ApiError`]; [`ApiError::status`] maps each to
//! its status in one exhaustive `match` (no `_` arm: a new case must choose its code).
//! Bodies have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
//!
//! An unknown model is **404** with code `model_not_found`, as OpenAI answers (400 would
//! also be defensible; 404 lets OpenAI clients raise their `NotFoundError`).
//!
//! A missing or unknown API key is **401** with code `invalid_api_key` and a
//! `WWW-Authenticate: Bearer` challenge (RFC 6750), as OpenAI answers; an API key on an
//! admin route is **403** `insufficient_permissions`; a key over `max_streams_per_key` is
//! **429** `rate_limit_exceeded` with `Retry-After`.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use baton_common::protocol::{ErrorKind, WireError};
use serde::Serialize;

use crate::actors::router::RouteError;
use crate::actors::sessions::AttachError;
use crate::dispatch::DispatchError;
use crate::nats::SubmitError;

/// Seconds a client should wait before retrying a 429 or a 503.
pub const RETRY_AFTER_SECS: u32 = 1;

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
    /// The HTTP status, one arm per case.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::MalformedJson(_) => StatusCode::BAD_REQUEST,
            ApiError::MissingField(_) => StatusCode::BAD_REQUEST,
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ContextLengthExceeded(_) => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::UnknownRoute(_) => StatusCode::NOT_FOUND,
            ApiError::StreamNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::StreamDiverged(_) => StatusCode::CONFLICT,
            ApiError::WorkerNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::WorkerFailed(_) => StatusCode::BAD_GATEWAY,
            ApiError::NotSynced => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NoLiveWorkers => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::ModelUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::WorkerTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::StreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::MissingApiKey => StatusCode::UNAUTHORIZED,
            ApiError::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ApiError::AdminKeyRequired(_) => StatusCode::FORBIDDEN,
            ApiError::TooManyStreams { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::TooManyConnections { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    /// OpenAI's error type, from the status class.
    pub fn error_type(&self) -> &'static str {
        match self.status().as_u16() {
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
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
            ApiError::BodyTooLarge { .. } => "request_too_large",
            ApiError::RequestTooLarge(_) => "request_too_large",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Internal(_) => "internal_error",
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
            ApiError::ModelNotFound(_) => Some("model"),
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

    /// The `WWW-Authenticate` challenge of a refused key (RFC 6750), if any.
    fn challenge(&self) -> Option<&'static str> {
        match self {
            ApiError::MissingApiKey => Some(r#"Bearer realm="baton""#),
            ApiError::InvalidApiKey => Some(r#"Bearer realm="baton", error="invalid_token""#),
            ApiError::AdminKeyRequired(_) => {
                Some(r#"Bearer realm="baton", error="insufficient_scope""#)
            }
            _ => None,
        }
    }

    /// Whether the response says when to retry.
    fn retry_after(&self) -> bool {
        matches!(
            self.status(),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        )
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
        }
    }
}

impl From<actix::MailboxError> for ApiError {
    fn from(e: actix::MailboxError) -> Self {
        ApiError::Internal(e.to_string())
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status()
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status());
        if self.retry_after() {
            response.insert_header((header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS)));
        }
        if let Some(challenge) = self.challenge() {
            response.insert_header((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            ));
        }
        response.json(self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::body::MessageBody;

    fn status(e: ApiError) -> u16 {
        e.status().as_u16()
    }

    #[test]
    fn each_case_has_its_status() {
        assert_eq!(status(ApiError::MalformedJson("x".into())), 400);
        assert_eq!(status(ApiError::MissingField("model")), 400);
        assert_eq!(status(ApiError::invalid("max_tokens", "too big")), 400);
        assert_eq!(status(ApiError::ContextLengthExceeded("long".into())), 400);
        assert_eq!(status(ApiError::ModelNotFound("m".into())), 404);
        assert_eq!(status(ApiError::UnknownRoute("/x".into())), 404);
        assert_eq!(status(ApiError::StreamNotFound("s".into())), 404);
        assert_eq!(status(ApiError::WorkerNotFound("w".into())), 404);
        assert_eq!(status(ApiError::BodyTooLarge { limit: 1 }), 413);
        assert_eq!(status(ApiError::Overloaded("full".into())), 429);
        assert_eq!(status(ApiError::Internal("x".into())), 500);
        assert_eq!(status(ApiError::WorkerFailed("x".into())), 502);
        assert_eq!(status(ApiError::NotSynced), 503);
        assert_eq!(status(ApiError::NoLiveWorkers), 503);
        assert_eq!(status(ApiError::ModelUnavailable("m".into())), 503);
        assert_eq!(status(ApiError::WorkerTimeout("slow".into())), 504);
        assert_eq!(status(ApiError::StreamTimeout(1)), 504);
        assert_eq!(status(ApiError::MissingApiKey), 401);
        assert_eq!(status(ApiError::InvalidApiKey), 401);
        assert_eq!(status(ApiError::AdminKeyRequired("/metrics".into())), 403);
        assert_eq!(status(ApiError::TooManyStreams { limit: 2 }), 429);
    }

    fn header(response: &HttpResponse, name: header::HeaderName) -> Option<&str> {
        response.headers().get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn refused_keys_get_a_bearer_challenge_in_the_openai_shape() {
        for (e, challenge) in [
            (ApiError::MissingApiKey, r#"Bearer realm="baton""#),
            (
                ApiError::InvalidApiKey,
                r#"Bearer realm="baton", error="invalid_token""#,
            ),
        ] {
            let response = e.error_response();
            assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
            assert_eq!(header(&response, header::WWW_AUTHENTICATE), Some(challenge));
            let body = serde_json::to_value(e.body()).expect("json");
            assert_eq!(body["error"]["code"], "invalid_api_key");
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert_eq!(body["error"]["param"], serde_json::Value::Null);
        }
        let response = ApiError::AdminKeyRequired("/metrics".into()).error_response();
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        assert!(header(&response, header::WWW_AUTHENTICATE)
            .is_some_and(|c| c.contains("insufficient_scope")));
        let response = ApiError::TooManyStreams { limit: 3 }.error_response();
        assert_eq!(header(&response, header::RETRY_AFTER), Some("1"));
        assert!(header(&response, header::WWW_AUTHENTICATE).is_none());
        let e = ApiError::TooManyStreams { limit: 3 };
        assert!(e.to_string().contains("max_streams_per_key"));
        assert_eq!(e.error_type(), "rate_limit_error");
    }

    #[test]
    fn worker_refusals_map_to_client_errors() {
        let refusal = |kind| {
            ApiError::from_worker(
                WireError {
                    kind,
                    message: "m".into(),
                },
                "model",
            )
        };
        let e = refusal(ErrorKind::PromptTooLong);
        assert_eq!(
            (status(e.clone()), e.code()),
            (400, "context_length_exceeded")
        );
        assert_eq!(status(refusal(ErrorKind::UnknownModel)), 404);
        assert_eq!(status(refusal(ErrorKind::InvalidRequest)), 400);
        assert_eq!(status(refusal(ErrorKind::Overloaded)), 429);
        assert_eq!(status(refusal(ErrorKind::Draining)), 503);
        assert_eq!(status(refusal(ErrorKind::Internal)), 502);
        assert_eq!(status(RouteError::NotSynced.into()), 503);
        assert_eq!(status(RouteError::UnknownModel("m".into()).into()), 404);
    }

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
    }

    #[test]
    fn overload_says_when_to_retry() {
        let response = ApiError::Overloaded("full".into()).error_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let bytes = response.into_body().try_into_bytes().expect("body");
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(json["error"]["code"], "overloaded");
        let response = ApiError::invalid("n", "only 1").error_response();
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
    }
}
