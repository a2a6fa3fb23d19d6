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
mod tests;
