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
    decode_from: Option<usize>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model with `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![None; n_layers],
            host: vec![HostKv::default(); n_layers],
            len: 0,
            decode_from: None,
        }
    }

    /// Marks positions `from..` as generated tokens: with integer-input weights
    /// (`native-i16`) their rows take the integer kernels whether they run one a step or
    /// replayed together after a move, and the prompt's rows the f32 kernels. Unset, a
    /// row is treated as generated when it is the only new row of a non-empty cache.
    pub fn set_decode_from(&mut self, from: usize) {
        self.decode_from = Some(from);
    }

    /// Whether the row at `pos`, one of `rows` new rows, is a generated token's (see
    /// [`KvCache::set_decode_from`]).
    pub(crate) fn is_decode_row(&self, pos: usize, rows: usize) -> bool {
        match self.decode_from {
            Some(from) => pos >= from,
            None => rows == 1 && pos > 0,
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

    /// Whether the host store holds this cache's positions (the host forward path
    /// filled it), or the cache is empty.
    pub(crate) fn host_backed(&self) -> bool {
        self.layers.iter().all(Option::is_none)
    }

    /// Keys and values of positions `start..start + n` of every layer, packed for the
    /// prefix cache: per layer, the keys then the values, position-major. `None` when
    /// the positions are not cached or the store is the burn one.
    pub(crate) fn host_span(&self, start: usize, n: usize) -> Option<Box<[f32]>> {
        if start + n > self.len || n == 0 || !self.host_backed() {
            return None;
        }
        let width = self.host.first()?.k.len() / self.len;
        let mut out = Vec::with_capacity(self.host.len() * 2 * n * width);
        for kv in &self.host {
            out.extend_from_slice(&kv.k[start * width..(start + n) * width]);
            out.extend_from_slice(&kv.v[start * width..(start + n) * width]);
        }
        Some(out.into_boxed_slice())
    }

    /// Appends the first `take` of `n` positions packed by [`KvCache::host_span`] to the
    /// host store of every layer. Returns false, changing nothing, when the values do not
    /// fit this cache's shape, `take` is 0 or over `n`, or the cache is not on the host
    /// store.
    pub(crate) fn push_host_span(&mut self, n: usize, take: usize, kv: &[f32]) -> bool {
        let layers = self.host.len();
        if take == 0
            || take > n
            || layers == 0
            || !self.host_backed()
            || !kv.len().is_multiple_of(layers * 2 * n)
        {
            return false;
        }
        let width = kv.len() / (layers * 2 * n);
        if self.len > 0 && self.host[0].k.len() != self.len * width {
            return false;
        }
        for (layer, chunk) in self.host.iter_mut().zip(kv.chunks_exact(2 * n * width)) {
            let (k, v) = chunk.split_at(n * width);
            layer.k.extend_from_slice(&k[..take * width]);
            layer.v.extend_from_slice(&v[..take * width]);
        }
        self.len += take;
        true
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
