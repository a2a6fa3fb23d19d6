//! Grouped-query self-attention.

use burn_tensor::{
    backend::Backend, module::attention, ops::AttentionModuleOptions, Bool, DType, Tensor,
    TensorData,
};

use super::{
    cache::{DeviceKvCache, LayerKv},
    linear::Linear,
    model::RmsNorm,
    rope::Rope,
};

/// A bias added to a product's outputs (Qwen2's Q/K/V biases).
#[derive(Debug, Clone)]
pub struct Bias<B: Backend> {
    /// `[1, width]`.
    pub(crate) tensor: Tensor<B, 2>,
}

impl<B: Backend> Bias<B> {
    /// A bias of `values`.
    pub fn new(values: Vec<f32>, device: &B::Device) -> Self {
        let width = values.len();
        Self {
            tensor: Tensor::from_data(TensorData::new(values, [1, width]), device),
        }
    }
}

/// One layer's attention weights.
#[derive(Debug, Clone)]
pub struct Attention<B: Backend> {
    /// Q, K and V projections fused in one `[q + k + v, hidden]` matrix: one product per
    /// layer instead of three.
    pub(crate) qkv: Linear<B>,
    /// Added to the fused Q, K, V outputs (in their order), when the model has biases.
    pub(crate) qkv_bias: Option<Bias<B>>,
    /// RMSNorm of each query head before RoPE (Qwen3).
    pub(crate) q_norm: Option<RmsNorm<B>>,
    /// RMSNorm of each key head before RoPE (Qwen3).
    pub(crate) k_norm: Option<RmsNorm<B>>,
    /// Output projection.
    pub(crate) out: Linear<B>,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
}

/// Where one sequence's rows sit in a batched activation.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan {
    /// First row of the sequence in the batch.
    pub row: usize,
    /// Rows (new tokens) of the sequence.
    pub len: usize,
    /// Position of the first new token (tokens already in the cache).
    pub pos: usize,
}

/// What a layer's attention uses beside its weights.
pub struct AttendWith<'a, B: Backend> {
    /// The layer's rotations.
    pub rope: &'a Rope<B>,
    /// Scores are `q·k` times this.
    pub scale: f32,
    /// A sliding-window layer's window: a query sees itself and the `window − 1`
    /// positions before it.
    pub window: Option<usize>,
}

/// A mask on the device: `true` hides a key from a query.
type Mask<B> = Tensor<B, 4, Bool>;

/// Whether the query at `pos` may not see the key at `key`: a later position, or one
/// past the layer's window (a query sees itself and the `window − 1` before it).
fn hidden(pos: usize, key: usize, window: Option<usize>) -> bool {
    key > pos || window.is_some_and(|w| pos >= key + w)
}

/// The attention masks of one forward pass. A mask depends only on the step's spans and
/// on a layer's window, so each is built on the host and uploaded once, then shared by
/// every layer with that window, not rebuilt layer by layer.
pub struct StepMasks<B: Backend> {
    /// By (sequence, window): a prompt's `[1, kv_heads, group·len, total]`.
    prompts: Vec<(usize, Option<usize>, Mask<B>)>,
    /// By window: the decode rows' `[rows, kv_heads, group, keys]`, `None` where it
    /// hides nothing.
    decode: Vec<(Option<usize>, Option<Mask<B>>)>,
}

impl<B: Backend> StepMasks<B> {
    /// None built yet.
    pub fn new() -> Self {
        Self {
            prompts: Vec::new(),
            decode: Vec::new(),
        }
    }

    fn prompt(
        &mut self,
        seq: usize,
        window: Option<usize>,
        build: impl FnOnce() -> Mask<B>,
    ) -> Mask<B> {
        if let Some((.., m)) = self.prompts.iter().find(|p| (p.0, p.1) == (seq, window)) {
            return m.clone();
        }
        let m = build();
        self.prompts.push((seq, window, m.clone()));
        m
    }

    fn decode(
        &mut self,
        window: Option<usize>,
        build: impl FnOnce() -> Option<Mask<B>>,
    ) -> Option<Mask<B>> {
        if let Some((_, m)) = self.decode.iter().find(|(w, _)| *w == window) {
            return m.clone();
        }
        let m = build();
        self.decode.push((window, m.clone()));
        m
    }
}

impl<B: Backend> Default for StepMasks<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Attention<B> {
    /// `x: [rows, hidden]` for all sequences of the batch → `[rows, hidden]`. `masks`
    /// holds what earlier layers of the same step built.
    pub fn forward(
        &self,
        layer: usize,
        x: Tensor<B, 2>,
        spans: &[SeqSpan],
        caches: &mut [&mut DeviceKvCache<B>],
        how: &AttendWith<'_, B>,
        masks: &mut StepMasks<B>,
    ) -> Tensor<B, 2> {
        let rope = how.rope;
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let mut qkv = self.qkv.forward(x);
        if let Some(b) = &self.qkv_bias {
            qkv = qkv + b.tensor.clone();
        }
        // A head's norm is a row norm of the heads laid out one a row.
        let head_norm = |t: Tensor<B, 3>, norm: &Option<RmsNorm<B>>| match norm {
            Some(n) => {
                let [len, heads, _] = t.dims();
                n.forward(t.reshape([len * heads, d]))
                    .reshape([len, heads, d])
            }
            None => t,
        };
        // Each sequence's new keys and values go into its store; the queries of its
        // single generated token (a decode row) wait to be attended together with the
        // others', in one call; a prompt's rows are attended on their own.
        let mut outs: Vec<Option<Tensor<B, 2>>> = vec![None; spans.len()];
        let mut decode: Vec<(usize, Tensor<B, 3>, LayerKv<B>, usize)> = Vec::new();
        for (i, (span, cache)) in spans.iter().zip(caches.iter_mut()).enumerate() {
            let rows = qkv.clone().narrow(0, span.row, span.len);
            let q = rows.clone().narrow(1, 0, h * d).reshape([span.len, h, d]);
            let k = rows
                .clone()
                .narrow(1, h * d, kvh * d)
                .reshape([span.len, kvh, d]);
            let v = rows
                .narrow(1, (h + kvh) * d, kvh * d)
                .reshape([span.len, kvh, d]);
            let (q, k) = rope.apply_pair(
                head_norm(q, &self.q_norm),
                head_norm(k, &self.k_norm),
                span.pos,
            );
            // [len, heads, d] → [heads, len, d]
            let store = cache.append(layer, k.swap_dims(0, 1), v.swap_dims(0, 1));
            let total = span.pos + span.len;
            if span.len == 1 {
                decode.push((i, q, store, total));
            } else {
                let keys = store.k.narrow(1, 0, total).cast(DType::F32);
                let values = store.v.narrow(1, 0, total).cast(DType::F32);
                let mask = masks.prompt(i, how.window, || {
                    self.prompt_mask(span.len, span.pos, how.window, &keys.device())
                });
                outs[i] = Some(self.attend(q, keys, values, mask, how));
            }
        }
        if !decode.is_empty() {
            let rows = self.attend_decode(
                decode.iter().map(|(_, q, s, t)| (q.clone(), s, *t)),
                how,
                masks,
            );
            // A step of decode rows alone (the common one) is already in row order.
            if decode.len() == spans.len() {
                return self.out.forward(rows);
            }
            for (r, (i, ..)) in decode.iter().enumerate() {
                outs[*i] = Some(rows.clone().narrow(0, r, 1));
            }
        }
        let mut outs: Vec<Tensor<B, 2>> = outs.into_iter().flatten().collect();
        let merged = if outs.len() == 1 {
            outs.pop().expect("one output")
        } else {
            Tensor::cat(outs, 0)
        };
        self.out.forward(merged)
    }

    /// The decode rows of a step, one per sequence — `q: [1, heads, d]` at position
    /// `total − 1` against its store's first `total` positions — in one attention call:
    /// the stores are read up to the longest `total` (a shorter one is padded), and a
    /// mask hides each row's keys past its own `total` and before its window. Returns
    /// the rows' `[rows, heads·d]`, in order.
    fn attend_decode<'s>(
        &self,
        rows: impl ExactSizeIterator<Item = (Tensor<B, 3>, &'s LayerKv<B>, usize)>,
        how: &AttendWith<'_, B>,
        masks: &mut StepMasks<B>,
    ) -> Tensor<B, 2> {
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let group = h / kvh;
        let rows: Vec<_> = rows.collect();
        let n = rows.len();
        let longest = rows.iter().map(|r| r.2).max().unwrap_or(0);
        // Keys before `first` are outside every row's window: none is read.
        let first = how.window.map_or(0, |w| {
            rows.iter()
                .map(|r| r.2.saturating_sub(w))
                .min()
                .unwrap_or(0)
        });
        let span = longest - first;
        let take = |t: &Tensor<B, 3>| {
            let room = t.dims()[1];
            let t = t.clone().narrow(1, first, span.min(room - first));
            if room - first >= span {
                t
            } else {
                let pad = Tensor::<B, 3>::zeros(
                    [kvh, span - (room - first), d],
                    (&t.device(), t.dtype()),
                );
                Tensor::cat(vec![t, pad], 1)
            }
        };
        let device = rows[0].0.device();
        let mut q = Vec::with_capacity(n);
        let (mut keys, mut values) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (row_q, store, _) in &rows {
            // The `group` query heads sharing a KV head become `group` query rows of it
            // (head h reads KV head h / group), so keys are never repeated.
            q.push(row_q.clone().reshape([1, kvh, group, d]));
            keys.push(take(&store.k).unsqueeze_dim::<4>(0));
            values.push(take(&store.v).unsqueeze_dim::<4>(0));
        }
        let cat = |t: Vec<Tensor<B, 4>>| {
            if t.len() == 1 {
                t.into_iter().next().expect("one")
            } else {
                Tensor::cat(t, 0)
            }
        };
        let (keys, values) = (cat(keys).cast(DType::F32), cat(values).cast(DType::F32));
        let mask = masks.decode(how.window, || {
            let hide: Vec<bool> = rows
                .iter()
                .flat_map(|&(_, _, total)| {
                    (first..longest).map(move |key| hidden(total - 1, key, how.window))
                })
                .collect();
            hide.iter().any(|&x| x).then(|| {
                Tensor::<B, 2, Bool>::from_data(TensorData::new(hide, [n, span]), &device)
                    .reshape([n, 1, 1, span])
                    .expand([n, kvh, group, span])
            })
        });
        let options = AttentionModuleOptions {
            scale: Some(f64::from(how.scale)),
            ..Default::default()
        };
        attention(cat(q), keys, values, mask, None, options).reshape([n, h * d])
    }

    /// What a prompt's query rows may not see, laid out as [`Self::attend`] lays out
    /// its queries (`group · len` rows of each KV head, query `i` at position
    /// `start + i`): later positions, and those past its window. It is spelled out
    /// rather than left to `is_causal`, whose diagonal would have to line up with the
    /// last key when the queries are fewer than the keys.
    fn prompt_mask(
        &self,
        len: usize,
        start: usize,
        window: Option<usize>,
        device: &B::Device,
    ) -> Mask<B> {
        let (kvh, group) = (self.n_kv_heads, self.n_heads / self.n_kv_heads);
        let total = start + len;
        let hide: Vec<bool> = (start..total)
            .flat_map(|pos| (0..total).map(move |key| hidden(pos, key, window)))
            .collect();
        let rows = group * len;
        Tensor::<B, 2, Bool>::from_data(TensorData::new(hide.repeat(group), [rows, total]), device)
            .reshape([1, 1, rows, total])
            .expand([1, kvh, rows, total])
    }

    /// `q: [len, heads, d]` (positions `start..start + len`) against the cached
    /// `[kv_heads, total, d]` (positions `0..total`, `total = start + len`), `mask` from
    /// [`Self::prompt_mask`] → `[len, heads·d]`. As at decode, the `group` query heads
    /// sharing a KV head become `group · len` query rows of it (head h reads KV head
    /// h / group), so keys are never repeated.
    fn attend(
        &self,
        q: Tensor<B, 3>,
        keys: Tensor<B, 3>,
        values: Tensor<B, 3>,
        mask: Mask<B>,
        how: &AttendWith<'_, B>,
    ) -> Tensor<B, 2> {
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let group = h / kvh;
        let [len, _, _] = q.dims();
        let rows = group * len;
        let options = AttentionModuleOptions {
            scale: Some(f64::from(how.scale)),
            ..Default::default()
        };
        // [len, h, d] → [len, kvh, group, d] → [1, kvh, group·len, d]
        let q = q
            .reshape([len, kvh, group, d])
            .permute([1, 2, 0, 3])
            .reshape([1, kvh, rows, d]);
        let out = attention(
            q,
            keys.unsqueeze_dim::<4>(0),
            values.unsqueeze_dim::<4>(0),
            Some(mask),
            None,
            options,
        );
        // [1, kvh, group·len, d] → [len, kvh, group, d] → [len, h·d]
        out.reshape([kvh, group, len, d])
            .permute([2, 0, 1, 3])
            .reshape([len, h * d])
    }
}
