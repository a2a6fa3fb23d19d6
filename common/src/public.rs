//! The public NATS API: header names, admin bodies, and the rkyv replies Rust clients
//! may ask for.
//!
//! Requests are JSON bodies with the fields of the HTTP API, published with a reply
//! inbox on [`crate::subjects::Subjects::completions`] or
//! [`crate::subjects::Subjects::chat_completions`]. Every reply message carries its
//! meaning in headers ([`headers`]); its body is JSON (OpenAI shapes) by default, or a
//! [`Reply`] encoded with rkyv when the request's `Content-Type` header is
//! [`CONTENT_TYPE_RKYV`]. `docs/protocol.md` is the full description.

use rkyv::{rancor, util::AlignedVec, Archive, Deserialize, Serialize};

use crate::ids::{CoordinatorId, StreamId, WorkerId};
use crate::protocol::{PromptEcho, TokenLogprobs, ToolCall, MAX_MESSAGE_BYTES};

/// The NATS queue group every coordinator serves the public subjects in.
pub const QUEUE_GROUP: &str = "baton-coordinators";

/// `Content-Type` of a request whose replies must be rkyv-encoded [`Reply`]s.
pub const CONTENT_TYPE_RKYV: &str = "application/x-baton-rkyv";

/// `Content-Type` of JSON (the default).
pub const CONTENT_TYPE_JSON: &str = "application/json";

/// Header names of the public API (compared case-insensitively on requests).
pub mod headers {
    /// The stream a message belongs to (32 hex digits).
    pub const STREAM_ID: &str = "Baton-Stream-Id";
    /// The message's number among the messages sent to this reply inbox: 0, 1, 2, …
    pub const SEQ: &str = "Baton-Seq";
    /// The token position of a chunk (its index in the output; on a final message, the
    /// number of generated tokens).
    pub const POSITION: &str = "Baton-Position";
    /// `true` on the last message of a successful answer.
    pub const FINAL: &str = "Baton-Final";
    /// The stable error code of an error message (the last message of a failed answer).
    pub const ERROR: &str = "Baton-Error";
    /// Which choice (`n`) a message is of, when the request asked for more than one:
    /// 0, 1, … (its `Baton-Stream-Id` is the first choice's plus it).
    pub const CHOICE: &str = "Baton-Choice";
    /// The coordinator that answers (replays of its streams go to it).
    pub const COORDINATOR: &str = "Baton-Coordinator";
    /// The body's encoding, on requests and replies.
    pub const CONTENT_TYPE: &str = "Content-Type";
    /// `true` on a request to a coordinator's own replay subject that only asks whether
    /// it is there: it answers at once with one final message, `{}`.
    pub const PROBE: &str = "Baton-Probe";
}

/// Body of a replay request (`<p>.v1.streams.replay`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayRequest {
    /// The stream (the `Baton-Stream-Id` of its messages).
    pub stream: StreamId,
    /// The last position the client has; `None` or absent: from the start.
    #[serde(default)]
    pub after: Option<u32>,
    /// The coordinator that served the stream (its `Baton-Coordinator` header); any
    /// coordinator that receives the replay forwards it there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<CoordinatorId>,
}

/// Body of a drain request (`<p>.v1.admin.drain`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DrainRequest {
    /// The worker to drain.
    pub worker: WorkerId,
    /// How long its streams may run on before they move to other workers, in
    /// milliseconds (0: move them now); absent: the worker's `drain_handover_ms`.
    #[serde(default)]
    pub handover_after_ms: Option<u64>,
}

/// Answer to a drain request.
#[derive(
    Archive,
    Serialize,
    Deserialize,
    Debug,
    Clone,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Drained {
    /// The worker, now draining.
    pub worker: WorkerId,
    /// Always true.
    pub draining: bool,
    /// Sequences it still runs.
    pub running: u32,
    /// Sequences it still has queued.
    pub queued: u32,
}

/// Body of a model load (`<p>.v1.admin.models.load`; over HTTP `POST
/// /admin/workers/{id}/models`, where the URL names the worker).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadModelRequest {
    /// The worker to load it on (over HTTP, the URL's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerId>,
    /// The GGUF file, as the worker's host sees it.
    pub path: String,
    /// Its SHA-256 (hex); absent: the worker reads `<path>.sha256`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The name to serve it as; absent: the replaced model's (the file's stem when
    /// added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Serve it beside the models served now; without it, it takes the place of the
    /// served model of its name, or of the only model served.
    #[serde(default)]
    pub add: bool,
}

/// Body of a model unload (`<p>.v1.admin.models.unload`; over HTTP `DELETE
/// /admin/workers/{id}/models/{model}`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnloadModelRequest {
    /// The worker.
    pub worker: WorkerId,
    /// The model's public name.
    pub model: String,
}

/// A model a worker serves, as an answer shows it.
#[derive(
    Archive,
    Serialize,
    Deserialize,
    Debug,
    Clone,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct ServedModel {
    /// The name clients ask for.
    pub id: String,
    /// Its context length in tokens.
    pub max_model_len: u32,
    /// Its fingerprint (weights, tokenizer, arithmetic), hex.
    pub fingerprint: String,
}

impl From<&crate::protocol::ModelInfo> for ServedModel {
    fn from(m: &crate::protocol::ModelInfo) -> Self {
        ServedModel {
            id: m.name.clone(),
            max_model_len: m.context_length,
            fingerprint: format!("{:016x}", m.fingerprint),
        }
    }
}

/// Answer to a model load or unload that the worker carried out.
#[derive(
    Archive,
    Serialize,
    Deserialize,
    Debug,
    Clone,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct ModelsChanged {
    /// The worker.
    pub worker: WorkerId,
    /// The model loaded (a load).
    pub loaded: Option<ServedModel>,
    /// The models it serves now.
    pub serving: Vec<ServedModel>,
    /// Streams still running on the models it no longer serves; they finish there.
    pub retiring_streams: u32,
}

/// Answer to a status request: the cluster as the answering coordinator sees it.
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct ClusterStatus {
    /// The answering coordinator.
    pub coordinator: CoordinatorStatus,
    /// `ok`, `not synced` (no heartbeat heard yet) or `no live workers`.
    pub health: String,
    /// Live workers, by id.
    pub workers: Vec<WorkerStatus>,
    /// Models live workers serve, by name.
    pub models: Vec<ModelStatus>,
    /// Sums over live workers.
    pub load: LoadStatus,
}

/// The answering coordinator.
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct CoordinatorStatus {
    /// Its id.
    pub id: CoordinatorId,
    /// Requests it took on the public subjects.
    pub requests: u64,
    /// Of those, the malformed ones (not JSON, wrong fields, unknown model, …).
    pub malformed_requests: u64,
    /// Internal messages it dropped as malformed.
    pub garbage: u64,
}

/// One worker, from its last heartbeat.
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerStatus {
    /// Its id.
    pub id: WorkerId,
    /// The models it serves.
    pub models: Vec<String>,
    /// Most sequences it runs at once.
    pub capacity: u32,
    /// Sequences running.
    pub running: u32,
    /// Sequences queued.
    pub queued: u32,
    /// KV cache bytes in use.
    pub kv_used_bytes: u64,
    /// KV cache budget in bytes.
    pub kv_budget_bytes: u64,
    /// Taking no new work.
    pub draining: bool,
    /// Its software version.
    pub version: String,
    /// Milliseconds since its last heartbeat.
    pub last_seen_ms: u64,
    /// Streams the answering coordinator runs on it.
    pub in_flight: u32,
}

/// One model.
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize,
)]
pub struct ModelStatus {
    /// Its name.
    pub name: String,
    /// Longest sequence a live worker allows for it.
    pub context_length: u32,
    /// Live workers serving it.
    pub workers: u32,
}

/// Load summed over live workers.
#[derive(
    Archive,
    Serialize,
    Deserialize,
    Debug,
    Clone,
    Default,
    PartialEq,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct LoadStatus {
    /// Sum of capacities.
    pub capacity: u64,
    /// Sequences running.
    pub running: u64,
    /// Sequences queued.
    pub queued: u64,
    /// KV cache bytes in use.
    pub kv_used_bytes: u64,
    /// KV cache budget in bytes.
    pub kv_budget_bytes: u64,
}

/// A reply message's body when the request asked for rkyv. Which variant comes is
/// also said by the headers: a chunk has neither `Baton-Final` nor `Baton-Error`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Reply {
    /// The echoed prompt of a stream (a completion's `echo`), before its chunks.
    Prompt(PromptEcho),
    /// New text of a stream.
    Chunk(Chunk),
    /// The end of a stream.
    Final(Final),
    /// A whole answer (`"stream": false`).
    Whole(Whole),
    /// The request failed.
    Error(ErrorReply),
    /// Answer to a status request.
    Status(ClusterStatus),
    /// Answer to a drain request.
    Drained(Drained),
    /// Answer to a tokenize request.
    Tokenized(Tokenized),
    /// Answer to a detokenize request.
    Detokenized(Detokenized),
    /// Answer to a model load or unload.
    ModelsChanged(ModelsChanged),
}

/// A tokenize request's answer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// The model's context length.
    pub max_model_len: u32,
}

/// A detokenize request's answer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Detokenized {
    /// The text.
    pub prompt: String,
}

impl Tokenized {
    /// The JSON answer (vLLM's shape): `{"count", "max_model_len", "tokens",
    /// "token_strs": null}`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.tokens.len(),
            "max_model_len": self.max_model_len,
            "tokens": self.tokens,
            "token_strs": null,
        })
    }
}

impl Detokenized {
    /// The JSON answer (vLLM's shape): `{"prompt"}`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"prompt": self.prompt})
    }
}

/// New text of a stream.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Chunk {
    /// The text.
    pub text: String,
    /// The logprobs of the tokens since the last chunk, when the request asked (a token
    /// whose text is held back has its entry in the next chunk with text, or in the
    /// final message).
    pub logprobs: Vec<TokenLogprobs>,
    /// Tool calls completed since the last chunk (a chat that offered tools); their
    /// text is not in `text`.
    pub tool_calls: Vec<ToolCall>,
}

/// How a stream ended.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Final {
    /// OpenAI's `finish_reason`: `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens whose keys and values the worker's prefix cache held.
    pub cached_tokens: u32,
    /// The logprobs of tokens not in any chunk (in a whole answer: empty, they are all
    /// in [`Whole::logprobs`]).
    pub logprobs: Vec<TokenLogprobs>,
}

/// A whole answer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Whole {
    /// OpenAI's response id (`chatcmpl-…`, `cmpl-…`).
    pub id: String,
    /// The model.
    pub model: String,
    /// The text.
    pub text: String,
    /// Every token's logprobs, when the request asked.
    pub logprobs: Vec<TokenLogprobs>,
    /// The echoed prompt (a completion's `echo`): `text` starts with its text.
    pub prompt: Option<PromptEcho>,
    /// The tools the answer called (a chat that offered tools).
    pub tool_calls: Vec<ToolCall>,
    /// How it ended.
    pub end: Final,
}

/// An error, with the fields of OpenAI's error body.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// Stable code (`invalid_json`, `model_not_found`, …).
    pub code: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, …).
    pub kind: String,
    /// The request field to blame, if any.
    pub param: Option<String>,
    /// For people.
    pub message: String,
}

/// Why bytes were not a [`Reply`].
#[derive(Debug, thiserror::Error)]
pub enum ReplyDecodeError {
    /// Over [`MAX_MESSAGE_BYTES`].
    #[error("reply of {0} bytes is over the limit")]
    TooLarge(usize),
    /// Not a valid archive of [`Reply`].
    #[error("malformed reply: {0}")]
    Malformed(String),
}

/// Encodes a reply.
pub fn encode_reply(reply: &Reply) -> Vec<u8> {
    rkyv::to_bytes::<rancor::Error>(reply)
        .expect("serializing owned values into a growable buffer cannot fail")
        .into_vec()
}

/// Decodes and validates a reply from the network (copied into an aligned buffer
/// first, as NATS payloads have no alignment guarantee). Never panics on any input.
pub fn decode_reply(bytes: &[u8]) -> Result<Reply, ReplyDecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ReplyDecodeError::TooLarge(bytes.len()));
    }
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<Reply, rancor::Error>(&aligned)
        .map_err(|e| ReplyDecodeError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> ClusterStatus {
        ClusterStatus {
            coordinator: CoordinatorStatus {
                id: CoordinatorId(3),
                requests: 5,
                malformed_requests: 1,
                garbage: 0,
            },
            health: "ok".into(),
            workers: vec![WorkerStatus {
                id: WorkerId(9),
                models: vec!["m".into()],
                capacity: 16,
                running: 1,
                queued: 0,
                kv_used_bytes: 10,
                kv_budget_bytes: 100,
                draining: false,
                version: "0.1.0".into(),
                last_seen_ms: 12,
                in_flight: 1,
            }],
            models: vec![ModelStatus {
                name: "m".into(),
                context_length: 2048,
                workers: 1,
            }],
            load: LoadStatus {
                capacity: 16,
                running: 1,
                ..LoadStatus::default()
            },
        }
    }

    #[test]
    fn replies_round_trip_unaligned() {
        for reply in [
            Reply::Chunk(Chunk {
                text: "héllo".into(),
                logprobs: vec![TokenLogprobs {
                    logprob: -0.5,
                    bytes: b"h".to_vec(),
                    text_offset: 0,
                    top: vec![],
                }],
                tool_calls: vec![ToolCall {
                    index: 2,
                    id: "call_2".into(),
                    name: "f".into(),
                    arguments: r#"{"a":[1]}"#.into(),
                }],
            }),
            Reply::Final(Final {
                finish_reason: "length".into(),
                prompt_tokens: 3,
                completion_tokens: 4,
                cached_tokens: 2,
                logprobs: vec![],
            }),
            Reply::Error(ErrorReply {
                code: "model_not_found".into(),
                kind: "invalid_request_error".into(),
                param: Some("model".into()),
                message: "no".into(),
            }),
            Reply::Status(status()),
        ] {
            let bytes = encode_reply(&reply);
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            assert_eq!(decode_reply(&shifted[1..]).expect("decode"), reply);
        }
        assert!(decode_reply(b"not rkyv at all").is_err());
        assert!(decode_reply(b"").is_err());
    }

    #[test]
    fn admin_bodies_are_json_with_ids_in_simple_form() {
        let json = serde_json::to_value(status()).expect("json");
        assert_eq!(json["workers"][0]["id"], WorkerId(9).to_string());
        assert_eq!(json["coordinator"]["malformed_requests"], 1);
        let replay: ReplayRequest = serde_json::from_str(&format!(
            r#"{{"stream": "{}", "after": 7, "extra": true}}"#,
            StreamId(1)
        ))
        .expect("replay");
        assert_eq!((replay.after, replay.coordinator), (Some(7), None));
        let drain: DrainRequest =
            serde_json::from_str(&format!(r#"{{"worker": "{}"}}"#, WorkerId(2))).expect("drain");
        assert_eq!(drain.worker, WorkerId(2));
    }
}
