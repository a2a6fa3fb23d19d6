//! Grouped-query self-attention.

use burn_tensor::{
    backend::Backend, module::attention, ops::AttentionModuleOptions, Tensor, TensorData,
};

use super::{cache::KvCache, linear::Linear, model::RmsNorm, rope::Rope};

/// A bias added to a product's outputs (Qwen2's Q/K/V biases).
#[derive(Debug, Clone)]
pub struct Bias<B: Backend> {
    /// `[1, width]`, for the burn path.
    pub(crate) tensor: Tensor<B, 2>,
    /// The same values on the host.
    pub(crate) host: Vec<f32>,
}

impl<B: Backend> Bias<B> {
    /// A bias of `values`.
    pub fn new(values: Vec<f32>, device: &B::Device) -> Self {
        let width = values.len();
        Self {
            tensor: Tensor::from_data(TensorData::new(values.clone(), [1, width]), device),
            host: values,
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

impl<B: Backend> Attention<B> {
    /// `x: [rows, hidden]` for all sequences of the batch → `[rows, hidden]`.
    pub fn forward(
        &self,
        layer: usize,
        x: Tensor<B, 2>,
        spans: &[SeqSpan],
        caches: &mut [&mut KvCache<B>],
        rope: &Rope<B>,
    ) -> Tensor<B, 2> {
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
        let mut outs = Vec::with_capacity(spans.len());
        for (span, cache) in spans.iter().zip(caches.iter_mut()) {
            let rows = qkv.clone().narrow(0, span.row, span.len);
            let q = rows.clone().narrow(1, 0, h * d).reshape([span.len, h, d]);
            let k = rows
                .clone()
                .narrow(1, h * d, kvh * d)
                .reshape([span.len, kvh, d]);
            let v = rows
                .narrow(1, (h + kvh) * d, kvh * d)
                .reshape([span.len, kvh, d]);
            let q = rope.apply(head_norm(q, &self.q_norm), span.pos);
            let k = rope.apply(head_norm(k, &self.k_norm), span.pos);
            // [len, heads, d] → [heads, len, d]
            let (keys, values) = cache.append(layer, k.swap_dims(0, 1), v.swap_dims(0, 1));
            outs.push(self.attend(q, keys, values));
        }
        let merged = if outs.len() == 1 {
            outs.pop().expect("one output")
        } else {
            Tensor::cat(outs, 0)
        };
        self.out.forward(merged)
    }

    /// `q: [len, heads, d]` against cached `[kv_heads, total, d]` → `[len, heads·d]`.
    fn attend(&self, q: Tensor<B, 3>, keys: Tensor<B, 3>, values: Tensor<B, 3>) -> Tensor<B, 2> {
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let group = h / kvh;
        let [len, _, _] = q.dims();
        let total = keys.dims()[1];
        if len == 1 {
            // One query: the `group` query heads sharing a KV head become `group` query
            // rows of that KV head, so keys are never repeated and no mask is needed
            // (head h reads KV head h / group).
            let q = q.reshape([1, kvh, group, d]);
            let out = attention(
                q,
                keys.unsqueeze_dim::<4>(0),
                values.unsqueeze_dim::<4>(0),
                None,
                None,
                AttentionModuleOptions::default(),
            );
            return out.reshape([1, h * d]);
        }
        // Several queries (prefill): repeat each KV head for its query heads and mask
        // causally, aligned so that the last query sees every key.
        let expand = |t: Tensor<B, 3>| {
            t.unsqueeze_dim::<4>(1)
                .expand([kvh, group, total, d])
                .reshape([1, h, total, d])
        };
        let q = q.swap_dims(0, 1).unsqueeze_dim::<4>(0);
        let options = AttentionModuleOptions {
            is_causal: true,
            ..Default::default()
        };
        let out = attention(q, expand(keys), expand(values), None, None, options);
        // [1, h, len, d] → [len, h·d]
        out.squeeze_dim::<3>(0)
            .swap_dims(0, 1)
            .reshape([len, h * d])
    }
}
