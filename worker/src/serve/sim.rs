//! A simulated engine: deterministic tokens at a set pace, no model. A test tool for
//! routing and failover tests (never a default): `baton-worker serve --simulated`.

use std::time::Duration;

use baton_common::protocol::{
    ErrorKind, EventKind, FinishReason, Finished, ModelInfo, PromptSpec, SeqRequest, TokenEvent,
    TokenIds, TokenizeInput, TokenizeReply, TokenizeRequest, WireError,
};

use super::scheduler::{other_model, SeqEngine, Started};

/// Words the simulated tokens spell.
const WORDS: [&str; 8] = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
];

/// Deterministic fake generation.
pub struct SimEngine {
    name: String,
    /// Time one step takes.
    pace: Duration,
    context_length: u32,
    fingerprint: u64,
}

/// One simulated sequence.
pub struct SimSeq {
    seed: u64,
    prompt_tokens: u32,
    max_tokens: u32,
    generated: u32,
}

impl SimEngine {
    /// Serves `name`, one step per `pace`.
    pub fn new(name: String, pace: Duration) -> Self {
        Self {
            name,
            pace,
            context_length: 8192,
            fingerprint: xxhash_rust::xxh3::xxh3_64(b"simulated"),
        }
    }

    /// The same, under another fingerprint: a model whose chains differ (a test of
    /// what happens across a model swap).
    pub fn with_fingerprint(self, fingerprint: u64) -> Self {
        Self {
            fingerprint,
            ..self
        }
    }
}

/// The simulated tokenization: one token per whitespace-separated word (at least one),
/// and a seed from the whole prompt.
fn prompt_ids(p: &PromptSpec) -> (u64, Vec<u32>) {
    let text = match p {
        PromptSpec::Text(t) => t.clone(),
        PromptSpec::Chat(turns) => turns
            .iter()
            .map(|t| format!("{}:{}", t.role, t.content))
            .collect(),
        PromptSpec::Tokens(ids) => format!("{ids:?}"),
    };
    let mut ids: Vec<u32> = text
        .split_whitespace()
        .map(|w| (xxhash_rust::xxh3::xxh3_64(w.as_bytes()) % 49_152) as u32)
        .collect();
    if ids.is_empty() {
        ids.push(0);
    }
    (xxhash_rust::xxh3::xxh3_64(text.as_bytes()), ids)
}

/// The first parameter a request sets that the simulated words would ignore.
fn unsimulated(p: &baton_common::protocol::GenParams) -> Option<&'static str> {
    [
        ("grammar", p.grammar.is_some()),
        ("tools", p.tools.is_some()),
        ("logprobs", p.logprobs.is_some()),
        ("echo", p.prompt_logprobs.is_some()),
        ("logit_bias", !p.logit_bias.is_empty()),
        ("stop_token_ids", !p.stop_token_ids.is_empty()),
        ("min_tokens", p.min_tokens > 0),
        ("min_p", p.min_p > 0.0),
        ("presence_penalty", p.presence_penalty != 0.0),
        ("frequency_penalty", p.frequency_penalty != 0.0),
    ]
    .into_iter()
    .find_map(|(field, set)| set.then_some(field))
}

/// The simulated token at `index` of a sequence seeded with `seed`.
fn token_at(seed: u64, index: u32) -> u32 {
    (xxhash_rust::xxh3::xxh3_64_with_seed(&index.to_le_bytes(), seed) % WORDS.len() as u64) as u32
}

impl SeqEngine for SimEngine {
    type Seq = SimSeq;

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: self.name.clone(),
            context_length: self.context_length,
            fingerprint: self.fingerprint,
        }
    }

    fn start(&self, req: &SeqRequest) -> Result<Started<SimSeq>, WireError> {
        if let Some(e) = other_model(&self.name, &req.model) {
            return Err(e);
        }
        if let Some(field) = unsimulated(&req.params) {
            return Err(WireError {
                kind: ErrorKind::InvalidRequest,
                message: format!("the simulated worker does not do `{field}`"),
            });
        }
        let (seed, ids) = prompt_ids(&req.prompt);
        let prompt_tokens = ids.len() as u32;
        if prompt_tokens >= self.context_length {
            return Err(WireError {
                kind: ErrorKind::PromptTooLong,
                message: format!(
                    "the prompt has {prompt_tokens} tokens but the context holds {}",
                    self.context_length
                ),
            });
        }
        // Like a real model, greedy decoding does not depend on the seed.
        let seed = if req.params.temperature > 0.0 {
            seed ^ req.params.seed
        } else {
            seed
        };
        let max_tokens = req.params.max_tokens.max(1);
        let generated = match &req.resume {
            None => 0,
            Some(resume) => {
                let n = resume.tokens.len() as u32;
                let replays = resume
                    .tokens
                    .iter()
                    .enumerate()
                    .all(|(i, &t)| t == token_at(seed, i as u32));
                if n > max_tokens || !replays {
                    return Err(WireError {
                        kind: ErrorKind::InvalidRequest,
                        message: format!(
                            "resume of {n} tokens is not a prefix of this simulated stream"
                        ),
                    });
                }
                n
            }
        };
        Ok(Started {
            seq: SimSeq {
                seed,
                prompt_tokens,
                max_tokens,
                generated,
            },
            prompt_ids: ids,
        })
    }

    fn tokenize(&self, request: &TokenizeRequest) -> TokenizeReply {
        if let Some(e) = other_model(&self.name, &request.model) {
            return TokenizeReply::Failed(e);
        }
        // The simulated words have no text to decode back, and their ids are hashes.
        let prompt = match &request.input {
            TokenizeInput::Text(t) => PromptSpec::Text(t.text.clone()),
            TokenizeInput::Chat(c) => PromptSpec::Chat(c.turns.clone()),
            TokenizeInput::Ids(_) => {
                return TokenizeReply::Failed(WireError {
                    kind: ErrorKind::InvalidRequest,
                    message: "the simulated worker does not detokenize".into(),
                })
            }
        };
        TokenizeReply::Tokens(TokenIds {
            ids: prompt_ids(&prompt).1,
            context_length: self.context_length,
        })
    }

    fn step(&self, seqs: &mut [&mut SimSeq]) -> Result<Vec<Vec<EventKind>>, WireError> {
        std::thread::sleep(self.pace);
        Ok(seqs
            .iter_mut()
            .map(|s| {
                let mut out = Vec::with_capacity(2);
                if s.generated < s.max_tokens {
                    let index = s.generated;
                    let id = token_at(s.seed, index);
                    s.generated += 1;
                    out.push(EventKind::Token(TokenEvent {
                        index,
                        id,
                        hash: 0,
                        text: format!(" {}", WORDS[id as usize]),
                        logprobs: None,
                        tool_calls: Vec::new(),
                    }));
                }
                if s.generated >= s.max_tokens {
                    out.push(EventKind::Finished(Finished {
                        reason: FinishReason::Length,
                        prompt_tokens: s.prompt_tokens,
                        completion_tokens: s.generated,
                        cached_tokens: 0,
                    }));
                }
                out
            })
            .collect())
    }

    fn kv_bytes(&self, seq: &SimSeq) -> u64 {
        u64::from(seq.prompt_tokens + seq.generated) * 1024
    }
}
