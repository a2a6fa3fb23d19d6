//! A Rust client of a Baton cluster, over HTTP (Server-Sent Events) or over the public
//! NATS API, and the `baton` command line built on it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), baton_client::ClientError> {
//! use baton_client::{Client, Event, Request};
//! use futures::StreamExt;
//!
//! let client = Client::connect_nats("nats://127.0.0.1:4222", "baton").await?;
//! let mut tokens = client.stream(&Request::completion("SmolLM2-135M-Instruct.Q4_1", "Once")).await?;
//! while let Some(event) = tokens.next().await {
//!     if let Event::Text { text, .. } = event? {
//!         print!("{text}");
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`http`]: the HTTP transport and its SSE reader.
//! - [`nats`]: the NATS transport: headers, sequence checks, replays after a gap.
//! - [`cli`]: the `baton` command line (`chat`, `complete`, `status`, `drain`, `bench`).
//! - [`bench`](mod@bench): per-token overhead of each transport, measured in one run.

pub mod bench;
pub mod cli;
pub mod http;
pub mod nats;

use std::pin::Pin;
use std::time::Duration;

use baton_common::config::NatsConfig;
use baton_common::secret::Secret;
use futures::Stream;
use serde_json::{json, Value};

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The cluster answered with an error (OpenAI's error body).
    #[error("{code}: {message}")]
    Api {
        /// Stable code (`model_not_found`, `invalid_json`, …).
        code: String,
        /// For people.
        message: String,
    },
    /// The connection failed.
    #[error("transport: {0}")]
    Transport(String),
    /// NATS could not be reached, refused the credentials, or failed TLS.
    #[error(transparent)]
    Connect(#[from] baton_common::nats::NatsConnectError),
    /// The cluster answered something this client does not understand.
    #[error("protocol: {0}")]
    Protocol(String),
    /// Nothing arrived in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// This transport cannot do that.
    #[error("{0}")]
    Unsupported(&'static str),
}

impl ClientError {
    /// The stable code of an API error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Text.
    pub content: String,
}

/// What to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A text completion's prompt.
    Text(String),
    /// A chat.
    Chat(Vec<Message>),
}

/// A generation request (the HTTP API's fields; unset ones take the server's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Model name.
    pub model: String,
    /// What to continue.
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Temperature (0: greedy).
    pub temperature: Option<f32>,
    /// Sampler seed.
    pub seed: Option<u64>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Request {
    /// A chat of one user message.
    pub fn chat(model: &str, user: &str) -> Self {
        Self::new(
            model,
            Prompt::Chat(vec![Message {
                role: "user".into(),
                content: user.into(),
            }]),
        )
    }

    /// A text completion.
    pub fn completion(model: &str, prompt: &str) -> Self {
        Self::new(model, Prompt::Text(prompt.into()))
    }

    fn new(model: &str, prompt: Prompt) -> Self {
        Self {
            model: model.into(),
            prompt,
            max_tokens: None,
            temperature: None,
            seed: None,
            ignore_eos: false,
        }
    }

    /// Whether this is a chat.
    pub fn is_chat(&self) -> bool {
        matches!(self.prompt, Prompt::Chat(_))
    }

    /// The JSON body (the same for HTTP and NATS).
    pub fn body(&self, stream: bool) -> Value {
        let mut body = json!({"model": self.model, "stream": stream});
        match &self.prompt {
            Prompt::Text(text) => body["prompt"] = json!(text),
            Prompt::Chat(messages) => {
                body["messages"] = messages
                    .iter()
                    .map(|m| json!({"role": m.role, "content": m.content}))
                    .collect();
            }
        }
        if let Some(n) = self.max_tokens {
            body["max_tokens"] = json!(n);
        }
        if let Some(t) = self.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(s) = self.seed {
            body["seed"] = json!(s);
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// `stop` or `length`.
    pub reason: String,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
}

/// One item of a streamed answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// New text, at its token position.
    Text {
        /// Position of the token that completed it.
        position: u32,
        /// The text.
        text: String,
    },
    /// The stream ended normally (the last item).
    Finished(Finish),
}

/// A whole answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// OpenAI's response id.
    pub id: String,
    /// The text.
    pub text: String,
    /// How it ended.
    pub finish: Finish,
}

/// A streamed answer.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, ClientError>> + Send>>;

/// How the client reaches the cluster.
#[derive(Debug, Clone)]
enum Transport {
    Http(http::HttpTransport),
    Nats(nats::NatsTransport),
}

/// A client of one cluster.
#[derive(Debug, Clone)]
pub struct Client {
    transport: Transport,
}

impl Client {
    /// A client of the HTTP API at `base` (`http://host:port`). No I/O yet.
    pub fn http(base: &str) -> Result<Self, ClientError> {
        Ok(Self {
            transport: Transport::Http(http::HttpTransport::new(base)?),
        })
    }

    /// Connects to NATS at `url` without credentials; subjects under `prefix`. Replies
    /// come as rkyv.
    pub async fn connect_nats(url: &str, prefix: &str) -> Result<Self, ClientError> {
        Ok(Self {
            transport: Transport::Nats(nats::NatsTransport::connect(url, prefix).await?),
        })
    }

    /// Connects to NATS as `config` says: its URL, subject prefix, credentials and TLS
    /// settings (see [`baton_common::nats`]). Replies come as rkyv.
    pub async fn connect_nats_with(config: &NatsConfig) -> Result<Self, ClientError> {
        Ok(Self {
            transport: Transport::Nats(nats::NatsTransport::connect_with(config).await?),
        })
    }

    /// Over NATS, asks for JSON replies (`json`) instead of rkyv; no effect over HTTP.
    pub fn json_replies(mut self, json: bool) -> Self {
        if let Transport::Nats(t) = &mut self.transport {
            t.encoding = if json {
                nats::Encoding::Json
            } else {
                nats::Encoding::Rkyv
            };
        }
        self
    }

    /// Sends `key` as `Authorization: Bearer <key>` with every HTTP request (a
    /// coordinator with API keys configured needs one); no effect over NATS, whose
    /// access is NATS's own.
    pub fn api_key(mut self, key: Secret) -> Self {
        if let Transport::Http(t) = &mut self.transport {
            t.api_key = Some(key);
        }
        self
    }

    /// Longest wait for the next message of an answer (default: two minutes).
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        match &mut self.transport {
            Transport::Http(t) => t.idle = timeout,
            Transport::Nats(t) => t.idle = timeout,
        }
        self
    }

    /// Streams the answer to `request`.
    pub async fn stream(&self, request: &Request) -> Result<EventStream, ClientError> {
        match &self.transport {
            Transport::Http(t) => t.stream(request).await,
            Transport::Nats(t) => t.stream(request).await,
        }
    }

    /// The whole answer to `request`.
    pub async fn generate(&self, request: &Request) -> Result<Completion, ClientError> {
        match &self.transport {
            Transport::Http(t) => t.generate(request).await,
            Transport::Nats(t) => t.generate(request).await,
        }
    }

    /// The cluster's state: over NATS the admin status (workers, models, load); over
    /// HTTP what `/health` and `/v1/models` say.
    pub async fn status(&self) -> Result<Value, ClientError> {
        match &self.transport {
            Transport::Http(t) => t.status().await,
            Transport::Nats(t) => t.status().await,
        }
    }

    /// Loads the model file `path` on `worker` (its SHA-256 given, or read from
    /// `<path>.sha256` there), served as `name` (default: the replaced model's name),
    /// in place of the served model of that name (or the only one) or, with `add`, beside
    /// the others. An admin order.
    pub async fn load_model(
        &self,
        worker: &str,
        path: &str,
        sha256: Option<&str>,
        name: Option<&str>,
        add: bool,
    ) -> Result<Value, ClientError> {
        let mut body = serde_json::json!({"path": path, "add": add});
        if let Some(sha) = sha256 {
            body["sha256"] = sha.into();
        }
        if let Some(name) = name {
            body["name"] = name.into();
        }
        match &self.transport {
            Transport::Http(t) => t.load_model(worker, &body).await,
            Transport::Nats(t) => {
                body["worker"] = worker.into();
                t.load_model(&body).await
            }
        }
    }

    /// Stops `worker` serving `model`; its streams finish on it. An admin order.
    pub async fn unload_model(&self, worker: &str, model: &str) -> Result<Value, ClientError> {
        match &self.transport {
            Transport::Http(t) => t.unload_model(worker, model).await,
            Transport::Nats(t) => t.unload_model(worker, model).await,
        }
    }

    /// Drains `worker`: it takes no new work, finishes what it runs, and leaves. Over
    /// HTTP this is an admin route: with API keys configured it needs an admin key.
    pub async fn drain(&self, worker: &str) -> Result<Value, ClientError> {
        match &self.transport {
            Transport::Http(t) => t.drain(worker).await,
            Transport::Nats(t) => t.drain(worker).await,
        }
    }
}

/// The text of an OpenAI chunk or whole answer (`choices[0]`: `delta.content`,
/// `message.content` or `text`).
pub fn choice_text(body: &Value) -> Option<&str> {
    let choice = body.get("choices")?.get(0)?;
    choice
        .get("delta")
        .and_then(|d| d.get("content"))
        .or_else(|| choice.get("message").and_then(|m| m.get("content")))
        .or_else(|| choice.get("text"))
        .and_then(Value::as_str)
}

/// `finish_reason` and `usage` of a final chunk or whole answer.
pub fn finish_of(body: &Value) -> Option<Finish> {
    let reason = body
        .get("choices")?
        .get(0)?
        .get("finish_reason")?
        .as_str()?;
    let usage = body.get("usage");
    let count = |key: &str| {
        usage
            .and_then(|u| u.get(key))
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0)
    };
    Some(Finish {
        reason: reason.to_string(),
        prompt_tokens: count("prompt_tokens"),
        completion_tokens: count("completion_tokens"),
    })
}

/// The error of an OpenAI error body.
pub fn api_error(body: &Value) -> ClientError {
    let error = &body["error"];
    ClientError::Api {
        code: error["code"].as_str().unwrap_or("unknown").to_string(),
        message: error["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| body.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_carry_the_http_fields() {
        let mut r = Request::chat("m", "hi");
        r.max_tokens = Some(5);
        r.temperature = Some(0.0);
        let b = r.body(true);
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(
            (b["max_tokens"].clone(), b["stream"].clone()),
            (json!(5), json!(true))
        );
        assert_eq!(b["stream_options"]["include_usage"], true);
        let b = Request::completion("m", "x").body(false);
        assert_eq!(b["prompt"], "x");
        assert!(b.get("stream_options").is_none() && b.get("max_tokens").is_none());
    }

    #[test]
    fn texts_and_finishes_are_read_from_every_shape() {
        let chat = json!({"choices": [{"delta": {"content": "a"}, "finish_reason": null}]});
        assert_eq!(choice_text(&chat), Some("a"));
        assert_eq!(finish_of(&chat), None);
        let whole = json!({"choices": [{"message": {"content": "b"}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 3}});
        assert_eq!(choice_text(&whole), Some("b"));
        assert_eq!(
            finish_of(&whole),
            Some(Finish {
                reason: "stop".into(),
                prompt_tokens: 2,
                completion_tokens: 3
            })
        );
        assert_eq!(choice_text(&json!({"choices": [{"text": "c"}]})), Some("c"));
        let e = api_error(&json!({"error": {"code": "model_not_found", "message": "no"}}));
        assert_eq!(e.code(), Some("model_not_found"));
    }
}
