//! Rotary position embeddings, "rotate half" form.
//!
//! GGUF files written by llama.cpp's converter store `attn_q`/`attn_k` with the rows of
//! every head permuted so that rotation pairs are adjacent (`x[2i]`, `x[2i+1]`); the loader
//! undoes that permutation (see [`super::load::unpermute_rope_rows`]), so here the pairs are
//! `(x[i], x[i + d/2])` as in the Hugging Face implementation.

use burn_tensor::{backend::Backend, Tensor, TensorData};

/// Precomputed cosines and sines for every position up to the context length.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    /// `[positions, head_dim]`: `cos(p·θᵢ)` with each half repeated.
    cos: Tensor<B, 2>,
    /// `[positions, head_dim]`: `sin(p·θᵢ)` with each half repeated.
    sin: Tensor<B, 2>,
    /// `[positions, head_dim / 2]`: `cos(p·θᵢ)` on the host, for the host forward path.
    cos_host: Vec<f32>,
    /// `[positions, head_dim / 2]`: `sin(p·θᵢ)` on the host.
    sin_host: Vec<f32>,
    head_dim: usize,
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
        let mut cos = Vec::with_capacity(positions * head_dim);
        let mut sin = Vec::with_capacity(positions * head_dim);
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = (spec.base as f64).powf(-(2.0 * i as f64) / head_dim as f64);
                match spec.freq_factors {
                    Some(factors) => f / factors[i] as f64,
                    None => f,
                }
            })
            .collect();
        for p in 0..positions {
            for _ in 0..2 {
                for f in &inv_freq {
                    let angle = p as f64 * spec.scale as f64 * f;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        let cos_host: Vec<f32> = cos
            .chunks_exact(head_dim)
            .flat_map(|row| row[..half].iter().copied())
            .collect();
        let sin_host: Vec<f32> = sin
            .chunks_exact(head_dim)
            .flat_map(|row| row[..half].iter().copied())
            .collect();
        Self {
            cos_host,
            sin_host,
            cos: Tensor::from_data(TensorData::new(cos, [positions, head_dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [positions, head_dim]), device),
            head_dim,
        }
    }

    /// Rotates `x: [len, heads, head_dim]` holding positions `start..start + len`.
    pub fn apply(&self, x: Tensor<B, 3>, start: usize) -> Tensor<B, 3> {
        let [len, _, d] = x.dims();
        debug_assert_eq!(d, self.head_dim);
        let half = d / 2;
        let cos = self.cos.clone().narrow(0, start, len).unsqueeze_dim::<3>(1);
        let sin = self.sin.clone().narrow(0, start, len).unsqueeze_dim::<3>(1);
        let x1 = x.clone().narrow(2, 0, half);
        let x2 = x.clone().narrow(2, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
        x * cos + rotated * sin
    }

    /// Rotates one head's `x` (`head_dim` values) in place for position `pos`, on the
    /// host: `(x[i], x[i + d/2]) ← (x[i]·cos − x[i + d/2]·sin, x[i + d/2]·cos + x[i]·sin)`,
    /// the same arithmetic as [`Rope::apply`].
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
        self.cos.dims()[0]
    }
}
