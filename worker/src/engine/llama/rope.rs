//! Rotary position embeddings, "rotate half" form.
//!
//! GGUF files written by llama.cpp's converter store `attn_q`/`attn_k` with the rows of
//! every head permuted so that rotation pairs are adjacent (`x[2i]`, `x[2i+1]`); the loader
//! undoes that permutation (see [`super::load::unpermute_rope_rows`]), so here the pairs are
//! `(x[i], x[i + d/2])` as in the Hugging Face implementation.

use burn_tensor::{backend::Backend, Tensor, TensorData};

/// Precomputed cosines and sines for every position up to the context length, on the
/// host; the burn path uploads the rows a step needs (a few KB) rather than keeping a
/// second copy of every position on the device.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    /// `[positions, head_dim / 2]`: `cos(p·θᵢ)`.
    cos_host: Vec<f32>,
    /// `[positions, head_dim / 2]`: `sin(p·θᵢ)`.
    sin_host: Vec<f32>,
    head_dim: usize,
    positions: usize,
    device: B::Device,
}

/// The frequencies of a model's rotations.
#[derive(Debug, Clone, Copy)]
pub struct RopeSpec<'a> {
    /// Width of one head (every dimension rotates).
    pub head_dim: usize,
    /// Base frequency `θ`: frequency `i` is `θ^(-2i/head_dim)`.
    pub base: f32,
    /// Positions are multiplied by this (linear RoPE scaling: `1 / factor`).
    pub scale: f32,
    /// Divisors of each frequency (`rope_freqs.weight`, `head_dim / 2` values): how
    /// Llama 3.1 and later files carry their "llama3" RoPE scaling.
    pub freq_factors: Option<&'a [f32]>,
}

impl<'a> RopeSpec<'a> {
    /// Plain RoPE: no scaling.
    pub fn plain(head_dim: usize, base: f32) -> Self {
        Self {
            head_dim,
            base,
            scale: 1.0,
            freq_factors: None,
        }
    }
}

impl<B: Backend> Rope<B> {
    /// Tables for `positions` positions: angle `p · scale · θ^(-2i/head_dim) / fᵢ`
    /// (llama.cpp's and transformers' definition).
    pub fn new(spec: RopeSpec<'_>, positions: usize, device: &B::Device) -> Self {
        let head_dim = spec.head_dim;
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = (spec.base as f64).powf(-(2.0 * i as f64) / head_dim as f64);
                match spec.freq_factors {
                    Some(factors) => f / factors[i] as f64,
                    None => f,
                }
            })
            .collect();
        let mut cos_host = Vec::with_capacity(positions * half);
        let mut sin_host = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv_freq {
                let angle = p as f64 * spec.scale as f64 * f;
                cos_host.push(angle.cos() as f32);
                sin_host.push(angle.sin() as f32);
            }
        }
        Self {
            cos_host,
            sin_host,
            head_dim,
            positions,
            device: device.clone(),
        }
    }

    /// `[len, head_dim]` rows of `table` for positions `start..start + len`, each half
    /// repeated, as a tensor.
    fn rows(&self, table: &[f32], start: usize, len: usize) -> Tensor<B, 3> {
        let half = self.head_dim / 2;
        let mut v = Vec::with_capacity(len * self.head_dim);
        for row in table[start * half..(start + len) * half].chunks_exact(half) {
            v.extend_from_slice(row);
            v.extend_from_slice(row);
        }
        Tensor::<B, 2>::from_data(TensorData::new(v, [len, self.head_dim]), &self.device)
            .unsqueeze_dim::<3>(1)
    }

    /// Rotates queries `q` and keys `k` (`[len, heads, head_dim]` each, their own head
    /// counts) holding positions `start..start + len`, with one upload of the rows.
    pub fn apply_pair(
        &self,
        q: Tensor<B, 3>,
        k: Tensor<B, 3>,
        start: usize,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let len = q.dims()[0];
        let cos = self.rows(&self.cos_host, start, len);
        let sin = self.rows(&self.sin_host, start, len);
        (
            self.rotate(q, cos.clone(), sin.clone()),
            self.rotate(k, cos, sin),
        )
    }

    /// `x · cos + rotate_half(x) · sin`, the tables `[len, 1, head_dim]`.
    fn rotate(&self, x: Tensor<B, 3>, cos: Tensor<B, 3>, sin: Tensor<B, 3>) -> Tensor<B, 3> {
        let d = x.dims()[2];
        debug_assert_eq!(d, self.head_dim);
        let half = d / 2;
        let x1 = x.clone().narrow(2, 0, half);
        let x2 = x.clone().narrow(2, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
        x * cos + rotated * sin
    }

    /// Rotates one head's `x` (`head_dim` values) in place for position `pos`, on the
    /// host: `(x[i], x[i + d/2]) ← (x[i]·cos − x[i + d/2]·sin, x[i + d/2]·cos + x[i]·sin)`,
    /// the same arithmetic as [`Rope::apply_pair`].
    pub(crate) fn apply_host(&self, x: &mut [f32], pos: usize) {
        let half = self.head_dim / 2;
        let cos = &self.cos_host[pos * half..(pos + 1) * half];
        let sin = &self.sin_host[pos * half..(pos + 1) * half];
        let (x1, x2) = x.split_at_mut(half);
        for (((a, b), c), s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
            let (u, v) = (*a, *b);
            *a = u * c - v * s;
            *b = v * c + u * s;
        }
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.positions
    }
}
