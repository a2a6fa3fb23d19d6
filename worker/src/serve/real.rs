//! [`SeqEngine`] over the burn engine: the real model.

use baton_common::protocol::{
    ErrorKind, EventKind, FinishReason as WireFinish, Finished, GenParams, ModelInfo, PromptSpec,
    SeqRequest, TokenEvent, TokenIds, TokenLogprobs, TokenizeInput, TokenizeReply, TokenizeRequest,
    TopLogprob, WireError,
};
use burn_tensor::backend::Backend;

use super::scheduler::{SeqEngine, Started};
use crate::engine::{
    chat::ChatMessage, sampler::SamplingParams, Engine, EngineError, FinishReason, GenerateParams,
    Prompt, Sequence,
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

fn messages(turns: &[baton_common::protocol::ChatTurn]) -> Vec<ChatMessage> {
    turns
        .iter()
        .map(|t| ChatMessage {
            role: t.role.clone(),
            content: t.content.clone(),
        })
        .collect()
}

fn wire_error(e: EngineError) -> WireError {
    let kind = match &e {
        EngineError::PromptTooLong { .. } => ErrorKind::PromptTooLong,
        EngineError::Sampling(_)
        | EngineError::ZeroMaxTokens
        | EngineError::EmptyPrompt
        | EngineError::NoChatTemplate
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
        if req.model != self.name {
            return Err(WireError {
                kind: ErrorKind::UnknownModel,
                message: format!("this worker serves {:?}, not {:?}", self.name, req.model),
            });
        }
        let ids = match &req.prompt {
            PromptSpec::Text(t) => self.engine.encode_prompt(&Prompt::Text(t.clone())),
            PromptSpec::Chat(turns) => self.engine.encode_prompt(&Prompt::Chat(messages(turns))),
            PromptSpec::Tokens(ids) => Ok(ids.clone()),
        }
        .map_err(wire_error)?;
        let params = generate_params(&req.params);
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
            .zip(seqs.iter())
            .map(|(ev, seq)| {
                let mut out = Vec::with_capacity(2);
                if let Some(ev) = ev {
                    let logprobs = ev.logprobs.map(|l| TokenLogprobs {
                        logprob: l.logprob,
                        bytes: self.bytes_of(ev.id),
                        top: l
                            .top
                            .into_iter()
                            .map(|(id, logprob)| TopLogprob {
                                id,
                                logprob,
                                bytes: self.bytes_of(id),
                            })
                            .collect(),
                    });
                    out.push(EventKind::Token(TokenEvent {
                        index: ev.index as u32,
                        id: ev.id,
                        hash: 0,
                        text: ev.text,
                        logprobs,
                    }));
                }
                let reason = match seq.finish_reason() {
                    None => return out,
                    Some(FinishReason::GrammarFailed) => {
                        out.push(EventKind::Failed(WireError {
                            kind: ErrorKind::Internal,
                            message: format!(
                                "the grammar stopped the output: {}",
                                seq.failure().unwrap_or_default()
                            ),
                        }));
                        return out;
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
        if request.model != self.name {
            return TokenizeReply::Failed(WireError {
                kind: ErrorKind::UnknownModel,
                message: format!(
                    "this worker serves {:?}, not {:?}",
                    self.name, request.model
                ),
            });
        }
        let tokenizer = self.engine.tokenizer();
        let ids = match &request.input {
            TokenizeInput::Text(t) => tokenizer
                .encode(&t.text, t.add_special)
                .map_err(EngineError::from),
            TokenizeInput::Chat(c) => self
                .engine
                .encode_chat(&messages(&c.turns), c.add_generation_prompt),
            TokenizeInput::Ids(ids) => {
                return match tokenizer.decode(ids, false) {
                    Ok(text) => TokenizeReply::Text(text),
                    Err(e) => TokenizeReply::Failed(wire_error(e.into())),
                }
            }
        };
        match ids {
            Ok(ids) => TokenizeReply::Tokens(TokenIds {
                ids,
                context_length: self.engine.context_length() as u32,
            }),
            Err(e) => TokenizeReply::Failed(wire_error(e)),
        }
    }
}
