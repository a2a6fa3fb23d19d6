//! What the `http` fuzz target runs (`fuzz/fuzz_targets/http.rs`), here so that
//! `cargo test` replays the inputs in `fuzz/regressions/http/` through the very same code.
//!
//! [`http`] hands arbitrary bytes to what the coordinator does with a client's request
//! before routing it: the body of `/v1/completions` and of `/v1/chat/completions`
//! (JSON parsing and validation, shared with the public NATS API), and the
//! `Last-Event-ID` header of a reconnect. Each may refuse the input — always as a 400
//! with an OpenAI-shaped body — and none may panic. What validation accepts must keep
//! the promises [`ValidRequest`] makes to the workers.

use actix_web::http::header::HeaderValue;
use baton_common::config::CoordinatorConfig;

use crate::api::validate::{ValidRequest, MAX_STOP_STRINGS};
use crate::http::routes::parse_last_event_id;

/// Feeds `data` to request validation as both kinds of body and to the `Last-Event-ID`
/// parser; panics only on a bug.
pub fn http(data: &[u8]) {
    let config = CoordinatorConfig::default();
    for result in [
        ValidRequest::completion(data, &config),
        ValidRequest::chat(data, &config),
    ] {
        match result {
            Ok(request) => check_valid(&request, &config),
            Err(error) => {
                assert_eq!(error.status().as_u16(), 400, "{error:?} is not a 400");
                serde_json::to_vec(&error.body()).expect("error bodies serialize");
            }
        }
    }
    // What actix accepts as a header value, as a reconnecting client sends it.
    if let Ok(value) = HeaderValue::from_bytes(data) {
        if let Ok(text) = value.to_str() {
            if let Err(error) = parse_last_event_id(text) {
                assert_eq!(error.status().as_u16(), 400, "{error:?} is not a 400");
            }
        }
    }
}

/// The ranges a worker relies on.
fn check_valid(request: &ValidRequest, config: &CoordinatorConfig) {
    let p = &request.params;
    assert!(!request.model.trim().is_empty(), "empty model accepted");
    assert!(
        (1..=config.max_tokens_limit).contains(&p.max_tokens),
        "max_tokens {} accepted",
        p.max_tokens
    );
    assert!(
        p.temperature.is_finite() && p.temperature >= 0.0,
        "temperature {} accepted",
        p.temperature
    );
    assert!(
        p.top_p > 0.0 && p.top_p <= 1.0,
        "top_p {} accepted",
        p.top_p
    );
    assert!(
        p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0,
        "repetition_penalty {} accepted",
        p.repetition_penalty
    );
    assert!(p.stop.len() <= MAX_STOP_STRINGS && p.stop.iter().all(|s| !s.is_empty()));
    assert!(request.stream || !request.include_usage);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_and_invalid_inputs_pass() {
        http(br#"{"model": "m", "prompt": "hi", "max_tokens": 3, "stop": ["x"]}"#);
        http(br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#);
        http(br#"{"model": "m", "prompt": [1, 2], "temperature": 1e308}"#);
        http(b"00000000000000000000000000000001:7");
        http(b"");
        http(b"\xff\xfe");
    }
}
