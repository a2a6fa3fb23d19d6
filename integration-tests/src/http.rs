//! A blocking HTTP client for the coordinator's API, and a Server-Sent Events reader.

use std::{
    io::{BufRead, BufReader, Read},
    time::Duration,
};

use serde_json::Value;

/// A response: its status and its body (JSON when it parses, else the text as a string).
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status code.
    pub status: u16,
    /// The body.
    pub body: Value,
    /// The `X-Request-Id` header, if any.
    pub request_id: Option<String>,
}

/// A blocking client bound to one base URL (`http://127.0.0.1:<port>`), sending an API
/// key with every request when it has one.
#[derive(Clone)]
pub struct Api {
    /// `http://host:port`, no trailing slash.
    pub base: String,
    client: reqwest::blocking::Client,
    /// Sent as `Authorization: Bearer <key>`.
    key: Option<String>,
}

impl Api {
    /// A client for `base`; requests time out after two minutes.
    pub fn new(base: &str) -> Api {
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("building an HTTP client");
        Api {
            base: base.trim_end_matches('/').to_string(),
            client,
            key: None,
        }
    }

    /// The same client sending `key` as `Authorization: Bearer <key>`.
    pub fn with_key(&self, key: &str) -> Api {
        Api {
            key: Some(key.to_string()),
            ..self.clone()
        }
    }

    /// The same client sending no key.
    pub fn without_key(&self) -> Api {
        Api {
            key: None,
            ..self.clone()
        }
    }

    /// A request with the key, if any.
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        let req = self.client.request(method, self.url(path));
        match &self.key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    /// `GET <path>`.
    pub fn get(&self, path: &str) -> reqwest::Result<Reply> {
        let resp = self.request(reqwest::Method::GET, path).send()?;
        Ok(into_reply(resp))
    }

    /// `DELETE <path>`.
    pub fn delete(&self, path: &str) -> reqwest::Result<Reply> {
        let resp = self.request(reqwest::Method::DELETE, path).send()?;
        Ok(into_reply(resp))
    }

    /// `POST <path>` with a JSON body.
    pub fn post_json(&self, path: &str, body: &Value) -> reqwest::Result<Reply> {
        self.post_raw(path, body.to_string())
    }

    /// `POST <path>` with any bytes, declared as JSON.
    pub fn post_raw(&self, path: &str, body: impl Into<Vec<u8>>) -> reqwest::Result<Reply> {
        let resp = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body.into())
            .send()?;
        Ok(into_reply(resp))
    }

    /// `POST <path>` expecting an event stream; panics unless the answer is 200.
    pub fn stream(&self, path: &str, body: &Value) -> SseReader {
        self.stream_from(path, body, None)
    }

    /// `POST <path>` expecting an event stream, with a `Last-Event-ID` when reconnecting;
    /// panics unless the answer is 200.
    pub fn stream_from(&self, path: &str, body: &Value, last_event_id: Option<&str>) -> SseReader {
        self.try_stream_from(path, body, last_event_id)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `POST <path>` expecting an event stream, with a `Last-Event-ID` when reconnecting;
    /// an error (saying what happened) unless the answer is 200 with `text/event-stream`.
    pub fn try_stream_from(
        &self,
        path: &str,
        body: &Value,
        last_event_id: Option<&str>,
    ) -> Result<SseReader, String> {
        let mut req = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .body(body.to_string());
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id);
        }
        let resp = req.send().map_err(|e| format!("POST {path}: {e}"))?;
        let status = resp.status().as_u16();
        if status != 200 {
            let text = resp.text().unwrap_or_default();
            return Err(format!("POST {path} (stream) answered {status}: {text}"));
        }
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        if !content_type.starts_with("text/event-stream") {
            return Err(format!(
                "POST {path} (stream) answered content-type {content_type:?}"
            ));
        }
        Ok(SseReader::new(resp))
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }
}

fn into_reply(resp: reqwest::blocking::Response) -> Reply {
    let status = resp.status().as_u16();
    let request_id = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.text().unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Reply {
        status,
        body,
        request_id,
    }
}

/// One Server-Sent Event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SseEvent {
    /// `id:` (Baton: `<stream id>:<position>`).
    pub id: Option<String>,
    /// `event:` (absent for plain data events).
    pub event: Option<String>,
    /// `data:` lines, joined with newlines.
    pub data: String,
}

impl SseEvent {
    /// The `data:` parsed as JSON (`None` for `[DONE]` or text).
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }

    /// The `<stream id>` part of the `id:` (`<stream id>:<position>[:<chain hash>]`).
    pub fn stream_id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .and_then(|id| id.split_once(':'))
            .map(|(s, _)| s)
    }

    /// The `<position>` part of the `id:`.
    pub fn position(&self) -> Option<u64> {
        self.id
            .as_deref()
            .and_then(|id| id.split(':').nth(1))
            .and_then(|p| p.parse().ok())
    }

    /// The text the chunk carries: chat (`delta.content`) and text (`text`) completion
    /// chunks alike; empty for other events.
    pub fn text(&self) -> String {
        let Some(json) = self.json() else {
            return String::new();
        };
        json["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| {
                c["delta"]["content"]
                    .as_str()
                    .or_else(|| c["text"].as_str())
            })
            .collect()
    }

    /// Whether this is the final `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }
}

/// Reads events one by one from a streaming response.
pub struct SseReader {
    lines: BufReader<Box<dyn Read + Send>>,
}

impl SseReader {
    /// Reads events from any byte source (a response body, a test string).
    pub fn new(source: impl Read + Send + 'static) -> SseReader {
        SseReader {
            lines: BufReader::new(Box::new(source)),
        }
    }

    /// The next event; `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<SseEvent> {
        let mut event = SseEvent::default();
        let mut seen = false;
        let mut data: Vec<String> = Vec::new();
        loop {
            let mut line = String::new();
            // A broken connection ends the stream like a closed one; a partial event
            // is dropped.
            let Ok(n) = self.lines.read_line(&mut line) else {
                return None;
            };
            if n == 0 {
                return seen.then(|| finish(event, data));
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if seen {
                    return Some(finish(event, data));
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment (keep-alive)
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            seen = true;
            match field {
                "id" => event.id = Some(value.to_string()),
                "event" => event.event = Some(value.to_string()),
                "data" => data.push(value.to_string()),
                _ => {}
            }
        }
    }

    /// Every remaining event, up to and including `[DONE]` (or the end of the body).
    pub fn collect_all(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        while let Some(event) = self.next_event() {
            let done = event.is_done();
            out.push(event);
            if done {
                break;
            }
        }
        out
    }
}

fn finish(mut event: SseEvent, data: Vec<String>) -> SseEvent {
    event.data = data.join("\n");
    event
}

/// What a finished stream said, put together.
#[derive(Debug, Clone, Default)]
pub struct StreamSummary {
    /// The concatenated text deltas.
    pub text: String,
    /// How many chunks carried non-empty text.
    pub text_chunks: usize,
    /// The last `finish_reason` seen.
    pub finish_reason: Option<String>,
    /// The stream id of the `id:` fields (all must agree).
    pub stream_id: Option<String>,
    /// Whether the stream ended with `data: [DONE]`.
    pub done: bool,
    /// `event: error` frames, as their data.
    pub errors: Vec<String>,
}

/// Puts a stream's events together: the text of chat (`delta.content`) or text
/// (`text`) completion chunks, the finish reason, the stream id.
pub fn summarize(events: &[SseEvent]) -> StreamSummary {
    let mut s = StreamSummary::default();
    for event in events {
        if event.is_done() {
            s.done = true;
            continue;
        }
        if event.event.as_deref() == Some("error") {
            s.errors.push(event.data.clone());
            continue;
        }
        if let Some(id) = event.stream_id() {
            match &s.stream_id {
                None => s.stream_id = Some(id.to_string()),
                Some(seen) => assert_eq!(seen, id, "one stream, one id"),
            }
        }
        let Some(json) = event.json() else { continue };
        for choice in json["choices"].as_array().into_iter().flatten() {
            let piece = choice["delta"]["content"]
                .as_str()
                .or_else(|| choice["text"].as_str())
                .unwrap_or_default();
            if !piece.is_empty() {
                s.text.push_str(piece);
                s.text_chunks += 1;
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                s.finish_reason = Some(reason.to_string());
            }
        }
    }
    s
}

/// Asserts that `reply` is an OpenAI-shaped error with `status`, and returns its `error`.
pub fn assert_error(reply: &Reply, status: u16) -> Value {
    assert_eq!(reply.status, status, "status of {:?}", reply.body);
    let error = &reply.body["error"];
    assert!(error.is_object(), "no \"error\" object in {:?}", reply.body);
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        !message.is_empty(),
        "error.message must be a non-empty string: {error}"
    );
    assert!(
        error["type"].is_string(),
        "error.type must be a string: {error}"
    );
    for key in ["param", "code"] {
        assert!(
            error.get(key).is_some(),
            "error.{key} must be present (null allowed): {error}"
        );
    }
    error.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_split_on_blank_lines() {
        let text = ": hello\n\nid: s1:0\ndata: {\"a\":1}\n\nid: s1:1\nevent: error\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        let mut reader = SseReader::new(std::io::Cursor::new(text.as_bytes().to_vec()));
        let events = reader.collect_all();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].stream_id(), Some("s1"));
        assert_eq!(events[0].position(), Some(0));
        assert_eq!(events[0].json().expect("json")["a"], 1);
        assert_eq!(events[1].event.as_deref(), Some("error"));
        assert_eq!(events[1].data, "x\ny");
        assert!(events[2].is_done());
    }

    #[test]
    fn summaries_join_chat_and_text_deltas() {
        let text = "id: s:0\ndata: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
                    id: s:1\ndata: {\"choices\":[{\"text\":\" there\",\"finish_reason\":\"length\"}]}\n\n\
                    data: [DONE]\n\n";
        let mut reader = SseReader::new(std::io::Cursor::new(text.as_bytes().to_vec()));
        let s = summarize(&reader.collect_all());
        assert_eq!(s.text, "Hi there");
        assert_eq!(s.text_chunks, 2);
        assert_eq!(s.finish_reason.as_deref(), Some("length"));
        assert_eq!(s.stream_id.as_deref(), Some("s"));
        assert!(s.done);
    }
}
