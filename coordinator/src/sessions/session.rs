//! One stream's state: its request, the tokens so far, where it runs and who listens.

use std::time::{Duration, Instant};

use baton_common::protocol::{
    ErrorKind, Finished, PromptEcho, Resume, SeqRequest, TokenLogprobs, ToolCall, WireError,
};
use tokio::sync::mpsc::UnboundedSender;

use baton_common::ids::WorkerId;

use crate::store::StreamRecord;

/// What a stream's clients receive.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// A token's text at its position.
    Token {
        /// Position in the output.
        index: u32,
        /// Text that became final with it (may be empty).
        text: String,
        /// The chain hash after it (hₚ): a reconnecting client names it with the
        /// position, so that a regenerated stream is checked against what it holds.
        hash: u64,
        /// Its logprobs, when the request asked.
        logprobs: Option<TokenLogprobs>,
        /// Tool calls it completed (named: `call_…`).
        tool_calls: Vec<ToolCall>,
    },
    /// The scored prompt (a completion's `echo`), before the first token.
    Prompt(PromptEcho),
    /// The worker ran part of a long prompt: nothing to show, but the stream is alive.
    Progress,
    /// The stream ended normally.
    Finished(Finished),
    /// The stream failed.
    Failed(WireError),
}

/// Prompt tokens a stall window covers before a stream's first token.
const PROMPT_TOKENS_PER_WINDOW: u32 = 1024;

/// Where a session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Being offered to workers (new, or resumed).
    Dispatching,
    /// Running on a worker.
    Running(WorkerId),
    /// No client listens; the worker was told to stop. A client that attaches within
    /// the reconnect window resumes it; after that, the stream is forgotten.
    Detached {
        /// When the last client went away.
        since: Instant,
    },
}

/// A client of a stream: its channel and the first position it has not seen.
#[derive(Debug)]
pub(super) struct Subscriber {
    pub(super) tx: UnboundedSender<Update>,
    /// Tokens before this position are not sent again: a client that reconnects with
    /// `Last-Event-ID` after a coordinator restart may hold tokens the store lost (in
    /// `async` mode), which the resumed stream regenerates.
    pub(super) next: u32,
    /// The position and chain hash of the client's last token when the session did not
    /// have it yet: the regenerated token there must carry the same hash, else the
    /// client holds another text and its stream fails.
    pub(super) expect: Option<(u32, u64)>,
}

/// A token a session holds.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub(super) id: u32,
    /// Chain hash after it.
    pub(super) hash: u64,
    pub(super) text: String,
    pub(super) logprobs: Option<TokenLogprobs>,
    pub(super) tool_calls: Vec<ToolCall>,
}

/// One stream.
#[derive(Debug)]
pub(super) struct Session {
    /// The request and its answer's shape, as stored.
    pub(super) record: StreamRecord,
    /// Tokens so far.
    pub(super) tokens: Vec<Held>,
    /// How many of them reached the clients (the rest wait for a checkpoint flush).
    pub(super) forwarded: usize,
    /// Prompt length, as a worker counted it.
    pub(super) prompt_tokens: u32,
    pub(super) phase: Phase,
    /// Clients listening.
    pub(super) subscribers: Vec<Subscriber>,
    /// Whether the stream's record has reached the disk (`async` mode holds its tokens
    /// back from clients until it has, so that a client never holds a stream that a
    /// restarted coordinator does not know).
    pub(super) durable: bool,
    /// Dispatched again after a restart: runs to its end even with no client.
    pub(super) orphan: bool,
    /// Last time it moved (token, dispatch).
    pub(super) last_progress: Instant,
    /// Resumes so far.
    pub(super) resumes: u32,
    /// The worker's end is in and waits for a checkpoint flush to reach the clients: the
    /// stream is no longer the worker's, however long the flush takes.
    pub(super) finishing: bool,
}

impl Session {
    pub(super) fn new(record: StreamRecord, tokens: Vec<Held>, now: Instant) -> Self {
        Self {
            forwarded: tokens.len(),
            record,
            tokens,
            prompt_tokens: 0,
            phase: Phase::Dispatching,
            subscribers: Vec::new(),
            durable: true,
            orphan: false,
            last_progress: now,
            resumes: 0,
            finishing: false,
        }
    }

    /// Whether `worker` runs it and has not yet ended it: the streams a probe asks
    /// after and a lost worker's loss moves.
    pub(super) fn runs_on(&self, worker: WorkerId) -> bool {
        self.phase == Phase::Running(worker) && !self.finishing
    }

    /// Whether any client still listens (dropping closed channels).
    pub(super) fn listened(&mut self) -> bool {
        self.subscribers.retain(|s| !s.tx.is_closed());
        self.orphan || !self.subscribers.is_empty()
    }

    /// Adds a client that has every token before position `next` (and, when `expect`
    /// is given, the chain hash there that a token still to come must match).
    pub(super) fn subscribe(
        &mut self,
        tx: UnboundedSender<Update>,
        next: u32,
        expect: Option<(u32, u64)>,
    ) {
        self.subscribers.push(Subscriber { tx, next, expect });
    }

    pub(super) fn send(&mut self, update: &Update) {
        self.subscribers.retain_mut(|s| match update {
            Update::Token { index, hash, .. } if *index < s.next => match s.expect {
                Some((at, want)) if at == *index && want != *hash => {
                    let _ = s.tx.send(Update::Failed(diverged(*index)));
                    false
                }
                Some((at, _)) if at == *index => {
                    s.expect = None;
                    !s.tx.is_closed()
                }
                _ => !s.tx.is_closed(),
            },
            Update::Token { index, .. } => {
                s.next = index + 1;
                s.tx.send(update.clone()).is_ok()
            }
            _ => s.tx.send(update.clone()).is_ok(),
        });
    }

    pub(super) fn attempt(&self) -> u32 {
        self.record.attempt
    }

    /// How long it may be silent before it moves although its worker answers: before
    /// its first token the worker may be running a long prompt in one step, so the
    /// window grows with the prompt (one more `stall_timeout` a 1,024 tokens).
    pub(super) fn stall_window(&self, stall_timeout: Duration) -> Duration {
        if !self.tokens.is_empty() {
            return stall_timeout;
        }
        stall_timeout.saturating_mul(1 + self.prompt_tokens / PROMPT_TOKENS_PER_WINDOW)
    }

    /// The update that replays held token `index`.
    pub(super) fn replay(&self, index: usize) -> Update {
        let t = &self.tokens[index];
        Update::Token {
            index: index as u32,
            text: t.text.clone(),
            hash: t.hash,
            logprobs: t.logprobs.clone(),
            tool_calls: t.tool_calls.clone(),
        }
    }

    /// The request of the next dispatch: a resume from the tokens so far.
    pub(super) fn request(&self) -> SeqRequest {
        let mut req = self.record.request.clone();
        req.attempt = self.record.attempt;
        req.resume = self.tokens.last().map(|last| Resume {
            tokens: self.tokens.iter().map(|t| t.id).collect(),
            hash: last.hash,
        });
        // A prompt already scored is not scored again (unless scoring is all it asks).
        if self.record.prompt.is_some() && req.params.max_tokens > 0 {
            req.params.prompt_logprobs = None;
        }
        req
    }
}

/// The failure a client gets when the regenerated token at `index` is not the one it
/// holds.
pub(crate) fn diverged(index: u32) -> WireError {
    WireError {
        kind: ErrorKind::ChainMismatch,
        message: format!(
            "the resumed stream produced another token at position {index} than the one this client holds"
        ),
    }
}
