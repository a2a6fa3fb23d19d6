//! The NATS transport: requests on the public subjects, answers on a private inbox.
//!
//! Every reply message is numbered (`Baton-Seq`, from 0 on each inbox). When a number
//! is skipped, or nothing arrives for the idle timeout after the stream started, the
//! client asks for a replay after the last position it has, on a fresh inbox, from the
//! coordinator that served the stream: it sees each token once, in order.

use std::time::Duration;

use async_nats::{HeaderMap, Message, Subscriber};
use baton_common::config::NatsConfig;
use baton_common::public::{
    decode_reply, headers, ReplayRequest, Reply, CONTENT_TYPE_JSON, CONTENT_TYPE_RKYV,
};
use baton_common::subjects::Subjects;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::{
    api_error, choice_text, finish_of, ClientError, Completion, Event, EventStream, Finish, Request,
};

/// Most replays one stream asks for before it gives up.
const MAX_REPLAYS: u32 = 5;

/// The encoding of reply bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// OpenAI JSON, as any client gets.
    Json,
    /// rkyv-encoded [`Reply`]s.
    Rkyv,
}

/// A connection to the cluster's NATS.
#[derive(Debug, Clone)]
pub struct NatsTransport {
    client: async_nats::Client,
    subjects: Subjects,
    /// Reply encoding asked for.
    pub(crate) encoding: Encoding,
    /// Longest wait for the next message.
    pub(crate) idle: Duration,
}

/// What one reply message means.
#[derive(Debug)]
enum Decoded {
    Text(String),
    Finished(Finish),
    Whole(Completion),
    Value(Value),
}

/// The meta-data of a reply message, from its headers.
#[derive(Debug, Default)]
struct Meta {
    seq: Option<u64>,
    position: Option<u32>,
    stream: Option<String>,
    coordinator: Option<String>,
    last: bool,
    error: Option<String>,
}

impl Meta {
    fn of(msg: &Message) -> Meta {
        let Some(h) = msg.headers.as_ref() else {
            return Meta::default();
        };
        let get = |name: &str| h.get(name).map(|v| v.as_str().to_string());
        Meta {
            seq: get(headers::SEQ).and_then(|v| v.parse().ok()),
            position: get(headers::POSITION).and_then(|v| v.parse().ok()),
            stream: get(headers::STREAM_ID),
            coordinator: get(headers::COORDINATOR),
            last: get(headers::FINAL).is_some_and(|v| v == "true"),
            error: get(headers::ERROR),
        }
    }
}

impl NatsTransport {
    /// Connects to `url` without credentials.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, ClientError> {
        Self::connect_with(&NatsConfig {
            url: url.into(),
            subject_prefix: prefix.into(),
            ..NatsConfig::default()
        })
        .await
    }

    /// Connects with `config`'s URL, subject prefix, credentials and TLS settings.
    pub async fn connect_with(config: &NatsConfig) -> Result<Self, ClientError> {
        let client = baton_common::nats::connect(config, "baton-client").await?;
        Ok(Self {
            client,
            subjects: Subjects::new(config.subject_prefix.clone()),
            encoding: Encoding::Rkyv,
            idle: Duration::from_secs(120),
        })
    }

    fn headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        let content_type = match self.encoding {
            Encoding::Json => CONTENT_TYPE_JSON,
            Encoding::Rkyv => CONTENT_TYPE_RKYV,
        };
        h.insert(headers::CONTENT_TYPE, content_type);
        h
    }

    /// Publishes `body` on `subject` with a fresh inbox to answer on.
    async fn ask(&self, subject: String, body: Vec<u8>) -> Result<Subscriber, ClientError> {
        let inbox = self.client.new_inbox();
        let sub = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        self.client
            .publish_with_reply_and_headers(subject, inbox, self.headers(), body.into())
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(sub)
    }

    fn subject(&self, request: &Request) -> String {
        if request.is_chat() {
            self.subjects.chat_completions()
        } else {
            self.subjects.completions()
        }
    }

    /// Reads one message: its meta-data and what it says, or the error it carries.
    async fn receive(&self, sub: &mut Subscriber) -> Result<(Meta, Decoded), ClientError> {
        self.receive_within(sub, self.idle).await
    }

    /// [`NatsTransport::receive`], waiting at most `wait`.
    async fn receive_within(
        &self,
        sub: &mut Subscriber,
        wait: Duration,
    ) -> Result<(Meta, Decoded), ClientError> {
        let msg = match tokio::time::timeout(wait, sub.next()).await {
            Err(_) => return Err(ClientError::Timeout(wait)),
            Ok(None) => return Err(ClientError::Transport("the NATS connection closed".into())),
            Ok(Some(msg)) => msg,
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(ClientError::Transport(
                "no coordinator serves this subject (no responders)".into(),
            ));
        }
        let meta = Meta::of(&msg);
        let decoded = self.decode(&meta, &msg.payload)?;
        Ok((meta, decoded))
    }

    fn decode(&self, meta: &Meta, payload: &[u8]) -> Result<Decoded, ClientError> {
        match self.encoding {
            Encoding::Rkyv => {
                match decode_reply(payload).map_err(|e| ClientError::Protocol(e.to_string()))? {
                    Reply::Chunk(c) => Ok(Decoded::Text(c.text)),
                    Reply::Prompt(p) => Ok(Decoded::Text(p.text)),
                    Reply::Final(f) => Ok(Decoded::Finished(Finish {
                        reason: f.finish_reason,
                        prompt_tokens: f.prompt_tokens,
                        completion_tokens: f.completion_tokens,
                    })),
                    Reply::Whole(w) => Ok(Decoded::Whole(Completion {
                        id: w.id,
                        text: w.text,
                        finish: Finish {
                            reason: w.end.finish_reason,
                            prompt_tokens: w.end.prompt_tokens,
                            completion_tokens: w.end.completion_tokens,
                        },
                    })),
                    Reply::Error(e) => Err(ClientError::Api {
                        code: e.code,
                        message: e.message,
                    }),
                    Reply::Status(s) => serde_json::to_value(s)
                        .map(Decoded::Value)
                        .map_err(|e| ClientError::Protocol(e.to_string())),
                    Reply::Drained(d) => serde_json::to_value(d)
                        .map(Decoded::Value)
                        .map_err(|e| ClientError::Protocol(e.to_string())),
                    Reply::Tokenized(t) => Ok(Decoded::Value(t.json())),
                    Reply::Detokenized(d) => Ok(Decoded::Value(d.json())),
                    Reply::ModelsChanged(m) => serde_json::to_value(m)
                        .map(Decoded::Value)
                        .map_err(|e| ClientError::Protocol(e.to_string())),
                }
            }
            Encoding::Json => {
                let body: Value = serde_json::from_slice(payload)
                    .map_err(|e| ClientError::Protocol(format!("a reply is not JSON: {e}")))?;
                if meta.error.is_some() {
                    return Err(api_error(&body));
                }
                if meta.last {
                    // A stream's final chunk or a whole answer (a completion's chunks
                    // and whole answers share `"object": "text_completion"`): a stream
                    // reads a whole answer as its end.
                    return Ok(match finish_of(&body) {
                        Some(finish) => Decoded::Whole(Completion {
                            id: body["id"].as_str().unwrap_or_default().to_string(),
                            text: choice_text(&body).unwrap_or_default().to_string(),
                            finish,
                        }),
                        None => Decoded::Value(body),
                    });
                }
                Ok(Decoded::Text(
                    choice_text(&body).unwrap_or_default().to_string(),
                ))
            }
        }
    }

    /// Streams the answer to `request`, replaying after gaps.
    pub async fn stream(&self, request: &Request) -> Result<EventStream, ClientError> {
        let body = request.body(true).to_string().into_bytes();
        let sub = self.ask(self.subject(request), body).await?;
        let state = StreamState {
            transport: self.clone(),
            sub,
            expected: 0,
            last_position: None,
            stream: None,
            coordinator: None,
            replays: 0,
            ended: false,
        };
        Ok(Box::pin(futures::stream::unfold(
            state,
            |mut st| async move {
                if st.ended {
                    return None;
                }
                let item = st.next().await;
                if !matches!(item, Ok(Event::Text { .. })) {
                    st.ended = true;
                }
                Some((item, st))
            },
        )))
    }

    /// The whole answer to `request`.
    pub async fn generate(&self, request: &Request) -> Result<Completion, ClientError> {
        let body = request.body(false).to_string().into_bytes();
        let mut sub = self.ask(self.subject(request), body).await?;
        match self.receive(&mut sub).await?.1 {
            Decoded::Whole(c) => Ok(c),
            other => Err(ClientError::Protocol(format!(
                "expected a whole answer, got {other:?}"
            ))),
        }
    }

    async fn single(&self, subject: String, body: Vec<u8>) -> Result<Value, ClientError> {
        self.single_within(subject, body, self.idle).await
    }

    async fn single_within(
        &self,
        subject: String,
        body: Vec<u8>,
        wait: Duration,
    ) -> Result<Value, ClientError> {
        let mut sub = self.ask(subject, body).await?;
        match self.receive_within(&mut sub, wait).await?.1 {
            Decoded::Value(v) => Ok(v),
            other => Err(ClientError::Protocol(format!("unexpected reply {other:?}"))),
        }
    }

    /// The admin status.
    pub async fn status(&self) -> Result<Value, ClientError> {
        self.single(self.subjects.admin_status(), b"{}".to_vec())
            .await
    }

    /// Loads a model on the worker `body` names.
    pub async fn load_model(&self, body: &Value) -> Result<Value, ClientError> {
        let body = body.to_string().into_bytes();
        // The coordinator gives a load up to 10 minutes (hashing and loading a large
        // file from a slow disk): its answer is waited for a little longer.
        let wait = self.idle.max(Duration::from_secs(630));
        self.single_within(self.subjects.admin_load_model(), body, wait)
            .await
    }

    /// Stops `worker` serving `model`.
    pub async fn unload_model(&self, worker: &str, model: &str) -> Result<Value, ClientError> {
        let body = json!({"worker": worker, "model": model})
            .to_string()
            .into_bytes();
        self.single(self.subjects.admin_unload_model(), body).await
    }

    /// Drains `worker`.
    pub async fn drain(&self, worker: &str) -> Result<Value, ClientError> {
        let body = json!({"worker": worker}).to_string().into_bytes();
        self.single(self.subjects.admin_drain(), body).await
    }
}

/// Where a streamed answer stands.
struct StreamState {
    transport: NatsTransport,
    sub: Subscriber,
    /// The next `Baton-Seq` on the current inbox.
    expected: u64,
    /// The last token position delivered.
    last_position: Option<u32>,
    stream: Option<String>,
    coordinator: Option<String>,
    replays: u32,
    ended: bool,
}

impl StreamState {
    async fn next(&mut self) -> Result<Event, ClientError> {
        loop {
            let (meta, decoded) = match self.transport.receive(&mut self.sub).await {
                Err(ClientError::Timeout(_)) if self.stream.is_some() => {
                    self.replay().await?;
                    continue;
                }
                other => other?,
            };
            if self.stream.is_none() {
                self.stream = meta.stream.clone();
                self.coordinator = meta.coordinator.clone();
            }
            if meta.seq.is_some_and(|s| s != self.expected) {
                self.replay().await?;
                continue;
            }
            self.expected += 1;
            match decoded {
                Decoded::Text(text) => {
                    let position = meta.position.unwrap_or(0);
                    if self.last_position.is_some_and(|p| position <= p) {
                        continue; // already delivered
                    }
                    self.last_position = Some(position);
                    return Ok(Event::Text { position, text });
                }
                Decoded::Finished(f) | Decoded::Whole(Completion { finish: f, .. }) => {
                    return Ok(Event::Finished(f))
                }
                other => {
                    return Err(ClientError::Protocol(format!(
                        "unexpected message in a stream: {other:?}"
                    )))
                }
            }
        }
    }

    /// Asks the stream's coordinator for everything after the last position, on a
    /// fresh inbox.
    async fn replay(&mut self) -> Result<(), ClientError> {
        let stream = self
            .stream
            .as_deref()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| ClientError::Protocol("a gap before the stream's id is known".into()))?;
        self.replays += 1;
        if self.replays > MAX_REPLAYS {
            return Err(ClientError::Protocol(format!(
                "still losing messages after {MAX_REPLAYS} replays"
            )));
        }
        let request = ReplayRequest {
            stream,
            after: self.last_position,
            coordinator: self.coordinator.as_deref().and_then(|c| c.parse().ok()),
        };
        let body =
            serde_json::to_vec(&request).map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.sub = self
            .transport
            .ask(self.transport.subjects.replay(), body)
            .await?;
        self.expected = 0;
        Ok(())
    }
}
