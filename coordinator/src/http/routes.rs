//! The HTTP handlers.
//!
//! A generation request is validated and handed to the sessions actor, which
//! checkpoints it, routes it and submits it (a worker that is gone, full or draining is
//! skipped for another one, a few times at most); it is then answered either as one JSON
//! body or as Server-Sent Events. A request with a `Last-Event-ID` header — or
//! `GET /v1/streams/{id}` — reattaches to a stream instead: what came after that
//! position, then the live rest.
//!
//! With API keys configured ([`super::auth`]), a stream belongs to the key that opened
//! it: another API key reattaching gets 404, as for a stream that does not exist. Each
//! answer, streamed or whole, new or reattached, holds one of its key's
//! `max_streams_per_key` slots until it ends or its client goes away.

use std::time::{Duration, Instant};

use actix_web::http::header::{self, HeaderValue};
use actix_web::web::{self, Bytes, BytesMut};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError};
use baton_common::config::CoordinatorConfig;
use baton_common::ids::StreamId;
use futures::StreamExt;
use tokio::sync::mpsc::unbounded_channel;
use tracing::info;

use super::auth::identity;
use super::request_id::RequestId;
use super::sse::{SseSettings, SseStream};
use super::AppState;
use crate::actors::messages::{CheckHealth, ListModels};
use crate::actors::registry::HealthStatus;
use crate::api::answer::{gather, whole_body, Reader, Shape};
use crate::api::choices::{member, parse_positions, Member};
use crate::api::chunks::{response_id, ChunkWriter};
use crate::api::error::ApiError;
use crate::api::open::{open_streams, StreamGuard};
use crate::api::openai::{ModelCard, ModelList};
use crate::api::tokenize::Direction;
use crate::api::validate::{Endpoint, ValidRequest};
use crate::auth::{Identity, StreamSlot};
use crate::metrics::StreamTracker;
use crate::sessions::Attach;

/// Registers every route on `cfg`; another method on a known URL is an OpenAI-shaped
/// 405.
pub fn configure(cfg: &mut web::ServiceConfig) {
    let routes = [
        ("/v1/chat/completions", web::post().to(chat_completions)),
        ("/v1/completions", web::post().to(completions)),
        ("/v1/models", web::get().to(models)),
        (
            "/tokenize",
            web::post().to(|s, r, p| tokenizer(s, r, p, Direction::Tokenize)),
        ),
        (
            "/detokenize",
            web::post().to(|s, r, p| tokenizer(s, r, p, Direction::Detokenize)),
        ),
        ("/v1/streams/{id}", web::get().to(stream_events)),
        ("/health", web::get().to(health)),
        ("/v1/status", web::get().to(super::status::status)),
        ("/metrics", web::get().to(super::status::metrics)),
        (
            "/admin/workers/{id}/drain",
            web::post().to(super::status::drain),
        ),
        (
            "/admin/workers/{id}/models",
            web::post().to(super::status::load_model),
        ),
        (
            "/admin/workers/{id}/models/{model}",
            web::delete().to(super::status::unload_model),
        ),
        ("/", web::get().to(super::status::page)),
    ];
    for (path, route) in routes {
        cfg.service(
            web::resource(path)
                .route(route)
                .default_service(web::to(method_not_allowed)),
        );
    }
}

/// A known URL with another method.
async fn method_not_allowed(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::MethodNotAllowed(format!(
        "{} is not allowed on {}",
        req.method(),
        req.path()
    )))
}

/// Any other URL: an OpenAI-shaped 404.
pub async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::UnknownRoute(format!(
        "{} {}",
        req.method(),
        req.path()
    )))
}

async fn chat_completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    generation(state, req, payload, Endpoint::Chat).await
}

async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    generation(state, req, payload, Endpoint::Completion).await
}

/// A generation request on `endpoint`: a new answer, or a reattach with `Last-Event-ID`.
async fn generation(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
    endpoint: Endpoint,
) -> Result<HttpResponse, ApiError> {
    let started = Instant::now();
    let result = async {
        let identity = identity(&req, &state.keys)?;
        if let Some(last) = last_event_id(&req)? {
            return reattach(&state, &identity, last, started).await;
        }
        let body = read_body(&req, payload, &state.config).await?;
        let request = ValidRequest::parse(endpoint, &body, &state.config)?;
        generate(&state, &identity, request, started).await
    }
    .await;
    log_client_id(&req, &result);
    counted(&state, endpoint_label(endpoint), result)
}

/// Names the stream a client's own request id became, so that the client's id finds the
/// stream's log lines (and its worker's).
fn log_client_id(req: &HttpRequest, result: &Result<HttpResponse, ApiError>) {
    let extensions = req.extensions();
    let (Some(client), Ok(response)) = (extensions.get::<RequestId>(), result) else {
        return;
    };
    if let Some(stream) = response
        .headers()
        .get(&super::request_id::HEADER)
        .and_then(|v| v.to_str().ok())
    {
        info!(client_request_id = %client.0, stream, "client request id");
    }
}

/// Counts a request that failed before its answer started (its stream counts itself).
fn counted(
    state: &AppState,
    endpoint: &str,
    result: Result<HttpResponse, ApiError>,
) -> Result<HttpResponse, ApiError> {
    if let Err(e) = &result {
        state.metrics.request_done(endpoint, e.code());
    }
    result
}

fn endpoint_label(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Chat => "chat",
        Endpoint::Completion => "completion",
    }
}

/// `/tokenize` and `/detokenize` ([`super::tokenize`]).
async fn tokenizer(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
    direction: Direction,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(&req, payload, &state.config).await?;
    let request = crate::api::tokenize::parse(direction, &body)?;
    let timeout = Duration::from_millis(state.config.submit_timeout_ms);
    let answer = crate::api::tokenize::run(&state.registry, &state.nats, timeout, request).await?;
    Ok(HttpResponse::Ok().json(answer.json()))
}

async fn models(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let entries = state.registry.send(ListModels).await?;
    let data = entries
        .into_iter()
        .map(|e| ModelCard {
            id: e.id,
            object: "model",
            created: e.created,
            owned_by: "baton",
            max_model_len: e.context_length,
            context_length: e.context_length,
        })
        .collect();
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list",
        data,
    }))
}

async fn health(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let status = state.registry.send(CheckHealth).await?;
    Ok(match status {
        HealthStatus::Live { workers } => {
            HttpResponse::Ok().json(serde_json::json!({"status": "ok", "workers": workers}))
        }
        HealthStatus::NotSynced => HttpResponse::ServiceUnavailable()
            .json(serde_json::json!({"status": "not synced", "workers": 0})),
        HealthStatus::NoLiveWorkers => HttpResponse::ServiceUnavailable()
            .json(serde_json::json!({"status": "no live workers", "workers": 0})),
    })
}

/// Reads the body, refusing more than `max_body_bytes` with a 413 and one that takes
/// longer than `body_timeout_ms` with a 408.
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    config: &CoordinatorConfig,
) -> Result<Bytes, ApiError> {
    let limit = config.max_body_bytes;
    // 0: no limit (a year).
    let wait = match config.body_timeout_ms {
        0 => Duration::from_secs(365 * 24 * 3600),
        ms => Duration::from_millis(ms),
    };
    let deadline = tokio::time::Instant::now() + wait;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let mut body = BytesMut::with_capacity(declared.unwrap_or(0));
    loop {
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(_) => return Err(ApiError::BodyTimeout(config.body_timeout_ms)),
        };
        let chunk =
            chunk.map_err(|e| ApiError::MalformedJson(format!("cannot read the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Shapes an answer for `endpoint` and streams or collects it.
struct Answer {
    endpoint: Endpoint,
    /// The first choice's stream: the response's id.
    group: StreamId,
    model: String,
    created: u64,
    include_usage: bool,
    /// The request asked for logprobs.
    logprobs: bool,
    prompt_tokens: u32,
    /// One per choice, in order. Declared before `guards`: their channels close first.
    members: Vec<Member>,
    guards: Vec<StreamGuard>,
    /// The key's stream slots (one per choice), freed with the answer.
    slots: Vec<StreamSlot>,
    started: Instant,
}

async fn generate(
    state: &AppState,
    identity: &Identity,
    mut request: ValidRequest,
    started: Instant,
) -> Result<HttpResponse, ApiError> {
    request.params.content_specials = identity.content_specials();
    let slots = (0..request.n)
        .map(|_| admit(identity))
        .collect::<Result<Vec<_>, _>>()?;
    let opened = open_streams(&state.sessions, &request, identity.owner()).await?;
    let answer = Answer {
        endpoint: request.endpoint,
        group: opened.group,
        model: request.model,
        created: opened.created,
        include_usage: request.include_usage,
        logprobs: request.params.logprobs.is_some(),
        prompt_tokens: opened.prompt_tokens,
        members: opened.members,
        guards: opened.guards,
        slots,
        started,
    };
    if request.stream {
        Ok(sse_response(state, answer, false))
    } else {
        respond_whole(state, answer).await
    }
}

/// Takes one of the caller's stream slots, or refuses with 429.
fn admit(identity: &Identity) -> Result<StreamSlot, ApiError> {
    identity.admit().map_err(|full| {
        info!(key = %identity, limit = full.limit, "stream refused: max_streams_per_key reached");
        ApiError::TooManyStreams { limit: full.limit }
    })
}

fn sse_response(state: &AppState, answer: Answer, resumed: bool) -> HttpResponse {
    let request_id = answer.group.to_string();
    let writers = answer
        .members
        .iter()
        .map(|m| {
            let mut writer = ChunkWriter::new(
                answer.endpoint,
                answer.group,
                answer.model.clone(),
                answer.created,
                answer.logprobs,
            )
            .choice(m.choice);
            if resumed {
                writer.role_sent();
            }
            writer
        })
        .collect();
    let tracker = StreamTracker::new(
        state.metrics.clone(),
        endpoint_label(answer.endpoint),
        answer.started,
    );
    let idle = Duration::from_millis(state.config.stream_timeout_ms);
    let reader = Reader::new(answer.members, answer.model.clone(), idle);
    let body = SseStream::new(
        answer.group,
        reader,
        answer.guards,
        answer.slots,
        tracker,
        writers,
        SseSettings {
            keepalive: match state.config.sse_keepalive_ms {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            include_usage: answer.include_usage,
            prompt_tokens: answer.prompt_tokens,
        },
    );
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("X-Request-Id", request_id))
        .insert_header((header::CACHE_CONTROL, HeaderValue::from_static("no-cache")))
        .insert_header(("X-Accel-Buffering", HeaderValue::from_static("no")))
        .streaming(body.into_body())
}

async fn respond_whole(state: &AppState, answer: Answer) -> Result<HttpResponse, ApiError> {
    let mut tracker = StreamTracker::new(
        state.metrics.clone(),
        endpoint_label(answer.endpoint),
        answer.started,
    );
    let Answer {
        endpoint,
        group,
        model,
        created,
        logprobs,
        prompt_tokens,
        members,
        guards,
        slots,
        ..
    } = answer;
    let idle = Duration::from_millis(state.config.stream_timeout_ms);
    let mut reader = Reader::new(members, model.clone(), idle);
    let gathered = gather(&mut reader, || tracker.token()).await;
    // The channels close before the guards detach.
    drop(reader);
    drop((guards, slots));
    let parts = match gathered {
        Ok(parts) => {
            tracker.finish("finished");
            parts
        }
        Err(e) => {
            // Counted here, with the stream's outcome; not again as a request that failed
            // before its answer started.
            tracker.finish(e.code());
            return Ok(e.error_response());
        }
    };
    let shape = Shape {
        endpoint,
        id: response_id(endpoint, group),
        model,
        created,
        logprobs,
        prompt_tokens,
    };
    Ok(HttpResponse::Ok()
        .insert_header(("X-Request-Id", group.to_string()))
        .content_type("application/json")
        .body(whole_body(&shape, &parts)))
}

/// What a `Last-Event-ID` names: a stream, the last position the client has, and the
/// chain hash there; or, for a request with several choices, the first choice's stream
/// and each choice's last position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId {
    /// The stream (the first choice's, for a group).
    pub stream: StreamId,
    /// The client's last position (`None`: it has nothing yet).
    pub position: Option<u32>,
    /// The chain hash after that position, when the id carries one.
    pub hash: Option<u64>,
    /// A group's positions, one per choice (empty: one stream).
    pub group: Vec<Option<u32>>,
}

/// `Last-Event-ID: <stream id>:<position>:<chain hash, 16 hex digits>` as token events
/// carry it, `<stream id>:<position>` (the final events', or an older client's), a bare
/// stream id (from the start), or `<stream id>:<p0>.<p1>…` (a request's choices: each
/// one's last position, `-` for none).
pub fn parse_last_event_id(value: &str) -> Result<EventId, ApiError> {
    let bad = || {
        ApiError::InvalidRequest {
        param: None,
        message: format!(
            "Last-Event-ID {value:?} is not `<stream id>:<position>[:<hash>]` as this server's events carry"
        ),
    }
    };
    let mut parts = value.trim().split(':');
    let stream = parts
        .next()
        .and_then(|id| id.parse::<StreamId>().ok())
        .ok_or_else(bad)?;
    let second = parts.next();
    if let Some(list) = second.filter(|p| p.contains('.')) {
        let group = parse_positions(list).ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        return Ok(EventId {
            stream,
            position: None,
            hash: None,
            group,
        });
    }
    let position = second
        .map(|p| p.parse::<u32>().map_err(|_| bad()))
        .transpose()?;
    let hash = parts
        .next()
        .map(|h| {
            (h.len() == 16)
                .then(|| u64::from_str_radix(h, 16).ok())
                .flatten()
                .ok_or_else(bad)
        })
        .transpose()?;
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(EventId {
        stream,
        position,
        hash,
        group: Vec::new(),
    })
}

/// The `Last-Event-ID` of a request, if it has one.
fn last_event_id(req: &HttpRequest) -> Result<Option<EventId>, ApiError> {
    match req.headers().get("last-event-id") {
        None => Ok(None),
        Some(v) => {
            let v = v.to_str().map_err(|_| ApiError::InvalidRequest {
                param: None,
                message: "Last-Event-ID is not text".into(),
            })?;
            parse_last_event_id(v).map(Some)
        }
    }
}

/// Reattaches a client to `stream`: what comes after `after`, then the live rest, as SSE.
/// A stream `identity` may not read is not found.
async fn reattach(
    state: &AppState,
    identity: &Identity,
    last: EventId,
    started: Instant,
) -> Result<HttpResponse, ApiError> {
    // One stream, or each choice of a group after its own position.
    let wanted: Vec<(u32, Option<u32>, Option<u64>)> = if last.group.is_empty() {
        vec![(0, last.position, last.hash)]
    } else {
        (0..last.group.len() as u32)
            .map(|i| (i, last.group[i as usize], None))
            .collect()
    };
    let slots = wanted
        .iter()
        .map(|_| admit(identity))
        .collect::<Result<Vec<_>, _>>()?;
    let mut members = Vec::with_capacity(wanted.len());
    let mut guards = Vec::with_capacity(wanted.len());
    let mut first = None;
    for &(choice, after, after_hash) in &wanted {
        let stream = member(last.stream, choice);
        let (tx, events) = unbounded_channel();
        guards.push(StreamGuard::new(stream, state.sessions.clone()));
        let attached = state
            .sessions
            .send(Attach {
                stream,
                after,
                after_hash,
                subscriber: tx,
                access: identity.access(),
            })
            .await??;
        if !last.group.is_empty() && attached.record.choice != choice {
            return Err(ApiError::StreamNotFound(format!(
                "stream {stream} is not choice {choice} of a request"
            )));
        }
        info!(%stream, ?after, key = %identity, "client reattached");
        members.push(Member {
            // One choice of several, read alone, keeps its index.
            choice: attached.record.choice,
            stream,
            events,
            done: false,
        });
        first.get_or_insert(attached);
    }
    let Some(attached) = first else {
        return Err(ApiError::StreamNotFound(format!(
            "no stream {}",
            last.stream
        )));
    };
    let group = StreamId(last.stream.0.wrapping_sub(u128::from(members[0].choice)));
    let record = attached.record;
    let resumed = last.position.is_some() || last.group.iter().any(Option::is_some);
    let answer = Answer {
        endpoint: record.endpoint,
        group,
        model: record.request.model,
        created: record.created,
        include_usage: record.include_usage,
        logprobs: record.request.params.logprobs.is_some(),
        prompt_tokens: attached.prompt_tokens,
        members,
        guards,
        slots,
        started,
    };
    Ok(sse_response(state, answer, resumed))
}

/// `GET /v1/streams/{id}`: a stream's events as SSE, from the start or after the
/// request's `Last-Event-ID`.
async fn stream_events(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let identity = identity(&req, &state.keys)?;
    let stream = path
        .parse::<StreamId>()
        .map_err(|_| ApiError::StreamNotFound(format!("{:?} is not a stream id", path.as_str())))?;
    let last = match last_event_id(&req)? {
        Some(last) if last.stream == stream => last,
        Some(_) => {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: "Last-Event-ID names another stream".into(),
            })
        }
        None => EventId {
            stream,
            position: None,
            hash: None,
            group: Vec::new(),
        },
    };
    reattach(&state, &identity, last, Instant::now()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_event_ids_parse() {
        let id = StreamId(0xabc);
        let event = |position, hash| EventId {
            stream: id,
            position,
            hash,
            group: Vec::new(),
        };
        assert_eq!(
            parse_last_event_id(&format!("{id}:17:00000000deadbeef")).expect("parse"),
            event(Some(17), Some(0xdead_beef))
        );
        assert_eq!(
            parse_last_event_id(&format!("{id}:17")).expect("parse"),
            event(Some(17), None)
        );
        assert_eq!(
            parse_last_event_id(&id.to_string()).expect("parse"),
            event(None, None)
        );
        assert_eq!(
            parse_last_event_id(&format!("{id}:4.-.9"))
                .expect("parse")
                .group,
            vec![Some(4), None, Some(9)]
        );
        for bad in [
            "",
            "nope:1",
            &format!("{id}:x"),
            &format!("{id}:-1"),
            &format!("{id}:1:beef"),
            &format!("{id}:1:00000000deadbeeg"),
            &format!("{id}:1:00000000deadbeef:2"),
            &format!("{id}:1.2:00000000deadbeef"),
            &format!("{id}:1.x"),
        ] {
            assert!(parse_last_event_id(bad).is_err(), "{bad:?}");
        }
    }
}
