//! `X-Request-Id` on every response (an actix `from_fn` middleware): the client's own id
//! when it sent a usable one; else the id the handler gave (a generation's answer names
//! its stream, the id its log lines and its worker's carry); else a new one. So a client,
//! a proxy and this server's logs can name the same request. Errors carry it too, the
//! key check's refusals among them.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::HttpMessage;

/// The header, as clients and proxies (nginx, Envoy, vLLM's server) spell it.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Longest id taken from a client; a longer one is replaced.
pub const MAX_LEN: usize = 128;

/// The id a client sent, in its request's extensions for the handlers and their logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

/// Whether a client's id can be echoed as it is: 1 to [`MAX_LEN`] visible ASCII
/// characters.
pub fn usable(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The middleware.
pub async fn echo<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<B>, actix_web::Error> {
    let sent = req
        .headers()
        .get(&HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|id| usable(id))
        .map(str::to_owned);
    if let Some(id) = &sent {
        req.extensions_mut().insert(RequestId(id.clone()));
    }
    // Handlers' errors and the key check's refusals come back as responses; only a
    // middleware's own failure is an `Err`, and this server's middlewares have none.
    // (The request cannot be kept to render one here: routing needs it unshared.)
    let mut response = next.call(req).await?;
    let id = match sent {
        Some(id) => id,
        None if response.headers().contains_key(&HEADER) => return Ok(response),
        None => uuid::Uuid::new_v4().simple().to_string(),
    };
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, value);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use actix_web::{middleware::from_fn, test, web, App, HttpResponse};

    use super::*;

    async fn ok() -> HttpResponse {
        HttpResponse::Ok().body("ok")
    }

    async fn fails() -> Result<HttpResponse, actix_web::Error> {
        Err(actix_web::error::ErrorBadRequest("refused"))
    }

    async fn named() -> HttpResponse {
        HttpResponse::Ok()
            .insert_header((HEADER, "stream-1"))
            .body("ok")
    }

    /// The client's id comes back on answers and on errors; a missing or unusable one is
    /// replaced by a fresh id, different each time.
    #[actix_rt::test]
    async fn every_response_carries_the_request_id() {
        let app = test::init_service(
            App::new()
                .wrap(from_fn(echo))
                .route("/ok", web::get().to(ok))
                .route("/fails", web::get().to(fails))
                .route("/named", web::get().to(named)),
        )
        .await;
        for path in ["/ok", "/fails", "/missing", "/named"] {
            let req = test::TestRequest::get()
                .uri(path)
                .insert_header((HEADER, "client-id-42"))
                .to_request();
            let res = test::call_service(&app, req).await;
            assert_eq!(
                res.headers().get(&HEADER).and_then(|v| v.to_str().ok()),
                Some("client-id-42"),
                "{path}"
            );
        }
        let res =
            test::call_service(&app, test::TestRequest::get().uri("/fails").to_request()).await;
        assert_eq!(res.status().as_u16(), 400);
        let mut fresh = Vec::new();
        for sent in [None, Some("has space"), Some(&"x".repeat(MAX_LEN + 1)[..])] {
            let mut req = test::TestRequest::get().uri("/ok");
            if let Some(s) = sent {
                req = req.insert_header((HEADER, s));
            }
            let res = test::call_service(&app, req.to_request()).await;
            let id = res
                .headers()
                .get(&HEADER)
                .and_then(|v| v.to_str().ok())
                .expect("an id")
                .to_owned();
            assert!(usable(&id) && Some(id.as_str()) != sent, "{id}");
            fresh.push(id);
        }
        fresh.dedup();
        assert_eq!(fresh.len(), 3, "fresh ids repeat: {fresh:?}");
        // Without the client's, the handler's own id stands.
        let res =
            test::call_service(&app, test::TestRequest::get().uri("/named").to_request()).await;
        assert_eq!(
            res.headers().get(&HEADER).and_then(|v| v.to_str().ok()),
            Some("stream-1")
        );
    }
}
