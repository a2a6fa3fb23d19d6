//! Choosing the next token from logits.
//!
//! The random draw for position `p` depends only on `(seed, p)`: a ChaCha8 generator
//! keyed by the seed, on stream `p`. A stream resumed on another worker at position `p`
//! therefore draws exactly what the first worker would have drawn.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to pick tokens. `temperature == 0` is greedy.
///
/// A draw first changes the logits as the request asks ([`SamplingParams::adjust`]:
/// `logit_bias`, then the repetition, presence and frequency penalties), then picks from
/// them ([`SamplingParams::pick`]): the largest when greedy, else a draw from the
/// softmax at `temperature` cut to `top_k`, `top_p` and `min_p`.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Keep only the tokens whose probability is at least `min_p` × the largest one's
    /// (0: all).
    pub min_p: f32,
    /// Penalty (> 1 discourages) on tokens already in the prompt or the output.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the output holds.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it.
    pub frequency_penalty: f32,
    /// Added to these tokens' logits (ids past the vocabulary are ignored).
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the counter-based random draw.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

/// A sampling parameter outside its domain.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum SamplingError {
    /// Temperature must be finite and ≥ 0.
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    /// top_p must lie in (0, 1].
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// min_p must lie in [0, 1].
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    /// The repetition penalty must be finite and > 0.
    #[error("repetition_penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    /// Presence and frequency penalties lie in [−2, 2].
    #[error("{0} must be in [-2, 2], got {1}")]
    Penalty(&'static str, f32),
    /// A bias must be finite and in [−100, 100].
    #[error("logit_bias for token {0} must be in [-100, 100], got {1}")]
    LogitBias(u32, f32),
}

impl SamplingParams {
    /// Checks every field's domain.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(SamplingError::Penalty(name, v));
            }
        }
        if let Some(&(id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(SamplingError::LogitBias(id, b));
        }
        Ok(())
    }

    /// Whether [`SamplingParams::adjust`] changes anything.
    pub fn adjusts(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    /// Whether a draw is the argmax of the logits as the model gave them.
    pub fn plain_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.adjusts()
    }

    /// The uniform draw in `[0, 1)` used at `position`.
    pub fn draw(&self, position: u64) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(position);
        rng.random::<f64>()
    }

    /// Picks the token at `position` from `logits`, given the prompt and the output so
    /// far (for the penalties): [`SamplingParams::adjust`], then
    /// [`SamplingParams::pick`]. `logits` is modified in place.
    pub fn sample(&self, logits: &mut [f32], prompt: &[u32], output: &[u32], position: u64) -> u32 {
        self.adjust(logits, prompt, output);
        self.pick(logits, position)
    }

    /// Changes `logits` as the request asks, in this order (vLLM's): `logit_bias` is
    /// added; the repetition penalty (CTRL's: a positive logit divided by it, a negative
    /// one multiplied) applies to every token of the prompt and the output; the presence
    /// penalty is subtracted once from every token the output holds, and the frequency
    /// penalty once per time it holds it (OpenAI's definitions).
    pub fn adjust(&self, logits: &mut [f32], prompt: &[u32], output: &[u32]) {
        for &(id, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.repetition_penalty != 1.0 {
            apply_repetition_penalty(logits, prompt.iter().chain(output), self.repetition_penalty);
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            let mut counts: std::collections::HashMap<u32, u32> = Default::default();
            for &t in output {
                *counts.entry(t).or_insert(0) += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.presence_penalty + self.frequency_penalty * n as f32;
                }
            }
        }
    }

    /// Picks the token at `position` from logits already adjusted.
    pub fn pick(&self, logits: &[f32], position: u64) -> u32 {
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        let Some(ranked) = self.ranked(logits) else {
            return 0;
        };
        self.pick_ranked(&ranked, position)
            .expect("a ranking of the whole row knows its last candidate")
    }

    /// The draw [`SamplingParams::pick`] makes at `position` from a row of `count`
    /// logits, all finite, given only some of its largest: `top`, `(id, logit)` in any
    /// order, which holds every logit above the least of them (a device's top-k
    /// selection, which may part ties at its edge either way), and, where the device
    /// summed it at this temperature, the `rest` of the row. `None` when those do not
    /// decide the draw: the first `top_k` reach past what `top` surely holds; or the
    /// candidates within 42 of the largest do, and either no `rest` was summed or the
    /// draw lands in it, or the draw or a `top_p` cut lands too near the edge of a
    /// candidate for the bound on that sum to tell, or the temperature is so small
    /// beside the logits that the device's exponents may be off by more than 1e-3 (see
    /// `pick_with_rest`). Temperature
    /// must be above 0, and the row as the model gave it (nothing for
    /// [`SamplingParams::adjust`] to change).
    pub fn pick_from_top(
        &self,
        top: &[(u32, f32)],
        count: usize,
        rest: Option<&Rest>,
        position: u64,
    ) -> Option<u32> {
        debug_assert!(self.temperature > 0.0 && !self.adjusts());
        match self.ranked_from_top(top, count) {
            Some(ranked) => self.pick_ranked(&ranked, position),
            None => self.pick_with_rest(top, count, rest?, position),
        }
    }

    /// [`SamplingParams::pick_from_top`] where the candidates reach past `top`: the
    /// decision the whole row's draw makes, from `top` and a bounded sum of the rest.
    ///
    /// Every comparison a draw makes is between partial sums of the candidates' terms
    /// `e^(s − max)` (`s` a scaled logit) and a fraction of their total; only the total
    /// needs the rest. The candidates above the least scaled value of `top` come first
    /// in the full order and are summed here as the whole row's draw sums them; the
    /// rest's total is the terms of `top` at that least value, the row's other logits
    /// equal to it (`rest.ties` tells how many) and `rest.below`, the device's f32 sum
    /// of the others. That sum is off by at most `count` roundings of its terms' total
    /// plus each term's own error: its exponent is `(l − max) · (1/T)` in f32 where the
    /// row's draw has `l/T − max/T`, and a GPU's `exp` may be off by `3 + 2|x|` units in
    /// the last place (Vulkan's bound; CUDA's fast `exp` is within it); terms under
    /// e^-42 that the draw leaves out, or that underflow on the device, are counted by
    /// `count` too. A decision is taken only when it holds for every total within that
    /// bound, by a margin ([`CLEAR`]) far above the rounding of the draw's own f64 sums.
    /// A `top_p` cut past the candidates summed here keeps a sum that the total bounds
    /// too: at least `top_p` of it, and less than that plus one term no larger than the
    /// least value's, so a draw landing well inside those candidates is still decided.
    fn pick_with_rest(
        &self,
        top: &[(u32, f32)],
        count: usize,
        rest: &Rest,
        position: u64,
    ) -> Option<u32> {
        if self.top_k > 0 && self.top_k < count {
            return None;
        }
        let t = self.temperature;
        let lmax = top.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
        let least = top.iter().map(|x| x.1).fold(f32::INFINITY, f32::min);
        let (max, edge) = (lmax / t, least / t);
        let below = f64::from(rest.below);
        if !(below.is_finite() && below >= 0.0 && max.is_finite()) || edge - max < -NEGLIGIBLE_BELOW
        {
            return None;
        }
        let term = |s: f32| f64::from(s - max).exp();
        // The candidates surely ahead of every logit outside `top`, in the full order.
        let mut keys: Vec<u64> = top
            .iter()
            .filter(|&&(_, l)| l / t > edge)
            .map(|&(id, l)| (u64::from(descending(l / t)) << 32) | u64::from(id))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return None;
        }
        let terms: Vec<f64> = keys.iter().map(|&k| term(scaled_of(k))).collect();
        let ahead: f64 = terms.iter().sum();
        let at_least_in_top = top.iter().filter(|x| x.1 == least).count();
        let ties_outside = rest.ties.checked_sub(at_least_in_top)?;
        let known = top
            .iter()
            .filter(|&&(_, l)| l / t <= edge)
            .map(|&(_, l)| term(l / t))
            .sum::<f64>()
            + ties_outside as f64 * term(edge);
        let unit = f64::from(f32::EPSILON) / 2.0;
        let n = count as f64;
        // A term's exponent off by δ makes it off by e^δ − 1 of itself; past a small δ
        // (a tiny temperature on large logits) the bound says too little to decide on.
        let exponent = unit * (2.0 * f64::from(max.abs()) + 1024.0);
        if exponent > 1e-3 {
            return None;
        }
        let relative = 1.01 * (exponent.exp_m1() + n * unit);
        let absolute = n * ((-f64::from(NEGLIGIBLE_BELOW)).exp() + 2f64.powi(-100));
        let sum_lo = ahead + known + (below * (1.0 - relative) - absolute).max(0.0);
        let sum_hi = ahead + known + below * (1.0 + relative) + absolute;
        // min_p cuts where a term falls below it; within `terms`, or it cannot be told.
        let mut keep: Option<usize> = None;
        // Bounds on the sum of the terms a draw keeps when that is more than `terms`.
        let mut kept = (sum_lo, sum_hi);
        if self.min_p > 0.0 {
            let min_p = f64::from(self.min_p);
            let above = terms.iter().take_while(|&&p| p >= min_p).count();
            if above == terms.len() {
                return None;
            }
            keep = Some(above.max(1));
        }
        if self.top_p < 1.0 {
            let top_p = f64::from(self.top_p);
            let (surely, maybe) = (
                top_p * sum_hi * (1.0 + CLEAR),
                top_p * sum_lo * (1.0 - CLEAR),
            );
            let mut acc = 0.0;
            let mut cut = None;
            for (i, p) in terms[..keep.unwrap_or(terms.len())].iter().enumerate() {
                acc += p;
                if acc >= surely {
                    cut = Some(i + 1);
                    break;
                }
                if acc >= maybe {
                    return None;
                }
            }
            match (cut, keep) {
                (Some(_), _) => keep = cut,
                (None, Some(_)) => {}
                // The cut lies past `terms`: what it keeps sums to at least `top_p` of the
                // total and passes that by less than its last term, which is at most the
                // edge's (and never to more than the total).
                (None, None) => {
                    kept = (
                        top_p * sum_lo * (1.0 - CLEAR),
                        ((top_p * sum_hi + term(edge)) * (1.0 + CLEAR)).min(sum_hi),
                    );
                }
            }
        }
        let u = self.draw(position);
        let (target_lo, target_hi) = match keep {
            Some(k) => {
                let target = u * terms[..k].iter().sum::<f64>();
                (target * (1.0 - CLEAR), target * (1.0 + CLEAR))
            }
            None => (u * kept.0 * (1.0 - CLEAR), u * kept.1 * (1.0 + CLEAR)),
        };
        let mut acc = 0.0;
        for (&k, p) in keys.iter().zip(&terms).take(keep.unwrap_or(terms.len())) {
            acc += p;
            if target_hi < acc {
                return Some(k as u32);
            }
            if target_lo < acc {
                return None;
            }
        }
        None
    }

    /// The draw from the candidates `ranked` at `position`; `None` only when it runs
    /// past every candidate and the ranking does not know the last one.
    fn pick_ranked(&self, ranked: &Ranked, position: u64) -> Option<u32> {
        let cands = &ranked.head;
        let max = cands[0].1;
        let mut probs: Vec<f64> = cands.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        // min_p compares each candidate with the most likely one: a prefix of the head
        // (the tail, below e^-42 of it, stays only under a smaller min_p).
        let mut keep = ranked.len;
        if self.min_p > 0.0 {
            let min_p = f64::from(self.min_p);
            let above = probs.iter().take_while(|&&p| p >= min_p).count();
            if above < cands.len() || min_p > (-f64::from(NEGLIGIBLE_BELOW)).exp() {
                keep = above.max(1);
            }
        }
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        // `keep` counts all candidates, the negligible tail included, unless top_p or
        // min_p cuts inside the head (the tail cannot move a cumulative sum; see
        // `Ranked`).
        if self.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.top_p as f64 {
                    keep = keep.min(i + 1);
                    break;
                }
            }
        }
        let in_head = keep.min(cands.len());
        let total: f64 = probs[..in_head].iter().sum();
        let target = self.draw(position) * total;
        let mut acc = 0.0;
        for (c, p) in cands[..in_head].iter().zip(&probs[..in_head]) {
            acc += p;
            if target < acc {
                return Some(c.0);
            }
        }
        if keep == ranked.len {
            ranked.last
        } else {
            Some(cands[keep - 1].0)
        }
    }
}

/// The log-probability of `chosen` and of the `top` most likely tokens (most likely
/// first, equal values by id; −∞ and NaN logits are never among them) under the
/// softmax of `logits` at temperature 1, summed in f64.
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let finite = |l: &f32| !l.is_nan() && *l != f32::NEG_INFINITY;
    let max = logits
        .iter()
        .filter(|l| finite(l))
        .fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let sum: f64 = logits
        .iter()
        .filter(|l| finite(l))
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let norm = f64::from(max) + sum.ln();
    let of = |l: f32| (f64::from(l) - norm) as f32;
    let chosen_lp = match logits.get(chosen as usize) {
        Some(&l) if finite(&l) => of(l),
        _ => f32::NEG_INFINITY,
    };
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| finite(l))
        .map(|(i, &l)| (u64::from(descending(l)) << 32) | i as u64)
        .collect();
    if top < keys.len() && top > 0 {
        keys.select_nth_unstable(top - 1);
    }
    keys.truncate(top);
    keys.sort_unstable();
    let best = keys
        .iter()
        .map(|&k| (k as u32, of(logits[k as u32 as usize])))
        .collect();
    (chosen_lp, best)
}

/// [`logprobs`] of a row of `count` finite logits from some of its largest, `top`
/// (as [`SamplingParams::pick_from_top`] takes them), `ties`, how many of the row's
/// logits equal the least in `top`, and `below`, `Σ e^(l − max)` over those below it as
/// a device summed them in f32. `None` unless `top` holds `chosen` and surely the `top`
/// most likely (`n`). The normalizer is the one sum not made here, so the values are
/// the whole row's up to that sum's rounding (a few units in the last place of a
/// log-probability), not its bits.
pub fn logprobs_from_top(
    top: &[(u32, f32)],
    ties: usize,
    below: f32,
    chosen: u32,
    n: usize,
) -> Option<(f32, Vec<(u32, f32)>)> {
    let max = top.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
    let least = top.iter().map(|x| x.1).fold(f32::INFINITY, f32::min);
    let at_least = top.iter().filter(|x| x.1 == least).count();
    let outside = ties.checked_sub(at_least)?;
    if !(max.is_finite() && least.is_finite() && below.is_finite() && below >= 0.0) {
        return None;
    }
    let term = |l: f32| f64::from(l - max).exp();
    let sum = top.iter().map(|&(_, l)| term(l)).sum::<f64>()
        + outside as f64 * term(least)
        + f64::from(below);
    let norm = f64::from(max) + sum.ln();
    let of = |l: f32| (f64::from(l) - norm) as f32;
    let chosen = top.iter().find(|t| t.0 == chosen)?.1;
    let mut keys: Vec<u64> = top
        .iter()
        .map(|&(id, l)| (u64::from(descending(l)) << 32) | u64::from(id))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    // Past the logits above the least, the order is sure only if no tie lies outside.
    let sure = if outside == 0 {
        keys.len()
    } else {
        top.iter().filter(|x| x.1 > least).count()
    };
    if n > sure {
        return None;
    }
    let best = keys[..n]
        .iter()
        .map(|&k| (k as u32, of(scaled_of(k))))
        .collect();
    Some((of(chosen), best))
}

/// The candidates of one draw, most likely first.
///
/// Sampling sums the candidates' probabilities in that order, in f64, starting from the
/// most likely one, whose term is 1 (or 1 / sum once normalized). A candidate whose logit
/// is more than 42 below the largest adds less than e^-42 < 2^-60 of that first term,
/// under half a unit in the last place of any running sum, so it leaves every sum exactly
/// as it was: only the head above that line is sorted and summed, and the result is
/// bitwise what sorting and summing them all gives. The tail matters only in one case:
/// when the draw runs past every candidate, the last one in the full order is chosen.
struct Ranked {
    /// The candidates within 42 of the largest, `(id, logit / temperature)`, most likely
    /// first, equal values by id.
    head: Vec<(u32, f32)>,
    /// How many candidates there are in all (after `top_k`).
    len: usize,
    /// The id of the last candidate in the full order, where it is known.
    last: Option<u32>,
}

/// How far below the largest scaled logit a candidate may be and still be summed.
const NEGLIGIBLE_BELOW: f32 = 42.0;

/// The relative margin by which a draw decided from a bounded sum
/// ([`SamplingParams::pick_with_rest`]) clears each comparison: far above the rounding
/// of the draw's own f64 sums (at most 2^18 terms, so under 2^-34 of them).
const CLEAR: f64 = 1e-9;

/// What a device found of a row beyond some of its largest logits (`top`), for
/// [`SamplingParams::pick_from_top`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rest {
    /// How many of the row's logits equal the least in `top`, those in `top` included.
    pub ties: usize,
    /// `Σ e^((l − max) · (1/T))` over the row's logits below the least in `top`: `max`
    /// the row's largest, `1/T` the draw's temperature's inverse in f32, summed in f32
    /// in any order.
    pub below: f32,
}

impl SamplingParams {
    /// The candidates `(id, logit / temperature)`, cut to `top_k` when it is set; NaNs
    /// are left out. `None` when there are none.
    ///
    /// Each candidate is one `u64` key, its value's rank in the high half and its id in
    /// the low one, so the order is a plain integer order, `top_k` a selection, and only
    /// the head is sorted (over a 49k vocabulary at temperature 1: ~0.8 ms a draw, against
    /// ~1.2 ms for a comparison sort of every pair).
    fn ranked(&self, logits: &[f32]) -> Option<Ranked> {
        let scaled = |id: u32| logits[id as usize] / self.temperature;
        let mut keys: Vec<u64> = logits
            .iter()
            .enumerate()
            // −∞ is a token a grammar forbids: never a candidate, not even the last.
            .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
            .map(|(i, &l)| (u64::from(descending(l / self.temperature)) << 32) | i as u64)
            .collect();
        if self.top_k > 0 && self.top_k < keys.len() {
            keys.select_nth_unstable(self.top_k - 1);
            keys.truncate(self.top_k);
        }
        let first = *keys.iter().min()?;
        let last = *keys.iter().max()?;
        let len = keys.len();
        let max = scaled(first as u32);
        // NaN differences (infinite logits) stay in the head, as they are in every sum.
        keys.retain(|&k| {
            (scaled(k as u32) - max).partial_cmp(&-NEGLIGIBLE_BELOW)
                != Some(std::cmp::Ordering::Less)
        });
        keys.sort_unstable();
        Some(Ranked {
            head: keys.iter().map(|&k| (k as u32, scaled(k as u32))).collect(),
            len,
            last: Some(last as u32),
        })
    }

    /// [`SamplingParams::ranked`] of a row of `count` finite logits from `top`, some of
    /// its largest (see [`SamplingParams::pick_from_top`]); `None` unless `top` surely
    /// holds every candidate the ranking sums.
    ///
    /// Every logit left out of `top` is at most the least logit in it, and dividing by
    /// the temperature and subtracting the largest keep that order (rounding never
    /// reverses it). So the first `top_k` of the full order are the first `top_k` of
    /// `top` when the `top_k`-th scaled value is strictly above the least one in `top`
    /// (ties at the edge of `top` then lie below it), and the head within 42 of the
    /// largest lies inside `top` when the least scaled value is more than 42 below the
    /// largest. Comparing values, not keys, keeps −0 and +0 together as a device's
    /// selection does.
    fn ranked_from_top(&self, top: &[(u32, f32)], count: usize) -> Option<Ranked> {
        let mut keys: Vec<u64> = top
            .iter()
            .map(|&(id, l)| (u64::from(descending(l / self.temperature)) << 32) | u64::from(id))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        let whole = keys.len() == count;
        let max = scaled_of(*keys.first()?);
        let least = scaled_of(*keys.last()?);
        let cut = self.top_k > 0 && self.top_k < count;
        if cut {
            if !whole && (keys.len() <= self.top_k || scaled_of(keys[self.top_k - 1]) <= least) {
                return None;
            }
            keys.truncate(self.top_k);
        } else if !whole && least - max >= -NEGLIGIBLE_BELOW {
            return None;
        }
        // The last candidate in the full order is in `top` only when `top_k` cut there
        // or `top` is the whole row.
        let last = (whole || cut).then(|| *keys.last().expect("not empty") as u32);
        keys.retain(|&k| {
            (scaled_of(k) - max).partial_cmp(&-NEGLIGIBLE_BELOW) != Some(std::cmp::Ordering::Less)
        });
        Some(Ranked {
            head: keys.iter().map(|&k| (k as u32, scaled_of(k))).collect(),
            len: if cut { self.top_k } else { count },
            last,
        })
    }
}

/// The scaled logit a ranking key holds in its high half (the inverse of
/// [`descending`]).
fn scaled_of(key: u64) -> f32 {
    let ascending = !((key >> 32) as u32);
    f32::from_bits(if ascending & 0x8000_0000 != 0 {
        ascending & 0x7FFF_FFFF
    } else {
        !ascending
    })
}

/// A key that orders floats as `f32::total_cmp` does, reversed: the largest first.
fn descending(v: f32) -> u32 {
    let b = v.to_bits();
    let ascending = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    !ascending
}

/// Index of the largest logit; the lowest index among equals. NaNs are skipped; 0 when
/// no logit is above −∞.
///
/// Sixteen lanes each keep their own largest value and its first index (compares and
/// selects the compiler turns into vector instructions), then the lanes and the last
/// few logits are merged: what one scan keeping the first strictly larger value finds,
/// at a fraction of the time.
pub fn argmax(logits: &[f32]) -> u32 {
    first_max(logits).map_or(0, |(_, i)| i)
}

/// The largest logit and its index (the lowest among equals), NaNs skipped; `None`
/// when no logit is above −∞. [`argmax`] of a row split in consecutive parts is the
/// index of the first part whose value is strictly larger than every earlier part's
/// ([`merge_first_max`]): the forward pass finds each part's as it writes it.
pub fn first_max(logits: &[f32]) -> Option<(f32, u32)> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F (checked just above).
        return unsafe { first_max_avx512(logits) };
    }
    first_max_lanes(logits)
}

/// [`argmax`] of a row from the [`first_max`] of its consecutive parts, in order, with
/// their indices counted from the row's start.
pub fn merge_first_max(parts: impl IntoIterator<Item = Option<(f32, u32)>>) -> u32 {
    let (mut top, mut index) = (f32::NEG_INFINITY, 0u32);
    for (v, i) in parts.into_iter().flatten() {
        if v > top {
            (top, index) = (v, i);
        }
    }
    index
}

/// [`first_max`] compiled for AVX-512: the same lanes and comparisons in one register
/// (about 3 µs for the default model's 49,152 logits, against about 20 with the
/// baseline's 128-bit vectors).
///
/// # Safety
/// Needs AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn first_max_avx512(logits: &[f32]) -> Option<(f32, u32)> {
    first_max_lanes(logits)
}

/// [`first_max`] on sixteen independent lanes, each keeping its first largest value;
/// the same result for any vector width the compiler picks.
#[inline(always)]
fn first_max_lanes(logits: &[f32]) -> Option<(f32, u32)> {
    const LANES: usize = 16;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut at = [0u32; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let base = (c * LANES) as u32;
        for i in 0..LANES {
            let take = chunk[i] > best[i];
            best[i] = if take { chunk[i] } else { best[i] };
            at[i] = if take { base + i as u32 } else { at[i] };
        }
    }
    let (mut top, mut index) = (f32::NEG_INFINITY, 0u32);
    for (&v, &i) in best.iter().zip(&at) {
        if v > top || (v == top && v > f32::NEG_INFINITY && i < index) {
            (top, index) = (v, i);
        }
    }
    let start = logits.len() - tail.len();
    for (k, &v) in tail.iter().enumerate() {
        if v > top {
            (top, index) = (v, (start + k) as u32);
        }
    }
    (top > f32::NEG_INFINITY).then_some((top, index))
}

/// CTRL-style penalty: positive logits are divided by it, negative ones multiplied;
/// once per distinct token.
fn apply_repetition_penalty<'a>(
    logits: &mut [f32],
    history: impl Iterator<Item = &'a u32>,
    penalty: f32,
) {
    let mut seen = vec![false; logits.len()];
    for &t in history {
        if let Some(s) = seen.get_mut(t as usize) {
            if !*s {
                *s = true;
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One scan, keeping the first strictly larger value.
    fn argmax_by_scan(logits: &[f32]) -> u32 {
        let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
        for (i, &v) in logits.iter().enumerate() {
            if v > best_v {
                (best, best_v) = (i, v);
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_largest_value() {
        let mut state = 0x2545_f491_u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for len in [0, 1, 5, 15, 16, 17, 33, 100, 49_152] {
            for round in 0..20 {
                // Few distinct values, so that ties are common; some NaNs and −∞.
                let logits: Vec<f32> = (0..len)
                    .map(|_| match next() % 23 {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        r if round % 4 == 0 => -(r as f32) - 1.0,
                        r => (r % 7) as f32 - 3.0,
                    })
                    .collect();
                let want = argmax_by_scan(&logits);
                // The dispatched version (AVX-512 where the CPU has it), the baseline
                // build of the same lanes, and the row in parts of every size merged.
                assert_eq!(argmax(&logits), want, "{len}, {round}");
                assert_eq!(
                    first_max_lanes(&logits).map_or(0, |m| m.1),
                    want,
                    "{len}, {round}"
                );
                for part in [1, 3, 16, 17, 1000] {
                    let maxima = logits
                        .chunks(part)
                        .enumerate()
                        .map(|(k, c)| first_max(c).map(|(v, i)| (v, i + (k * part) as u32)));
                    assert_eq!(
                        merge_first_max(maxima),
                        want,
                        "{len}, {round}, parts of {part}"
                    );
                }
            }
        }
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NAN]), 0);
        let mut late = vec![0.0f32; 40];
        late[39] = 1.0;
        assert_eq!(argmax(&late), 39);
        late[21] = 1.0;
        assert_eq!(argmax(&late), 21);
    }

    fn params(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            seed,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_max_and_lowest_on_ties() {
        let p = params(0.0, 1);
        assert_eq!(p.sample(&mut [0.1, 3.0, -1.0, 2.0], &[], &[], 0), 1);
        assert_eq!(p.sample(&mut [1.0, 5.0, 5.0], &[], &[], 0), 1);
        assert_eq!(p.sample(&mut [f32::NAN, 1.0], &[], &[], 0), 1);
    }

    #[test]
    fn draw_depends_only_on_seed_and_position() {
        let a = params(1.0, 42);
        let b = params(1.0, 42);
        let seq_a: Vec<f64> = (0..50).map(|p| a.draw(p)).collect();
        // Another "worker" that starts at position 25 draws the same values there.
        let seq_b: Vec<f64> = (25..50).map(|p| b.draw(p)).collect();
        assert_eq!(&seq_a[25..], &seq_b[..]);
        assert_ne!(params(1.0, 43).draw(7), a.draw(7));
        assert_ne!(a.draw(7), a.draw(8));
        assert!(seq_a.iter().all(|u| (0.0..1.0).contains(u)));
    }

    #[test]
    fn sampling_is_reproducible_and_follows_probabilities() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let p = params(1.0, 9);
        let mut counts = [0usize; 3];
        for pos in 0..4000 {
            let t = p.sample(&mut logits.clone(), &[], &[], pos);
            assert_eq!(t, p.sample(&mut logits.clone(), &[], &[], pos));
            counts[t as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let share = counts[1] as f64 / 4000.0;
        assert!((share - 0.75).abs() < 0.03, "share of token 1 was {share}");
    }

    /// Sampling as it was before the keyed ranking: every candidate sorted by comparison,
    /// every probability summed.
    fn sample_by_full_sort(p: &SamplingParams, logits: &[f32], position: u64) -> u32 {
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        if cands.is_empty() {
            return 0;
        }
        cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.truncate(p.top_k);
        }
        let max = cands[0].1;
        let mut probs: Vec<f64> = cands.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            // Ratios to the likeliest, before normalizing.
            keep = probs
                .iter()
                .take_while(|&&q| q >= f64::from(p.min_p))
                .count()
                .max(1);
        }
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = keep.min(i + 1);
                    break;
                }
            }
        }
        let total: f64 = probs[..keep].iter().sum();
        let target = p.draw(position) * total;
        let mut acc = 0.0;
        for (c, q) in cands[..keep].iter().zip(&probs[..keep]) {
            acc += q;
            if target < acc {
                return c.0;
            }
        }
        cands[keep - 1].0
    }

    #[test]
    fn sampling_matches_the_full_sort_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for case in 0..40 {
            let n = [1, 2, 7, 300, 5000][case % 5];
            // A wide spread (a long negligible tail), ties, both zeros, infinities, NaNs
            // and subnormals.
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..14) {
                    0 => 0.0,
                    1 => -0.0,
                    2 if case % 3 == 0 => f32::NEG_INFINITY,
                    3 if case % 7 == 0 => f32::INFINITY,
                    4 => f32::NAN,
                    5 => 1.0e-40,
                    6 => (rng.random_range(0..4) as f32) * 0.5,
                    7 | 8 => rng.random_range(-200.0f32..-40.0),
                    _ => rng.random_range(-30.0f32..30.0),
                })
                .collect();
            for (temperature, top_k, top_p, min_p) in [
                (1.0, 0, 1.0, 0.0),
                (0.7, 0, 0.9, 0.0),
                (1.3, 40, 1.0, 0.0),
                (1.0, 1, 1.0, 0.0),
                (0.5, n + 3, 0.999_999, 0.0),
                (3.0, 0, 0.5, 0.0),
                (0.05, 0, 1.0, 0.0),
                (1.0, 0, 1.0, 0.05),
                (2.0, 0, 0.8, 0.3),
                (0.9, 50, 1.0, 0.01),
            ] {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: case as u64,
                    ..Default::default()
                };
                for pos in 0..50 {
                    assert_eq!(
                        p.sample(&mut logits.clone(), &[], &[], pos),
                        sample_by_full_sort(&p, &logits, pos),
                        "case {case}, T {temperature}, top_k {top_k}, top_p {top_p}, pos {pos}"
                    );
                }
            }
        }
    }

    /// The `k` largest logits of `row` as a device's top-k gives them: ties at the edge
    /// parted at random, the order shuffled.
    fn device_top(row: &[f32], k: usize, rng: &mut ChaCha8Rng) -> Vec<(u32, f32)> {
        let mut all: Vec<(u32, f32, u32)> = row
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l, rng.random::<u32>()))
            .collect();
        // Numeric order (−0 and +0 equal), random among equals.
        all.sort_by(|a, b| b.1.partial_cmp(&a.1).expect("finite").then(a.2.cmp(&b.2)));
        all.truncate(k);
        let mut top: Vec<(u32, f32)> = all.into_iter().map(|(i, l, _)| (i, l)).collect();
        for i in (1..top.len()).rev() {
            top.swap(i, rng.random_range(0..=i));
        }
        top
    }

    #[test]
    fn a_draw_from_the_top_logits_is_the_full_rows_draw_or_none() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let (mut decided, mut total) = (0usize, 0usize);
        for case in 0..60 {
            let n = [5, 64, 300, 2000][case % 4];
            // Wide rows (a short head), narrow ones (a head of the whole row), and
            // rows of few distinct values (ties everywhere, both zeros).
            let spread = [200.0f32, 20.0, 0.0][case % 3];
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    if spread == 0.0 {
                        [0.0, -0.0, 1.0, -3.0, 7.5][rng.random_range(0..5)]
                    } else {
                        rng.random_range(-spread..spread)
                    }
                })
                .collect();
            for (temperature, top_k, top_p, min_p) in [
                (1.0, 0, 1.0, 0.0),
                (0.7, 0, 0.9, 0.0),
                (1.0, 40, 1.0, 0.0),
                (0.3, 20, 0.95, 0.0),
                (1.0, 1, 1.0, 0.0),
                (2.0, 0, 0.8, 0.3),
                (0.9, 63, 1.0, 0.01),
                (1.0, n, 1.0, 0.0),
            ] {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: case as u64,
                    ..Default::default()
                };
                for k in [1, 16, 64] {
                    let top = device_top(&row, k.min(n), &mut rng);
                    for pos in 0..20 {
                        total += 1;
                        if let Some(id) = p.pick_from_top(&top, n, None, pos) {
                            decided += 1;
                            assert_eq!(
                                id,
                                p.pick(&row, pos),
                                "case {case}, T {temperature}, top_k {top_k}, k {k}, pos {pos}"
                            );
                        }
                    }
                }
                // A top_k below the selection, on distinct values, is always decided.
                if spread > 0.0 && top_k > 0 && top_k < 64 && n > 64 {
                    let top = device_top(&row, 64, &mut rng);
                    assert!((0..20).all(|pos| p.pick_from_top(&top, n, None, pos).is_some()));
                }
            }
        }
        // Neither always nor never: both answers are exercised.
        assert!(
            decided > total / 5 && decided < total,
            "{decided} of {total}"
        );
    }

    /// What a device sums of `row` beyond `top` at temperature `t` ([`Rest`]), in f32 in
    /// a shuffled order, then moved by up to `skew` of itself (a device's rounding).
    fn device_rest(
        row: &[f32],
        top: &[(u32, f32)],
        t: f32,
        skew: f64,
        rng: &mut ChaCha8Rng,
    ) -> Rest {
        let least = top.iter().map(|x| x.1).fold(f32::INFINITY, f32::min);
        let max = top.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
        let inv = 1.0 / t;
        let mut terms: Vec<f32> = row
            .iter()
            .filter(|&&l| l < least)
            .map(|&l| ((l - max) * inv).exp())
            .collect();
        for i in (1..terms.len()).rev() {
            terms.swap(i, rng.random_range(0..=i));
        }
        let below = terms.iter().sum::<f32>();
        Rest {
            ties: row.iter().filter(|&&l| l == least).count(),
            below: (f64::from(below) * (1.0 + rng.random_range(-skew..=skew))) as f32,
        }
    }

    /// Rows shaped like a language model's: noise, a few tokens far above it.
    fn peaked_row(n: usize, peaks: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        let mut row: Vec<f32> = (0..n)
            .map(|_| (0..4).map(|_| rng.random_range(-1.5f32..1.5)).sum())
            .collect();
        for _ in 0..peaks {
            row[rng.random_range(0..n)] += rng.random_range(6.0f32..14.0);
        }
        row
    }

    #[test]
    fn a_draw_from_the_top_logits_and_the_rests_sum_is_the_full_rows_draw_or_none() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (mut decided, mut total) = (0usize, 0usize);
        for case in 0..24 {
            let n = [3000, 20000][case % 2];
            let row = peaked_row(n, [1, 3, 12, 0][case % 4], &mut rng);
            for (temperature, top_p, min_p) in [
                (0.7, 1.0, 0.0),
                (1.0, 1.0, 0.0),
                (0.8, 0.95, 0.0),
                (1.3, 0.9, 0.05),
                (0.2, 1.0, 0.0),
                (1.0, 0.95, 0.0),
                (1.0, 0.5, 0.0),
            ] {
                let p = SamplingParams {
                    temperature,
                    top_p,
                    min_p,
                    seed: case as u64,
                    ..Default::default()
                };
                let top = device_top(&row, 64, &mut rng);
                // The largest error the bound allows for the sum alone.
                let skew = n as f64 * f64::from(f32::EPSILON) / 2.0;
                let rest = device_rest(&row, &top, temperature, skew, &mut rng);
                for pos in 0..30 {
                    total += 1;
                    if let Some(id) = p.pick_from_top(&top, n, Some(&rest), pos) {
                        decided += 1;
                        assert_eq!(
                            id,
                            p.pick(&row, pos),
                            "case {case}, T {temperature}, top_p {top_p}, pos {pos}"
                        );
                    }
                }
            }
        }
        // Most draws from rows like a model's are decided, not all (some land in the rest).
        eprintln!("{decided} of {total}");
        assert!(
            decided > total * 3 / 5 && decided < total,
            "{decided} of {total}"
        );
    }

    #[test]
    fn a_rest_summed_wrong_gives_other_draws() {
        // The check above can fail: a sum of the rest three times too large moves draws.
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let mut wrong = 0;
        for case in 0..8 {
            let row = peaked_row(3000, 2, &mut rng);
            let p = SamplingParams {
                temperature: 1.0,
                seed: case,
                ..Default::default()
            };
            let top = device_top(&row, 64, &mut rng);
            let mut rest = device_rest(&row, &top, 1.0, 0.0, &mut rng);
            rest.below *= 3.0;
            wrong += (0..40)
                .filter(|&pos| {
                    p.pick_from_top(&top, row.len(), Some(&rest), pos)
                        .is_some_and(|id| id != p.pick(&row, pos))
                })
                .count();
        }
        assert!(wrong > 0);
    }

    #[test]
    fn a_top_p_cut_past_the_top_logits_still_decides_draws_well_inside_them() {
        // Rows without peaks: the 64 largest hold far less than half the total, so a
        // top_p of 0.5 cuts in the rest, and draws landing inside the 64 are decided.
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        let (mut decided, mut total) = (0usize, 0usize);
        for case in 0..6 {
            let row = peaked_row(3000, 0, &mut rng);
            let p = SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                seed: case,
                ..Default::default()
            };
            let top = device_top(&row, 64, &mut rng);
            let skew = row.len() as f64 * f64::from(f32::EPSILON) / 2.0;
            let rest = device_rest(&row, &top, 1.0, skew, &mut rng);
            for pos in 0..50 {
                total += 1;
                if let Some(id) = p.pick_from_top(&top, row.len(), Some(&rest), pos) {
                    assert_eq!(id, p.pick(&row, pos), "case {case}, pos {pos}");
                    decided += 1;
                }
            }
        }
        assert!(
            decided > total / 10 && decided < total,
            "{decided} of {total}"
        );
    }

    #[test]
    fn a_tiny_temperature_on_large_logits_leaves_the_rest_undecided() {
        // At T 1e-4 a logit of 30 scales to 3e5, where the device's exponent may be off
        // by enough to move each term of the rest by several percent: nothing is decided
        // from the sum. The same row moved down to 0 is decided as usual.
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let shape: Vec<f32> = (0..3000)
            .map(|i| if i < 200 { -(i as f32) * 4e-6 } else { -1.0 })
            .collect();
        let p = SamplingParams {
            temperature: 1e-4,
            seed: 3,
            ..Default::default()
        };
        let decided = |row: &[f32], rng: &mut ChaCha8Rng| {
            let top = device_top(row, 64, rng);
            let rest = device_rest(row, &top, p.temperature, 0.0, rng);
            (0..40)
                .filter_map(|pos| {
                    let id = p.pick_from_top(&top, row.len(), Some(&rest), pos)?;
                    assert_eq!(id, p.pick(row, pos), "pos {pos}");
                    Some(id)
                })
                .count()
        };
        let high: Vec<f32> = shape.iter().map(|l| l + 30.0).collect();
        assert_eq!(decided(&high, &mut rng), 0);
        assert!(decided(&shape, &mut rng) > 20);
    }

    #[test]
    fn the_negligible_tail_is_counted_but_not_summed() {
        // Only the head is sorted and summed; the tail's size and its last candidate in
        // the full order (chosen if a draw ever ran past the head) are kept.
        let logits = [0.0f32, -100.0, -100.0, -300.0];
        let p = SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..Default::default()
        };
        let ranked = p.ranked(&logits).expect("candidates");
        assert_eq!(ranked.head.len(), 1);
        assert_eq!((ranked.len, ranked.last), (4, Some(3)));
        for pos in 0..2000 {
            assert_eq!(
                p.sample(&mut logits.clone(), &[], &[], pos),
                sample_by_full_sort(&p, &logits, pos)
            );
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_candidates() {
        let logits = [1.0f32, 2.0, 3.0, 4.0];
        let k1 = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        };
        let p_small = SamplingParams {
            temperature: 1.0,
            top_p: 0.1,
            ..Default::default()
        };
        for pos in 0..100 {
            assert_eq!(k1.sample(&mut logits.clone(), &[], &[], pos), 3);
            assert_eq!(p_small.sample(&mut logits.clone(), &[], &[], pos), 3);
        }
        let k2 = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let seen: std::collections::BTreeSet<u32> = (0..200)
            .map(|pos| k2.sample(&mut logits.clone(), &[], &[], pos))
            .collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![2, 3]);
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Token 0 leads but was already used: 3.0 / 2 < 2.0.
        assert_eq!(p.sample(&mut [3.0, 2.0], &[0], &[0], 0), 1);
        let mut neg = [-1.0f32, -1.5];
        p.sample(&mut neg, &[0], &[], 0);
        assert_eq!(neg, [-2.0, -1.5]);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openais_definition() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        // logit −= presence × [count > 0] + frequency × count, over the output only.
        let mut l = [1.0f32, 1.0, 1.0, 1.0];
        p.adjust(&mut l, &[3, 3, 3], &[0, 1, 1, 1]);
        assert_eq!(l, [1.0 - 0.75, 1.0 - 1.25, 1.0, 1.0]);
        // Greedy: token 0 leads, but the output already holds it three times.
        assert_eq!(p.sample(&mut [2.0, 1.5], &[], &[0, 0, 0], 0), 1);
        assert_eq!(p.sample(&mut [2.0, 1.5], &[0, 0, 0], &[], 0), 0);
        // A negative presence penalty encourages repeats.
        let encourage = SamplingParams {
            presence_penalty: -2.0,
            ..Default::default()
        };
        assert_eq!(encourage.sample(&mut [2.0, 1.5], &[], &[1], 0), 1);
    }

    #[test]
    fn logit_bias_moves_the_draw() {
        let p = SamplingParams {
            logit_bias: vec![(2, 100.0), (0, -100.0), (99, 5.0)],
            temperature: 1.0,
            ..Default::default()
        };
        for pos in 0..200 {
            assert_eq!(p.sample(&mut [5.0, 4.0, -3.0], &[], &[], pos), 2);
        }
        let ban = SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..Default::default()
        };
        assert_eq!(ban.sample(&mut [5.0, 4.0], &[], &[], 0), 1);
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_most_likely() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
        let logits = [0.0f32, -(2.0f32).ln(), -(4.0f32).ln(), -(4.0f32).ln()];
        let seen = |min_p: f32| {
            let p = SamplingParams {
                temperature: 1.0,
                min_p,
                seed: 3,
                ..Default::default()
            };
            (0..2000)
                .map(|pos| p.sample(&mut logits.clone(), &[], &[], pos))
                .collect::<std::collections::BTreeSet<u32>>()
                .into_iter()
                .collect::<Vec<_>>()
        };
        assert_eq!(seen(0.0), vec![0, 1, 2, 3]);
        assert_eq!(seen(0.2), vec![0, 1, 2, 3]);
        assert_eq!(seen(0.3), vec![0, 1]);
        assert_eq!(seen(0.45), vec![0, 1]);
        assert_eq!(seen(0.6), vec![0]);
        assert_eq!(seen(1.0), vec![0]);
        // Only ratios to the largest count: the far tail goes with any min_p.
        let mut wide = vec![-300.0f32; 100];
        wide[7] = 0.0;
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 1e-30,
            ..Default::default()
        };
        for pos in 0..200 {
            assert_eq!(p.sample(&mut wide.clone(), &[], &[], pos), 7);
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, f32::NAN, 2.0];
        let (chosen, top) = logprobs(&logits, 5, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, 2.0].iter().map(|l| l.exp()).sum();
        let lp = |l: f64| (l - z.ln()) as f32;
        assert!((chosen - lp(2.0)).abs() < 1e-6, "{chosen}");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 5]);
        assert!((top[0].1 - lp(3.0)).abs() < 1e-6);
        let total: f64 = [0u32, 1, 3, 5]
            .iter()
            .map(|&i| f64::from(logprobs(&logits, i, 0).0).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        // Forbidden tokens are never listed, even when fewer are left than asked for.
        let (none, top) = logprobs(&logits, 2, 20);
        assert_eq!(none, f32::NEG_INFINITY);
        assert_eq!(top.len(), 4);
    }

    #[test]
    fn validation_rejects_out_of_domain_values() {
        assert!(params(-0.1, 0).validate().is_err());
        assert!(params(f32::NAN, 0).validate().is_err());
        let mut p = params(1.0, 0);
        p.top_p = 0.0;
        assert!(p.validate().is_err());
        p.top_p = 1.0;
        p.repetition_penalty = 0.0;
        assert!(p.validate().is_err());
        p.repetition_penalty = 1.1;
        assert!(p.validate().is_ok());
        p.min_p = 1.5;
        assert!(p.validate().is_err());
        p.min_p = 0.1;
        p.presence_penalty = 2.5;
        assert!(p.validate().is_err());
        p.presence_penalty = -2.0;
        p.frequency_penalty = f32::NAN;
        assert!(p.validate().is_err());
        p.frequency_penalty = 2.0;
        p.logit_bias = vec![(1, 101.0)];
        assert!(p.validate().is_err());
        p.logit_bias = vec![(1, -100.0)];
        assert!(p.validate().is_ok());
    }
}
