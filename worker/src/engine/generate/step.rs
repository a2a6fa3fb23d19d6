//! One step of the engine: a batched forward pass over every sequence that runs, then
//! each row's draw.

use super::*;

impl<B: Backend> Engine<B> {
    /// Advances every unfinished sequence by one token with one forward pass, and
    /// returns the token event of each (in order; `None` for sequences already finished,
    /// and for a prompt that ran only a chunk of itself under the step budget, see
    /// [`Engine::set_step_tokens`]).
    pub fn step(
        &self,
        seqs: &mut [&mut Sequence<B>],
    ) -> Result<Vec<Option<TokenEvent>>, EngineError> {
        use crate::engine::llama::SeqInput;
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].finish.is_none())
            .collect();
        let mut events = vec![None; seqs.len()];
        if active.is_empty() {
            return Ok(events);
        }
        let prefix = self.prefix_cache().enabled();
        // Sequences looked up in the prefix cache now: positions reused, and positions
        // that could have been (counted once it runs or reuses something; a prompt that
        // found nothing and waits under the step budget is looked up again next step,
        // when the prompts that ran before it may have stored what it needs).
        let mut looked: Vec<(usize, usize, usize)> = Vec::new();
        if prefix {
            let mut cache = self.prefix_cache();
            for &i in &active {
                let s = &mut *seqs[i];
                // A scored prompt needs the logits of every position it holds.
                if !s.cache.is_empty() || s.params.prompt_logprobs.is_some() {
                    continue;
                }
                let hashes = block_hashes(self.fingerprint, &s.pending);
                // The last token always runs: its logits give the first output token.
                let candidates = s.pending.len() - 1;
                let usable = candidates / BLOCK_TOKENS;
                let found = cache.lookup(&hashes[..usable]);
                let mut loaded = 0;
                for &h in &hashes[..found] {
                    let kv = cache.get(h).expect("lookup found it");
                    if !s.cache.push_span(BLOCK_TOKENS, BLOCK_TOKENS, kv) {
                        break;
                    }
                    loaded += BLOCK_TOKENS;
                }
                // Then the leading positions of a cached block that follows the last one
                // found and begins with the same tokens.
                if loaded == found * BLOCK_TOKENS && loaded < candidates {
                    let parent = match found {
                        0 => root(self.fingerprint),
                        n => hashes[n - 1],
                    };
                    if let Some((h, n)) = cache.partial(parent, &s.pending[loaded..candidates]) {
                        let kv = cache.get(h).expect("partial found it");
                        if s.cache.push_span(BLOCK_TOKENS, n, kv) {
                            loaded += n;
                        }
                    }
                }
                looked.push((i, loaded, candidates));
                s.pending.drain(..loaded);
                s.reused = s.reused.max(loaded.min(s.prompt_ids.len()));
            }
        }
        // How many pending tokens each sequence runs this step: one for each generating
        // sequence, then what the step's budget leaves, prompt by prompt.
        let budget = match self.step_tokens.load(Ordering::Relaxed) {
            0 => usize::MAX,
            n => n,
        };
        let generating = active
            .iter()
            .filter(|&&i| seqs[i].pending.len() == 1)
            .count();
        let mut left = budget.saturating_sub(generating);
        let mut prompt_ran = false;
        let runs: Vec<(usize, usize)> = active
            .iter()
            .filter_map(|&i| {
                let s = &seqs[i];
                let mut n = s.pending.len();
                if n == 1 || s.scoring() {
                    return Some((i, 1));
                }
                if !self.model.host_path() {
                    // The device engine's prompt rows and decode rows round differently
                    // (other product and attention shapes), so a resume's replayed
                    // tokens run as they first ran: the prompt as prompt rows, then
                    // each generated token as a decode row, one a step.
                    let (done, prompt) = (s.cache.len(), s.prompt_ids.len());
                    n = n.min(prompt.saturating_sub(done).max(1));
                }
                let mut take = n.min(left);
                if take == 0 && !prompt_ran {
                    take = n.min(BLOCK_TOKENS);
                }
                left = left.saturating_sub(take);
                prompt_ran |= take > 0;
                (take > 0).then_some((i, take))
            })
            .collect();
        if !looked.is_empty() {
            let mut cache = self.prefix_cache();
            for (i, loaded, candidates) in looked {
                if loaded > 0 || runs.iter().any(|&(r, _)| r == i) {
                    cache.record(loaded, candidates);
                }
            }
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            // The forward pass's rows: one per generating sequence, the rest prompts'.
            let rows: usize = runs.iter().map(|r| r.1).sum();
            let prompts = runs.iter().filter(|r| r.1 > 1).count();
            tracing::debug!(rows, generating, prompts, "forward");
        }
        // The device engine downloads each row's argmax, and where a row draws from the
        // model's logits as they are at a temperature, the heads of the rows; then only
        // the rows that need every logit: those whose draw their head left undecided,
        // those the sampler's adjustments or a grammar change, and scored prompts'. The
        // step's other rows stay on the device.
        let scored: Vec<bool> = runs.iter().map(|&(i, _)| seqs[i].scoring()).collect();
        let whole: Vec<bool> = runs
            .iter()
            .zip(&scored)
            .map(|(&(i, _), &scored)| scored || !seqs[i].plain())
            .collect();
        let temperatures: Vec<f32> = runs
            .iter()
            .map(|&(i, _)| {
                let s = &*seqs[i];
                match s.params.sampling.temperature {
                    t if t > 0.0 && s.plain() => t,
                    _ => 1.0,
                }
            })
            .collect();
        let fetch = if whole.iter().all(|&w| w) {
            Fetch::Logits
        } else if runs
            .iter()
            .zip(&whole)
            .all(|(&(i, _), &w)| w || seqs[i].plain_greedy())
        {
            Fetch::Ids
        } else {
            Fetch::Heads(&temperatures)
        };
        // The grammar masks of the rows that draw are computed on a thread of their own
        // while the forward pass runs: they depend on the tokens so far only.
        let (forward, computed) = {
            let mut inputs: Vec<SeqInput<'_, B>> = Vec::with_capacity(runs.len());
            let mut guides: Vec<(usize, &mut Guide)> = Vec::new();
            let mut rest: Vec<Option<&mut Sequence<B>>> =
                seqs.iter_mut().map(|s| Some(&mut **s)).collect();
            for (r, &(i, take)) in runs.iter().enumerate() {
                let s = rest[i].take().expect("each index once");
                if take == s.pending.len() {
                    if let Some(guide) = s.guide.as_mut() {
                        guides.push((r, guide));
                    }
                }
                inputs.push(SeqInput {
                    tokens: &s.pending[..take],
                    cache: &mut s.cache,
                });
            }
            if guides.is_empty() {
                (self.model.forward_fetch(&mut inputs, fetch), Vec::new())
            } else {
                std::thread::scope(|scope| {
                    let masker = scope.spawn(move || {
                        guides
                            .into_iter()
                            .map(|(r, g)| (r, g.mask()))
                            .collect::<Vec<_>>()
                    });
                    let forward = self.model.forward_fetch(&mut inputs, fetch);
                    let masks = masker
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    (forward, masks)
                })
            }
        };
        let mut forward = forward?;
        // Draws at a temperature, and logprobs, decided by their rows' heads (see
        // `SamplingParams::pick_from_top`, `logprobs_from_top`); any other needs every
        // logit of the step.
        let count = self.model.config().vocab;
        let from_heads: Vec<Option<(u32, Option<Logprobs>)>> = runs
            .iter()
            .enumerate()
            .map(|(r, &(i, take))| {
                let s = &*seqs[i];
                let head = forward.heads.as_ref()?.get(r).filter(|h| h.finite)?;
                if take < s.pending.len() || s.plain_greedy() || !s.plain() {
                    return None;
                }
                let position = (s.prompt_ids.len() + s.generated.len()) as u64;
                let sampling = &s.params.sampling;
                let id = if sampling.temperature == 0.0 {
                    *forward.argmax.as_ref()?.get(r)?
                } else {
                    sampling.pick_from_top(&head.top, count, Some(&head.rest), position)?
                };
                let logprobs = match s.params.logprobs {
                    None => None,
                    Some(n) => {
                        let (logprob, top) = crate::engine::sampler::logprobs_from_top(
                            &head.top,
                            head.rest.ties,
                            head.below_at_one,
                            id,
                            n,
                        )?;
                        Some(Logprobs {
                            logprob,
                            top,
                            text_offset: 0,
                        })
                    }
                };
                Some((id, logprobs))
            })
            .collect();
        // Only the rows that need every logit come down (where they are still on the
        // device).
        let wanted: Vec<bool> = runs
            .iter()
            .zip(&from_heads)
            .zip(&scored)
            .map(|((&(i, take), drawn), &scored)| {
                let s = &*seqs[i];
                scored || (drawn.is_none() && take == s.pending.len() && !s.plain_greedy())
            })
            .collect();
        forward.fetch_rows(&wanted);
        self.downloaded_rows
            .fetch_add(forward.downloaded_rows(), Ordering::Relaxed);
        let greedy = forward.argmax.take();
        let mut masks: Vec<Option<Result<toktrie::SimpleVob, String>>> =
            runs.iter().map(|_| None).collect();
        for (r, mask) in computed {
            masks[r] = Some(mask.and_then(|m| {
                if m.is_zero() {
                    Err("the grammar allows no token here".to_string())
                } else {
                    Ok(m)
                }
            }));
        }
        let mut rows = forward.rows_mut();
        // A scored prompt's row: the next prompt token's log-probability, from the logits
        // as the model gave them.
        for ((&(i, _), row), _) in runs.iter().zip(&rows).zip(&scored).filter(|x| *x.1) {
            let s = &mut *seqs[i];
            let next = s.prompt_ids[s.cache.len()];
            let top = s.params.prompt_logprobs.unwrap_or(0);
            let (logprob, top) = crate::engine::sampler::logprobs(row, next, top);
            s.prompt_scores.push(Logprobs {
                logprob,
                top,
                text_offset: 0,
            });
        }
        // Every draw depends only on its own row, parameters, history and position, so
        // several run in parallel on the compute threads (a draw at temperature > 0 sorts
        // most of the vocabulary); the commits then run in order. A prompt that ran only
        // a chunk draws nothing: the logits of a chunk's last row are not its prompt's.
        // A greedy draw without a penalty is the row's argmax, which the host forward
        // pass found as it wrote the row: reading 16 rows of logits again, from the
        // caches of the threads that wrote them, took ~0.4 ms of a 16-sequence step.
        let draws: Vec<(usize, Drawn)> = {
            let mut jobs: Vec<Draw<'_>> = runs
                .iter()
                .zip(rows.iter_mut())
                .zip(masks)
                .enumerate()
                .filter(|(_, (((i, take), _), _))| {
                    *take == seqs[*i].pending.len() && seqs[*i].params.max_tokens > 0
                })
                .map(|(r, ((&(i, _), row), mask))| {
                    let s = &*seqs[i];
                    let known = greedy
                        .as_ref()
                        .filter(|_| s.plain_greedy())
                        .and_then(|g| g.get(r).map(|&id| (id, None)))
                        .or_else(|| from_heads[r].clone());
                    Draw {
                        seq: i,
                        params: &s.params,
                        prompt: &s.prompt_ids,
                        output: &s.generated,
                        banned: s.banned(self),
                        row,
                        known,
                        mask,
                    }
                })
                .collect();
            if jobs.len() > 1 && jobs.iter().any(|j| j.params.sampling.temperature > 0.0) {
                use rayon::prelude::*;
                jobs.par_iter_mut().map(Draw::run).collect()
            } else {
                jobs.iter_mut().map(Draw::run).collect()
            }
        };
        for &(i, take) in &runs {
            if take < seqs[i].pending.len() {
                seqs[i].pending.drain(..take);
            } else if seqs[i].params.max_tokens == 0 {
                // A prompt scored and nothing asked of it beyond.
                seqs[i].finish = Some(FinishReason::MaxTokens);
                seqs[i].decoder = None;
            }
        }
        for (i, drawn) in draws {
            match drawn {
                Ok((id, logprobs)) => {
                    let mut event = seqs[i].take(self, id)?;
                    event.logprobs = logprobs.map(|l| Logprobs {
                        text_offset: seqs[i].text_chars - event.text.chars().count(),
                        ..l
                    });
                    events[i] = Some(event);
                }
                Err(message) => seqs[i].fail(message),
            }
        }
        if prefix {
            // The full blocks of every prompt (or replay) that ran this step, and of
            // every sequence that finished.
            let mut cache = self.prefix_cache();
            for &(i, take) in &runs {
                let s = &*seqs[i];
                if take > 1 || s.finish.is_some() && s.cache.len() >= BLOCK_TOKENS {
                    store_blocks(&mut cache, self.fingerprint, &s.cache, &s.cached_tokens());
                }
            }
        }
        Ok(events)
    }
}

/// What a row's draw gave: the token and its logprobs, or why no token may be drawn.
type Drawn = Result<(u32, Option<Logprobs>), String>;

/// One row's draw: everything it reads, so that draws run in parallel.
struct Draw<'a> {
    /// The sequence's index in the step.
    seq: usize,
    params: &'a GenerateParams,
    prompt: &'a [u32],
    output: &'a [u32],
    /// Tokens that may not be drawn yet ([`GenerateParams::min_tokens`]).
    banned: Vec<u32>,
    row: &'a mut [f32],
    /// The draw (and its logprobs, where asked) where the forward pass found it: the
    /// row's argmax, or what its head decided.
    known: Option<(u32, Option<Logprobs>)>,
    /// The grammar's mask, where the sequence has one.
    mask: Option<Result<toktrie::SimpleVob, String>>,
}

impl Draw<'_> {
    /// The grammar's mask and the bans, then the sampler's adjustments; the logprobs
    /// (when asked) from the row as the draw sees it.
    fn run(&mut self) -> (usize, Drawn) {
        if let Some(known) = self.known.take() {
            return (self.seq, Ok(known));
        }
        if self.row.is_empty() {
            // A draw its head left undecided whose row stayed on the device: an error,
            // never a draw from nothing.
            return (
                self.seq,
                Err("the row of logits for this draw was not fetched".into()),
            );
        }
        let constrained = self.mask.is_some() || !self.banned.is_empty();
        match &self.mask {
            Some(Err(e)) => return (self.seq, Err(e.clone())),
            Some(Ok(m)) => apply_mask(m, self.row),
            None => {}
        }
        let mut lifted: Vec<(usize, f32)> = Vec::with_capacity(self.banned.len());
        for &t in &self.banned {
            if let Some(l) = self.row.get_mut(t as usize) {
                lifted.push((t as usize, *l));
                *l = f32::NEG_INFINITY;
            }
        }
        if !lifted.is_empty() && crate::engine::sampler::first_max(self.row).is_none() {
            // The grammar allows nothing but what min_tokens bans (its end): it ends.
            for (t, l) in lifted {
                self.row[t] = l;
            }
        }
        let sampling = &self.params.sampling;
        sampling.adjust(self.row, self.prompt, self.output);
        if constrained && crate::engine::sampler::first_max(self.row).is_none() {
            return (self.seq, Err("no token is allowed here".into()));
        }
        // The position of the token drawn: what its draw is keyed by.
        let position = (self.prompt.len() + self.output.len()) as u64;
        let id = sampling.pick(self.row, position);
        let logprobs = self.params.logprobs.map(|top| {
            let (logprob, top) = crate::engine::sampler::logprobs(self.row, id, top);
            Logprobs {
                logprob,
                top,
                text_offset: 0,
            }
        });
        (self.seq, Ok((id, logprobs)))
    }
}

/// Stores the full blocks of `kv`, whose positions hold `tokens` (block *i* is positions
/// `16i..16i + 16`, named by the chain's hash after them), last to first, so that a
/// run's first block is its most recently used and the last to be evicted.
fn store_blocks<B: Backend>(
    cache: &mut PrefixCache,
    fingerprint: u64,
    kv: &KvCache<B>,
    tokens: &[u32],
) {
    let hashes = block_hashes(fingerprint, tokens);
    let full = (kv.len() / BLOCK_TOKENS).min(hashes.len());
    for (b, &h) in hashes[..full].iter().enumerate().rev() {
        if !cache.touch(h) {
            if let Some(values) = kv.span(b * BLOCK_TOKENS, BLOCK_TOKENS) {
                let parent = match b {
                    0 => root(fingerprint),
                    b => hashes[b - 1],
                };
                let block: [u32; BLOCK_TOKENS] = tokens[b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS]
                    .try_into()
                    .expect("a block's worth");
                cache.insert(h, parent, block, values);
            }
        }
    }
}
