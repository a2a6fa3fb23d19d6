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

impl<B: Backend> Rope<B> {
    /// Tables for `positions` positions, `θᵢ = base^(-2i/head_dim)`.
    pub fn new(head_dim: usize, positions: usize, base: f32, device: &B::Device) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions * head_dim);
        let mut sin = Vec::with_capacity(positions * head_dim);
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| (base as f64).powf(-(2.0 * i as f64) / head_dim as f64))
            .collect();
        for p in 0..positions {
            for _ in 0..2 {
                for f in &inv_freq {
                    let angle = p as f64 * f;
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
