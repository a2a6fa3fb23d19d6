//! Rotary position embeddings, "rotate half" form.
//!
//! GGUF files written by llama.cpp's converter store `attn_q`/`attn_k` with the rows of
//! every head permuted so that rotation pairs are adjacent (`x[2i]`, `x[2i+1]`); the loader
//! undoes that permutation (see [`super::load::unpermute_rope_rows`]), so here the pairs are
//! `(x[i], x[i + d/2])` as in the Hugging Face implementation. With partial rotary
//! embeddings (`rope.dimension_count` below the head size, Phi-3.5 / Phi-4) only the
//! first `dims` values of a head rotate, as pairs `(x[i], x[i + dims/2])`; the rest pass
//! through.

use burn_tensor::{backend::Backend, Tensor, TensorData};

/// Precomputed cosines and sines for every position up to the context length, on the
/// host: the host engine rotates with them in place.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `[positions, dims / 2]`: `m · cos(p·θᵢ)`.
    cos: Vec<f32>,
    /// `[positions, dims / 2]`: `m · sin(p·θᵢ)`.
    sin: Vec<f32>,
    head_dim: usize,
    /// Dimensions that rotate (the first of each head).
    dims: usize,
    positions: usize,
}

/// The rotations of the device engine: the host tables, of which a step uploads the rows
/// it needs (a few KB) rather than keeping a second copy of every position on the device.
#[derive(Debug, Clone)]
pub struct Rope<B: Backend> {
    tables: RopeTables,
    device: B::Device,
}

/// The frequencies of a model's rotations.
#[derive(Debug, Clone, Copy)]
pub struct RopeSpec<'a> {
    /// Width of one head.
    pub head_dim: usize,
    /// Dimensions that rotate, the first of each head (even, at most `head_dim`).
    pub dims: usize,
    /// Base frequency `θ`: frequency `i` is `θ^(-2i/dims)`.
    pub base: f32,
    /// Positions are multiplied by this (linear RoPE scaling: `1 / factor`).
    pub scale: f32,
    /// Divisors of each frequency (`dims / 2` values): how Llama 3.1 and later files
    /// carry their "llama3" RoPE scaling (`rope_freqs.weight`), and Phi-3's LongRoPE
    /// (`rope_factors_long.weight` or `_short`).
    pub freq_factors: Option<&'a [f32]>,
    /// Cosines and sines are multiplied by this (LongRoPE's attention factor, else 1).
    pub mscale: f32,
}

impl<'a> RopeSpec<'a> {
    /// Plain RoPE: no scaling.
    pub fn plain(head_dim: usize, base: f32) -> Self {
        Self {
            head_dim,
            dims: head_dim,
            base,
            scale: 1.0,
            freq_factors: None,
            mscale: 1.0,
        }
    }
}

impl RopeTables {
    /// Tables for `positions` positions: angle `p · scale · θ^(-2i/dims) / fᵢ`, cosine
    /// and sine times `mscale` (llama.cpp's and transformers' definition).
    pub fn new(spec: RopeSpec<'_>, positions: usize) -> Self {
        let (head_dim, dims) = (spec.head_dim, spec.dims);
        assert!(
            dims > 0 && dims.is_multiple_of(2) && dims <= head_dim,
            "rotary dimensions {dims} of a head of {head_dim}"
        );
        let half = dims / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = (spec.base as f64).powf(-(2.0 * i as f64) / dims as f64);
                match spec.freq_factors {
                    Some(factors) => f / factors[i] as f64,
                    None => f,
                }
            })
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv_freq {
                let angle = p as f64 * spec.scale as f64 * f;
                cos.push((angle.cos() * spec.mscale as f64) as f32);
                sin.push((angle.sin() * spec.mscale as f64) as f32);
            }
        }
        Self {
            cos,
            sin,
            head_dim,
            dims,
            positions,
        }
    }

    /// Rotates one head's `x` (`head_dim` values) in place for position `pos`:
    /// `(x[i], x[i + h]) ← (x[i]·cos − x[i + h]·sin, x[i + h]·cos + x[i]·sin)` for
    /// `h = dims / 2`, the same arithmetic as [`Rope::apply_pair`].
    pub(crate) fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.dims / 2;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        let (x1, x2) = x[..self.dims].split_at_mut(half);
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

impl<B: Backend> Rope<B> {
    /// Rotations with `tables`, uploaded to `device` a step's rows at a time.
    pub fn new(tables: RopeTables, device: &B::Device) -> Self {
        Self {
            tables,
            device: device.clone(),
        }
    }

    /// `[len, dims]` rows of `table` for positions `start..start + len`, each half
    /// repeated, as a tensor.
    fn rows(&self, table: &[f32], start: usize, len: usize) -> Tensor<B, 3> {
        let dims = self.tables.dims;
        let half = dims / 2;
        let mut v = Vec::with_capacity(len * dims);
        for row in table[start * half..(start + len) * half].chunks_exact(half) {
            v.extend_from_slice(row);
            v.extend_from_slice(row);
        }
        Tensor::<B, 2>::from_data(TensorData::new(v, [len, dims]), &self.device)
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
        let cos = self.rows(&self.tables.cos, start, len);
        let sin = self.rows(&self.tables.sin, start, len);
        (
            self.rotate(q, cos.clone(), sin.clone()),
            self.rotate(k, cos, sin),
        )
    }

    /// `x · cos + rotate_half(x) · sin` over the first `dims` values of each head, the
    /// rest as they are; the tables `[len, 1, dims]`.
    fn rotate(&self, x: Tensor<B, 3>, cos: Tensor<B, 3>, sin: Tensor<B, 3>) -> Tensor<B, 3> {
        let d = x.dims()[2];
        debug_assert_eq!(d, self.tables.head_dim);
        let (dims, half) = (self.tables.dims, self.tables.dims / 2);
        let rot = if dims == d {
            x.clone()
        } else {
            x.clone().narrow(2, 0, dims)
        };
        let x1 = rot.clone().narrow(2, 0, half);
        let x2 = rot.clone().narrow(2, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
        let out = rot * cos + rotated * sin;
        if dims == d {
            out
        } else {
            Tensor::cat(vec![out, x.narrow(2, dims, d - dims)], 2)
        }
    }

    /// Positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.tables.positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend as B;

    /// Partial rotation with frequency divisors and a scale: the first `dims` values
    /// turn as the definition says (on the host and the burn path alike), the rest
    /// pass through untouched.
    #[test]
    fn a_partial_rotation_turns_the_first_dims_scaled() {
        let (head_dim, dims, base, mscale) = (8, 6, 100.0f32, 1.5f32);
        let factors = [1.0f32, 2.0, 4.0];
        let spec = RopeSpec {
            head_dim,
            dims,
            base,
            scale: 1.0,
            freq_factors: Some(&factors),
            mscale,
        };
        let device = Default::default();
        let tables = RopeTables::new(spec, 16);
        let rope = Rope::<B>::new(tables.clone(), &device);
        let x: Vec<f32> = (0..head_dim).map(|i| 0.1 * i as f32 + 0.3).collect();
        let pos = 5;
        let mut host = x.clone();
        tables.apply(&mut host, pos);
        let half = dims / 2;
        for i in 0..half {
            let angle = pos as f64 * (base as f64).powf(-(2.0 * i as f64) / dims as f64)
                / factors[i] as f64;
            let c = (angle.cos() * mscale as f64) as f32;
            let s = (angle.sin() * mscale as f64) as f32;
            assert!((host[i] - (x[i] * c - x[i + half] * s)).abs() < 1e-6, "{i}");
            assert!(
                (host[i + half] - (x[i + half] * c + x[i] * s)).abs() < 1e-6,
                "{i}"
            );
        }
        assert_eq!(&host[dims..], &x[dims..], "past the rotary dims");
        let t = Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [1, 1, head_dim]), &device);
        let (q, k) = rope.apply_pair(t.clone(), t, pos);
        for out in [q, k] {
            let burn: Vec<f32> = out.into_data().to_vec().expect("f32");
            for (a, b) in burn.iter().zip(&host) {
                assert!((a - b).abs() < 1e-6, "burn {burn:?} host {host:?}");
            }
        }
    }
}
