//! One request in flight, between steps.

use super::*;

/// One request in flight.
pub struct Sequence<B: Backend> {
    pub(super) cache: KvCache<B>,
    /// Tokens not yet run through the model (the prompt, then each sampled token).
    pub(super) pending: Vec<u32>,
    pub(super) prompt_ids: Vec<u32>,
    pub(super) generated: Vec<u32>,
    pub(super) params: GenerateParams,
    pub(super) stops: StopMatcher,
    /// Text emitted so far.
    pub(super) text: String,
    /// Tool calls found so far.
    pub(super) calls: Vec<ToolCall>,
    /// Its length in characters.
    pub(super) text_chars: usize,
    /// Turns ids into whole characters as they come; taken when the sequence ends.
    pub(super) decoder: Option<StreamDecoder>,
    pub(super) finish: Option<FinishReason>,
    /// The request's grammar, where it has one.
    pub(super) guide: Option<Guide>,
    /// Finds tool calls in the output, when the request offers tools.
    pub(super) tools: Option<ToolParser>,
    /// Why the grammar ended the sequence ([`FinishReason::GrammarFailed`]).
    pub(super) failure: Option<String>,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub(super) reused: usize,
    /// The scored prompt's entries so far ([`GenerateParams::prompt_logprobs`]).
    pub(super) prompt_scores: Vec<Logprobs>,
    /// Whether they were taken.
    pub(super) prompt_scored: bool,
    /// Positions last reported by [`Sequence::progress`].
    pub(super) reported: usize,
}

impl<B: Backend> Sequence<B> {
    /// The tokens whose keys and values the KV cache holds: the prompt, then the
    /// generated tokens, as far as the cache reaches.
    pub(super) fn cached_tokens(&self) -> Vec<u32> {
        self.prompt_ids
            .iter()
            .chain(&self.generated)
            .take(self.cache.len())
            .copied()
            .collect()
    }

    /// Why the sequence ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tool calls found in the output so far.
    pub fn tool_calls(&self) -> u32 {
        self.tools.as_ref().map_or(0, ToolParser::calls)
    }

    /// What went wrong when it ended with [`FinishReason::GrammarFailed`].
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    pub(super) fn fail(&mut self, message: String) {
        self.failure = Some(message);
        self.finish = Some(FinishReason::GrammarFailed);
        self.decoder = None;
    }

    /// Prompt tokens whose keys and values came from the prefix cache instead of running
    /// through the model.
    pub fn reused_prompt_tokens(&self) -> usize {
        self.reused
    }

    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt_ids.len()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// The KV cache (its length is the number of positions processed).
    pub fn cache(&self) -> &KvCache<B> {
        &self.cache
    }

    /// Whether its next row is a scored prompt's, with a prompt token after it.
    pub(super) fn scoring(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.cache.len() + 1 < self.prompt_ids.len()
    }

    /// The scored prompt's entries, once its whole prompt has run (then never again):
    /// the log-probability of each prompt token after the first given those before it.
    pub fn take_prompt_scores(&mut self) -> Option<Vec<Logprobs>> {
        let done = self.cache.len() >= self.prompt_ids.len();
        if self.params.prompt_logprobs.is_none() || self.prompt_scored || !done {
            return None;
        }
        self.prompt_scored = true;
        Some(std::mem::take(&mut self.prompt_scores))
    }

    /// The positions its KV cache holds, when they grew since the last call: a step that
    /// ran a chunk of its prompt and gave no token still shows the sequence moving.
    pub fn progress(&mut self) -> Option<u32> {
        let at = self.cache.len();
        (at > self.reported).then(|| {
            self.reported = at;
            at as u32
        })
    }

    /// The prompt's token ids.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    /// Whether its next draw is from the logits as the model gives them (no penalty,
    /// bias, grammar or ban): its row's head may decide it and give its logprobs.
    pub(super) fn plain(&self) -> bool {
        !self.params.sampling.adjusts()
            && self.guide.is_none()
            && self.generated.len() >= self.params.min_tokens
    }

    /// Whether its next draw is the argmax of the logits as the model gives them, and
    /// nothing else is asked of the row.
    pub(super) fn plain_greedy(&self) -> bool {
        self.plain() && self.params.sampling.temperature == 0.0 && self.params.logprobs.is_none()
    }

    /// The tokens its next draw may not pick: while the output is shorter than
    /// `min_tokens`, those that would end it.
    pub(super) fn banned(&self, engine: &Engine<B>) -> Vec<u32> {
        if self.generated.len() >= self.params.min_tokens {
            return Vec::new();
        }
        let mut banned = self.params.stop_token_ids.clone();
        if !self.params.ignore_eos || self.guide.is_some() {
            banned.extend_from_slice(&engine.end_tokens);
        }
        banned
    }

    /// Takes `id`, drawn from this sequence's logits, as its next token and applies the
    /// stop conditions.
    pub(super) fn take(&mut self, engine: &Engine<B>, id: u32) -> Result<TokenEvent, EngineError> {
        self.pending.clear();
        self.pending.push(id);
        self.commit(engine, id)
    }

    /// Appends `id` to the output and applies the stop conditions; returns the token's
    /// event. The same for a sampled token and for one replayed on resume, so that a
    /// resumed sequence is in exactly the state the original was.
    pub(super) fn commit(
        &mut self,
        engine: &Engine<B>,
        id: u32,
    ) -> Result<TokenEvent, EngineError> {
        let index = self.generated.len();
        self.generated.push(id);

        // Under a grammar an end token is drawn only where the grammar may end, and ends.
        // A stop token ends the output whatever `ignore_eos` says.
        let is_end = ((!self.params.ignore_eos || self.guide.is_some())
            && engine.end_tokens.contains(&id))
            || self.params.stop_token_ids.contains(&id);
        if let Some(guide) = self.guide.as_mut().filter(|_| !is_end) {
            if let Err(e) = guide.consume(id) {
                self.fail(format!("token {index} (id {id}): {e}"));
                return Ok(TokenEvent {
                    index,
                    id,
                    text: String::new(),
                    logprobs: None,
                    tool_calls: Vec::new(),
                });
            }
        }
        let mut text = String::new();
        if is_end {
            self.finish = Some(FinishReason::Eos);
        } else if let Some(decoder) = self.decoder.as_mut() {
            let fresh = decoder.push(id)?;
            if self.generated.len() < self.params.min_tokens {
                // Stop strings are looked for once the output is long enough.
                text = fresh;
            } else if !fresh.is_empty() {
                let out = self.stops.push(&fresh);
                text = out.emit;
                if out.stopped {
                    self.finish = Some(FinishReason::StopString);
                }
            }
        }
        if self.finish.is_none() {
            if self.guide.as_ref().is_some_and(Guide::is_stopped) {
                self.finish = Some(FinishReason::Eos);
            } else if self.generated.len() >= self.params.max_tokens {
                self.finish = Some(FinishReason::MaxTokens);
            } else if self.prompt_ids.len() + self.generated.len() >= engine.context_length() {
                self.finish = Some(FinishReason::ContextFull);
            }
        }
        if let Some(reason) = self.finish {
            // Release what is still pending: a trailing partial character, and text the
            // stop matcher held back (unless a stop string ended the completion).
            let rest = self
                .decoder
                .take()
                .map(StreamDecoder::finish)
                .unwrap_or_default();
            if reason != FinishReason::StopString {
                let out = self.stops.push(&rest);
                text.push_str(&out.emit);
                if out.stopped {
                    self.finish = Some(FinishReason::StopString);
                } else {
                    text.push_str(&self.stops.finish());
                }
            }
        }
        let mut tool_calls = Vec::new();
        if let Some(parser) = self.tools.as_mut() {
            let mut parsed = parser.push(&text);
            if self.finish.is_some() {
                let last = parser.finish();
                parsed.content.push_str(&last.content);
                parsed.calls.extend(last.calls);
            }
            text = parsed.content;
            tool_calls = parsed.calls;
            for piece in &tool_calls {
                baton_common::tools::merge(&mut self.calls, piece.clone());
            }
        }
        self.text.push_str(&text);
        self.text_chars += text.chars().count();
        Ok(TokenEvent {
            index,
            id,
            text,
            logprobs: None,
            tool_calls,
        })
    }

    /// The finished completion.
    pub fn into_completion(self) -> Completion {
        Completion {
            prompt_ids: self.prompt_ids,
            ids: self.generated,
            text: self.text,
            tool_calls: self.calls,
            finish: self.finish.unwrap_or(FinishReason::MaxTokens),
            prompt_logprobs: self.prompt_scores,
        }
    }
}
