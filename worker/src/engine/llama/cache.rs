//! The per-sequence KV cache.
//!
//! A cache belongs to one sequence; the weights are shared by all sequences
//! (`forward(&self, …, &mut cache)`). Keys are stored after RoPE.

use burn_tensor::{backend::Backend, Tensor};

/// Keys and values of one layer: `[kv_heads, len, head_dim]` each.
#[derive(Debug, Clone)]
struct LayerKv<B: Backend> {
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
}

/// Keys and values of every layer for the positions a sequence has seen.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<LayerKv<B>>>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![None; n_layers],
            len: 0,
        }
    }

    /// Positions cached so far (the position the next token will take).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first forward.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `k`, `v` (`[kv_heads, new, head_dim]`) to `layer` and returns the
    /// layer's whole keys and values.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let slot = &mut self.layers[layer];
        let next = match slot.take() {
            None => LayerKv { k, v },
            Some(prev) => LayerKv {
                k: Tensor::cat(vec![prev.k, k], 1),
                v: Tensor::cat(vec![prev.v, v], 1),
            },
        };
        let out = (next.k.clone(), next.v.clone());
        *slot = Some(next);
        out
    }

    /// Records that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forgets everything after the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        for slot in &mut self.layers {
            if let Some(kv) = slot.take() {
                if len > 0 {
                    *slot = Some(LayerKv {
                        k: kv.k.narrow(1, 0, len),
                        v: kv.v.narrow(1, 0, len),
                    });
                }
            }
        }
        self.len = len;
    }

    /// Bytes held, for KV budgets (f32 elements).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|kv| (kv.k.shape().num_elements() + kv.v.shape().num_elements()) * 4)
            .sum()
    }
}
