//! Reading an answer, whatever the front: the updates of its choices' streams side by
//! side ([`Reader`]), with the idle timeout (`stream_timeout_ms`) that a long prompt's
//! progress restarts, a failed stream as its error; and the whole answer gathered
//! ([`gather`]) and shaped as OpenAI's body ([`whole_body`]). The SSE body and the NATS
//! streams render what the reader gives; both whole answers are the same body.

use std::time::Duration;

use baton_common::protocol::{Finished, PromptEcho, TokenLogprobs, ToolCall};
use tokio::time::Instant;

use super::choices::{next, Member};
use super::chunks::to_json;
use super::error::ApiError;
use super::logprobs::LogprobsWriter;
use super::openai::{
    ChatChoice, ChatCompletion, ChatMessageOut, Completion, CompletionChoice, Usage,
};
use super::validate::Endpoint;
use crate::sessions::Update;

/// What a read gave.
#[derive(Debug)]
pub enum Read {
    /// Choice `members[i]`'s scored prompt (a completion's `echo`).
    Prompt(usize, PromptEcho),
    /// A token of choice `members[choice]`.
    Token {
        /// Its member's index.
        choice: usize,
        /// Its position in the output.
        index: u32,
        /// The text it made final.
        text: String,
        /// The chain hash after it.
        hash: u64,
        /// Its logprobs, when asked.
        logprobs: Option<TokenLogprobs>,
        /// Tool call pieces it completed.
        tool_calls: Vec<ToolCall>,
    },
    /// Choice `members[i]` ended.
    Finished(usize, Finished),
    /// Nothing arrived before the caller's wake-up time.
    Quiet,
    /// Every choice has ended.
    Done,
}

/// The updates of an answer's choices.
#[derive(Debug)]
pub struct Reader {
    members: Vec<Member>,
    /// The model asked for, to name it in a worker's errors.
    model: String,
    idle: Duration,
    idle_since: Instant,
}

impl Reader {
    /// Reads `members` (in choice order); fails after `idle` without an update.
    pub fn new(members: Vec<Member>, model: String, idle: Duration) -> Self {
        Self {
            members,
            model,
            idle,
            idle_since: Instant::now(),
        }
    }

    /// The choices' streams.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The next update of any choice still running, or [`Read::Quiet`] at `wake` when
    /// nothing came. A stream that failed is its error; so is `idle` without any update
    /// (a long prompt's progress counts as one) and a session that went away.
    pub async fn next(&mut self, wake: Option<Instant>) -> Result<Read, ApiError> {
        loop {
            let deadline = self.idle_since + self.idle;
            let until = wake.map_or(deadline, |w| w.min(deadline));
            let update = match tokio::time::timeout_at(until, next(&mut self.members)).await {
                Ok(None) => return Ok(Read::Done),
                Ok(Some((i, Some(update)))) => (i, update),
                Ok(Some((_, None))) => {
                    return Err(ApiError::Internal("the stream's session closed".into()))
                }
                Err(_) if until < deadline => return Ok(Read::Quiet),
                Err(_) => {
                    let ms = u64::try_from(self.idle.as_millis()).unwrap_or(u64::MAX);
                    return Err(ApiError::StreamTimeout(ms));
                }
            };
            self.idle_since = Instant::now();
            return Ok(match update {
                (_, Update::Progress) => continue,
                (i, Update::Prompt(p)) => Read::Prompt(i, p),
                (
                    choice,
                    Update::Token {
                        index,
                        text,
                        hash,
                        logprobs,
                        tool_calls,
                    },
                ) => Read::Token {
                    choice,
                    index,
                    text,
                    hash,
                    logprobs,
                    tool_calls,
                },
                (i, Update::Finished(f)) => {
                    self.members[i].done = true;
                    Read::Finished(i, f)
                }
                (i, Update::Failed(error)) => {
                    self.members[i].done = true;
                    return Err(ApiError::from_worker(error, &self.model));
                }
            });
        }
    }
}

/// One choice's whole answer.
#[derive(Debug, Clone)]
pub struct Part {
    /// Its text (the echoed prompt first, when asked).
    pub text: String,
    /// Each token's logprobs, when asked.
    pub logprobs: Vec<TokenLogprobs>,
    /// The tools it called, whole.
    pub tool_calls: Vec<ToolCall>,
    /// The scored prompt (a completion's `echo`).
    pub prompt: Option<PromptEcho>,
    /// How it ended.
    pub finished: Finished,
}

/// Reads every choice to its end; `on_token` is called for each token (metrics).
pub async fn gather(
    reader: &mut Reader,
    mut on_token: impl FnMut(),
) -> Result<Vec<Part>, ApiError> {
    let n = reader.members().len();
    let mut texts = vec![String::new(); n];
    let mut logprobs: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); n];
    let mut calls: Vec<Vec<ToolCall>> = vec![Vec::new(); n];
    let mut prompts: Vec<Option<PromptEcho>> = vec![None; n];
    let mut ends: Vec<Option<Finished>> = vec![None; n];
    loop {
        match reader.next(None).await? {
            Read::Prompt(i, p) => {
                texts[i].insert_str(0, &p.text);
                prompts[i] = Some(p);
            }
            Read::Token {
                choice,
                text,
                logprobs: l,
                tool_calls,
                ..
            } => {
                on_token();
                texts[choice].push_str(&text);
                logprobs[choice].extend(l);
                for piece in tool_calls {
                    baton_common::tools::merge(&mut calls[choice], piece);
                }
            }
            Read::Finished(i, f) => ends[i] = Some(f),
            Read::Quiet => {}
            Read::Done => break,
        }
    }
    let parts = texts
        .into_iter()
        .zip(logprobs)
        .zip(calls)
        .zip(prompts)
        .zip(ends)
        .filter_map(|((((text, logprobs), tool_calls), prompt), end)| {
            Some(Part {
                text,
                logprobs,
                tool_calls,
                prompt,
                finished: end?,
            })
        })
        .collect::<Vec<_>>();
    if parts.len() != n {
        return Err(ApiError::Internal("a choice ended without its end".into()));
    }
    Ok(parts)
}

/// What shapes a whole answer besides its parts.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Chat or text completion.
    pub endpoint: Endpoint,
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// The model asked for.
    pub model: String,
    /// Unix seconds.
    pub created: u64,
    /// The request asked for logprobs.
    pub logprobs: bool,
    /// Prompt tokens, as the first choice's worker counted.
    pub prompt_tokens: u32,
}

/// The usage of `parts` together.
pub fn usage(parts: &[Part], prompt_tokens: u32) -> Usage {
    Usage::of_choices(
        parts
            .iter()
            .map(|p| Usage::finished(&p.finished, prompt_tokens)),
    )
}

/// The OpenAI body of a whole answer (`chat.completion` or `text_completion`), as JSON.
pub fn whole_body(shape: &Shape, parts: &[Part]) -> String {
    let logprobs = |part: &Part| {
        let mut writer = LogprobsWriter::new(shape.endpoint, shape.logprobs);
        if let Some(p) = &part.prompt {
            writer.push_prompt(p);
        }
        for l in &part.logprobs {
            writer.push(Some(l));
        }
        writer.take()
    };
    let usage = usage(parts, shape.prompt_tokens);
    match shape.endpoint {
        Endpoint::Chat => to_json(&ChatCompletion {
            id: shape.id.clone(),
            object: "chat.completion",
            created: shape.created,
            model: shape.model.clone(),
            choices: parts
                .iter()
                .enumerate()
                .map(|(i, part)| ChatChoice {
                    index: i as u32,
                    message: ChatMessageOut::answer(part.text.clone(), &part.tool_calls),
                    logprobs: logprobs(part),
                    finish_reason: part.finished.reason.openai(),
                })
                .collect(),
            usage,
        }),
        Endpoint::Completion => to_json(&Completion {
            id: shape.id.clone(),
            object: "text_completion",
            created: shape.created,
            model: shape.model.clone(),
            choices: parts
                .iter()
                .enumerate()
                .map(|(i, part)| CompletionChoice {
                    text: part.text.clone(),
                    index: i as u32,
                    logprobs: logprobs(part),
                    finish_reason: Some(part.finished.reason.openai()),
                })
                .collect(),
            usage: Some(usage),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::FinishReason;
    use serde_json::{json, Value};

    #[test]
    fn whole_bodies_have_the_openai_shape() {
        let shape = |logprobs: bool| Shape {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            model: "m".into(),
            created: 7,
            logprobs,
            prompt_tokens: 2,
        };
        let part = |text: &str, reason, completion_tokens| Part {
            text: text.into(),
            logprobs: Vec::new(),
            tool_calls: Vec::new(),
            prompt: None,
            finished: Finished {
                reason,
                prompt_tokens: 2,
                completion_tokens,
                cached_tokens: 0,
            },
        };
        let body = |shape: &Shape, parts: &[Part]| -> Value {
            serde_json::from_str(&whole_body(shape, parts)).expect("json")
        };
        let b = body(&shape(false), &[part("Hi", FinishReason::Stop, 1)]);
        assert_eq!(b["object"], "chat.completion");
        assert_eq!(b["id"], "chatcmpl-1");
        assert_eq!(b["choices"][0]["message"]["content"], "Hi");
        assert_eq!(b["choices"][0]["logprobs"], Value::Null);
        assert_eq!(b["usage"]["total_tokens"], 3);
        let entry = TokenLogprobs {
            logprob: -0.5,
            bytes: b"Hi".to_vec(),
            text_offset: 0,
            top: Vec::new(),
        };
        let with_logprobs = Part {
            logprobs: vec![entry],
            ..part("Hi", FinishReason::Stop, 1)
        };
        let b = body(&shape(true), &[with_logprobs]);
        assert_eq!(
            b["choices"][0]["logprobs"]["content"][0]["token"], "Hi",
            "{b}"
        );
        let call = ToolCall {
            index: 0,
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        // Two choices: each its own entry; the prompt counted once, the tokens of both.
        let calling = Part {
            tool_calls: vec![call],
            ..part("", FinishReason::ToolCalls, 3)
        };
        let b = body(
            &shape(false),
            &[calling, part("Hello", FinishReason::Length, 4)],
        );
        assert_eq!(
            b["choices"][0]["message"],
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                   "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
        );
        assert_eq!(b["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(b["choices"][1]["index"], 1);
        assert_eq!(b["choices"][1]["message"]["content"], "Hello");
        assert_eq!(
            (
                b["usage"]["prompt_tokens"].as_u64(),
                b["usage"]["completion_tokens"].as_u64()
            ),
            (Some(2), Some(7))
        );
        let completion = Shape {
            endpoint: Endpoint::Completion,
            ..shape(false)
        };
        let b = body(&completion, &[part("Hi", FinishReason::Stop, 1)]);
        assert_eq!(b["object"], "text_completion");
        assert_eq!(b["choices"][0]["text"], "Hi");
    }
}
