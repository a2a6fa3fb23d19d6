//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes, over HTTP and NATS.
//!
//! The coordinator has no tokenizer: a live worker serving the model answers with its
//! own (request/reply on its submit subject, between its steps; nothing runs through the
//! model). The least loaded such worker is asked, one that is not draining if any.

use actix::Addr;
use baton_common::protocol::{ChatInput, TextInput, TokenizeInput, TokenizeReply, TokenizeRequest};
use baton_common::public::{Detokenized, Tokenized};
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::openai::ChatMessageIn;
use super::validate::{model, parse_json, turn};
use crate::actors::messages::ListWorkers;
use crate::actors::registry::Registry;
use crate::nats::NatsHandle;

/// Which of the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Text or messages to ids.
    Tokenize,
    /// Ids to text.
    Detokenize,
}

/// `/tokenize`: `prompt` (text) or `messages` (rendered with the model's template).
#[derive(Debug, Default, Deserialize)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<ChatMessageIn>>,
    /// Default: true for a prompt, false for messages (the template writes them).
    add_special_tokens: Option<bool>,
    /// Messages only; default true.
    add_generation_prompt: Option<bool>,
    /// Messages only: the tools a chat request would offer.
    tools: Option<Value>,
}

/// `/detokenize`.
#[derive(Debug, Default, Deserialize)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Option<Value>,
}

/// Most ids one `/detokenize` takes: far more than any context, and a request that
/// stays well under NATS's payload limit on its way to the worker.
pub const MAX_DETOKENIZE_IDS: usize = 1 << 16;

/// Validates a body into what a worker is asked.
pub fn parse(direction: Direction, body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    match direction {
        Direction::Tokenize => {
            let b: TokenizeBody = parse_json(body)?;
            let model = model(b.model)?;
            let input = match (b.prompt, b.messages) {
                (Some(_), Some(_)) => {
                    return Err(ApiError::invalid(
                        "messages",
                        "give `prompt` or `messages`, not both",
                    ))
                }
                (Some(_), None) if b.tools.is_some() => {
                    return Err(ApiError::invalid("tools", "`tools` go with `messages`"))
                }
                (Some(Value::String(text)), None) => TokenizeInput::Text(TextInput {
                    text,
                    add_special: b.add_special_tokens.unwrap_or(true),
                }),
                (Some(_), None) => {
                    return Err(ApiError::invalid("prompt", "`prompt` must be a string"))
                }
                (None, Some(messages)) => {
                    if b.add_special_tokens == Some(true) {
                        return Err(ApiError::invalid(
                            "add_special_tokens",
                            "messages are rendered by the model's template, which writes \
                             its own special tokens: `add_special_tokens` must be false",
                        ));
                    }
                    TokenizeInput::Chat(ChatInput {
                        turns: messages
                            .into_iter()
                            .enumerate()
                            .map(|(i, m)| turn(i, m))
                            .collect::<Result<_, _>>()?,
                        add_generation_prompt: b.add_generation_prompt.unwrap_or(true),
                        tools: match b.tools {
                            None | Some(Value::Null) => None,
                            Some(Value::Array(a)) if a.is_empty() => None,
                            Some(tools) => {
                                baton_common::tools::functions(&tools)
                                    .map_err(|e| ApiError::invalid("tools", e.0))?;
                                Some(tools.to_string())
                            }
                        },
                    })
                }
                (None, None) => return Err(ApiError::MissingField("prompt")),
            };
            Ok(TokenizeRequest { model, input })
        }
        Direction::Detokenize => {
            let b: DetokenizeBody = parse_json(body)?;
            let model = model(b.model)?;
            let Some(Value::Array(items)) = b.tokens else {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` must be an array of token ids",
                ));
            };
            if items.len() > MAX_DETOKENIZE_IDS {
                return Err(ApiError::invalid(
                    "tokens",
                    format!("at most {MAX_DETOKENIZE_IDS} token ids"),
                ));
            }
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    ApiError::invalid("tokens", "`tokens` must hold integers in 0..2^32")
                })?;
            Ok(TokenizeRequest {
                model,
                input: TokenizeInput::Ids(ids),
            })
        }
    }
}

/// What a worker answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Ids.
    Tokens(Tokenized),
    /// Text.
    Text(Detokenized),
}

impl Answer {
    /// vLLM's JSON body: `{"count", "max_model_len", "tokens", "token_strs": null}` or
    /// `{"prompt"}`.
    pub fn json(&self) -> Value {
        match self {
            Answer::Tokens(t) => t.json(),
            Answer::Text(d) => d.json(),
        }
    }
}

/// Asks a worker serving the request's model.
pub async fn run(
    registry: &Addr<Registry>,
    nats: &NatsHandle,
    timeout: std::time::Duration,
    request: TokenizeRequest,
) -> Result<Answer, ApiError> {
    let workers = registry.send(ListWorkers).await?;
    if workers.is_empty() {
        return Err(ApiError::NoLiveWorkers);
    }
    let serving = |w: &&crate::actors::registry::LiveWorker| {
        w.heartbeat.models.iter().any(|m| m.name == request.model)
    };
    let Some(worker) = workers
        .iter()
        .filter(serving)
        .min_by_key(|w| {
            let h = &w.heartbeat;
            (h.draining, h.running + h.queued, h.worker)
        })
        .map(|w| w.heartbeat.worker)
    else {
        return Err(ApiError::ModelNotFound(request.model));
    };
    let model = request.model.clone();
    match nats.tokenize(worker, request, timeout).await? {
        TokenizeReply::Tokens(t) => Ok(Answer::Tokens(Tokenized {
            tokens: t.ids,
            max_model_len: t.context_length,
        })),
        TokenizeReply::Text(prompt) => Ok(Answer::Text(Detokenized { prompt })),
        TokenizeReply::Failed(error) => Err(ApiError::from_worker(error, &model)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::ChatTurn;
    use serde_json::json;

    fn tokenize(v: Value) -> Result<TokenizeRequest, ApiError> {
        parse(Direction::Tokenize, v.to_string().as_bytes())
    }

    fn detokenize(v: Value) -> Result<TokenizeRequest, ApiError> {
        parse(Direction::Detokenize, v.to_string().as_bytes())
    }

    #[test]
    fn bodies_become_worker_requests() {
        assert_eq!(
            tokenize(json!({"model": "m", "prompt": "hi"})).expect("valid"),
            TokenizeRequest {
                model: "m".into(),
                input: TokenizeInput::Text(TextInput {
                    text: "hi".into(),
                    add_special: true
                })
            }
        );
        let chat = tokenize(json!({"model": "m", "add_generation_prompt": false,
                                   "messages": [{"role": "user", "content": "hi"}]}))
        .expect("valid");
        assert_eq!(
            chat.input,
            TokenizeInput::Chat(ChatInput {
                turns: vec![ChatTurn::new("user", "hi")],
                add_generation_prompt: false,
                tools: None,
            })
        );
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let with_tools = tokenize(json!({"model": "m", "tools": tools,
                                         "messages": [{"role": "user", "content": "hi"}]}))
        .expect("valid");
        let TokenizeInput::Chat(c) = with_tools.input else {
            panic!("chat")
        };
        assert_eq!(c.tools.as_deref(), Some(tools.to_string().as_str()));
        assert_eq!(
            detokenize(json!({"model": "m", "tokens": [1, 2]}))
                .expect("valid")
                .input,
            TokenizeInput::Ids(vec![1, 2])
        );
    }

    #[test]
    fn bad_bodies_name_their_field() {
        let param = |r: Result<TokenizeRequest, ApiError>| r.expect_err("refused").param();
        assert_eq!(param(tokenize(json!({"prompt": "x"}))), Some("model"));
        assert_eq!(param(tokenize(json!({"model": "m"}))), Some("prompt"));
        assert_eq!(
            param(tokenize(json!({"model": "m", "prompt": [1]}))),
            Some("prompt")
        );
        assert_eq!(
            param(tokenize(
                json!({"model": "m", "prompt": "x", "messages": []})
            )),
            Some("messages")
        );
        assert_eq!(
            param(tokenize(json!({"model": "m", "add_special_tokens": true,
                                  "messages": [{"role": "user", "content": "x"}]}))),
            Some("add_special_tokens")
        );
        assert_eq!(
            param(tokenize(
                json!({"model": "m", "tools": [{"type": "function"}],
                                  "messages": [{"role": "user", "content": "x"}]})
            )),
            Some("tools")
        );
        assert_eq!(
            param(tokenize(json!({"model": "m", "prompt": "x",
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}))),
            Some("tools")
        );
        assert_eq!(
            param(tokenize(
                json!({"model": "m", "messages": [{"content": "x"}]})
            )),
            Some("messages")
        );
        assert_eq!(param(detokenize(json!({"model": "m"}))), Some("tokens"));
        assert_eq!(
            param(detokenize(json!({"model": "m", "tokens": [-1]}))),
            Some("tokens")
        );
        assert_eq!(
            param(detokenize(json!({"model": "m", "tokens": "12"}))),
            Some("tokens")
        );
        assert!(matches!(
            parse(Direction::Detokenize, b"{not json"),
            Err(ApiError::MalformedJson(_))
        ));
    }

    #[test]
    fn answers_have_vllms_shape() {
        let t = Answer::Tokens(Tokenized {
            tokens: vec![5, 6],
            max_model_len: 8192,
        });
        assert_eq!(
            t.json(),
            json!({"count": 2, "max_model_len": 8192, "tokens": [5, 6], "token_strs": null})
        );
        let d = Answer::Text(Detokenized {
            prompt: "hi".into(),
        });
        assert_eq!(d.json(), json!({"prompt": "hi"}));
    }
}
