//! The API key check in front of every route (an actix `from_fn` middleware).
//!
//! With keys configured ([`crate::auth::Keys`]), a request needs
//! `Authorization: Bearer <key>`:
//!
//! | path | needs |
//! | --- | --- |
//! | `/health` (load balancers), `/` (the status page: static HTML, its data comes from `/v1/status`) | nothing |
//! | `/admin/*`, `/metrics`, `/v1/status` | an admin key |
//! | everything else: `/v1/*`, `/tokenize`, `/detokenize`, and unknown URLs (no route list for strangers) | an API or admin key |
//!
//! The path judged is the one the router matches (percent-decoded), so a route cannot
//! be reached under a spelling this check reads differently. Refusals are OpenAI error
//! bodies: 401 `invalid_api_key` with `WWW-Authenticate: Bearer`, 403
//! `insufficient_permissions`. The request's [`Identity`] goes into its extensions for
//! the handlers ([`identity`]).

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, HttpRequest, ResponseError};
use tracing::{debug, warn};

use super::AppState;
use crate::api::error::ApiError;
use crate::auth::{Identity, KeyId, Keys, Role};

/// What a path needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Nothing: open to anyone.
    Nothing,
    /// An API or admin key.
    Key,
    /// An admin key.
    Admin,
}

/// What `path` (as the router sees it) needs when keys are configured.
pub fn need(path: &str) -> Need {
    match path {
        "/health" | "/" => Need::Nothing,
        "/metrics" | "/v1/status" | "/admin" => Need::Admin,
        p if p.starts_with("/admin/") => Need::Admin,
        _ => Need::Key,
    }
}

/// The key of an `Authorization: Bearer <key>` header (scheme in any case), if any.
fn bearer(req: &ServiceRequest) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.trim().split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// Who `req` comes from, or why it is refused.
fn judge(keys: &Keys, req: &ServiceRequest) -> Result<Identity, ApiError> {
    if !keys.enabled() {
        return Ok(Identity::Anonymous);
    }
    let path = req.match_info().as_str();
    let need = need(path);
    let presented = bearer(req);
    let caller = match presented.map(|key| (key, keys.authenticate(key))) {
        Some((_, Some(caller))) => caller,
        // An open path serves anyone, whatever key (or none) comes with it.
        _ if need == Need::Nothing => return Ok(Identity::Anonymous),
        None => {
            debug!(path, peer = ?req.peer_addr(), "request without an API key refused");
            return Err(ApiError::MissingApiKey);
        }
        Some((key, None)) => {
            warn!(path, peer = ?req.peer_addr(), key = %KeyId::of(key), "request with an unknown API key refused");
            return Err(ApiError::InvalidApiKey);
        }
    };
    if need == Need::Admin && caller.role != Role::Admin {
        warn!(path, key = %caller.key, "API key refused on an admin route");
        return Err(ApiError::AdminKeyRequired(path.to_string()));
    }
    Ok(Identity::Key(caller))
}

/// The middleware: refuses requests whose key does not allow their path; puts the
/// [`Identity`] of the others in their extensions.
pub async fn check<B: MessageBody + 'static>(
    req: ServiceRequest,
    next: Next<B>,
) -> Result<ServiceResponse<EitherBody<B>>, actix_web::Error> {
    let judged = match req.app_data::<web::Data<AppState>>() {
        Some(state) => judge(&state.keys, &req).inspect_err(|e| {
            state.metrics.auth_refused(e.code());
        }),
        None => Err(ApiError::Internal(
            "the API key check has no application state".into(),
        )),
    };
    match judged {
        Ok(identity) => {
            req.extensions_mut().insert(identity);
            next.call(req)
                .await
                .map(ServiceResponse::map_into_left_body)
        }
        Err(e) => Ok(req.into_response(e.error_response()).map_into_right_body()),
    }
}

/// The identity the middleware found for `req`. A request it did not see is anonymous
/// only while no key is configured.
pub fn identity(req: &HttpRequest, keys: &Keys) -> Result<Identity, ApiError> {
    match req.extensions().get::<Identity>() {
        Some(identity) => Ok(identity.clone()),
        None if !keys.enabled() => Ok(Identity::Anonymous),
        None => Err(ApiError::Internal(
            "the request did not pass the API key check".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_has_its_need() {
        assert_eq!(need("/health"), Need::Nothing);
        assert_eq!(need("/"), Need::Nothing);
        for admin in ["/metrics", "/v1/status", "/admin", "/admin/workers/x/drain"] {
            assert_eq!(need(admin), Need::Admin, "{admin}");
        }
        for key in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/tokenize",
            "/detokenize",
            "/v1/streams/abc",
            "/v2/nothing",
            "/health/x",
            "/metrics/",
            "//admin/x",
        ] {
            assert_eq!(need(key), Need::Key, "{key}");
        }
    }

    #[test]
    fn bearer_keys_are_read_in_any_scheme_case() {
        let read = |value: &str| {
            let req = actix_web::test::TestRequest::default()
                .insert_header((header::AUTHORIZATION, value))
                .to_srv_request();
            bearer(&req).map(str::to_string)
        };
        assert_eq!(read("Bearer sk-1").as_deref(), Some("sk-1"));
        assert_eq!(read("bearer   sk-1 ").as_deref(), Some("sk-1"));
        assert_eq!(read("Basic c2stMQ=="), None);
        assert_eq!(read("Bearer "), None);
        assert_eq!(read("sk-1"), None);
        let req = actix_web::test::TestRequest::default().to_srv_request();
        assert_eq!(bearer(&req), None);
    }
}
