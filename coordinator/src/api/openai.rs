//! OpenAI request and response bodies, as they travel in JSON.
//!
//! Requests keep the loosely typed fields (`prompt`, `stop`, message `content`) as
//! [`serde_json::Value`]: the validator ([`super::validate`]) turns them into precise
//! errors instead of serde's "did not match any variant". Unknown fields are ignored;
//! fields of OpenAI's API (and vLLM's extensions) that Baton does not do yet are read
//! into [`NotSupported`], so that asking for one is a 400 naming it, never a 200 that
//! quietly ignores it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Temperature (0 is greedy; OpenAI's default is 1).
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Top-k (extension; 0 is off).
    pub top_k: Option<i64>,
    /// Repetition penalty (extension; 1 is off).
    pub repetition_penalty: Option<f64>,
    /// Sampler seed.
    pub seed: Option<serde_json::Number>,
    /// Stop string or strings.
    pub stop: Option<Value>,
    /// Choices per prompt (only 1 is supported).
    pub n: Option<i64>,
    /// Stream the answer as Server-Sent Events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Keep going past end-of-sequence tokens (extension).
    pub ignore_eos: Option<bool>,
    /// −2..=2, subtracted once from the logit of each token the output holds.
    pub presence_penalty: Option<f64>,
    /// −2..=2, subtracted from a token's logit per time the output holds it.
    pub frequency_penalty: Option<f64>,
    /// 0..=1 (extension): drop tokens below `min_p` × the likeliest one's probability.
    pub min_p: Option<f64>,
    /// Token id (as a string) → bias in −100..=100.
    pub logit_bias: Option<Value>,
    /// At least this many tokens before an end or stop (extension).
    pub min_tokens: Option<i64>,
    /// Token ids that end the output (extension).
    pub stop_token_ids: Option<Value>,
    /// Chat: a boolean; completions: how many alternatives per token (0..=20).
    pub logprobs: Option<Value>,
    /// Chat: how many alternatives per token (0..=20), with `logprobs: true`.
    pub top_logprobs: Option<i64>,
    /// Completions: the answer starts with the prompt (its tokens' logprobs first, with
    /// `logprobs`); `max_tokens` may then be 0, to score a prompt.
    pub echo: Option<bool>,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a usage chunk before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields Baton does not do yet, as the client sent them: each is refused unless its
/// value asks for nothing (see `validate::refuse_unsupported`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NotSupported {
    pub best_of: Option<Value>,
    pub suffix: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub prompt_logprobs: Option<Value>,
}

/// The ways a client asks for structured output: OpenAI's `response_format`, vLLM's
/// `structured_outputs` object and its older `guided_*` fields. At most one may be set
/// (see `validate::grammar`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {…}}`.
    pub response_format: Option<Value>,
    /// vLLM: `{"json" | "regex" | "choice" | "grammar" | "json_object": …}`.
    pub structured_outputs: Option<Value>,
    /// vLLM: a JSON schema (object or its text).
    pub guided_json: Option<Value>,
    /// vLLM: a regular expression.
    pub guided_regex: Option<Value>,
    /// vLLM: one of these strings.
    pub guided_choice: Option<Value>,
    /// vLLM: a grammar (here in llguidance's Lark dialect).
    pub guided_grammar: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    pub model: Option<String>,
    /// A string, an array of one string, token ids, or an array of one token id array.
    pub prompt: Option<Value>,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Structured output.
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// Fields asked for that Baton does not do.
    #[serde(flatten)]
    pub unsupported: NotSupported,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatRequest {
    /// Model name.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Most tokens to generate (newer name of `max_tokens`; wins when both are given).
    pub max_completion_tokens: Option<i64>,
    /// Whether the model may call several tools in one answer (default true).
    pub parallel_tool_calls: Option<Value>,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Structured output.
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// Fields asked for that Baton does not do.
    #[serde(flatten)]
    pub unsupported: NotSupported,
}

/// One message of a chat request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant`, …
    pub role: Option<String>,
    /// A string, an array of `{"type": "text", "text": …}` parts, or null.
    pub content: Option<Value>,
    /// An assistant's tool calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`.
    pub tool_calls: Option<Value>,
    /// Which call a `tool` message answers.
    pub tool_call_id: Option<Value>,
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// What the prompt's count holds.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose keys and values the worker's prefix cache held.
    pub cached_tokens: u32,
}

impl Usage {
    /// Usage of `prompt` and `completion` tokens, none of them cached.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens: 0 },
        }
    }

    /// The usage of a request's choices: the prompt (and its cached tokens) once, the
    /// generated tokens of all.
    pub fn of_choices(usages: impl IntoIterator<Item = Usage>) -> Self {
        let mut usages = usages.into_iter();
        let Some(first) = usages.next() else {
            return Self::new(0, 0);
        };
        let completion = usages.fold(first.completion_tokens, |sum, u| {
            sum.saturating_add(u.completion_tokens)
        });
        Self {
            prompt_tokens_details: first.prompt_tokens_details,
            ..Self::new(first.prompt_tokens, completion)
        }
    }

    /// Usage of a finished stream; `accepted_prompt` (the count the worker gave when it
    /// took the stream) stands in for a final count of 0.
    pub fn finished(f: &baton_common::protocol::Finished, accepted_prompt: u32) -> Self {
        let prompt = if f.prompt_tokens > 0 {
            f.prompt_tokens
        } else {
            accepted_prompt
        };
        Self {
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: f.cached_tokens.min(prompt),
            },
            ..Self::new(prompt, f.completion_tokens)
        }
    }
}

/// `chat.completion`: a whole chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-<stream id>`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// The one choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// A choice of a [`ChatCompletion`].
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The answer.
    pub message: ChatMessageOut,
    /// The tokens' logprobs when the request asked ([`super::logprobs`]), else null.
    pub logprobs: Option<Value>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// The assistant's answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text (null when the answer is only tool calls).
    pub content: Option<String>,
    /// The tools it called, when the request offered some (omitted otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One call of a function, in OpenAI's shape: whole, or as a streamed delta (the first
/// delta of a call has its id, type and name; later ones only more arguments).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// Its place among the answer's calls (streamed deltas only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// `call_…`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `function`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// What it calls.
    pub function: FunctionOut,
}

/// The function of a [`ToolCallOut`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionOut {
    /// Its name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its arguments, as JSON text (a delta: the next piece of it).
    pub arguments: String,
}

impl ChatMessageOut {
    /// The assistant's whole answer: its text (null when it only called tools), and
    /// its calls when it made any.
    pub fn answer(text: String, calls: &[baton_common::protocol::ToolCall]) -> Self {
        Self {
            role: "assistant",
            content: (!text.is_empty() || calls.is_empty()).then_some(text),
            tool_calls: (!calls.is_empty())
                .then(|| calls.iter().map(|c| ToolCallOut::of(c, false)).collect()),
        }
    }
}

impl ToolCallOut {
    /// `call` as a whole answer lists it (`streamed`: as a delta, with its index).
    pub fn of(call: &baton_common::protocol::ToolCall, streamed: bool) -> Self {
        let first = !call.name.is_empty();
        Self {
            index: streamed.then_some(call.index),
            id: first.then(|| call.id.clone()),
            kind: first.then_some("function"),
            function: FunctionOut {
                name: first.then(|| call.name.clone()),
                arguments: call.arguments.clone(),
            },
        }
    }
}

/// `chat.completion.chunk`: one streamed piece of a chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// `chatcmpl-<stream id>`, the same for every chunk of a stream.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Only in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A choice of a [`ChatChunk`].
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What is new.
    pub delta: Delta,
    /// The tokens' logprobs when the request asked ([`super::logprobs`]), else null.
    pub logprobs: Option<Value>,
    /// Null until the final chunk.
    pub finish_reason: Option<&'static str>,
}

/// What a chat chunk adds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls completed since the last chunk (each whole: id, name and arguments).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// `text_completion`: a whole completion, or one streamed piece of it.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    /// `cmpl-<stream id>`.
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// One choice, or none in a usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// In whole completions and in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A choice of a [`Completion`].
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// The text (new text, in a chunk).
    pub text: String,
    /// Always 0.
    pub index: u32,
    /// The tokens' logprobs when the request asked ([`super::logprobs`]), else null.
    pub logprobs: Option<Value>,
    /// Null until the end.
    pub finish_reason: Option<&'static str>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelCard>,
}

/// One model of [`ModelList`].
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The name clients use.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds (when this coordinator first saw it).
    pub created: u64,
    /// Always `baton`.
    pub owned_by: &'static str,
    /// Longest sequence (prompt and output) in tokens that a live worker allows for it
    /// (vLLM's field name).
    pub max_model_len: u32,
    /// The same, under the name other servers and clients read.
    pub context_length: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn to_json<T: Serialize>(v: &T) -> Value {
        serde_json::to_value(v).expect("serialize")
    }

    #[test]
    fn chat_chunks_have_the_openai_shape() {
        let chunk = ChatChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 7,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some("Hi".into()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        assert_eq!(
            to_json(&chunk),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                   "model": "m", "choices": [{"index": 0,
                   "delta": {"role": "assistant", "content": "Hi"},
                   "logprobs": null, "finish_reason": null}]})
        );
    }

    #[test]
    fn whole_answers_have_the_openai_shape() {
        let chat = ChatCompletion {
            id: "chatcmpl-1".into(),
            object: "chat.completion",
            created: 7,
            model: "m".into(),
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut::answer("Hi".into(), &[]),
                logprobs: None,
                finish_reason: "stop",
            }],
            usage: Usage::new(3, 1),
        };
        assert_eq!(
            to_json(&chat),
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                                "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}})
        );
        let text = Completion {
            id: "cmpl-1".into(),
            object: "text_completion",
            created: 7,
            model: "m".into(),
            choices: vec![CompletionChoice {
                text: "Hi".into(),
                index: 0,
                logprobs: None,
                finish_reason: Some("length"),
            }],
            usage: None,
        };
        assert_eq!(
            to_json(&text),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"text": "Hi", "index": 0, "logprobs": null,
                                "finish_reason": "length"}]})
        );
        let models = ModelList {
            object: "list",
            data: vec![ModelCard {
                id: "m".into(),
                object: "model",
                created: 7,
                owned_by: "baton",
                max_model_len: 8192,
                context_length: 8192,
            }],
        };
        assert_eq!(
            to_json(&models),
            json!({"object": "list", "data": [{"id": "m", "object": "model", "created": 7,
                                               "owned_by": "baton", "max_model_len": 8192,
                                               "context_length": 8192}]})
        );
    }

    #[test]
    fn requests_ignore_unknown_fields() {
        let r: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi", "name": "x"}],
            "max_tokens": 5, "frequency_penalty": 0.5, "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .expect("parse");
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.sampling.max_tokens, Some(5));
        assert!(r.sampling.stream_options.expect("options").include_usage);
    }
}
