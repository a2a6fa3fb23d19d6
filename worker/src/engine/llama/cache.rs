//! The per-sequence KV cache.
//!
//! A cache belongs to one sequence; the weights are shared by all sequences
//! (`forward(&self, …, &mut cache)`). Keys are stored after RoPE.
//!
//! Two stores, one per forward path: burn tensors for weights kept as tensors, and plain
//! host vectors for weights kept in block form (the host path of
//! [`super::host`]), where a step appends its keys and values in place (the vectors grow
//! by doubling, so a step copies nothing that is already cached).

use burn_tensor::{backend::Backend, Tensor};

/// Keys and values of one layer: `[kv_heads, len, head_dim]` each.
#[derive(Debug, Clone)]
struct LayerKv<B: Backend> {
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
}

/// Keys and values of one layer on the host: position-major, `[len, kv_heads·head_dim]`
/// each.
#[derive(Debug, Clone, Default)]
pub(crate) struct HostKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// Keys and values of every layer for the positions a sequence has seen.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<LayerKv<B>>>,
    host: Vec<HostKv>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![None; n_layers],
            host: vec![HostKv::default(); n_layers],
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

    /// The host store of every layer (the host forward path appends to it).
    pub(crate) fn host_layers(&mut self) -> &mut [HostKv] {
        &mut self.host
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
        for kv in &mut self.host {
            let keep = if kv.k.is_empty() {
                0
            } else {
                kv.k.len() / self.len * len
            };
            kv.k.truncate(keep);
            kv.v.truncate(keep);
        }
        self.len = len;
    }

    /// Bytes held, for KV budgets (f32 elements of the cached positions; the host
    /// store's spare capacity, at most as much again, is not counted).
    pub fn bytes(&self) -> usize {
        let tensors: usize = self
            .layers
            .iter()
            .flatten()
            .map(|kv| kv.k.shape().num_elements() + kv.v.shape().num_elements())
            .sum();
        let host: usize = self.host.iter().map(|kv| kv.k.len() + kv.v.len()).sum();
        (tensors + host) * 4
    }
}
