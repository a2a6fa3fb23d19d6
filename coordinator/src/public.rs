//! The public NATS API: completions, chat completions, replays and admin requests for
//! clients that speak NATS instead of HTTP.
//!
//! Every coordinator serves the public subjects in one queue group
//! ([`baton_common::public::QUEUE_GROUP`]), so NATS spreads requests over them. A
//! request is validated exactly as the HTTP API does ([`ValidRequest`]) and opens a
//! stream session the same way; its answer goes to the request's reply inbox, one
//! message per chunk, numbered by `Baton-Seq`, ending with a `Baton-Final` or a
//! `Baton-Error` message. Replays attach to a stream's session ([`Attach`]); one that
//! names another coordinator is forwarded to that coordinator's own replay subject.
//!
//! Nothing a client sends can stop this loop: every request that fails validation is
//! counted in [`PublicCounters`] and answered with an error message (when it has a reply
//! inbox). `docs/protocol.md` describes the messages.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use async_nats::client::RequestErrorKind;
use async_nats::{Client, HeaderMap, Message, Subject, Subscriber};
use baton_common::config::CoordinatorConfig;
use baton_common::ids::{CoordinatorId, StreamId};
use baton_common::protocol::{FinishReason, TokenLogprobs};
use baton_common::public::{
    encode_reply, headers, Chunk, ClusterStatus, CoordinatorStatus, DrainRequest, Drained,
    ErrorReply, Final, LoadModelRequest, LoadStatus, ModelStatus, ModelsChanged, ReplayRequest,
    Reply, UnloadModelRequest, Whole, WorkerStatus, CONTENT_TYPE_JSON, CONTENT_TYPE_RKYV,
    QUEUE_GROUP,
};
use baton_common::throttle::Throttle;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;
use tracing::{debug, info, warn};

use crate::actors::messages::{CheckHealth, ListModels, ListWorkers};
use crate::actors::registry::{HealthStatus, Registry};
use crate::api::answer::{gather, whole_body, Read, Reader, Shape};
use crate::api::choices::Member;
use crate::api::chunks::{response_id, ChunkWriter};
use crate::api::error::ApiError;
use crate::api::open::{open_streams, StreamGuard};
use crate::api::openai::Usage;
use crate::api::tokenize::{self, Direction};
use crate::api::validate::{Endpoint, ValidRequest};
use crate::auth::StreamAccess;
use crate::nats::NatsHandle;
use crate::sessions::{Attach, AttachError, Sessions};

/// What the public API has taken.
#[derive(Debug, Default)]
pub struct PublicCounters {
    /// Requests received on the public subjects.
    pub requests: AtomicU64,
    /// Requests refused as malformed: not JSON, wrong fields, out-of-range values,
    /// unknown model or stream, no reply inbox.
    pub malformed: AtomicU64,
}

impl PublicCounters {
    /// Requests so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Malformed requests so far.
    pub fn malformed(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }
}

/// Requests without a reply inbox are logged once a second (with the count held back).
static NO_INBOX_WARNINGS: Throttle = Throttle::new(Duration::from_secs(1));

/// Which public subject a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Generate(Endpoint),
    /// The shared replay subject (may forward).
    Replay,
    /// This coordinator's own replay subject (never forwards).
    OwnReplay,
    Status,
    Drain,
    LoadModel,
    UnloadModel,
    Tokenize(Direction),
}

/// The public API of one coordinator.
#[derive(Clone)]
pub struct PublicApi {
    /// This coordinator's NATS connection.
    nats: NatsHandle,
    /// Limits and timeouts, as for HTTP.
    config: Arc<CoordinatorConfig>,
    /// Workers, for routing and status.
    registry: Addr<Registry>,
    /// Stream sessions.
    sessions: Addr<Sessions>,
    /// What the API has taken.
    counters: Arc<PublicCounters>,
}

impl PublicApi {
    /// The API over these actors; nothing is subscribed until [`PublicApi::serve`].
    pub fn new(
        nats: NatsHandle,
        config: Arc<CoordinatorConfig>,
        registry: Addr<Registry>,
        sessions: Addr<Sessions>,
    ) -> Self {
        Self {
            nats,
            config,
            registry,
            sessions,
            counters: Arc::new(PublicCounters::default()),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> &Arc<PublicCounters> {
        &self.counters
    }

    /// Subscribes to the public subjects and serves them from tasks on the current
    /// arbiter, one task per request.
    pub async fn serve(&self) -> Result<(), async_nats::SubscribeError> {
        let client = self.nats.client().clone();
        let subjects = self.nats.subjects().clone();
        let own = self.nats.coordinator();
        let shared = [
            (
                subjects.completions(),
                Route::Generate(Endpoint::Completion),
            ),
            (subjects.chat_completions(), Route::Generate(Endpoint::Chat)),
            (subjects.replay(), Route::Replay),
            (subjects.admin_status(), Route::Status),
            (subjects.admin_drain(), Route::Drain),
            (subjects.admin_load_model(), Route::LoadModel),
            (subjects.admin_unload_model(), Route::UnloadModel),
            (subjects.tokenize(), Route::Tokenize(Direction::Tokenize)),
            (
                subjects.detokenize(),
                Route::Tokenize(Direction::Detokenize),
            ),
        ];
        for (subject, route) in shared {
            let sub = client
                .queue_subscribe(subject.clone(), QUEUE_GROUP.into())
                .await?;
            self.spawn_loop(sub, route, subject);
        }
        let subject = subjects.coordinator_replay(own);
        let sub = client.subscribe(subject.clone()).await?;
        self.spawn_loop(sub, Route::OwnReplay, subject);
        if let Err(e) = client.flush().await {
            warn!(error = %e, "NATS flush failed");
        }
        info!(prefix = subjects.prefix(), "public NATS API serving");
        Ok(())
    }

    fn spawn_loop(&self, mut sub: Subscriber, route: Route, subject: String) {
        let api = self.clone();
        actix::spawn(async move {
            while let Some(msg) = sub.next().await {
                actix::spawn(api.clone().handle(route, msg));
            }
            warn!(%subject, "public subscription ended");
        });
    }

    /// Answers one request; never fails (errors become error messages).
    async fn handle(self, route: Route, msg: Message) {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let Some(inbox) = msg.reply.clone() else {
            self.counters.malformed.fetch_add(1, Ordering::Relaxed);
            if let Some(held) = NO_INBOX_WARNINGS.admit() {
                warn!(subject = %msg.subject, bytes = msg.payload.len(), held_back = held, "public request without a reply inbox dropped");
            }
            return;
        };
        let mut out = Replier::new(
            self.nats.client().clone(),
            inbox,
            Format::of(msg.headers.as_ref()),
            self.nats.coordinator(),
        );
        let probe = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(headers::PROBE))
            .is_some_and(|v| v.as_str() == "true");
        if route == Route::OwnReplay && probe {
            out.send(Kind::Single, b"{}".to_vec()).await;
            return;
        }
        let result = if msg.payload.len() > self.config.max_body_bytes {
            Err(ApiError::BodyTooLarge {
                limit: self.config.max_body_bytes,
            })
        } else {
            match route {
                Route::Generate(endpoint) => self.generate(endpoint, &msg.payload, &mut out).await,
                Route::Replay => self.replay(&msg, true, &mut out).await,
                Route::OwnReplay => self.replay(&msg, false, &mut out).await,
                Route::Status => self.status(&mut out).await,
                Route::Drain => self.drain(&msg.payload, &mut out).await,
                Route::LoadModel => self.load_model(&msg.payload, &mut out).await,
                Route::UnloadModel => self.unload_model(&msg.payload, &mut out).await,
                Route::Tokenize(direction) => {
                    self.tokenize(direction, &msg.payload, &mut out).await
                }
            }
        };
        if let Err(error) = result {
            if malformed(&error) {
                self.counters.malformed.fetch_add(1, Ordering::Relaxed);
            }
            debug!(subject = %msg.subject, code = error.code(), %error, "public request failed");
            out.error(&error).await;
        }
    }

    async fn generate(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        out: &mut Replier,
    ) -> Result<(), ApiError> {
        let request = ValidRequest::parse(endpoint, body, &self.config)?;
        // Held until the answer is out: then the sessions may stop the streams.
        let opened = open_streams(&self.sessions, &request, None).await?;
        let _guards = opened.guards;
        let asked = request.params.logprobs.is_some();
        let answer = Answer::new(
            endpoint,
            opened.group,
            request.model,
            opened.created,
            asked,
            opened.prompt_tokens,
            opened.members,
            Duration::from_millis(self.config.stream_timeout_ms),
        );
        if request.stream {
            self.forward(answer, out).await
        } else {
            self.whole(answer, out).await
        }
    }

    /// Sends every update as a chunk, then each choice's final message (the last one
    /// marked final, with the usage of all).
    async fn forward(&self, mut answer: Answer, out: &mut Replier) -> Result<(), ApiError> {
        let n = answer.reader.members().len();
        // rkyv replies: logprobs of tokens whose text is still held back, per choice.
        let mut pending: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); n];
        let mut usages: Vec<Option<Usage>> = vec![None; n];
        loop {
            let read = answer.reader.next(None).await?;
            let i = match &read {
                Read::Prompt(i, _) | Read::Finished(i, _) => *i,
                Read::Token { choice, .. } => *choice,
                Read::Quiet => continue,
                Read::Done => return Ok(()),
            };
            let member = &answer.reader.members()[i];
            out.stream = Some(member.stream);
            out.choice = (n > 1).then_some(member.choice);
            let last = answer.reader.members().iter().all(|m| m.done);
            let writer = &mut answer.writers[i];
            match read {
                Read::Prompt(_, p) => {
                    let payload = match out.format {
                        Format::Json => writer.prompt(&p).into_bytes(),
                        Format::Rkyv => encode_reply(&Reply::Prompt(p)),
                    };
                    out.send(Kind::Prompt, payload).await;
                }
                Read::Token {
                    index,
                    text,
                    logprobs,
                    tool_calls,
                    ..
                } => {
                    let payload = match out.format {
                        Format::Json => writer
                            .token(&text, logprobs.as_ref(), &tool_calls)
                            .map(String::into_bytes),
                        Format::Rkyv => {
                            pending[i].extend(logprobs);
                            (!text.is_empty() || !tool_calls.is_empty()).then(|| {
                                encode_reply(&Reply::Chunk(Chunk {
                                    text,
                                    logprobs: std::mem::take(&mut pending[i]),
                                    tool_calls,
                                }))
                            })
                        }
                    };
                    if let Some(payload) = payload {
                        out.send(Kind::Chunk(index), payload).await;
                    }
                }
                Read::Finished(_, f) => {
                    let usage = Usage::finished(&f, answer.prompt_tokens);
                    usages[i] = Some(usage);
                    let payload = match out.format {
                        Format::Json => {
                            let chunk = writer.finish(f.reason);
                            let mut value: Value = serde_json::from_str(&chunk)
                                .map_err(|e| ApiError::Internal(e.to_string()))?;
                            if last {
                                value["usage"] =
                                    json!(Usage::of_choices(usages.iter().flatten().copied()));
                            }
                            value.to_string().into_bytes()
                        }
                        Format::Rkyv => encode_reply(&Reply::Final(Final {
                            logprobs: std::mem::take(&mut pending[i]),
                            ..final_of(f.reason, usage)
                        })),
                    };
                    if last {
                        out.send(Kind::Final(f.completion_tokens), payload).await;
                        return Ok(());
                    }
                    out.send(Kind::Chunk(f.completion_tokens), payload).await;
                }
                Read::Quiet | Read::Done => {}
            }
        }
    }

    /// Gathers the whole answer and sends it as one message (rkyv: one per choice, the
    /// last marked final).
    async fn whole(&self, mut answer: Answer, out: &mut Replier) -> Result<(), ApiError> {
        let parts = gather(&mut answer.reader, || {}).await?;
        let n = parts.len();
        let shape = Shape {
            endpoint: answer.endpoint,
            id: response_id(answer.endpoint, answer.group),
            model: answer.model.clone(),
            created: answer.created,
            logprobs: answer.logprobs,
            prompt_tokens: answer.prompt_tokens,
        };
        let generated: u32 = parts.iter().map(|p| p.finished.completion_tokens).sum();
        match out.format {
            Format::Json => {
                let payload = whole_body(&shape, &parts).into_bytes();
                out.stream = Some(answer.group);
                out.send(Kind::Final(generated), payload).await;
            }
            Format::Rkyv => {
                for (i, part) in parts.into_iter().enumerate() {
                    let member = &answer.reader.members()[i];
                    out.stream = Some(member.stream);
                    out.choice = (n > 1).then_some(member.choice);
                    let f = part.finished;
                    let usage = Usage::finished(&f, answer.prompt_tokens);
                    let payload = encode_reply(&Reply::Whole(Whole {
                        id: shape.id.clone(),
                        model: answer.model.clone(),
                        text: part.text,
                        logprobs: part.logprobs,
                        prompt: part.prompt,
                        tool_calls: part.tool_calls,
                        end: final_of(f.reason, usage),
                    }));
                    let kind = if i + 1 == n {
                        Kind::Final(f.completion_tokens)
                    } else {
                        Kind::Chunk(f.completion_tokens)
                    };
                    out.send(kind, payload).await;
                }
            }
        }
        Ok(())
    }

    async fn replay(&self, msg: &Message, shared: bool, out: &mut Replier) -> Result<(), ApiError> {
        let request: ReplayRequest = serde_json::from_slice(&msg.payload)
            .map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        let own = self.nats.coordinator();
        let mut gone = None;
        if let Some(owner) = request.coordinator.filter(|c| shared && *c != own) {
            // Another coordinator holds the stream: it answers the same inbox, once it is
            // known to be there (else nobody would answer at all).
            let subject = self.nats.subjects().coordinator_replay(owner);
            match self.probe_coordinator(owner, &subject).await {
                Ok(()) => {
                    let headers = msg.headers.clone().unwrap_or_default();
                    return self
                        .nats
                        .client()
                        .publish_with_reply_and_headers(
                            subject,
                            out.inbox.clone(),
                            headers,
                            msg.payload.clone(),
                        )
                        .await
                        .map_err(|e| {
                            ApiError::Internal(format!("cannot forward the replay: {e}"))
                        });
                }
                // It is gone: with checkpoints in JetStream, the stream is read (or taken
                // over) here.
                Err(e @ ApiError::StreamNotFound(_)) => gone = Some(e),
                Err(e) => return Err(e),
            }
        }
        let stream = request.stream;
        let (tx, events) = unbounded_channel();
        let _guard = StreamGuard::new(stream, self.sessions.clone());
        let attached = match self
            .sessions
            .send(Attach {
                stream,
                after: request.after,
                // The public NATS API's replays name a position only.
                after_hash: None,
                subscriber: tx,
                // NATS clients pass NATS's own credentials, not API keys.
                access: StreamAccess::Any,
            })
            .await?
        {
            Err(AttachError::Unknown(_)) if gone.is_some() => return Err(gone.expect("checked")),
            attached => attached?,
        };
        debug!(%stream, after = ?request.after, "NATS client replays a stream");
        out.stream = Some(stream);
        let record = attached.record;
        let asked = record.request.params.logprobs.is_some();
        // A choice of a request with several replays alone: its chunks keep its index.
        let member = Member {
            choice: record.choice,
            stream,
            events,
            done: false,
        };
        let group = StreamId(stream.0.wrapping_sub(u128::from(record.choice)));
        let mut answer = Answer::new(
            record.endpoint,
            group,
            record.request.model,
            record.created,
            asked,
            attached.prompt_tokens,
            vec![member],
            Duration::from_millis(self.config.stream_timeout_ms),
        );
        if request.after.is_some() {
            answer.writers[0].role_sent();
        }
        self.forward(answer, out).await
    }

    /// Checks that coordinator `owner` answers on its replay `subject`.
    async fn probe_coordinator(&self, owner: CoordinatorId, subject: &str) -> Result<(), ApiError> {
        let mut probe = HeaderMap::new();
        probe.insert(headers::PROBE, "true");
        let timeout = Duration::from_millis(self.config.submit_timeout_ms);
        let request = async_nats::Request::new()
            .headers(probe)
            .payload(Vec::new().into())
            .timeout(Some(timeout));
        match self
            .nats
            .client()
            .send_request(subject.to_string(), request)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                Err(ApiError::StreamNotFound(format!(
                    "the stream is held by coordinator {owner}, which is not running (nothing \
                     answers on its replay subject); its streams cannot be replayed"
                )))
            }
            Err(e) => Err(ApiError::WorkerTimeout(format!(
                "coordinator {owner} did not answer a replay probe: {e}"
            ))),
        }
    }

    /// `/tokenize` and `/detokenize`: one final message.
    async fn tokenize(
        &self,
        direction: Direction,
        body: &[u8],
        out: &mut Replier,
    ) -> Result<(), ApiError> {
        let request = tokenize::parse(direction, body)?;
        let timeout = Duration::from_millis(self.config.submit_timeout_ms);
        let answer = tokenize::run(&self.registry, &self.nats, timeout, request).await?;
        let payload = match out.format {
            Format::Json => to_json_bytes(&answer.json()),
            Format::Rkyv => encode_reply(&match answer {
                tokenize::Answer::Tokens(t) => Reply::Tokenized(t),
                tokenize::Answer::Text(d) => Reply::Detokenized(d),
            }),
        };
        out.send(Kind::Single, payload).await;
        Ok(())
    }

    async fn status(&self, out: &mut Replier) -> Result<(), ApiError> {
        let workers = self.registry.send(ListWorkers).await?;
        let health = self.registry.send(CheckHealth).await?;
        let models = self.registry.send(ListModels).await?;
        let mut load = LoadStatus::default();
        let workers: Vec<WorkerStatus> = workers
            .into_iter()
            .map(|w| {
                let h = w.heartbeat;
                load.capacity += u64::from(h.capacity);
                load.running += u64::from(h.running);
                load.queued += u64::from(h.queued);
                load.kv_used_bytes += h.kv_used_bytes;
                load.kv_budget_bytes += h.kv_budget_bytes;
                WorkerStatus {
                    id: h.worker,
                    models: h.models.into_iter().map(|m| m.name).collect(),
                    capacity: h.capacity,
                    running: h.running,
                    queued: h.queued,
                    kv_used_bytes: h.kv_used_bytes,
                    kv_budget_bytes: h.kv_budget_bytes,
                    draining: h.draining,
                    version: h.version,
                    last_seen_ms: u64::try_from(w.silent_for.as_millis()).unwrap_or(u64::MAX),
                    in_flight: w.in_flight,
                }
            })
            .collect();
        let models = models
            .into_iter()
            .map(|m| ModelStatus {
                workers: workers.iter().filter(|w| w.models.contains(&m.id)).count() as u32,
                name: m.id,
                context_length: m.context_length,
            })
            .collect();
        let status = ClusterStatus {
            coordinator: CoordinatorStatus {
                id: self.nats.coordinator(),
                requests: self.counters.requests(),
                malformed_requests: self.counters.malformed(),
                garbage: self.nats.counters().garbage(),
            },
            health: match health {
                HealthStatus::Live { .. } => "ok",
                HealthStatus::NotSynced => "not synced",
                HealthStatus::NoLiveWorkers => "no live workers",
            }
            .to_string(),
            workers,
            models,
            load,
        };
        let payload = match out.format {
            Format::Json => to_json_bytes(&status),
            Format::Rkyv => encode_reply(&Reply::Status(status)),
        };
        out.send(Kind::Single, payload).await;
        Ok(())
    }

    async fn drain(&self, body: &[u8], out: &mut Replier) -> Result<(), ApiError> {
        let value: Value =
            serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        if value.get("worker").is_none_or(Value::is_null) {
            return Err(ApiError::MissingField("worker"));
        }
        let request: DrainRequest = serde_json::from_value(value).map_err(|e| {
            ApiError::invalid("worker", format!("`worker` must be a worker id: {e}"))
        })?;
        let worker = request.worker;
        let timeout = Duration::from_millis(self.config.submit_timeout_ms);
        let reply = self
            .nats
            .drain(
                worker,
                "an operator asked over NATS".into(),
                request.handover_after_ms,
                timeout,
            )
            .await
            .map_err(|e| ApiError::from_drain(worker, e))?;
        info!(%worker, running = reply.running, queued = reply.queued, "worker drains on an operator's request");
        let drained = Drained {
            worker: reply.worker,
            draining: true,
            running: reply.running,
            queued: reply.queued,
        };
        let payload = match out.format {
            Format::Json => to_json_bytes(&drained),
            Format::Rkyv => encode_reply(&Reply::Drained(drained)),
        };
        out.send(Kind::Single, payload).await;
        Ok(())
    }
}

impl PublicApi {
    /// `<p>.v1.admin.models.load`: `{"worker", "path", "sha256"?, "name"?, "add"?}`.
    async fn load_model(&self, body: &[u8], out: &mut Replier) -> Result<(), ApiError> {
        let request: LoadModelRequest = admin_body(body, &["worker", "path"])?;
        let worker = request.worker.ok_or(ApiError::MissingField("worker"))?;
        let changed = crate::api::models::load(&self.nats, worker, request).await?;
        info!(%worker, loaded = ?changed.loaded.as_ref().map(|m| &m.id), "model loaded on an operator's request (NATS)");
        self.send_models_changed(changed, out).await;
        Ok(())
    }

    /// `<p>.v1.admin.models.unload`: `{"worker", "model"}`.
    async fn unload_model(&self, body: &[u8], out: &mut Replier) -> Result<(), ApiError> {
        let request: UnloadModelRequest = admin_body(body, &["worker", "model"])?;
        let timeout = Duration::from_millis(self.config.submit_timeout_ms);
        let worker = request.worker;
        let changed =
            crate::api::models::unload(&self.nats, worker, request.model, timeout).await?;
        info!(%worker, "model unloaded on an operator's request (NATS)");
        self.send_models_changed(changed, out).await;
        Ok(())
    }

    async fn send_models_changed(&self, changed: ModelsChanged, out: &mut Replier) {
        let payload = match out.format {
            Format::Json => to_json_bytes(&changed),
            Format::Rkyv => encode_reply(&Reply::ModelsChanged(changed)),
        };
        out.send(Kind::Single, payload).await;
    }
}

/// An admin request's JSON body, each of `required` present (else that field is
/// named missing) before it is read as `T`.
fn admin_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    required: &[&'static str],
) -> Result<T, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
    if let Some(field) = required
        .iter()
        .find(|f| value.get(**f).is_none_or(Value::is_null))
    {
        return Err(ApiError::MissingField(field));
    }
    serde_json::from_value(value).map_err(|e| ApiError::MalformedJson(e.to_string()))
}

/// An accepted stream and how to shape its answer.
struct Answer {
    /// Shape each choice's chunks.
    writers: Vec<ChunkWriter>,
    endpoint: Endpoint,
    /// The request asked for logprobs.
    logprobs: bool,
    /// The first choice's stream: the response's id.
    group: StreamId,
    model: String,
    created: u64,
    prompt_tokens: u32,
    /// Each choice's updates, in order.
    reader: Reader,
}

impl Answer {
    #[allow(clippy::too_many_arguments)]
    fn new(
        endpoint: Endpoint,
        group: StreamId,
        model: String,
        created: u64,
        logprobs: bool,
        prompt_tokens: u32,
        members: Vec<Member>,
        idle: Duration,
    ) -> Self {
        let writers = members
            .iter()
            .map(|m| {
                ChunkWriter::new(endpoint, group, model.clone(), created, logprobs).choice(m.choice)
            })
            .collect();
        let model_for_errors = model.clone();
        Self {
            writers,
            endpoint,
            logprobs,
            group,
            model,
            created,
            prompt_tokens,
            reader: Reader::new(members, model_for_errors, idle),
        }
    }
}

/// Whether a failed request counts as malformed (the client's fault).
fn malformed(error: &ApiError) -> bool {
    match error {
        ApiError::MalformedJson(_)
        | ApiError::MissingField(_)
        | ApiError::InvalidRequest { .. }
        | ApiError::ModelNotFound(_)
        | ApiError::ContextLengthExceeded(_)
        | ApiError::BodyTooLarge { .. }
        | ApiError::RequestTooLarge(_)
        | ApiError::UnknownRoute(_)
        | ApiError::StreamNotFound(_)
        | ApiError::WorkerNotFound(_)
        | ApiError::ModelNotServed(_)
        | ApiError::WorkerDraining(_)
        | ApiError::MissingApiKey
        | ApiError::InvalidApiKey
        | ApiError::AdminKeyRequired(_) => true,
        ApiError::Overloaded(_)
        | ApiError::TooManyStreams { .. }
        | ApiError::TooManyConnections { .. }
        | ApiError::BodyTimeout(_)
        | ApiError::MethodNotAllowed(_)
        | ApiError::NotSynced
        | ApiError::NoLiveWorkers
        | ApiError::ModelUnavailable(_)
        | ApiError::WorkerTimeout(_)
        | ApiError::StreamTimeout(_)
        | ApiError::StreamDiverged(_)
        | ApiError::WorkerFailed(_)
        | ApiError::CheckpointsUnavailable(_)
        | ApiError::Internal(_) => false,
    }
}

fn final_of(reason: FinishReason, usage: Usage) -> Final {
    Final {
        finish_reason: reason.openai().to_string(),
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        cached_tokens: usage.prompt_tokens_details.cached_tokens,
        logprobs: Vec::new(),
    }
}

fn to_json_bytes<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"message":"serialization failed: {e}","type":"server_error","param":null,"code":"internal_error"}}}}"#).into_bytes()
    })
}

/// The body encoding a client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Rkyv,
}

impl Format {
    /// rkyv when the request's `Content-Type` (any case) says so; JSON otherwise.
    fn of(headers: Option<&HeaderMap>) -> Format {
        let rkyv = headers.is_some_and(|h| {
            h.iter().any(|(name, values)| {
                let name: &str = name.as_ref();
                name.eq_ignore_ascii_case(headers::CONTENT_TYPE)
                    && values
                        .iter()
                        .any(|v| v.as_str().trim().eq_ignore_ascii_case(CONTENT_TYPE_RKYV))
            })
        });
        if rkyv {
            Format::Rkyv
        } else {
            Format::Json
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Format::Json => CONTENT_TYPE_JSON,
            Format::Rkyv => CONTENT_TYPE_RKYV,
        }
    }
}

/// What a reply message is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// A chunk at this token position.
    Chunk(u32),
    /// The last message of a stream or a whole answer; generated tokens.
    Final(u32),
    /// The only message of an admin or tokenizer answer.
    Single,
    /// An echoed prompt, before a stream's chunks (no position: no token made it).
    Prompt,
}

/// Publishes the messages of one answer to one inbox, numbering them.
struct Replier {
    client: Client,
    inbox: Subject,
    format: Format,
    coordinator: CoordinatorId,
    /// The stream, once there is one.
    stream: Option<StreamId>,
    /// The choice of the next message, when the request asked for several.
    choice: Option<u32>,
    /// The next message's `Baton-Seq`.
    seq: u64,
}

impl Replier {
    fn new(client: Client, inbox: Subject, format: Format, coordinator: CoordinatorId) -> Self {
        Self {
            client,
            inbox,
            format,
            coordinator,
            stream: None,
            choice: None,
            seq: 0,
        }
    }

    fn headers(&mut self) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(headers::CONTENT_TYPE, self.format.content_type());
        h.insert(headers::COORDINATOR, self.coordinator.to_string());
        if let Some(stream) = self.stream {
            h.insert(headers::STREAM_ID, stream.to_string());
        }
        if let Some(choice) = self.choice {
            h.insert(headers::CHOICE, choice.to_string());
        }
        h.insert(headers::SEQ, self.seq.to_string());
        self.seq += 1;
        h
    }

    async fn send(&mut self, kind: Kind, payload: Vec<u8>) {
        // NATS drops a message over its limit: the client gets an error instead of
        // waiting for an answer that never comes.
        let limit = self.client.server_info().max_payload;
        if payload.len() > limit {
            let error = ApiError::InvalidRequest {
                param: None,
                message: format!(
                    "the answer is {} bytes, more than this NATS server's max_payload of \
                     {limit}: ask for it with \"stream\": true, or for fewer logprobs",
                    payload.len()
                ),
            };
            return self.error(&error).await;
        }
        let mut h = self.headers();
        match kind {
            Kind::Chunk(position) => h.insert(headers::POSITION, position.to_string()),
            Kind::Final(tokens) => {
                h.insert(headers::POSITION, tokens.to_string());
                h.insert(headers::FINAL, "true");
            }
            Kind::Single => h.insert(headers::FINAL, "true"),
            Kind::Prompt => {}
        }
        self.publish(h, payload).await;
    }

    async fn error(&mut self, error: &ApiError) {
        let mut h = self.headers();
        h.insert(headers::ERROR, error.code());
        let payload = match self.format {
            Format::Json => to_json_bytes(&error.body()),
            Format::Rkyv => encode_reply(&Reply::Error(ErrorReply {
                code: error.code().to_string(),
                kind: error.error_type().to_string(),
                param: error.param().map(str::to_string),
                message: error.to_string(),
            })),
        };
        self.publish(h, payload).await;
    }

    async fn publish(&self, headers: HeaderMap, payload: Vec<u8>) {
        if let Err(e) = self
            .client
            .publish_with_headers(self.inbox.clone(), headers, payload.into())
            .await
        {
            warn!(inbox = %self.inbox, error = %e, "public reply not published");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_follows_the_content_type_in_any_case() {
        assert_eq!(Format::of(None), Format::Json);
        let mut h = HeaderMap::new();
        h.insert("content-type", "Application/X-Baton-Rkyv");
        assert_eq!(Format::of(Some(&h)), Format::Rkyv);
        let mut h = HeaderMap::new();
        h.insert(headers::CONTENT_TYPE, CONTENT_TYPE_JSON);
        assert_eq!(Format::of(Some(&h)), Format::Json);
    }

    #[test]
    fn client_faults_are_malformed_and_server_faults_are_not() {
        assert!(malformed(&ApiError::MalformedJson("x".into())));
        assert!(malformed(&ApiError::ModelNotFound("m".into())));
        assert!(malformed(&ApiError::MissingField("model")));
        assert!(!malformed(&ApiError::NoLiveWorkers));
        assert!(!malformed(&ApiError::Overloaded("full".into())));
    }
}
