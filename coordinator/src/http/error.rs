//! The one place where errors become HTTP status codes: [`ApiError::status`] maps each
//! case in one exhaustive `match` (no `_` arm: a new case must choose its code), and the
//! response carries OpenAI's error body.
//!
//! A missing or unknown API key is **401** with a `WWW-Authenticate: Bearer` challenge
//! (RFC 6750), as OpenAI answers; an API key on an admin route is **403**; 429 and 503
//! say when to retry (`Retry-After`).

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};

use crate::api::error::ApiError;

/// Seconds a client should wait before retrying a 429 or a 503.
pub const RETRY_AFTER_SECS: u32 = 1;

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
            ApiError::ModelNotServed(_) => StatusCode::NOT_FOUND,
            ApiError::WorkerDraining(_) => StatusCode::CONFLICT,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::CheckpointsUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
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
    use crate::actors::router::RouteError;
    use actix_web::body::MessageBody;
    use baton_common::protocol::{ErrorKind, WireError};

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
    fn model_order_refusals_say_which_kind() {
        let refusal = |kind| {
            ApiError::from_model_order(
                "model",
                WireError {
                    kind,
                    message: "this worker serves a, not \"b\"".into(),
                },
            )
        };
        let unknown = refusal(ErrorKind::UnknownModel);
        assert_eq!(
            (status(unknown.clone()), unknown.code(), unknown.param()),
            (404, "model_not_found", Some("model"))
        );
        assert!(unknown.to_string().contains("serves a"), "{unknown}");
        let draining = refusal(ErrorKind::Draining);
        assert_eq!(
            (status(draining.clone()), draining.code()),
            (409, "worker_draining")
        );
        let invalid = refusal(ErrorKind::InvalidRequest);
        assert_eq!(
            (status(invalid.clone()), invalid.param()),
            (400, Some("model"))
        );
        assert_eq!(status(refusal(ErrorKind::Internal)), 502);
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

    /// OpenAI's error type (the front-neutral class) agrees with the HTTP status.
    #[test]
    fn the_error_type_follows_the_status_class() {
        let cases = [
            ApiError::MalformedJson("x".into()),
            ApiError::MissingField("model"),
            ApiError::invalid("n", "x"),
            ApiError::ContextLengthExceeded("x".into()),
            ApiError::ModelNotFound("m".into()),
            ApiError::UnknownRoute("/x".into()),
            ApiError::StreamNotFound("s".into()),
            ApiError::StreamDiverged("s".into()),
            ApiError::WorkerNotFound("w".into()),
            ApiError::ModelNotServed("m".into()),
            ApiError::WorkerDraining("w".into()),
            ApiError::BodyTooLarge { limit: 1 },
            ApiError::RequestTooLarge("x".into()),
            ApiError::Overloaded("x".into()),
            ApiError::Internal("x".into()),
            ApiError::WorkerFailed("x".into()),
            ApiError::NotSynced,
            ApiError::NoLiveWorkers,
            ApiError::ModelUnavailable("m".into()),
            ApiError::WorkerTimeout("x".into()),
            ApiError::StreamTimeout(1),
            ApiError::MissingApiKey,
            ApiError::InvalidApiKey,
            ApiError::AdminKeyRequired("/x".into()),
            ApiError::TooManyStreams { limit: 1 },
            ApiError::TooManyConnections { limit: 1 },
            ApiError::BodyTimeout(1),
            ApiError::MethodNotAllowed("x".into()),
        ];
        for e in cases {
            let expected = match e.status().as_u16() {
                429 => "rate_limit_error",
                400..=499 => "invalid_request_error",
                _ => "server_error",
            };
            assert_eq!(e.error_type(), expected, "{e:?}");
        }
    }
}
