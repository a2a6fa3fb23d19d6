//! The HTTP transport: `POST /v1/{chat/,}completions`, streamed as Server-Sent Events.
//! With an API key, every request carries `Authorization: Bearer <key>`.

use std::time::Duration;

use baton_common::secret::Secret;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::{
    api_error, choice_text, finish_of, ClientError, Completion, Event, EventStream, Request,
};

/// The coordinator's HTTP API.
#[derive(Debug, Clone)]
pub struct HttpTransport {
    /// `http://host:port`, no trailing slash.
    base: String,
    http: reqwest::Client,
    /// Longest wait for the next bytes.
    pub(crate) idle: Duration,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub(crate) api_key: Option<Secret>,
}

impl HttpTransport {
    /// A client of `base`.
    pub fn new(base: &str) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .build()
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            http,
            idle: Duration::from_secs(120),
            api_key: None,
        })
    }

    /// A request to `path`, with the API key if there is one.
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(key) => request.bearer_auth(key.expose()),
            None => request,
        }
    }

    fn path(request: &Request) -> &'static str {
        if request.is_chat() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    async fn post(&self, path: &str, body: &Value) -> Result<reqwest::Response, ClientError> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// `method` on `path` (with a JSON body when given); an error status becomes the
    /// error its body names.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<reqwest::Response, ClientError> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Err(match serde_json::from_slice::<Value>(&bytes) {
            Ok(body) => api_error(&body),
            Err(_) => ClientError::Protocol(format!("HTTP {status} without an error body")),
        })
    }

    /// Streams the answer as SSE.
    pub async fn stream(&self, request: &Request) -> Result<EventStream, ClientError> {
        let response = self.post(Self::path(request), &request.body(true)).await?;
        let idle = self.idle;
        let bytes = response.bytes_stream();
        let state = (bytes, SseParser::default(), Vec::<Event>::new(), false);
        let stream = futures::stream::unfold(
            state,
            move |(mut bytes, mut parser, mut ready, mut ended)| async move {
                loop {
                    if !ready.is_empty() {
                        let event = ready.remove(0);
                        return Some((Ok(event), (bytes, parser, ready, ended)));
                    }
                    if ended {
                        return None;
                    }
                    let chunk = match tokio::time::timeout(idle, bytes.next()).await {
                        Err(_) => {
                            ended = true;
                            return Some((
                                Err(ClientError::Timeout(idle)),
                                (bytes, parser, ready, ended),
                            ));
                        }
                        Ok(None) => {
                            ended = true;
                            let e = ClientError::Protocol(
                                "the SSE stream ended before its final chunk".into(),
                            );
                            return Some((Err(e), (bytes, parser, ready, ended)));
                        }
                        Ok(Some(Err(e))) => {
                            ended = true;
                            return Some((
                                Err(ClientError::Transport(e.to_string())),
                                (bytes, parser, ready, ended),
                            ));
                        }
                        Ok(Some(Ok(chunk))) => chunk,
                    };
                    for frame in parser.push(&chunk) {
                        match interpret(frame) {
                            Ok(Item::Text(event)) => ready.push(event),
                            Ok(Item::Finish(f)) => parser.finish = Some(f),
                            Ok(Item::Usage(prompt, completion)) => {
                                if let Some(f) = &mut parser.finish {
                                    f.prompt_tokens = prompt;
                                    f.completion_tokens = completion;
                                }
                            }
                            Ok(Item::Done) => {
                                ended = true;
                                match parser.finish.take() {
                                    Some(f) => ready.push(Event::Finished(f)),
                                    None => {
                                        let e = ClientError::Protocol(
                                            "[DONE] before a finish_reason".into(),
                                        );
                                        return Some((Err(e), (bytes, parser, ready, ended)));
                                    }
                                }
                                break;
                            }
                            Ok(Item::Nothing) => {}
                            Err(e) => {
                                ended = true;
                                return Some((Err(e), (bytes, parser, ready, ended)));
                            }
                        }
                    }
                }
            },
        );
        Ok(Box::pin(stream))
    }

    /// The whole answer.
    pub async fn generate(&self, request: &Request) -> Result<Completion, ClientError> {
        let response = self.post(Self::path(request), &request.body(false)).await?;
        let body: Value = response
            .json()
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        whole(&body)
    }

    /// `/v1/status` (workers, load, KV); without an admin key (when keys are on),
    /// `/health` and `/v1/models`.
    pub async fn status(&self) -> Result<Value, ClientError> {
        let get = |path: &'static str| async move {
            let response = self
                .request(reqwest::Method::GET, path)
                .send()
                .await
                .map_err(|e| ClientError::Transport(e.to_string()))?;
            response
                .json::<Value>()
                .await
                .map_err(|e| ClientError::Protocol(e.to_string()))
        };
        // The whole view (workers, load, KV) is an admin route; without an admin key, the
        // health and the models.
        let status = get("/v1/status").await?;
        if status.get("error").is_none() {
            return Ok(status);
        }
        let health = get("/health").await?;
        let models = get("/v1/models").await?;
        if models.get("error").is_some() {
            return Err(api_error(&models));
        }
        Ok(json!({
            "health": health["status"],
            "workers": health["workers"],
            "models": models["data"].as_array().map(|m| m.iter().map(|m| m["id"].clone()).collect::<Vec<_>>()),
        }))
    }

    /// `POST /admin/workers/{worker}/models` (an admin route).
    pub async fn load_model(&self, worker: &str, body: &Value) -> Result<Value, ClientError> {
        let response = self
            .post(&format!("/admin/workers/{worker}/models"), body)
            .await?;
        response
            .json::<Value>()
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// `DELETE /admin/workers/{worker}/models/{model}` (an admin route).
    pub async fn unload_model(&self, worker: &str, model: &str) -> Result<Value, ClientError> {
        let path = format!("/admin/workers/{worker}/models/{}", path_segment(model));
        let response = self.call(reqwest::Method::DELETE, &path, None).await?;
        response
            .json::<Value>()
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// `POST /admin/workers/{worker}/drain` (needs an admin key when keys are on).
    pub async fn drain(&self, worker: &str) -> Result<Value, ClientError> {
        let response = self
            .post(&format!("/admin/workers/{worker}/drain"), &json!({}))
            .await?;
        response
            .json::<Value>()
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }
}

/// `text` as one URL path segment: unreserved characters as they are, every other byte
/// percent-encoded.
fn path_segment(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A whole OpenAI answer.
pub(crate) fn whole(body: &Value) -> Result<Completion, ClientError> {
    if body.get("error").is_some() {
        return Err(api_error(body));
    }
    let finish = finish_of(body)
        .ok_or_else(|| ClientError::Protocol(format!("no finish_reason in {body}")))?;
    Ok(Completion {
        id: body["id"].as_str().unwrap_or_default().to_string(),
        text: choice_text(body).unwrap_or_default().to_string(),
        finish,
    })
}

/// One SSE frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frame {
    /// `event:`, if any.
    pub event: Option<String>,
    /// `id:`, if any.
    pub id: Option<String>,
    /// The `data:` lines, joined by newlines.
    pub data: String,
}

/// Splits bytes into SSE frames, however the bytes are cut.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The finish chunk's reason, completed by the usage chunk, sent at `[DONE]`.
    finish: Option<crate::Finish>,
    buffer: Vec<u8>,
    frame: Frame,
    has_data: bool,
}

impl SseParser {
    /// Feeds bytes; returns the frames they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Frame> {
        self.buffer.extend_from_slice(bytes);
        let mut frames = Vec::new();
        while let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if self.has_data || self.frame.event.is_some() {
                    frames.push(std::mem::take(&mut self.frame));
                }
                self.has_data = false;
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "event" => self.frame.event = Some(value.to_string()),
                "id" => self.frame.id = Some(value.to_string()),
                "data" => {
                    if self.has_data {
                        self.frame.data.push('\n');
                    }
                    self.frame.data.push_str(value);
                    self.has_data = true;
                }
                _ => {}
            }
        }
        frames
    }
}

/// What one frame says.
#[derive(Debug, PartialEq, Eq)]
enum Item {
    /// New text.
    Text(Event),
    /// The chunk with `finish_reason`.
    Finish(crate::Finish),
    /// The usage chunk: prompt and completion tokens.
    Usage(u32, u32),
    /// `[DONE]`.
    Done,
    /// Nothing to show (an empty text).
    Nothing,
}

/// What one frame means; an `event: error` frame is the error it carries.
fn interpret(frame: Frame) -> Result<Item, ClientError> {
    if frame.data == "[DONE]" {
        return Ok(Item::Done);
    }
    let body: Value = serde_json::from_str(&frame.data)
        .map_err(|e| ClientError::Protocol(format!("an SSE frame is not JSON: {e}")))?;
    if frame.event.as_deref() == Some("error") {
        return Err(api_error(&body));
    }
    if let Some(finish) = finish_of(&body) {
        return Ok(Item::Finish(finish));
    }
    if body["choices"].as_array().is_some_and(Vec::is_empty) {
        let count = |k: &str| {
            body["usage"][k]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
        };
        if let (Some(p), Some(c)) = (count("prompt_tokens"), count("completion_tokens")) {
            return Ok(Item::Usage(p, c));
        }
    }
    let position = frame
        .id
        .as_deref()
        .and_then(|id| id.rsplit_once(':'))
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(0);
    Ok(match choice_text(&body).filter(|t| !t.is_empty()) {
        Some(text) => Item::Text(Event::Text {
            position,
            text: text.to_string(),
        }),
        None => Item::Nothing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_survive_any_cut() {
        let text = "id: s:0\ndata: {\"a\":1}\n\nevent: error\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        for cut in 0..text.len() {
            let mut p = SseParser::default();
            let mut frames = p.push(&text.as_bytes()[..cut]);
            frames.extend(p.push(&text.as_bytes()[cut..]));
            assert_eq!(frames.len(), 3, "cut at {cut}");
            assert_eq!(frames[0].id.as_deref(), Some("s:0"));
            assert_eq!(frames[1].data, "x\ny");
            assert_eq!(frames[2].data, "[DONE]");
        }
    }

    #[test]
    fn frames_become_events() {
        let text = Frame {
            id: Some("abc:4".into()),
            data: r#"{"choices":[{"text":"hi","finish_reason":null}]}"#.into(),
            ..Frame::default()
        };
        assert_eq!(
            interpret(text).expect("ok"),
            Item::Text(Event::Text {
                position: 4,
                text: "hi".into()
            })
        );
        let error = Frame {
            event: Some("error".into()),
            data: r#"{"error":{"code":"stream_timeout","message":"m"}}"#.into(),
            ..Frame::default()
        };
        assert_eq!(
            interpret(error).expect_err("error").code(),
            Some("stream_timeout")
        );
        assert_eq!(
            interpret(Frame {
                data: "[DONE]".into(),
                ..Frame::default()
            })
            .expect("ok"),
            Item::Done
        );
        let usage = Frame {
            data: r#"{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}"#.into(),
            ..Frame::default()
        };
        assert_eq!(interpret(usage).expect("ok"), Item::Usage(2, 3));
    }
}
