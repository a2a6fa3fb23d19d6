//! A simulated engine: deterministic tokens at a set pace, no model. A test tool for
//! routing and failover tests (never a default): `baton-worker serve --simulated`.

use std::time::Duration;

use baton_common::protocol::{
    ErrorKind, EventKind, FinishReason, Finished, ModelInfo, PromptSpec, SeqRequest, TokenEvent,
    WireError,
};

use super::scheduler::SeqEngine;

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
        }
    }
}

fn prompt_seed(p: &PromptSpec) -> (u64, u32) {
    let text = match p {
        PromptSpec::Text(t) => t.clone(),
        PromptSpec::Chat(turns) => turns
            .iter()
            .map(|t| format!("{}:{}", t.role, t.content))
            .collect(),
        PromptSpec::Tokens(ids) => format!("{ids:?}"),
    };
    let words = text.split_whitespace().count().max(1) as u32;
    (xxhash_rust::xxh3::xxh3_64(text.as_bytes()), words)
}

impl SeqEngine for SimEngine {
    type Seq = SimSeq;

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            name: self.name.clone(),
            context_length: self.context_length,
            fingerprint: xxhash_rust::xxh3::xxh3_64(b"simulated"),
        }
    }

    fn start(&self, req: &SeqRequest) -> Result<(SimSeq, u32), WireError> {
        if req.model != self.name {
            return Err(WireError {
                kind: ErrorKind::UnknownModel,
                message: format!("this worker serves {:?}, not {:?}", self.name, req.model),
            });
        }
        let (seed, prompt_tokens) = prompt_seed(&req.prompt);
        if prompt_tokens >= self.context_length {
            return Err(WireError {
                kind: ErrorKind::PromptTooLong,
                message: format!(
                    "the prompt has {prompt_tokens} tokens but the context holds {}",
                    self.context_length
                ),
            });
        }
        Ok((
            SimSeq {
                seed: seed ^ req.params.seed,
                prompt_tokens,
                max_tokens: req.params.max_tokens.max(1),
                generated: 0,
            },
            prompt_tokens,
        ))
    }

    fn step(&self, seqs: &mut [&mut SimSeq]) -> Result<Vec<Vec<EventKind>>, WireError> {
        std::thread::sleep(self.pace);
        Ok(seqs
            .iter_mut()
            .map(|s| {
                let index = s.generated;
                let id =
                    (xxhash_rust::xxh3::xxh3_64_with_seed(&index.to_le_bytes(), s.seed) % 8) as u32;
                s.generated += 1;
                let mut out = vec![EventKind::Token(TokenEvent {
                    index,
                    id,
                    text: format!(" {}", WORDS[id as usize]),
                })];
                if s.generated >= s.max_tokens {
                    out.push(EventKind::Finished(Finished {
                        reason: FinishReason::Length,
                        prompt_tokens: s.prompt_tokens,
                        completion_tokens: s.generated,
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
