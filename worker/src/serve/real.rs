//! [`SeqEngine`] over the burn engine: the real model.

use baton_common::protocol::{
    ErrorKind, EventKind, FinishReason as WireFinish, Finished, GenParams, ModelInfo, PromptEcho,
    PromptSpec, SeqRequest, TokenEvent, TokenIds, TokenLogprobs, TokenizeInput, TokenizeReply,
    TokenizeRequest, Tools, TopLogprob, WireError,
};
use burn_tensor::backend::Backend;

use super::scheduler::{other_model, SeqEngine, Started};
use crate::engine::{
    chat::{ChatFunctionCall, ChatMessage, ChatToolCall},
    sampler::SamplingParams,
    Engine, EngineError, FinishReason, GenerateParams, Logprobs, Prompt, Sequence, ToolUse,
};

/// The burn engine serving one model under a public name.
pub struct RealEngine<B: Backend> {
    engine: Engine<B>,
    name: String,
}

impl<B: Backend> RealEngine<B> {
    /// Serves `engine` as `name`.
    pub fn new(engine: Engine<B>, name: String) -> Self {
        Self { engine, name }
    }
    /// Token `id`'s logprobs as they travel.
    fn wire_logprobs(&self, id: u32, l: Logprobs) -> TokenLogprobs {
        TokenLogprobs {
            logprob: l.logprob,
            bytes: self.bytes_of(id),
            text_offset: l.text_offset as u32,
            top: l
                .top
                .into_iter()
                .map(|(id, logprob)| TopLogprob {
                    id,
                    logprob,
                    bytes: self.bytes_of(id),
                })
                .collect(),
        }
    }

    /// A scored prompt as it travels: its text (special tokens left out), and each
    /// later token's entry with its offset in that text.
    fn echo(&self, prompt: &[u32], scores: Vec<Logprobs>) -> PromptEcho {
        let tokenizer = self.engine.tokenizer();
        let mut chars = 0;
        // Bytes of a character not complete yet.
        let mut partial: Vec<u8> = Vec::new();
        let mut logprobs = Vec::with_capacity(scores.len());
        for (i, &id) in prompt.iter().enumerate() {
            if let Some(score) = i.checked_sub(1).and_then(|j| scores.get(j)) {
                logprobs.push(self.wire_logprobs(
                    id,
                    Logprobs {
                        text_offset: chars,
                        ..score.clone()
                    },
                ));
            }
            if tokenizer.is_special(id) {
                continue;
            }
            partial.extend_from_slice(&self.bytes_of(id));
            let whole = match std::str::from_utf8(&partial) {
                Ok(s) => s.len(),
                // Bytes that can never be a character count as one; a character cut
                // short waits for the next token.
                Err(e) if e.error_len().is_some() => partial.len(),
                Err(e) => e.valid_up_to(),
            };
            chars += String::from_utf8_lossy(&partial[..whole]).chars().count();
            partial.drain(..whole);
        }
        PromptEcho {
            text: tokenizer.decode(prompt, true).unwrap_or_default(),
            first: prompt
                .first()
                .map(|&id| self.bytes_of(id))
                .unwrap_or_default(),
            logprobs,
        }
    }

    /// The bytes of token `id`, for its logprobs (rows past the tokenizer's vocabulary,
    /// padding, have none).
    fn bytes_of(&self, id: u32) -> Vec<u8> {
        self.engine
            .tokenizer()
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
}

/// Most ids a tokenize answer carries.
const MAX_TOKENIZED: usize = 1 << 17;

fn messages(turns: &[baton_common::protocol::ChatTurn]) -> Vec<ChatMessage> {
    turns
        .iter()
        .map(|t| ChatMessage {
            role: t.role.clone(),
            content: t.content.clone(),
            tool_calls: t
                .tool_calls
                .iter()
                .map(|c| ChatToolCall {
                    id: c.id.clone(),
                    kind: "function".into(),
                    function: ChatFunctionCall {
                        name: c.name.clone(),
                        // Templates print the arguments as JSON; text that is not JSON
                        // stays text.
                        arguments: serde_json::from_str(&c.arguments)
                            .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone())),
                    },
                })
                .collect(),
            tool_call_id: t.tool_call_id.clone(),
        })
        .collect()
}

/// A request's tools in the engine's terms, and the array for the template.
fn tool_use(tools: &Tools) -> Result<(serde_json::Value, ToolUse), WireError> {
    let invalid = |message: String| WireError {
        kind: ErrorKind::InvalidRequest,
        message,
    };
    let array: serde_json::Value = serde_json::from_str(&tools.definitions)
        .map_err(|e| invalid(format!("`tools` is not JSON: {e}")))?;
    let functions = baton_common::tools::functions(&array).map_err(|e| invalid(e.to_string()))?;
    let tools = ToolUse {
        functions,
        choice: tools.choice.clone(),
        parallel: tools.parallel,
    };
    Ok((array, tools))
}

fn wire_error(e: EngineError) -> WireError {
    let kind = match &e {
        EngineError::PromptTooLong { .. } => ErrorKind::PromptTooLong,
        EngineError::Sampling(_)
        | EngineError::ZeroMaxTokens
        | EngineError::EmptyPrompt
        | EngineError::NoChatTemplate
        | EngineError::UnguardedContent(_)
        | EngineError::SpecialText(_)
        | EngineError::Chat(_)
        | EngineError::Tokenizer(_)
        | EngineError::Forward(_)
        | EngineError::ResumePastEnd { .. }
        | EngineError::TokenOutOfVocab { .. }
        | EngineError::TooManyLogprobs(_)
        | EngineError::Grammar(_) => ErrorKind::InvalidRequest,
        EngineError::ResumeOffGrammar { .. } => ErrorKind::ChainMismatch,
        EngineError::Gguf(_) | EngineError::Load(_) | EngineError::Device { .. } => {
            ErrorKind::Internal
        }
    };
    WireError {
        kind,
        message: e.to_string(),
    }
}

/// Request parameters in the engine's terms.
pub fn generate_params(p: &GenParams) -> GenerateParams {
    GenerateParams {
        max_tokens: p.max_tokens as usize,
        sampling: SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: p.logit_bias.iter().map(|b| (b.id, b.bias)).collect(),
            seed: p.seed,
        },
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos,
        grammar: p.grammar.clone(),
        min_tokens: p.min_tokens as usize,
        stop_token_ids: p.stop_token_ids.clone(),
        logprobs: p.logprobs.map(usize::from),
        prompt_logprobs: p.prompt_logprobs.map(usize::from),
        // Checked and set by `start`.
        tools: None,
    }
}

impl<B: Backend> SeqEngine for RealEngine<B> {
    type Seq = Sequence<B>;

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: self.name.clone(),
            context_length: self.engine.context_length() as u32,
            fingerprint: self.engine.fingerprint(),
        }
    }

    fn start(&self, req: &SeqRequest) -> Result<Started<Self::Seq>, WireError> {
        if let Some(e) = other_model(&self.name, &req.model) {
            return Err(e);
        }
        let tools = req.params.tools.as_ref().map(tool_use).transpose()?;
        let ids = match &req.prompt {
            PromptSpec::Text(t) => self.engine.encode_prompt(&Prompt::Text(t.clone())),
            PromptSpec::Chat(turns) => self.engine.encode_chat_as(
                &messages(turns),
                tools.as_ref().map(|(array, _)| array),
                true,
                req.params.content_specials,
            ),
            PromptSpec::Tokens(ids) => Ok(ids.clone()),
        }
        .map_err(wire_error)?;
        let mut params = generate_params(&req.params);
        params.tools = tools.map(|(_, t)| t);
        let seq = match &req.resume {
            None => self.engine.start(ids.clone(), params),
            Some(resume) => self.engine.resume(ids.clone(), &resume.tokens, params),
        }
        .map_err(wire_error)?;
        Ok(Started {
            seq,
            prompt_ids: ids,
        })
    }

    fn step(&self, seqs: &mut [&mut Self::Seq]) -> Result<Vec<Vec<EventKind>>, WireError> {
        let events = self.engine.step(seqs).map_err(wire_error)?;
        Ok(events
            .into_iter()
            .zip(seqs.iter_mut())
            .map(|(ev, seq)| {
                let mut out = Vec::with_capacity(3);
                if let Some(scores) = seq.take_prompt_scores() {
                    out.push(EventKind::Prompt(self.echo(seq.prompt_ids(), scores)));
                }
                if let Some(ev) = ev {
                    let logprobs = ev.logprobs.map(|l| self.wire_logprobs(ev.id, l));
                    out.push(EventKind::Token(TokenEvent {
                        index: ev.index as u32,
                        id: ev.id,
                        hash: 0,
                        text: ev.text,
                        logprobs,
                        // Unnamed: the coordinator names each call (it knows the stream).
                        tool_calls: ev.tool_calls,
                    }));
                }
                let reason = match seq.finish_reason() {
                    None => {
                        if out.is_empty() {
                            out.extend(seq.progress().map(EventKind::Progress));
                        }
                        return out;
                    }
                    // A grammar with no way on is the request's, and every worker would
                    // fail it alike: not a failure to move elsewhere.
                    Some(FinishReason::GrammarFailed) => {
                        out.push(EventKind::Failed(WireError {
                            kind: ErrorKind::InvalidRequest,
                            message: format!(
                                "the grammar stopped the output: {}",
                                seq.failure().unwrap_or_default()
                            ),
                        }));
                        return out;
                    }
                    Some(FinishReason::Eos | FinishReason::StopString) if seq.tool_calls() > 0 => {
                        WireFinish::ToolCalls
                    }
                    Some(FinishReason::Eos | FinishReason::StopString) => WireFinish::Stop,
                    Some(FinishReason::MaxTokens | FinishReason::ContextFull) => WireFinish::Length,
                };
                {
                    out.push(EventKind::Finished(Finished {
                        reason,
                        prompt_tokens: seq.prompt_len() as u32,
                        completion_tokens: seq.generated().len() as u32,
                        cached_tokens: seq.reused_prompt_tokens() as u32,
                    }));
                }
                out
            })
            .collect())
    }

    fn kv_bytes(&self, seq: &Self::Seq) -> u64 {
        seq.cache().bytes() as u64
    }

    fn prefix_stats(&self) -> crate::engine::prefix::PrefixStats {
        self.engine.prefix_stats()
    }

    fn tokenize(&self, request: &TokenizeRequest) -> TokenizeReply {
        if let Some(e) = other_model(&self.name, &request.model) {
            return TokenizeReply::Failed(e);
        }
        let tokenizer = self.engine.tokenizer();
        let ids = match &request.input {
            TokenizeInput::Text(t) => tokenizer
                .encode(&t.text, t.add_special)
                .map_err(EngineError::from),
            TokenizeInput::Chat(c) => {
                let tools = match c.tools.as_deref().map(serde_json::from_str) {
                    None => None,
                    Some(Ok(tools)) => Some(tools),
                    Some(Err(e)) => {
                        return TokenizeReply::Failed(WireError {
                            kind: ErrorKind::InvalidRequest,
                            message: format!("`tools` is not JSON: {e}"),
                        })
                    }
                };
                self.engine.encode_chat_with(
                    &messages(&c.turns),
                    tools.as_ref(),
                    c.add_generation_prompt,
                )
            }
            TokenizeInput::Ids(ids) => {
                return match tokenizer.decode(ids, false) {
                    Ok(text) => TokenizeReply::Text(text),
                    Err(e) => TokenizeReply::Failed(wire_error(e.into())),
                }
            }
        };
        match ids {
            // The answer must fit a NATS message (4 bytes an id).
            Ok(ids) if ids.len() > MAX_TOKENIZED => TokenizeReply::Failed(WireError {
                kind: ErrorKind::InvalidRequest,
                message: format!(
                    "the input has {} tokens, more than the {MAX_TOKENIZED} one answer holds",
                    ids.len()
                ),
            }),
            Ok(ids) => TokenizeReply::Tokens(TokenIds {
                ids,
                context_length: self.engine.context_length() as u32,
            }),
            Err(e) => TokenizeReply::Failed(wire_error(e)),
        }
    }
}
