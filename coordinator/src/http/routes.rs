//! The HTTP handlers.
//!
//! A generation request is validated, routed to a worker, given a session (before the
//! submit: tokens may arrive before the reply), submitted, and then answered either as
//! one JSON body or as Server-Sent Events. A worker that is gone, full or draining is
//! skipped for another one, a few times at most.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::http::header::{self, HeaderValue};
use actix_web::web::{self, Bytes, BytesMut};
use actix_web::{HttpRequest, HttpResponse};
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{ErrorKind, EventKind, FinishReason, SeqRequest, SubmitOutcome};
use futures::StreamExt;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tracing::{debug, info};

use super::error::ApiError;
use super::openai::{
    ChatChoice, ChatCompletion, ChatMessageOut, Completion, CompletionChoice, ModelCard, ModelList,
    Usage,
};
use super::sse::{response_id, ChunkWriter, SseStream};
use super::validate::{Endpoint, ValidRequest};
use super::AppState;
use crate::actors::messages::{CheckHealth, ListModels, OpenSession, RouteStream};
use crate::actors::registry::HealthStatus;
use crate::actors::sessions::SessionGuard;
use crate::nats::SubmitError;

/// Most workers one request is offered to before giving up.
pub const MAX_SUBMIT_ATTEMPTS: usize = 3;

/// Registers every route on `cfg`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/chat/completions", web::post().to(chat_completions))
        .route("/v1/completions", web::post().to(completions))
        .route("/v1/models", web::get().to(models))
        .route("/health", web::get().to(health));
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
    let body = read_body(&req, payload, state.config.max_body_bytes).await?;
    let request = ValidRequest::chat(&body, &state.config)?;
    generate(&state, request).await
}

async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body = read_body(&req, payload, state.config.max_body_bytes).await?;
    let request = ValidRequest::completion(&body, &state.config)?;
    generate(&state, request).await
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

/// Reads the body, refusing more than `limit` bytes with a 413.
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let mut body = BytesMut::with_capacity(declared.unwrap_or(0));
    while let Some(chunk) = payload.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::MalformedJson(format!("cannot read the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::BodyTooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// A stream a worker accepted.
struct Accepted {
    events: UnboundedReceiver<EventKind>,
    guard: SessionGuard,
    prompt_tokens: u32,
}

async fn generate(state: &AppState, request: ValidRequest) -> Result<HttpResponse, ApiError> {
    let accepted = submit(state, &request).await?;
    let created = unix_now();
    let idle_timeout = Duration::from_millis(state.config.stream_timeout_ms);
    let stream = accepted.guard.stream();
    if request.stream {
        let body = SseStream {
            events: accepted.events,
            guard: accepted.guard,
            writer: ChunkWriter::new(request.endpoint, stream, request.model.clone(), created),
            idle_timeout,
            include_usage: request.include_usage,
            prompt_tokens: accepted.prompt_tokens,
        };
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header((header::CACHE_CONTROL, HeaderValue::from_static("no-cache")))
            .insert_header(("X-Accel-Buffering", HeaderValue::from_static("no")))
            .streaming(body.into_body()));
    }
    let (text, reason, usage) = collect(accepted, &request.model, idle_timeout).await?;
    let id = response_id(request.endpoint, stream);
    Ok(match request.endpoint {
        Endpoint::Chat => HttpResponse::Ok().json(ChatCompletion {
            id,
            object: "chat.completion",
            created,
            model: request.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant",
                    content: text,
                },
                logprobs: None,
                finish_reason: reason.openai(),
            }],
            usage,
        }),
        Endpoint::Completion => HttpResponse::Ok().json(Completion {
            id,
            object: "text_completion",
            created,
            model: request.model,
            choices: vec![CompletionChoice {
                text,
                index: 0,
                logprobs: None,
                finish_reason: Some(reason.openai()),
            }],
            usage: Some(usage),
        }),
    })
}

/// Waits for a whole answer.
async fn collect(
    mut accepted: Accepted,
    model: &str,
    idle_timeout: Duration,
) -> Result<(String, FinishReason, Usage), ApiError> {
    let mut text = String::new();
    loop {
        let event = match tokio::time::timeout(idle_timeout, accepted.events.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => return Err(ApiError::Internal("the stream's session closed".into())),
            Err(_) => {
                let ms = u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX);
                return Err(ApiError::StreamTimeout(ms));
            }
        };
        match event {
            EventKind::Token(token) => text.push_str(&token.text),
            EventKind::Finished(f) => {
                accepted.guard.finish();
                let prompt = if f.prompt_tokens > 0 {
                    f.prompt_tokens
                } else {
                    accepted.prompt_tokens
                };
                return Ok((text, f.reason, Usage::new(prompt, f.completion_tokens)));
            }
            EventKind::Failed(error) => {
                accepted.guard.finish();
                return Err(ApiError::from_worker(error, model));
            }
        }
    }
}

/// Routes and submits the request, trying another worker when one is gone, full or
/// draining.
async fn submit(state: &AppState, request: &ValidRequest) -> Result<Accepted, ApiError> {
    let mut exclude: Vec<WorkerId> = Vec::new();
    let mut last_error: Option<ApiError> = None;
    for _ in 0..MAX_SUBMIT_ATTEMPTS {
        let route = state
            .registry
            .send(RouteStream {
                model: request.model.clone(),
                exclude: exclude.clone(),
            })
            .await?;
        let worker = match route {
            Ok(worker) => worker,
            // A refusal from a worker says more than "no other worker".
            Err(e) => return Err(last_error.unwrap_or_else(|| e.into())),
        };
        let stream = StreamId::random();
        let (tx, events) = unbounded_channel();
        state
            .sessions
            .send(OpenSession {
                stream,
                worker,
                events: tx,
            })
            .await?;
        let mut guard = SessionGuard::new(
            stream,
            worker,
            state.sessions.clone(),
            state.registry.clone(),
        );
        let sequence = SeqRequest {
            stream,
            model: request.model.clone(),
            prompt: request.prompt.clone(),
            params: request.params.clone(),
        };
        let timeout = Duration::from_millis(state.config.submit_timeout_ms);
        let reply = match state.nats.submit(worker, vec![sequence], timeout).await {
            Ok(reply) => reply,
            Err(SubmitError::NoResponders) => {
                debug!(%worker, "worker gone, trying another");
                guard.finish();
                exclude.push(worker);
                last_error = Some(SubmitError::NoResponders.into());
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let outcome = reply.outcomes.into_iter().find(|o| match o {
            SubmitOutcome::Accepted(a) => a.stream == stream,
            SubmitOutcome::Refused(r) => r.stream == stream,
        });
        match outcome {
            Some(SubmitOutcome::Accepted(a)) => {
                info!(%stream, %worker, model = %request.model, prompt_tokens = a.prompt_tokens, "stream accepted");
                return Ok(Accepted {
                    events,
                    guard,
                    prompt_tokens: a.prompt_tokens,
                });
            }
            Some(SubmitOutcome::Refused(r)) => {
                guard.finish();
                let retry = matches!(r.error.kind, ErrorKind::Overloaded | ErrorKind::Draining);
                debug!(%stream, %worker, kind = r.error.kind.as_str(), "submit refused");
                let error = ApiError::from_worker(r.error, &request.model);
                if !retry {
                    return Err(error);
                }
                exclude.push(worker);
                last_error = Some(error);
            }
            None => {
                return Err(ApiError::WorkerFailed(format!(
                    "worker {worker} answered without an outcome for stream {stream}"
                )))
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ApiError::ModelUnavailable(request.model.clone())))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
