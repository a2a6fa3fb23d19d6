//! The forward pass on host memory, for weights kept in block form (`native`).
//!
//! Every matrix is a [`QMatrix`] multiplied on the host, so activations never need to be
//! burn tensors: the residual stream, norms, RoPE, attention and the SwiGLU product run
//! as plain f32 loops over host vectors, and keys and values are appended in place to the
//! host store of each sequence's [`HostKvCache`]. Only the logits become a tensor.

use std::sync::Arc;

use crate::engine::cpu::{
    activation::{geglu, rms_norm, swiglu},
    attention::attend_heads,
    qmatrix::{Prepared, QMatrix},
    team::{Counters, Latch, Shared, SpinBarrier},
    transpose::transpose,
};
use crate::engine::sampler::{first_max, merge_first_max};

use super::{
    attention::SeqSpan,
    cache::{HostKvCache, KvDtype, KvElem},
    config::{Activation, LlamaConfig},
    rope::RopeTables,
};

/// One block's weights, all in block form.
#[derive(Debug, Clone)]
pub(crate) struct HostBlock {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) qkv: Arc<QMatrix>,
    /// Added to the QKV outputs (in their order), when the model has biases.
    pub(crate) qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of queries and keys, when the model has them.
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    /// Norms of the attention's and the feed-forward block's outputs (Gemma 3).
    pub(crate) post_attn_norm: Option<Vec<f32>>,
    pub(crate) post_ffn_norm: Option<Vec<f32>>,
    pub(crate) out: Arc<QMatrix>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate_up: Arc<QMatrix>,
    pub(crate) down: Arc<QMatrix>,
}

/// The whole network's weights in block form.
#[derive(Debug, Clone)]
pub(crate) struct HostWeights {
    pub(crate) embed: Arc<QMatrix>,
    /// The output projection; the embedding itself for tied models.
    pub(crate) lm_head: Arc<QMatrix>,
    pub(crate) blocks: Vec<HostBlock>,
    pub(crate) norm: Vec<f32>,
}

impl HostWeights {
    /// Every matrix, the embedding first.
    pub(crate) fn matrices(&self) -> impl Iterator<Item = &QMatrix> + '_ {
        [&*self.embed, &*self.lm_head].into_iter().chain(
            self.blocks
                .iter()
                .flat_map(|b| [&*b.qkv, &*b.out, &*b.gate_up, &*b.down]),
        )
    }
}

/// The host engine's network: every matrix in the file's blocks, multiplied by Baton's
/// CPU kernels; its caches are [`HostKvCache`]s.
#[derive(Debug, Clone)]
pub struct HostLlama {
    pub(crate) config: LlamaConfig,
    pub(crate) weights: HostWeights,
    pub(crate) rope: RopeTables,
    /// The rotations of sliding-window layers, when they have a base of their own.
    pub(crate) rope_local: Option<RopeTables>,
}

impl HostLlama {
    /// Bytes of weights one decode step reads: every matrix but the embedding once.
    pub(crate) fn decode_weight_bytes(&self) -> usize {
        self.weights.matrices().skip(1).map(QMatrix::bytes).sum()
    }

    /// Each distinct sequence of block formats the matrices are kept in (runs of a
    /// stack in order), sorted, joined by commas.
    pub(crate) fn held_formats(&self) -> String {
        let mut all: Vec<String> = self
            .weights
            .matrices()
            .map(|m| {
                let kinds: Vec<String> = m.kinds().iter().map(|k| format!("{k:?}")).collect();
                kinds.join("+")
            })
            .collect();
        all.sort();
        all.dedup();
        all.join(",")
    }

    /// The forward pass of [`super::Llama::forward`] on the host; inputs already checked.
    ///
    /// A step of generated tokens only, at least [`SPLIT_ROWS`] of them for every thread
    /// of the rayon pool, is split by sequence: each thread runs the whole network for
    /// its share of the sequences alone, with no barrier between phases (each weight is
    /// then read once a thread instead of once a step, which at that many rows costs
    /// less than the threads waiting for each other five times a layer). Any other step
    /// runs as one parallel region over the pool ([`HostLlama::forward_rows`]). A row's
    /// arithmetic is the same either way, so its results are too.
    ///
    /// In a split step a thread that is through its layers goes straight on to the
    /// output projection of its own sequences, in chunks of vocabulary rows, then takes
    /// the chunks left of the other threads' sequences once theirs are through: the
    /// threads rarely end their layers together (the machine slows one or the other),
    /// and the projection, a fifth of a step's multiply-adds, fills the wait.
    pub(crate) fn forward(
        &self,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut HostKvCache],
    ) -> HostLogits {
        let w = &self.weights;
        let threads = rayon::current_num_threads();
        let Some(groups) = split_by_sequence(spans, threads) else {
            let out = self.forward_rows_any(w, ids, spans, caches, true, true);
            return HostLogits {
                logits: out.values,
                argmax: out.argmax,
            };
        };
        let vocab = w.lm_head.rows();
        let chunks = vocab.div_ceil(chunk_size(vocab, threads));
        let mut logits = vec![0.0f32; spans.len() * vocab];
        let mut maxima = vec![None; spans.len() * chunks];
        let mut parts = Vec::with_capacity(groups.len());
        let mut rest: &mut [&mut HostKvCache] = caches;
        let mut rest_logits: &mut [f32] = &mut logits;
        let mut rest_maxima: &mut [ChunkMax] = &mut maxima;
        for g in groups {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(g.len());
            rest = tail;
            let (logs, tail) = std::mem::take(&mut rest_logits).split_at_mut(g.len() * vocab);
            rest_logits = tail;
            let (maxs, tail) = std::mem::take(&mut rest_maxima).split_at_mut(g.len() * chunks);
            rest_maxima = tail;
            let first = spans[g.start].row;
            let last = &spans[g.end - 1];
            let own: Vec<SeqSpan> = spans[g.clone()]
                .iter()
                .map(|s| SeqSpan {
                    row: s.row - first,
                    ..*s
                })
                .collect();
            parts.push(SplitPart {
                ids: &ids[first..last.row + last.len],
                spans: own,
                caches: std::sync::Mutex::new(Some(mine)),
                logits: Shared::new(logs),
                maxima: Shared::new(maxs),
                last: Latch::default(),
            });
        }
        let counters = Counters::new(parts.len());
        let eps = self.config.rms_eps;
        rayon::broadcast(|ctx| {
            let t = ctx.index();
            if let Some(part) = parts.get(t) {
                let _guard = part.last.guard();
                let caches = part.caches.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(caches) = caches {
                    let done =
                        self.forward_rows_any(w, part.ids, &part.spans, caches, false, false);
                    part.last.set((done.values, done.last_int));
                }
            }
            let (mut h, mut prep, mut tile, mut yt, mut tt) = Default::default();
            for k in 0..parts.len() {
                let g = (t + k) % parts.len();
                let part = &parts[g];
                let (last, last_int) = part.last.wait();
                let scratch = (&mut h, &mut prep, &mut tile, &mut yt, &mut tt);
                output_part(
                    w,
                    eps,
                    last,
                    last_int,
                    &counters,
                    g,
                    threads,
                    (&part.logits, &part.maxima),
                    scratch,
                );
            }
        });
        drop(parts);
        HostLogits {
            logits,
            argmax: merge_maxima(&maxima, chunks),
        }
    }

    /// The forward pass of `ids` as one region: on every thread of the rayon pool
    /// (`pool`), or on the calling thread alone. Returns the logits (`with_output`), or
    /// else the last row of every sequence before the final norm, for
    /// [`HostLlama::output`]; and which of those rows are generated tokens.
    ///
    /// Per layer:
    /// each thread normalises the residual stream into its own buffer; the QKV product,
    /// RoPE and the cache writes; attention, one (row, head) at a time; the output
    /// product, added to the residual; the gate/up product with SwiGLU; the down
    /// product, added to the residual. Threads take chunks of output rows of each phase
    /// from a counter and meet at a barrier after it: five barriers a layer.
    fn forward_rows_any(
        &self,
        w: &HostWeights,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut HostKvCache],
        pool: bool,
        with_output: bool,
    ) -> RowsOut {
        match caches.first().map(|c| c.kv_dtype()).unwrap_or_default() {
            KvDtype::F16 => {
                self.forward_rows::<half::f16>(w, ids, spans, caches, pool, with_output)
            }
            KvDtype::F32 => self.forward_rows::<f32>(w, ids, spans, caches, pool, with_output),
        }
    }

    /// [`HostLlama::forward_rows_any`] for caches whose host store holds `E` (all of them:
    /// the model makes every cache with its own KV dtype).
    fn forward_rows<E: KvElem>(
        &self,
        w: &HostWeights,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut HostKvCache],
        pool: bool,
        with_output: bool,
    ) -> RowsOut {
        let c = &self.config;
        let (hidden, heads, kvh, d, ffn) = (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn);
        let (qd, kvd) = (heads * d, kvh * d);
        let width = qd + 2 * kvd;
        let group = heads / kvh;
        let scale = c.attn_scale;
        let eps = self.config.rms_eps;
        let layers = w.blocks.len();
        let post_norms = w.blocks.iter().any(|b| b.post_attn_norm.is_some());
        // Each layer's phases: QKV, attention, output, gate/up, down, and with post norms
        // one more after the output and after the down product.
        let layer_phases = if post_norms { 7 } else { 5 };
        let vocab = w.lm_head.rows();
        let rows = ids.len();
        let nseq = spans.len();

        let mut x = Vec::with_capacity(rows * hidden);
        for &id in ids {
            x.extend(w.embed.row(id as usize));
        }
        if c.embed_scale != 1.0 {
            for v in &mut x {
                *v *= c.embed_scale;
            }
        }
        // Sequence and position of every row.
        let mut row_seq = Vec::with_capacity(rows);
        let mut row_pos = Vec::with_capacity(rows);
        for (i, s) in spans.iter().enumerate() {
            row_seq.extend(std::iter::repeat_n(i, s.len));
            row_pos.extend(s.pos..s.pos + s.len);
        }
        let last_rows: Vec<usize> = spans.iter().map(|s| s.row + s.len - 1).collect();
        // Rows of generated tokens take integer inputs where the weights allow it, the
        // prompt's rows f32 (see `KvCache::set_decode_from`): a row's kernels depend on
        // its own sequence alone, never on what shares the step.
        let row_int: Vec<bool> = (0..rows)
            .map(|j| caches[row_seq[j]].is_decode_row(row_pos[j], spans[row_seq[j]].len))
            .collect();
        let last_int: Vec<bool> = last_rows.iter().map(|&r| row_int[r]).collect();
        let longest = spans.iter().map(|s| s.pos + s.len).max().unwrap_or(0);
        // Every layer's cache grows to its new length now; the QKV phase writes into it.
        for (span, cache) in spans.iter().zip(caches.iter_mut()) {
            let expected = cache.expected_positions() * kvd;
            for kv in cache
                .layers::<E>()
                .expect("every cache of a step in one KV dtype")
            {
                kv.grow((span.pos + span.len) * kvd, expected);
            }
        }
        let kv: Vec<(Shared<'_, E>, Shared<'_, E>)> = caches
            .iter_mut()
            .flat_map(|c| c.layers::<E>().expect("checked above").iter_mut())
            .map(|kv| (Shared::new(&mut kv.k), Shared::new(&mut kv.v)))
            .collect();

        let mut q = vec![0.0f32; rows * qd];
        let mut att = vec![0.0f32; rows * qd];
        let mut act = vec![0.0f32; rows * ffn];
        let mut logits = vec![0.0f32; if with_output { nseq * vocab } else { 0 }];
        let threads = if pool {
            rayon::current_num_threads()
        } else {
            1
        };
        let chunks = vocab.div_ceil(chunk_size(vocab, threads));
        let mut maxima: Vec<ChunkMax> = vec![None; if with_output { nseq * chunks } else { 0 }];
        let (xs, qs, atts, acts, logs) = (
            Shared::new(&mut x),
            Shared::new(&mut q),
            Shared::new(&mut att),
            Shared::new(&mut act),
            Shared::new(&mut logits),
        );
        let maxs = Shared::new(&mut maxima);
        let barrier = SpinBarrier::new(threads);
        let counters = Counters::new(layers * layer_phases + 1);
        // The outputs of the attention and of the down product before their norms.
        let mut o = vec![0.0f32; if post_norms { rows * hidden } else { 0 }];
        let os = Shared::new(&mut o);

        let region = || {
            let _guard = barrier.guard();
            let mut h = vec![0.0f32; rows * hidden];
            let mut xsum = Prepared::default();
            let mut tile = Vec::new();
            let mut yt = Vec::new();
            let mut yt2 = Vec::new();
            // Product outputs turned to one row per input row ([`transpose`]).
            let mut tt = Vec::new();
            let mut scores = vec![0.0f32; longest * group];
            let mut head_scratch = vec![0.0f32; d];
            let mut phase = 0;
            for (layer, b) in w.blocks.iter().enumerate() {
                let (rope, window) = c.layer_rope(layer, &self.rope, &self.rope_local);
                // SAFETY (all `Shared` accesses below): each phase writes only the
                // elements of the chunks or items this thread claimed from the phase's
                // counter, which no other thread touches in that phase, and reads only
                // what earlier phases wrote, after the barrier that ended them.
                rms_norm(
                    unsafe { xs.get(0..rows * hidden) },
                    &b.attn_norm,
                    eps,
                    &mut h,
                );
                b.qkv.prepare(&h, &row_int, &mut xsum);
                while let Some(item) = counters.next(phase, width / d) {
                    let (r0, r1) = (item * d, item * d + d);
                    yt.resize(d * rows, 0.0);
                    b.qkv
                        .product_rows(&h, rows, &xsum, r0, r1, &mut tile, &mut yt);
                    transpose(&yt, d, rows, &mut tt);
                    // Per head: the bias, the head's norm, then RoPE (queries and keys).
                    let bias = b.qkv_bias.as_deref().map(|bias| &bias[r0..r1]);
                    let norm = match r0 {
                        r if r < qd => b.q_norm.as_deref(),
                        r if r < qd + kvd => b.k_norm.as_deref(),
                        _ => None,
                    };
                    for (j, head) in tt.chunks_exact_mut(d).enumerate() {
                        let (seq, pos) = (row_seq[j], row_pos[j]);
                        let (ks, vs) = &kv[seq * layers + layer];
                        if let Some(bias) = bias {
                            for (x, b) in head.iter_mut().zip(bias) {
                                *x += b;
                            }
                        }
                        if let Some(w) = norm {
                            head_scratch.copy_from_slice(head);
                            rms_norm(&head_scratch, w, eps, head);
                        }
                        if r0 < qd + kvd {
                            rope.apply(head, pos);
                        }
                        if r0 < qd {
                            unsafe { qs.get_mut(j * qd + r0..j * qd + r1) }.copy_from_slice(head);
                        } else {
                            let dst = if r0 < qd + kvd {
                                let at = pos * kvd + r0 - qd;
                                unsafe { ks.get_mut(at..at + d) }
                            } else {
                                let at = pos * kvd + r0 - qd - kvd;
                                unsafe { vs.get_mut(at..at + d) }
                            };
                            E::store(dst, head);
                        }
                    }
                }
                phase += 1;
                barrier.wait();

                // One item: the query heads of one row on one KV head (each key and
                // value row then read once for all of them), or a single head when
                // there are too few rows to keep every thread busy that way.
                let per_item = if rows * kvh >= 4 * threads { group } else { 1 };
                let items_per_row = heads / per_item;
                while let Some(item) = counters.next(phase, rows * items_per_row) {
                    let (j, i) = (item / items_per_row, item % items_per_row);
                    let hh = i * per_item;
                    let keys = row_pos[j] + 1;
                    // A sliding-window layer reads only the window's keys.
                    let first = window.map_or(0, |w| keys.saturating_sub(w));
                    let (ks, vs) = &kv[row_seq[j] * layers + layer];
                    let at = j * qd + hh * d;
                    // The keys and values of this thread's likely next item (the threads
                    // take items in turn) on their way into L2 while this one runs: each
                    // item reads a short run of rows, which the hardware prefetcher picks
                    // up only once it has started (a step of 16 sequences at 50–130
                    // positions ran ~10 % faster for it).
                    let next = item + threads;
                    if next < rows * items_per_row {
                        let (nj, ni) = (next / items_per_row, next % items_per_row);
                        let (nk, nv) = &kv[row_seq[nj] * layers + layer];
                        let nkeys = row_pos[nj] + 1;
                        let nfirst = window.map_or(0, |w| nkeys.saturating_sub(w));
                        let noff = ni * per_item / group * d;
                        let range = nfirst * kvd..nkeys * kvd;
                        prefetch_rows(unsafe { nk.get(range.clone()) }, kvd, noff, d);
                        prefetch_rows(unsafe { nv.get(range) }, kvd, noff, d);
                    }
                    attend_heads(
                        unsafe { qs.get(at..at + per_item * d) },
                        unsafe { ks.get(first * kvd..keys * kvd) },
                        unsafe { vs.get(first * kvd..keys * kvd) },
                        keys - first,
                        kvd,
                        hh / group * d,
                        d,
                        scale,
                        &mut scores,
                        unsafe { atts.get_mut(at..at + per_item * d) },
                    );
                }
                phase += 1;
                barrier.wait();

                let a = unsafe { atts.get(0..rows * qd) };
                b.out.prepare(a, &row_int, &mut xsum);
                let (dst, add) = if post_norms {
                    (&os, false)
                } else {
                    (&xs, true)
                };
                while let Some((r0, r1)) = chunk(&counters, phase, hidden, threads) {
                    yt.resize((r1 - r0) * rows, 0.0);
                    b.out
                        .product_rows(a, rows, &xsum, r0, r1, &mut tile, &mut yt);
                    put_rows(dst, hidden, r0, r1, rows, &yt, &mut tt, add);
                }
                phase += 1;
                barrier.wait();
                if let Some(norm) = b.post_attn_norm.as_deref() {
                    add_normed_rows(&counters, phase, (&os, &xs), norm, eps, &mut h);
                    phase += 1;
                    barrier.wait();
                }

                rms_norm(
                    unsafe { xs.get(0..rows * hidden) },
                    &b.ffn_norm,
                    eps,
                    &mut h,
                );
                b.gate_up.prepare(&h, &row_int, &mut xsum);
                while let Some((r0, r1)) = chunk(&counters, phase, ffn, threads) {
                    let n = (r1 - r0) * rows;
                    yt.resize(n, 0.0);
                    yt2.resize(n, 0.0);
                    b.gate_up
                        .product_rows(&h, rows, &xsum, r0, r1, &mut tile, &mut yt);
                    b.gate_up.product_rows(
                        &h,
                        rows,
                        &xsum,
                        ffn + r0,
                        ffn + r1,
                        &mut tile,
                        &mut yt2,
                    );
                    match c.activation {
                        Activation::Silu => swiglu(&mut yt[..n], &yt2[..n]),
                        Activation::GeluTanh => geglu(&mut yt[..n], &yt2[..n]),
                    }
                    transpose(&yt[..n], r1 - r0, rows, &mut tt);
                    for (j, t) in tt.chunks_exact(r1 - r0).enumerate() {
                        unsafe { acts.get_mut(j * ffn + r0..j * ffn + r1) }.copy_from_slice(t);
                    }
                }
                phase += 1;
                barrier.wait();

                let a = unsafe { acts.get(0..rows * ffn) };
                b.down.prepare(a, &row_int, &mut xsum);
                let (dst, add) = if post_norms {
                    (&os, false)
                } else {
                    (&xs, true)
                };
                while let Some((r0, r1)) = chunk(&counters, phase, hidden, threads) {
                    yt.resize((r1 - r0) * rows, 0.0);
                    b.down
                        .product_rows(a, rows, &xsum, r0, r1, &mut tile, &mut yt);
                    put_rows(dst, hidden, r0, r1, rows, &yt, &mut tt, add);
                }
                phase += 1;
                barrier.wait();
                if let Some(norm) = b.post_ffn_norm.as_deref() {
                    add_normed_rows(&counters, phase, (&os, &xs), norm, eps, &mut h);
                    phase += 1;
                    barrier.wait();
                }
            }
            if with_output {
                let mut last = Vec::with_capacity(nseq * hidden);
                for &r in &last_rows {
                    last.extend_from_slice(unsafe { xs.get(r * hidden..(r + 1) * hidden) });
                }
                let scratch = (&mut h, &mut xsum, &mut tile, &mut yt, &mut tt);
                output_part(
                    w,
                    eps,
                    &last,
                    &last_int,
                    &counters,
                    phase,
                    threads,
                    (&logs, &maxs),
                    scratch,
                );
            }
        };
        if pool {
            rayon::broadcast(|_| region());
        } else {
            region();
        }
        drop(kv);
        if with_output {
            return RowsOut {
                values: logits,
                argmax: merge_maxima(&maxima, chunks),
                last_int,
            };
        }
        let mut last = Vec::with_capacity(nseq * hidden);
        for &r in &last_rows {
            last.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        RowsOut {
            values: last,
            last_int,
            argmax: Vec::new(),
        }
    }
}

/// One thread's share of a step split by sequence ([`HostLlama::forward`]): its
/// tokens and spans (rows counted from its first), its sequences' caches (taken by the
/// thread that runs it), its rows of the logits, and the last hidden row of each of its
/// sequences with which rows are generated tokens, once its layers are through; its
/// rows of the chunk maxima.
struct SplitPart<'a, 'c> {
    ids: &'a [i32],
    spans: Vec<SeqSpan>,
    caches: std::sync::Mutex<Option<&'a mut [&'c mut HostKvCache]>>,
    logits: Shared<'a>,
    maxima: Shared<'a, ChunkMax>,
    last: Latch<(Vec<f32>, Vec<bool>)>,
}

/// A thread's buffers for [`output_part`]: the normalised rows, their preparation, the
/// dequantized tiles, the product and its transpose.
type OutputScratch<'a> = (
    &'a mut Vec<f32>,
    &'a mut Prepared,
    &'a mut Vec<f32>,
    &'a mut Vec<f32>,
    &'a mut Vec<f32>,
);

/// One thread's part of the output projection: the final norm of `last` (every
/// thread normalises all of it into its own buffer), then chunks of vocabulary rows
/// claimed from `phase`'s counter, written into `logs` `[nseq, vocab]`, each chunk's
/// largest logit of each row into `maxs` `[nseq, chunks]` while the chunk is in cache
/// (greedy decoding then needs no pass over the logits: [`merge_maxima`]).
#[allow(clippy::too_many_arguments)]
fn output_part(
    w: &HostWeights,
    eps: f32,
    last: &[f32],
    last_int: &[bool],
    counters: &Counters,
    phase: usize,
    threads: usize,
    (logs, maxs): (&Shared<'_>, &Shared<'_, ChunkMax>),
    (h, prep, tile, yt, tt): OutputScratch<'_>,
) {
    let size = chunk_size(w.lm_head.rows(), threads);
    let chunks = w.lm_head.rows().div_ceil(size);
    let nseq = last_int.len();
    let vocab = w.lm_head.rows();
    h.resize(last.len(), 0.0);
    rms_norm(last, &w.norm, eps, h);
    // With 8-bit prompts every sequence's last row takes 16-bit inputs here, prompt or
    // not: one row a sequence reads the blocks as decode does, where a prompt's row
    // would unpack the whole vocabulary into tiles for itself.
    let every: Vec<bool>;
    let last_int = if w.lm_head.byte_prompts() {
        every = vec![true; nseq];
        &every[..]
    } else {
        last_int
    };
    w.lm_head.prepare(h, last_int, prep);
    while let Some((r0, r1)) = chunk(counters, phase, vocab, threads) {
        yt.resize((r1 - r0) * nseq, 0.0);
        w.lm_head.product_rows(h, nseq, prep, r0, r1, tile, yt);
        transpose(yt, r1 - r0, nseq, tt);
        for (s, t) in tt.chunks_exact(r1 - r0).enumerate() {
            // SAFETY: vocabulary rows r0..r1, chunk r0 / size, belong to the chunk this
            // thread claimed.
            unsafe { logs.get_mut(s * vocab + r0..s * vocab + r1) }.copy_from_slice(t);
            let at = s * chunks + r0 / size;
            let found = first_max(t).map(|(v, i)| (v, i + r0 as u32));
            let slot = unsafe { maxs.get_mut(at..at + 1) };
            slot[0] = found;
        }
    }
}

/// Asks for `width` elements at `off` of every `stride`-long row of `data` to be
/// brought into L2 (x86-64; nothing elsewhere).
fn prefetch_rows<E>(data: &[E], stride: usize, off: usize, width: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let size = std::mem::size_of::<E>();
        let base = data.as_ptr().cast::<i8>();
        let mut row = off * size;
        let bytes = width * size;
        while bytes > 0 && row + bytes <= std::mem::size_of_val(data) {
            let mut b = 0;
            while b < bytes {
                // SAFETY: a prefetch never faults; the address is inside `data` anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(row + b)) };
                b += 64;
            }
            // The last byte's line too (a row need not start on a line).
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(row + bytes - 1)) };
            row += stride * size;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, stride, off, width);
}

/// Rows of a [`chunk`] of `total`.
fn chunk_size(total: usize, threads: usize) -> usize {
    total.div_ceil(threads.max(1) * 8).next_multiple_of(6)
}

/// The largest logit of one chunk of vocabulary rows of one sequence and its index
/// ([`first_max`]); `None` when none is above −∞.
type ChunkMax = Option<(f32, u32)>;

/// Each sequence's greedy token from its chunks' maxima `[nseq, chunks]`: what
/// [`crate::engine::sampler::argmax`] of its whole row of logits gives.
fn merge_maxima(maxima: &[ChunkMax], chunks: usize) -> Vec<u32> {
    maxima
        .chunks_exact(chunks)
        .map(|row| merge_first_max(row.iter().copied()))
        .collect()
}

/// What [`HostLlama::forward_rows_any`] gives: the logits (with the output projection) or
/// the last row of every sequence before the final norm (without), which of those
/// rows are generated tokens, and (with the output projection) each sequence's
/// greedy token.
struct RowsOut {
    values: Vec<f32>,
    last_int: Vec<bool>,
    argmax: Vec<u32>,
}

/// The logits of a host forward pass, `[sequences × vocab]` row-major, and the index
/// of each row's largest logit (the lowest among equals): what greedy decoding takes.
pub(crate) struct HostLogits {
    pub(crate) logits: Vec<f32>,
    pub(crate) argmax: Vec<u32>,
}

/// Generated tokens a thread takes, at least, when a step is split by sequence (see
/// [`HostLlama::forward`]): below this the weights read again by every thread cost more
/// than the barriers they save.
pub(crate) const SPLIT_ROWS: usize = 4;

/// The sequences of each thread when a step is split by sequence: `threads` runs of
/// consecutive sequences whose sizes differ by at most one, when there are at least two
/// threads and every sequence brings one generated token (a prompt's rows would load one
/// thread with most of the work) and at least [`SPLIT_ROWS`] of them a thread.
fn split_by_sequence(spans: &[SeqSpan], threads: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let n = spans.len();
    if threads < 2 || n < threads * SPLIT_ROWS || spans.iter().any(|s| s.len != 1) {
        return None;
    }
    Some(
        (0..threads)
            .map(|t| t * n / threads..(t + 1) * n / threads)
            .collect(),
    )
}

/// The next chunk `r0..r1` of `total` output rows in `phase`: about eight chunks a
/// thread, a multiple of six rows (the kernels' tiles of three rows and three pairs), so
/// that the threads finish a phase together (a phase of 576 rows in chunks of 64 left
/// one of two threads a ninth of it to wait through) and a thread slowed by the machine
/// leaves its last chunks to the others.
fn chunk(
    counters: &Counters,
    phase: usize,
    total: usize,
    threads: usize,
) -> Option<(usize, usize)> {
    let size = chunk_size(total, threads);
    let item = counters.next(phase, total.div_ceil(size))?;
    Some((item * size, (item * size + size).min(total)))
}

/// `x[j][r0..r1] += yt[r − r0][j]` (or `=`, without `add`) for every row `j` of `x`
/// (`width` wide), through `tt` (scratch).
#[allow(clippy::too_many_arguments)]
fn put_rows(
    x: &Shared<'_>,
    width: usize,
    r0: usize,
    r1: usize,
    rows: usize,
    yt: &[f32],
    tt: &mut Vec<f32>,
    add: bool,
) {
    transpose(yt, r1 - r0, rows, tt);
    for (j, t) in tt.chunks_exact(r1 - r0).enumerate() {
        // SAFETY: columns r0..r1 belong to the chunk the caller claimed in this phase.
        let o = unsafe { x.get_mut(j * width + r0..j * width + r1) };
        if add {
            for (o, t) in o.iter_mut().zip(t) {
                *o += t;
            }
        } else {
            o.copy_from_slice(t);
        }
    }
}

/// `x[j] += rms_norm(o[j]) · w` for the rows `j` this thread claims in `phase`; `h` is
/// scratch of at least one row.
fn add_normed_rows(
    counters: &Counters,
    phase: usize,
    (o, x): (&Shared<'_>, &Shared<'_>),
    w: &[f32],
    eps: f32,
    h: &mut [f32],
) {
    let width = w.len();
    let rows = o.len() / width;
    let h = &mut h[..width];
    while let Some(j) = counters.next(phase, rows) {
        // SAFETY: row j is this thread's alone in this phase; `o` was written in the
        // phase before, behind its barrier.
        rms_norm(unsafe { o.get(j * width..(j + 1) * width) }, w, eps, h);
        let xr = unsafe { x.get_mut(j * width..(j + 1) * width) };
        for (x, v) in xr.iter_mut().zip(h.iter()) {
            *x += v;
        }
    }
}

#[cfg(test)]
mod tests;
