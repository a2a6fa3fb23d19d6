//! The forward pass on host memory, for weights kept in block form (`native`).
//!
//! Every matrix is a [`QMatrix`] multiplied on the host, so activations never need to be
//! burn tensors: the residual stream, norms, RoPE, attention and the SwiGLU product run
//! as plain f32 loops over host vectors, and keys and values are appended in place to the
//! host store of each sequence's [`KvCache`]. Only the logits become a tensor.

use burn_tensor::backend::Backend;

use crate::engine::sampler::{first_max, merge_first_max};

use super::{
    attention::SeqSpan,
    cache::{KvCache, KvDtype, KvElem},
    config::Activation,
    linear::Linear,
    model::{Embedding, Llama},
    qmatrix::{Prepared, QMatrix},
    team::{Counters, Latch, Shared, SpinBarrier},
};

/// One block's weights, all in block form.
pub(crate) struct HostBlock<'a> {
    attn_norm: &'a [f32],
    qkv: &'a QMatrix,
    /// Added to the QKV outputs (in their order), when the model has biases.
    qkv_bias: Option<&'a [f32]>,
    /// Per-head RMSNorm weights of queries and keys, when the model has them.
    q_norm: Option<&'a [f32]>,
    k_norm: Option<&'a [f32]>,
    /// Norms of the attention's and the feed-forward block's outputs (Gemma 3).
    post_attn_norm: Option<&'a [f32]>,
    post_ffn_norm: Option<&'a [f32]>,
    out: &'a QMatrix,
    ffn_norm: &'a [f32],
    gate_up: &'a QMatrix,
    down: &'a QMatrix,
}

/// The whole network's weights, when every matrix is in block form.
pub(crate) struct HostWeights<'a> {
    embed: &'a QMatrix,
    lm_head: &'a QMatrix,
    blocks: Vec<HostBlock<'a>>,
    norm: &'a [f32],
}

impl HostWeights<'_> {
    /// Every matrix, the embedding first.
    pub(crate) fn matrices(&self) -> impl Iterator<Item = &QMatrix> + '_ {
        [self.embed, self.lm_head].into_iter().chain(
            self.blocks
                .iter()
                .flat_map(|b| [b.qkv, b.out, b.gate_up, b.down]),
        )
    }
}

fn quant<B: Backend>(l: &Linear<B>) -> Option<&QMatrix> {
    match l {
        Linear::Quant { matrix, .. } => Some(matrix),
        Linear::Dense { .. } => None,
    }
}

/// Sum of `a[i]·b[i]`, in eight lanes (vectorised by the compiler); `b` may be keys
/// kept as f16, widened as they are read.
#[inline]
fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i].to_f32();
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y.to_f32();
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y ← y + a·x`, `x` widened as it is read.
#[inline]
fn axpy<E: KvElem>(y: &mut [f32], a: f32, x: &[E]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x.to_f32();
    }
}

/// RMSNorm of every `hidden`-wide row of `x` into `out`, scaled by `w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = w.len();
    for (xr, or) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let mean = dot(xr, xr) / hidden as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// One query head (`q`, `d` wide) against the first `keys` positions of one KV head:
/// `k` and `v` hold position-major rows `stride` wide, the head at offset `off`.
/// `scores` is scratch of at least `keys` values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_head<E: KvElem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    keys: usize,
    stride: usize,
    off: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    let scores = &mut scores[..keys];
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate() {
        *s = dot(q, &k[t * stride + off..t * stride + off + d]) * scale;
        max = max.max(*s);
    }
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (t, &p) in scores.iter().enumerate() {
        axpy(out, p, &v[t * stride + off..t * stride + off + d]);
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// Attention for one row of the query heads `q` (`n · d` values: `n` heads, all on
/// the KV head at offset `off`) against its first `keys` positions, into `out` (`n · d`).
/// `scores` is scratch of at least `n · keys` values.
///
/// With AVX2 and FMA (checked at run time) each key and value row is read once for all
/// `n` heads, and the products run on 256-bit vectors with FMAs; elsewhere each head
/// runs [`attend_head`]. The two agree to rounding, not bitwise (as the integer product
/// kernels and the portable loop).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_heads<E: KvElem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    keys: usize,
    stride: usize,
    off: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let n = q.len() / d.max(1);
    assert!(
        d > 0
            && q.len() == n * d
            && out.len() == n * d
            && scores.len() >= n * keys
            && keys > 0
            && k.len() >= (keys - 1) * stride + off + d
            && v.len() >= (keys - 1) * stride + off + d,
        "attention shapes disagree"
    );
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(8)
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
    {
        let wide = d.is_multiple_of(16) && std::is_x86_feature_detected!("avx512f");
        // At most `MAX_HEADS` heads a call (their sums stay on the stack).
        for (qh, oh) in q.chunks(MAX_HEADS * d).zip(out.chunks_mut(MAX_HEADS * d)) {
            // SAFETY: AVX2 and FMA (and AVX-512 F for `wide`) were detected just above;
            // the shapes checked above keep every read and write in bounds.
            unsafe {
                if wide {
                    attend_heads_avx512(qh, k, v, keys, stride, off, d, scale, scores, oh)
                } else {
                    attend_heads_avx2(qh, k, v, keys, stride, off, d, scale, scores, oh)
                }
            };
        }
        return;
    }
    for (qh, oh) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        attend_head(qh, k, v, keys, stride, off, scale, scores, oh);
    }
}

/// Softmax weights of `n` rows of `keys` scores each, in place and unnormalised; returns
/// each row's reciprocal sum.
///
/// e^x is [`exp_avx2`], eight scores at a time (a row's last few through a padded
/// vector), summed in eight lanes and then the row's last few in order. Against the
/// library's e^x one score at a time, the default model's logits stay as close to the
/// reference (largest difference 6.7e-5 against 6.8e-5, 5e-3 allowed; an earlier state
/// of the forward pass, further from the reference, had moved past the tolerance).
///
/// # Safety
/// Needs AVX2 and FMA; `scores` at least `n · keys` long, `n` at most [`MAX_HEADS`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_rows(scores: &mut [f32], n: usize, keys: usize) -> [f32; MAX_HEADS] {
    use std::arch::x86_64::*;
    let mut inv = [0.0f32; MAX_HEADS];
    for h in 0..n {
        let row = &mut scores[h * keys..(h + 1) * keys];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let top = _mm256_set1_ps(max);
        // SAFETY: every load and store is of eight floats inside a chunk or `pad`.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            let mut chunks = row.chunks_exact_mut(8);
            for c in &mut chunks {
                let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), top));
                _mm256_storeu_ps(c.as_mut_ptr(), e);
                acc = _mm256_add_ps(acc, e);
            }
            let mut sum = hsum8(acc);
            let tail = chunks.into_remainder();
            if !tail.is_empty() {
                let mut pad = [max; 8];
                pad[..tail.len()].copy_from_slice(tail);
                let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(pad.as_ptr()), top));
                _mm256_storeu_ps(pad.as_mut_ptr(), e);
                tail.copy_from_slice(&pad[..tail.len()]);
                for &t in tail.iter() {
                    sum += t;
                }
            }
            inv[h] = 1.0 / sum;
        }
    }
    inv
}

/// The sum of eight lanes: the halves added (`a_j + a_j+4`), then lanes 0 + 2 and 1 + 3,
/// then those two. [`attend_heads_avx512`] reduces four sums at once in this order.
///
/// # Safety
/// Needs AVX.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
unsafe fn hsum8(x: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// Eight keys or values from `p`, as f32 (f16 ones widened, exactly).
///
/// # Safety
/// Needs AVX2 and F16C; eight elements readable at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<E: KvElem>(p: *const E) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: eight elements at `p` by the caller's contract.
    unsafe {
        if E::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        } else {
            _mm256_loadu_ps(p.cast())
        }
    }
}

/// Sixteen keys or values from `p`, as f32 (f16 ones widened, exactly).
///
/// # Safety
/// Needs AVX-512 F; sixteen elements readable at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn load16<E: KvElem>(p: *const E) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: sixteen elements at `p` by the caller's contract.
    unsafe {
        if E::HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        } else {
            _mm512_loadu_ps(p.cast())
        }
    }
}

/// Query heads a call of [`attend_heads_avx2`] takes.
#[cfg(target_arch = "x86_64")]
const MAX_HEADS: usize = 16;

/// [`attend_heads`] on 256-bit vectors.
///
/// # Safety
/// Needs AVX2 and FMA; the shapes as [`attend_heads`] checks them, `d` a multiple of 8,
/// at most [`MAX_HEADS`] heads.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_heads_avx2<E: KvElem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    keys: usize,
    stride: usize,
    off: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n = q.len() / d;
    debug_assert!(n <= MAX_HEADS);
    let chunks = d / 8;
    // SAFETY (all pointer reads and writes): the caller's shapes put key and value rows
    // `t < keys` at `t · stride + off .. + d` inside `k` and `v`, head `h < n` at
    // `h · d .. + d` inside `q` and `out`, and `h · keys + t` inside `scores`.
    unsafe {
        // Scores, four keys at a time (four independent chains of FMAs).
        for h in 0..n {
            let qp = q.as_ptr().add(h * d);
            let mut t = 0;
            while t < keys {
                let take = (keys - t).min(4);
                let mut acc = [_mm256_setzero_ps(); 4];
                for c in 0..chunks {
                    let qc = _mm256_loadu_ps(qp.add(8 * c));
                    for (i, a) in acc.iter_mut().enumerate().take(take) {
                        let kp = k.as_ptr().add((t + i) * stride + off + 8 * c);
                        *a = _mm256_fmadd_ps(qc, load8(kp), *a);
                    }
                }
                for (i, a) in acc.iter().enumerate().take(take) {
                    *scores.get_unchecked_mut(h * keys + t + i) = hsum8(*a) * scale;
                }
                t += take;
            }
        }
        // Softmax weights, unnormalised; each head's sum.
        let inv = softmax_rows(scores, n, keys);
        // Weighted values: each value row once for every head, eight values at a time,
        // even and odd keys in separate accumulators (two chains of FMAs a head).
        for c in 0..chunks {
            let mut h0 = 0;
            while h0 < n {
                let hn = (n - h0).min(4);
                let mut even = [_mm256_setzero_ps(); 4];
                let mut odd = [_mm256_setzero_ps(); 4];
                let value = |t: usize| load8(v.as_ptr().add(t * stride + off + 8 * c));
                let weight =
                    |h: usize, t: usize| _mm256_set1_ps(*scores.get_unchecked(h * keys + t));
                let mut t = 0;
                while t + 2 <= keys {
                    let (v0, v1) = (value(t), value(t + 1));
                    for i in 0..hn {
                        even[i] = _mm256_fmadd_ps(weight(h0 + i, t), v0, even[i]);
                        odd[i] = _mm256_fmadd_ps(weight(h0 + i, t + 1), v1, odd[i]);
                    }
                    t += 2;
                }
                if t < keys {
                    let v0 = value(t);
                    for i in 0..hn {
                        even[i] = _mm256_fmadd_ps(weight(h0 + i, t), v0, even[i]);
                    }
                }
                for i in 0..hn {
                    let h = h0 + i;
                    _mm256_storeu_ps(
                        out.as_mut_ptr().add(h * d + 8 * c),
                        _mm256_mul_ps(_mm256_add_ps(even[i], odd[i]), _mm256_set1_ps(inv[h])),
                    );
                }
                h0 += hn;
            }
        }
    }
}

/// [`attend_heads_avx2`] with fewer instructions, bit for bit the same results: every
/// sum is the same chain of the same operations, only the work around it differs.
///
/// - Scores: four keys against up to three heads at a time, so each key row is loaded
///   once for all of them, and each head's four sums are reduced together (the same
///   additions as one sum's reduction, on transposed lanes) instead of one by one.
/// - Weighted values: 512-bit vectors over 32 values of up to three heads at a time,
///   each weight broadcast once per key instead of once per 8 values; each output value
///   keeps its two chains (even and odd keys) in the same order, and lanes are
///   independent, so the vector width does not change them.
///
/// # Safety
/// Needs AVX-512 F, AVX2 and FMA; the shapes as [`attend_heads`] checks them, `d` a
/// multiple of 16, at most [`MAX_HEADS`] heads.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_heads_avx512<E: KvElem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    keys: usize,
    stride: usize,
    off: usize,
    d: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    /// Heads a pass takes.
    const HEADS: usize = 3;
    let n = q.len() / d;
    debug_assert!(n <= MAX_HEADS && d.is_multiple_of(16));
    let chunks = d / 8;
    // SAFETY (all pointer reads and writes): as in `attend_heads_avx2`: key and value
    // rows `t < keys` at `t · stride + off .. + d` inside `k` and `v`, head `h < n` at
    // `h · d .. + d` inside `q` and `out`, and `h · keys + t` inside `scores`.
    unsafe {
        let sc = _mm256_set1_ps(scale);
        let mut h0 = 0;
        while h0 < n {
            let hn = (n - h0).min(HEADS);
            let mut t = 0;
            while t + 4 <= keys {
                let mut acc = [[_mm256_setzero_ps(); 4]; HEADS];
                for c in 0..chunks {
                    let kc =
                        [0, 1, 2, 3].map(|i| load8(k.as_ptr().add((t + i) * stride + off + 8 * c)));
                    for h in 0..hn {
                        let qc = _mm256_loadu_ps(q.as_ptr().add((h0 + h) * d + 8 * c));
                        for i in 0..4 {
                            acc[h][i] = _mm256_fmadd_ps(qc, kc[i], acc[h][i]);
                        }
                    }
                }
                for h in 0..hn {
                    let [a, b, c, e] = acc[h];
                    // Halves: (a_lo + a_hi, b_lo + b_hi) and (c…, e…).
                    let ab = _mm256_add_ps(
                        _mm256_permute2f128_ps::<0x20>(a, b),
                        _mm256_permute2f128_ps::<0x31>(a, b),
                    );
                    let ce = _mm256_add_ps(
                        _mm256_permute2f128_ps::<0x20>(c, e),
                        _mm256_permute2f128_ps::<0x31>(c, e),
                    );
                    // Lanes 0+2 and 1+3 of each: (a, a, c, c | b, b, e, e).
                    let y = _mm256_add_ps(
                        _mm256_shuffle_ps::<0b01_00_01_00>(ab, ce),
                        _mm256_shuffle_ps::<0b11_10_11_10>(ab, ce),
                    );
                    // Those two: (a, c, a, c | b, e, b, e).
                    let r = _mm256_mul_ps(_mm256_hadd_ps(y, y), sc);
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), r);
                    let row = scores.as_mut_ptr().add((h0 + h) * keys + t);
                    *row = lanes[0];
                    *row.add(1) = lanes[4];
                    *row.add(2) = lanes[1];
                    *row.add(3) = lanes[5];
                }
                t += 4;
            }
            for t in t..keys {
                for h in 0..hn {
                    let mut a = _mm256_setzero_ps();
                    for c in 0..chunks {
                        let kp = k.as_ptr().add(t * stride + off + 8 * c);
                        let qc = _mm256_loadu_ps(q.as_ptr().add((h0 + h) * d + 8 * c));
                        a = _mm256_fmadd_ps(qc, load8(kp), a);
                    }
                    *scores.get_unchecked_mut((h0 + h) * keys + t) = hsum8(a) * scale;
                }
            }
            h0 += hn;
        }
        // Softmax weights, unnormalised; each head's sum (as `attend_heads_avx2`).
        let inv = softmax_rows(scores, n, keys);
        // Weighted values, 32 values (two vectors) of up to three heads at a time, then
        // 16 where `d` leaves them.
        let mut c0 = 0;
        while c0 < d {
            let wide = d - c0 >= 32;
            let mut h0 = 0;
            while h0 < n {
                let hn = (n - h0).min(HEADS);
                if wide {
                    weigh_values::<E, 2>(
                        scores,
                        v,
                        keys,
                        stride,
                        off + c0,
                        h0,
                        hn,
                        &inv,
                        out,
                        d,
                        c0,
                    );
                } else {
                    weigh_values::<E, 1>(
                        scores,
                        v,
                        keys,
                        stride,
                        off + c0,
                        h0,
                        hn,
                        &inv,
                        out,
                        d,
                        c0,
                    );
                }
                h0 += hn;
            }
            c0 += if wide { 32 } else { 16 };
        }
    }

    /// `out[h][c0 .. c0 + 16W] = Σ_t w(h, t) · v[t][c0 ..]` for heads `h0 .. h0 + hn`
    /// (`hn` ≤ 3), even and odd keys in separate chains, then `· inv[h]`.
    ///
    /// # Safety
    /// As [`attend_heads_avx512`]; `at` is the value rows' offset of column `c0`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn weigh_values<E: KvElem, const W: usize>(
        scores: &[f32],
        v: &[E],
        keys: usize,
        stride: usize,
        at: usize,
        h0: usize,
        hn: usize,
        inv: &[f32; MAX_HEADS],
        out: &mut [f32],
        d: usize,
        c0: usize,
    ) {
        // SAFETY: the caller's shapes (see `attend_heads_avx512`).
        unsafe {
            let mut even = [[_mm512_setzero_ps(); W]; HEADS];
            let mut odd = [[_mm512_setzero_ps(); W]; HEADS];
            let value = |t: usize, w: usize| load16(v.as_ptr().add(t * stride + at + 16 * w));
            let weight = |h: usize, t: usize| _mm512_set1_ps(*scores.get_unchecked(h * keys + t));
            let mut t = 0;
            while t + 2 <= keys {
                let mut v0 = [_mm512_setzero_ps(); W];
                let mut v1 = v0;
                for w in 0..W {
                    v0[w] = value(t, w);
                    v1[w] = value(t + 1, w);
                }
                for i in 0..hn {
                    let (w0, w1) = (weight(h0 + i, t), weight(h0 + i, t + 1));
                    for w in 0..W {
                        even[i][w] = _mm512_fmadd_ps(w0, v0[w], even[i][w]);
                        odd[i][w] = _mm512_fmadd_ps(w1, v1[w], odd[i][w]);
                    }
                }
                t += 2;
            }
            if t < keys {
                for i in 0..hn {
                    let w0 = weight(h0 + i, t);
                    for w in 0..W {
                        even[i][w] = _mm512_fmadd_ps(w0, value(t, w), even[i][w]);
                    }
                }
            }
            for i in 0..hn {
                let h = h0 + i;
                let scale = _mm512_set1_ps(inv[h]);
                for w in 0..W {
                    _mm512_storeu_ps(
                        out.as_mut_ptr().add(h * d + c0 + 16 * w),
                        _mm512_mul_ps(_mm512_add_ps(even[i][w], odd[i][w]), scale),
                    );
                }
            }
        }
    }
}

/// `g ← gelu_tanh(g) · u`, elementwise (GeGLU). GELU's tanh approximation,
/// `0.5·x·(1 + tanh(z))` with `z = √(2/π)·(x + 0.044715·x³)`, is `x / (1 + e^(−2z))`:
/// the sigmoid form, computed as [`swiglu`] computes its own.
pub(crate) fn geglu(g: &mut [f32], u: &[f32]) {
    gated::<true>(g, u);
}

/// `g ← silu(g) · u = g / (1 + e^−g) · u`, elementwise.
pub(crate) fn swiglu(g: &mut [f32], u: &[f32]) {
    gated::<false>(g, u);
}

/// √(2/π), GELU's tanh approximation's scale.
const GELU_K: f32 = 0.797_884_6;
/// GELU's tanh approximation's cubic coefficient.
const GELU_C: f32 = 0.044_715;

/// `g ← g / (1 + e^(−a)) · u` with `a = g` (SiLU) or `a = 2z` (GELU, `GELU`). With AVX2
/// and FMA (checked at run time) `e^x` is [`exp_avx2`] on eight values at a time
/// (within 2 ulp of the library's); elsewhere the library's.
fn gated<const GELU: bool>(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "gated halves disagree");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        /// # Safety
        /// Needs AVX2 and FMA; `g` and `u` of one length.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide<const GELU: bool>(g: &mut [f32], u: &[f32]) {
            use std::arch::x86_64::*;
            /// Eight values in place.
            ///
            /// # Safety
            /// Needs AVX2 and FMA; `g` and `u` at least eight long.
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn eight<const GELU: bool>(g: &mut [f32], u: &[f32]) {
                // SAFETY: eight values each, by the contract.
                unsafe {
                    let gv = _mm256_loadu_ps(g.as_ptr());
                    let a = if GELU {
                        // 2z = 2k·(x + c·x³) = x·(2k + 2kc·x²)
                        let x2 = _mm256_mul_ps(gv, gv);
                        let s = _mm256_fmadd_ps(
                            x2,
                            _mm256_set1_ps(2.0 * GELU_K * GELU_C),
                            _mm256_set1_ps(2.0 * GELU_K),
                        );
                        _mm256_mul_ps(gv, s)
                    } else {
                        gv
                    };
                    let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), a));
                    let y = _mm256_mul_ps(
                        _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e)),
                        _mm256_loadu_ps(u.as_ptr()),
                    );
                    _mm256_storeu_ps(g.as_mut_ptr(), y);
                }
            }
            let mut gc = g.chunks_exact_mut(8);
            for (g, u) in (&mut gc).zip(u.chunks_exact(8)) {
                // SAFETY: AVX2 and FMA by this function's contract; eight values each.
                unsafe { eight::<GELU>(g, u) };
            }
            let g = gc.into_remainder();
            if !g.is_empty() {
                // The tail through a padded copy.
                let n = g.len();
                let (mut gl, mut ul) = ([0.0f32; 8], [0.0f32; 8]);
                gl[..n].copy_from_slice(g);
                ul[..n].copy_from_slice(&u[u.len() - n..]);
                // SAFETY: as above.
                unsafe { eight::<GELU>(&mut gl, &ul) };
                g.copy_from_slice(&gl[..n]);
            }
        }
        // SAFETY: AVX2 and FMA were detected just above; lengths checked above.
        unsafe { wide::<GELU>(g, u) };
        return;
    }
    for (g, u) in g.iter_mut().zip(u) {
        let x = *g;
        let a = if GELU {
            x * (2.0 * GELU_K + 2.0 * GELU_K * GELU_C * x * x)
        } else {
            x
        };
        *g = x / (1.0 + (-a).exp()) * u;
    }
}

/// `e^x` in each lane: `2^n · p(r)` with `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, and a
/// degree-6 polynomial `p` (Cephes' `expf`), within 2 ulp of the exact value. Inputs
/// are clamped to `[−87.3, 88]`, where the result is a normal float: below, the result
/// is ~1.2e−38 instead of smaller (or 0); above, ~1.65e38 instead of larger (or ∞).
/// NaN stays NaN.
///
/// # Safety
/// Needs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.0),
    );
    // n = round(x · log2 e), by floor(x · log2 e + 1/2).
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    // r = x − n · ln 2, with ln 2 in two parts for the precision.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    // 2^n from the exponent bits (n in −126..=127 after the clamp).
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(p, two_n)
}

impl<B: Backend> Llama<B> {
    /// The weights as block matrices and host vectors, when every matrix is in block
    /// form; `None` sends the forward pass down the burn path.
    pub(crate) fn host_weights(&self) -> Option<HostWeights<'_>> {
        let embed = match &self.embed {
            Embedding::Quant(q) => &**q,
            Embedding::Dense(_) => return None,
        };
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Some(HostBlock {
                    attn_norm: &b.attn_norm.host,
                    qkv: quant(&b.attn.qkv)?,
                    qkv_bias: b.attn.qkv_bias.as_ref().map(|b| b.host.as_slice()),
                    q_norm: b.attn.q_norm.as_ref().map(|n| n.host.as_slice()),
                    k_norm: b.attn.k_norm.as_ref().map(|n| n.host.as_slice()),
                    post_attn_norm: b.post_attn_norm.as_ref().map(|n| n.host.as_slice()),
                    post_ffn_norm: b.post_ffn_norm.as_ref().map(|n| n.host.as_slice()),
                    out: quant(&b.attn.out)?,
                    ffn_norm: &b.ffn_norm.host,
                    gate_up: quant(&b.mlp.gate_up)?,
                    down: quant(&b.mlp.down)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(HostWeights {
            embed,
            lm_head: quant(&self.lm_head)?,
            blocks,
            norm: &self.norm.host,
        })
    }

    /// The forward pass of [`Llama::forward`] on the host; inputs already checked.
    ///
    /// A step of generated tokens only, at least [`SPLIT_ROWS`] of them for every thread
    /// of the rayon pool, is split by sequence: each thread runs the whole network for
    /// its share of the sequences alone, with no barrier between phases (each weight is
    /// then read once a thread instead of once a step, which at that many rows costs
    /// less than the threads waiting for each other five times a layer). Any other step
    /// runs as one parallel region over the pool ([`Llama::forward_rows`]). A row's
    /// arithmetic is the same either way, so its results are too.
    ///
    /// In a split step a thread that is through its layers goes straight on to the
    /// output projection of its own sequences, in chunks of vocabulary rows, then takes
    /// the chunks left of the other threads' sequences once theirs are through: the
    /// threads rarely end their layers together (the machine slows one or the other),
    /// and the projection, a fifth of a step's multiply-adds, fills the wait.
    pub(crate) fn forward_host(
        &self,
        w: &HostWeights<'_>,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut KvCache<B>],
    ) -> HostLogits {
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
        let mut rest: &mut [&mut KvCache<B>] = caches;
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
        let eps = self.norm.eps;
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
    /// [`Llama::output`]; and which of those rows are generated tokens.
    ///
    /// Per layer:
    /// each thread normalises the residual stream into its own buffer; the QKV product,
    /// RoPE and the cache writes; attention, one (row, head) at a time; the output
    /// product, added to the residual; the gate/up product with SwiGLU; the down
    /// product, added to the residual. Threads take chunks of output rows of each phase
    /// from a counter and meet at a barrier after it: five barriers a layer.
    fn forward_rows_any(
        &self,
        w: &HostWeights<'_>,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut KvCache<B>],
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

    /// [`Llama::forward_rows_any`] for caches whose host store holds `E` (all of them:
    /// the model makes every cache with its own KV dtype).
    fn forward_rows<E: KvElem>(
        &self,
        w: &HostWeights<'_>,
        ids: &[i32],
        spans: &[SeqSpan],
        caches: &mut [&mut KvCache<B>],
        pool: bool,
        with_output: bool,
    ) -> RowsOut {
        let c = &self.config;
        let (hidden, heads, kvh, d, ffn) = (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn);
        let (qd, kvd) = (heads * d, kvh * d);
        let width = qd + 2 * kvd;
        let group = heads / kvh;
        let scale = c.attn_scale;
        let eps = self.norm.eps;
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
                .host_layers::<E>()
                .expect("every cache of a step in one KV dtype")
            {
                kv.grow((span.pos + span.len) * kvd, expected);
            }
        }
        let kv: Vec<(Shared<'_, E>, Shared<'_, E>)> = caches
            .iter_mut()
            .flat_map(|c| c.host_layers::<E>().expect("checked above").iter_mut())
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
                let (rope, window) = self.layer_rope(layer);
                // SAFETY (all `Shared` accesses below): each phase writes only the
                // elements of the chunks or items this thread claimed from the phase's
                // counter, which no other thread touches in that phase, and reads only
                // what earlier phases wrote, after the barrier that ended them.
                rms_norm(
                    unsafe { xs.get(0..rows * hidden) },
                    b.attn_norm,
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
                    let bias = b.qkv_bias.map(|bias| &bias[r0..r1]);
                    let norm = match r0 {
                        r if r < qd => b.q_norm,
                        r if r < qd + kvd => b.k_norm,
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
                            rope.apply_host(head, pos);
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
                if let Some(norm) = b.post_attn_norm {
                    add_normed_rows(&counters, phase, (&os, &xs), norm, eps, &mut h);
                    phase += 1;
                    barrier.wait();
                }

                rms_norm(unsafe { xs.get(0..rows * hidden) }, b.ffn_norm, eps, &mut h);
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
                if let Some(norm) = b.post_ffn_norm {
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

/// One thread's share of a step split by sequence ([`Llama::forward_host`]): its
/// tokens and spans (rows counted from its first), its sequences' caches (taken by the
/// thread that runs it), its rows of the logits, and the last hidden row of each of its
/// sequences with which rows are generated tokens, once its layers are through; its
/// rows of the chunk maxima.
struct SplitPart<'a, 'c, B: Backend> {
    ids: &'a [i32],
    spans: Vec<SeqSpan>,
    caches: std::sync::Mutex<Option<&'a mut [&'c mut KvCache<B>]>>,
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
    w: &HostWeights<'_>,
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
    rms_norm(last, w.norm, eps, h);
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

/// What [`Llama::forward_rows_any`] gives: the logits (with the output projection) or
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
/// [`Llama::forward_host`]): below this the weights read again by every thread cost more
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

/// `dst: [n, r]` from `src: [r, n]` (resized to fit). The products leave one row per
/// weight row; the rest of the step wants one row per input row. With AVX (checked at
/// run time) eight by eight values at a time, through registers.
pub(crate) fn transpose(src: &[f32], r: usize, n: usize, dst: &mut Vec<f32>) {
    assert_eq!(src.len(), r * n, "transposed shapes disagree");
    dst.resize(r * n, 0.0);
    if n == 1 || r == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let (mut i0, mut j0) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") && r >= 8 && n >= 8 {
        // SAFETY: AVX was detected just above; the blocks stay inside both buffers.
        unsafe { transpose_avx(src, r, n, dst) };
        (i0, j0) = (r / 8 * 8, n / 8 * 8);
    }
    // What the blocks of eight left: the last rows of `src` for every column, and the
    // last columns for the rows the blocks took.
    for i in 0..r {
        let from = if i < i0 { j0 } else { 0 };
        for j in from..n {
            dst[j * r + i] = src[i * n + j];
        }
    }
}

/// [`transpose`] of the whole 8 × 8 blocks.
///
/// # Safety
/// Needs AVX; `src` and `dst` at least `r · n` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_avx(src: &[f32], r: usize, n: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY: rows i..i + 8 < r and columns j..j + 8 < n of `src`, and the same
    // transposed in `dst`, are inside both buffers.
    unsafe {
        for i in (0..r / 8 * 8).step_by(8) {
            for j in (0..n / 8 * 8).step_by(8) {
                let v: [__m256; 8] =
                    std::array::from_fn(|k| _mm256_loadu_ps(src.as_ptr().add((i + k) * n + j)));
                let t0 = _mm256_unpacklo_ps(v[0], v[1]);
                let t1 = _mm256_unpackhi_ps(v[0], v[1]);
                let t2 = _mm256_unpacklo_ps(v[2], v[3]);
                let t3 = _mm256_unpackhi_ps(v[2], v[3]);
                let t4 = _mm256_unpacklo_ps(v[4], v[5]);
                let t5 = _mm256_unpackhi_ps(v[4], v[5]);
                let t6 = _mm256_unpacklo_ps(v[6], v[7]);
                let t7 = _mm256_unpackhi_ps(v[6], v[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let out = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (k, o) in out.iter().enumerate() {
                    _mm256_storeu_ps(dst.as_mut_ptr().add((j + k) * r + i), *o);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        load::load_llama,
        model::SeqInput,
        synthetic::{write_synthetic_llama, SyntheticSpec},
        WeightDtype,
    };
    use super::*;
    use crate::{
        backend::CpuBackend as B,
        engine::gguf::{GgmlType, GgufFile},
    };

    /// The AVX-512 attention gives the AVX2 one's bits: heads in and across its groups
    /// of three, every key count around its blocks of four, head sizes that take the
    /// 32-value and 16-value passes, strided and offset key rows; with f32 keys and
    /// values and with f16 ones.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_attention_gives_the_avx2_bits() {
        if !(std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c"))
        {
            eprintln!("skipping: no AVX-512 F here");
            return;
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 6.0 - 3.0
        };
        let mut checked = 0;
        for d in [16, 32, 48, 64, 128] {
            for n in [1, 2, 3, 4, 5, 7, 9] {
                for keys in [1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 67] {
                    let (kvh, head) = (3, 1);
                    let stride = kvh * d;
                    let off = head * d;
                    let q: Vec<f32> = (0..n * d).map(|_| next()).collect();
                    let k: Vec<f32> = (0..keys * stride).map(|_| next()).collect();
                    let v: Vec<f32> = (0..keys * stride).map(|_| next()).collect();
                    let scale = 1.0 / (d as f32).sqrt();
                    let (mut s2, mut s5) = (vec![0.0; n * keys], vec![0.0; n * keys]);
                    let (mut o2, mut o5) = (vec![0.0; n * d], vec![0.0; n * d]);
                    // SAFETY: the features were detected above; the shapes fit.
                    unsafe {
                        attend_heads_avx2(
                            &q, &k, &v, keys, stride, off, d, scale, &mut s2, &mut o2,
                        );
                        attend_heads_avx512(
                            &q, &k, &v, keys, stride, off, d, scale, &mut s5, &mut o5,
                        );
                    }
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&s5),
                        bits(&s2),
                        "weights: d {d}, {n} heads, {keys} keys"
                    );
                    assert_eq!(
                        bits(&o5),
                        bits(&o2),
                        "outputs: d {d}, {n} heads, {keys} keys"
                    );
                    let half = |x: &[f32]| {
                        x.iter()
                            .map(|&f| half::f16::from_f32(f))
                            .collect::<Vec<_>>()
                    };
                    let (k16, v16) = (half(&k), half(&v));
                    // SAFETY: as above.
                    unsafe {
                        attend_heads_avx2(
                            &q, &k16, &v16, keys, stride, off, d, scale, &mut s2, &mut o2,
                        );
                        attend_heads_avx512(
                            &q, &k16, &v16, keys, stride, off, d, scale, &mut s5, &mut o5,
                        );
                    }
                    assert_eq!(
                        bits(&s5),
                        bits(&s2),
                        "f16 weights: d {d}, {n} heads, {keys} keys"
                    );
                    assert_eq!(
                        bits(&o5),
                        bits(&o2),
                        "f16 outputs: d {d}, {n} heads, {keys} keys"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 5 * 7 * 11);
    }

    fn native(ty: GgmlType, seed: u64) -> (tempfile::TempDir, Llama<B>) {
        load(ty, seed, WeightDtype::Native)
    }

    fn load(ty: GgmlType, seed: u64, dtype: WeightDtype) -> (tempfile::TempDir, Llama<B>) {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        let mut spec = SyntheticSpec::tiny(seed);
        spec.weight_type = ty;
        write_synthetic_llama(&path, &spec).expect("write");
        let gguf = GgufFile::open(&path).expect("open");
        let model =
            load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {}).expect("load");
        (dir, model)
    }

    /// One generated token for each cache.
    fn one_each<'a>(tokens: &'a [[u32; 1]], caches: &'a mut [KvCache<B>]) -> Vec<SeqInput<'a, B>> {
        tokens
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, c)| SeqInput {
                tokens: t,
                cache: c,
            })
            .collect()
    }

    fn run(model: &Llama<B>, seqs: &mut [SeqInput<'_, B>]) -> Vec<Vec<f32>> {
        Llama::<B>::logits_to_host(model.forward(seqs).expect("forward"))
    }

    fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The vector `e^x` stays within 2 ulp of the library's over the range that
    /// matters, and SwiGLU through it within rounding of the plain formula.
    #[test]
    fn vector_exp_swiglu_and_geglu_match_the_library() {
        let xs: Vec<f32> = (0..=20_000)
            .map(|i| -87.0 + 175.0 * i as f32 / 20_000.0)
            .chain([0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 88.0, -87.3])
            .collect();
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            use std::arch::x86_64::*;
            for c in xs.chunks(8) {
                let mut lanes = [0.0f32; 8];
                lanes[..c.len()].copy_from_slice(c);
                // SAFETY: AVX2 and FMA detected above.
                unsafe {
                    let e = exp_avx2(_mm256_loadu_ps(lanes.as_ptr()));
                    _mm256_storeu_ps(lanes.as_mut_ptr(), e);
                }
                for (&x, &got) in c.iter().zip(&lanes) {
                    let want = x.exp();
                    let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                    assert!(ulps <= 2, "exp({x}) = {got}, library {want} ({ulps} ulp)");
                }
            }
        }
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let u: Vec<f32> = (0..1003).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut y = g.clone();
        swiglu(&mut y, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&y) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (y - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "swiglu({g}, {u}) = {y}, want {want}"
            );
        }
        // GeGLU against GELU's tanh form, in f64.
        let mut y = g.clone();
        geglu(&mut y, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&y) {
            let x = f64::from(g);
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let want = 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()) * f64::from(u);
            assert!(
                (f64::from(y) - want).abs() <= 2e-6 * (1.0 + want.abs()),
                "geglu({g}, {u}) = {y}, want {want}"
            );
        }
    }

    /// Attention over several query heads of one KV head at once (the vector path
    /// where the CPU has it) matches each head alone through the plain loop.
    #[test]
    fn grouped_attention_matches_each_head_alone() {
        let (d, kvh, stride) = (16, 3, 48);
        let value = |i: usize| ((i * 7919 + 13) % 1000) as f32 / 100.0 - 5.0;
        for keys in [1, 2, 7, 9, 40, 301] {
            let k: Vec<f32> = (0..keys * stride).map(value).collect();
            let v: Vec<f32> = (0..keys * stride).map(|i| value(i + 5)).collect();
            for n in [1, 3, 5, 17] {
                let q: Vec<f32> = (0..n * d).map(|i| value(3 * i + 1)).collect();
                for g in 0..kvh {
                    let off = g * d;
                    let mut out = vec![0.0f32; n * d];
                    let mut scores = vec![0.0f32; n * keys];
                    attend_heads(
                        &q,
                        &k,
                        &v,
                        keys,
                        stride,
                        off,
                        d,
                        0.25,
                        &mut scores,
                        &mut out,
                    );
                    for h in 0..n {
                        let mut want = vec![0.0f32; d];
                        let mut scratch = vec![0.0f32; keys];
                        attend_head(
                            &q[h * d..(h + 1) * d],
                            &k,
                            &v,
                            keys,
                            stride,
                            off,
                            0.25,
                            &mut scratch,
                            &mut want,
                        );
                        for (a, b) in out[h * d..(h + 1) * d].iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                                "keys {keys}, {n} heads, head {h}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The host path and the burn path agree on prefill, cached decode, batches of
    /// sequences at different positions, and after a truncation: to rounding with an f32
    /// cache, within what rounding keys and values to f16 moves with an f16 one.
    #[test]
    fn host_path_matches_burn_path() {
        for (ty, kv) in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0]
            .into_iter()
            .flat_map(|ty| [(ty, KvDtype::F32), (ty, KvDtype::F16)])
        {
            let (_dir, mut host) = native(ty, 11);
            host.set_kv_dtype(kv);
            assert!(host.host_weights().is_some());
            let mut burn = host.clone();
            burn.force_burn = true;
            let prompts: [&[u32]; 3] =
                [&[5, 70, 200, 3, 9, 41, 7], &[1, 2], &[300, 17, 17, 17, 99]];
            let mut results = Vec::new();
            for (m, model) in [&host, &burn].into_iter().enumerate() {
                let mut caches: Vec<_> = (0..3).map(|_| model.new_cache()).collect();
                let mut out = Vec::new();
                // Prefill of all three at once, then decode steps of all three.
                {
                    let mut seqs: Vec<_> = caches
                        .iter_mut()
                        .zip(prompts)
                        .map(|(cache, tokens)| SeqInput { tokens, cache })
                        .collect();
                    out.push(run(model, &mut seqs));
                }
                for step in 0..4u32 {
                    let toks: Vec<[u32; 1]> = (0..3).map(|i| [10 + step * 3 + i]).collect();
                    let mut seqs: Vec<_> = caches
                        .iter_mut()
                        .zip(&toks)
                        .map(|(cache, tokens)| SeqInput { tokens, cache })
                        .collect();
                    out.push(run(model, &mut seqs));
                }
                // A truncation, then a mixed batch: one prompt chunk, one token.
                caches[0].truncate(4);
                assert_eq!(caches[0].len(), 4);
                let (a, rest) = caches.split_at_mut(1);
                out.push(run(
                    model,
                    &mut [
                        SeqInput {
                            tokens: &[8, 9, 10],
                            cache: &mut a[0],
                        },
                        SeqInput {
                            tokens: &[77],
                            cache: &mut rest[0],
                        },
                    ],
                ));
                assert_eq!(caches[0].len(), 7);
                // 7 positions × (keys + values) × 32 values × bytes × 2 layers (the
                // burn path's tensors are f32).
                let bytes = if m == 0 { kv.bytes() } else { 4 };
                assert_eq!(caches[0].bytes(), 7 * 2 * 32 * bytes * 2);
                results.push(out);
            }
            for (step, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
                let diff = max_diff(a, b);
                let tolerance = match kv {
                    KvDtype::F32 => 1e-4,
                    // 0.8–2.0e-3 on these models.
                    KvDtype::F16 => 5e-3,
                };
                assert!(
                    diff < tolerance,
                    "{ty:?} KV {kv} step {step}: host and burn differ by {diff}"
                );
            }
        }
    }

    /// With integer inputs a generated token's logits are bitwise the same whatever
    /// shares its step (other sequences decoding, another's prompt joining) and however
    /// the cache before it was filled: one token a step, or replayed in one pass with the
    /// prompt after a move to another worker.
    /// The sequences of a split step: one contiguous run a thread, sizes within one of
    /// each other; no split for one thread, too few rows or any prompt of two tokens.
    #[test]
    fn transposes_match_the_plain_loop() {
        let mut dst = Vec::new();
        for (r, n) in [
            (1, 5),
            (5, 1),
            (7, 3),
            (8, 8),
            (64, 16),
            (66, 13),
            (17, 9),
            (96, 7),
        ] {
            let src: Vec<f32> = (0..r * n).map(|v| v as f32 * 0.5 - 3.0).collect();
            transpose(&src, r, n, &mut dst);
            assert_eq!(dst.len(), r * n);
            for i in 0..r {
                for j in 0..n {
                    assert_eq!(dst[j * r + i], src[i * n + j], "{r} x {n} at ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn steps_split_by_sequence_only_when_every_thread_gets_enough() {
        let spans = |lens: &[usize]| {
            let mut row = 0;
            lens.iter()
                .map(|&len| {
                    row += len;
                    SeqSpan {
                        row: row - len,
                        len,
                        pos: 7,
                    }
                })
                .collect::<Vec<_>>()
        };
        let ones = |n: usize| spans(&vec![1; n]);
        assert!(split_by_sequence(&ones(16), 1).is_none());
        assert!(split_by_sequence(&ones(2 * SPLIT_ROWS - 1), 2).is_none());
        let mut lens = vec![1; 16];
        lens[5] = 2;
        assert!(split_by_sequence(&spans(&lens), 2).is_none());
        for (n, threads) in [(8, 2), (16, 2), (13, 3), (64, 4)] {
            let groups = split_by_sequence(&ones(n), threads).expect("split");
            assert_eq!(groups.len(), threads);
            assert_eq!(groups[0].start, 0);
            assert_eq!(groups[threads - 1].end, n);
            for pair in groups.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            let sizes: Vec<usize> = groups.iter().map(|g| g.len()).collect();
            let lo = sizes.iter().min().expect("groups");
            let hi = sizes.iter().max().expect("groups");
            assert!(
                hi - lo <= 1 && *lo >= SPLIT_ROWS,
                "{n} over {threads}: {sizes:?}"
            );
        }
    }

    /// A step of many generated tokens, split by sequence over two or three threads,
    /// gives every sequence bitwise the logits it gets decoding alone.
    #[test]
    fn a_step_split_by_sequence_gives_each_sequence_its_logits_alone() {
        let (_dir, model) = load(GgmlType::Q4_1, 5, WeightDtype::NativeI16);
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            pool.install(|| {
                let n = threads * SPLIT_ROWS + 1;
                let prompts: Vec<Vec<u32>> = (0..n as u32)
                    .map(|i| (0..3 + i % 5).map(|k| 11 + 7 * i + k).collect())
                    .collect();
                let step = |i: usize, s: usize| [(31 * i + 5 * s) as u32 % 250 + 1];
                let start = |p: &[u32]| {
                    let mut c = model.new_cache();
                    c.set_decode_from(p.len());
                    run(
                        &model,
                        &mut [SeqInput {
                            tokens: p,
                            cache: &mut c,
                        }],
                    );
                    c
                };
                let alone: Vec<Vec<Vec<f32>>> = prompts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let mut c = start(p);
                        (0..3)
                            .map(|s| {
                                let t = step(i, s);
                                run(
                                    &model,
                                    &mut [SeqInput {
                                        tokens: &t,
                                        cache: &mut c,
                                    }],
                                )
                                .remove(0)
                            })
                            .collect()
                    })
                    .collect();
                let mut caches: Vec<_> = prompts.iter().map(|p| start(p)).collect();
                #[allow(clippy::needless_range_loop)] // `s` also makes the tokens
                for s in 0..3 {
                    let tokens: Vec<[u32; 1]> = (0..n).map(|i| step(i, s)).collect();
                    let mut seqs = one_each(&tokens, &mut caches);
                    let together = run(&model, &mut seqs);
                    for (i, logits) in together.iter().enumerate() {
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert!(
                            bits(logits) == bits(&alone[i][s]),
                            "{threads} threads, sequence {i}, step {s}"
                        );
                    }
                }
            });
        }
    }

    /// The argmax the forward pass finds chunk by chunk as it writes the logits is the
    /// sampler's argmax of each whole row: in a step split by sequence (two and three
    /// threads), in a step with prompts (one region), and for a single sequence.
    #[test]
    fn the_forward_pass_argmax_is_the_samplers() {
        use crate::engine::sampler::argmax;
        let (_dir, model) = load(GgmlType::Q4_1, 9, WeightDtype::NativeI16);
        let vocab = model.config().vocab;
        let check = |seqs: &mut [SeqInput<'_, B>], what: &str| {
            let (logits, greedy) = model.forward_greedy(seqs).expect("forward");
            let greedy = greedy.expect("the host path finds the argmax");
            assert_eq!(greedy.len(), seqs.len(), "{what}");
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                assert_eq!(greedy[r], argmax(row), "{what}, row {r}");
            }
        };
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            pool.install(|| {
                let n = 3 * SPLIT_ROWS + 2;
                let prompts: Vec<Vec<u32>> = (0..n as u32)
                    .map(|i| (0..2 + i % 4).map(|k| 3 + 13 * i + k).collect())
                    .collect();
                let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
                // Prompts of several lengths together: one region.
                let mut seqs: Vec<SeqInput<'_, B>> = prompts
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(p, c)| {
                        c.set_decode_from(p.len());
                        SeqInput {
                            tokens: p,
                            cache: c,
                        }
                    })
                    .collect();
                check(&mut seqs, &format!("{threads} threads, prompts"));
                // Then generated tokens only: split by sequence from two threads on.
                for s in 0..2u32 {
                    let tokens: Vec<[u32; 1]> = (0..n as u32)
                        .map(|i| [(17 * i + 5 * s) % 200 + 1])
                        .collect();
                    let mut seqs = one_each(&tokens, &mut caches);
                    check(&mut seqs, &format!("{threads} threads, step {s}"));
                }
                let mut one = model.new_cache();
                check(
                    &mut [SeqInput {
                        tokens: &[7, 8, 9],
                        cache: &mut one,
                    }],
                    &format!("{threads} threads, one sequence"),
                );
            });
        }
    }

    /// A cache told how far its sequence will go takes room for it at the first step and
    /// never moves while it fills (no doubling, no copies mid-stream); one told nothing
    /// still grows.
    #[test]
    fn an_expected_length_is_allocated_once() {
        let (_dir, model) = load(GgmlType::Q4_1, 3, WeightDtype::NativeI16);
        let width = model.config().n_kv_heads * model.config().head_dim;
        let mut told = model.new_cache();
        told.expect_positions(40);
        let mut untold = model.new_cache();
        let prompt: &[u32] = &[5, 6, 7, 8, 9];
        for c in [&mut told, &mut untold] {
            c.set_decode_from(prompt.len());
            run(
                &model,
                &mut [SeqInput {
                    tokens: prompt,
                    cache: c,
                }],
            );
        }
        let first = told.host_allocation();
        assert_eq!(first.1, 40 * width);
        let mut moved = false;
        for t in 0..35u32 {
            run(
                &model,
                &mut [SeqInput {
                    tokens: &[t + 1],
                    cache: &mut told,
                }],
            );
            run(
                &model,
                &mut [SeqInput {
                    tokens: &[t + 1],
                    cache: &mut untold,
                }],
            );
            assert_eq!(told.host_allocation(), first, "step {t}");
            moved |= untold.host_allocation().1 > prompt.len() * width;
        }
        assert!(moved, "a cache told nothing grows as it goes");
    }

    #[test]
    fn generated_rows_do_not_depend_on_their_batch() {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let (_dir, model) = load(ty, 5, WeightDtype::NativeI16);
            let prompt: &[u32] = &[5, 70, 200, 3, 9, 41, 7];
            let steps: [u32; 4] = [12, 250, 31, 8];
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let cache = || {
                let mut c = model.new_cache();
                c.set_decode_from(prompt.len());
                c
            };

            // Alone: the prompt, then one token a step.
            let mut a = cache();
            run(
                &model,
                &mut [SeqInput {
                    tokens: prompt,
                    cache: &mut a,
                }],
            );
            let alone: Vec<Vec<f32>> = steps
                .iter()
                .map(|t| {
                    run(
                        &model,
                        &mut [SeqInput {
                            tokens: std::slice::from_ref(t),
                            cache: &mut a,
                        }],
                    )
                    .remove(0)
                })
                .collect();

            // Beside others: the same prompt, then each step beside a second sequence
            // decoding, with a third sequence's prompt joining at the second step.
            let (mut a, mut b, mut c) = (cache(), cache(), model.new_cache());
            run(
                &model,
                &mut [SeqInput {
                    tokens: prompt,
                    cache: &mut a,
                }],
            );
            run(
                &model,
                &mut [SeqInput {
                    tokens: &[1, 2, 3, 4, 5, 6, 7, 8, 9],
                    cache: &mut b,
                }],
            );
            let third: [u32; 10] = [300, 17, 17, 17, 99, 4, 4, 4, 4, 61];
            let mut batched = Vec::new();
            for (i, t) in steps.iter().enumerate() {
                let other = [40 + i as u32];
                let next = [140 + i as u32];
                let joining: &[u32] = if i == 1 { &third } else { &next };
                let mut seqs = vec![
                    SeqInput {
                        tokens: &other,
                        cache: &mut b,
                    },
                    SeqInput {
                        tokens: joining,
                        cache: &mut c,
                    },
                    SeqInput {
                        tokens: std::slice::from_ref(t),
                        cache: &mut a,
                    },
                ];
                if i == 0 {
                    // The third sequence has not arrived yet.
                    seqs.remove(1);
                }
                batched.push(run(&model, &mut seqs).pop().expect("a's logits"));
            }

            // Moved: prompt and every token but the last in one pass, then the last.
            let mut moved_cache = cache();
            let mut replay: Vec<u32> = prompt.to_vec();
            replay.extend_from_slice(&steps[..steps.len() - 1]);
            run(
                &model,
                &mut [SeqInput {
                    tokens: &replay,
                    cache: &mut moved_cache,
                }],
            );
            let last = &steps[steps.len() - 1..];
            let moved = run(
                &model,
                &mut [SeqInput {
                    tokens: last,
                    cache: &mut moved_cache,
                }],
            );

            // The prompt itself: alone, beside another prompt, or after a prefix-cache
            // hit (its first rows loaded, the rest run) gives the same logits.
            let mut p1 = cache();
            let first = run(
                &model,
                &mut [SeqInput {
                    tokens: prompt,
                    cache: &mut p1,
                }],
            )
            .remove(0);
            let (mut p2, mut other) = (cache(), model.new_cache());
            let beside = run(
                &model,
                &mut [
                    SeqInput {
                        tokens: &third,
                        cache: &mut other,
                    },
                    SeqInput {
                        tokens: prompt,
                        cache: &mut p2,
                    },
                ],
            )
            .remove(1);
            let mut p3 = cache();
            run(
                &model,
                &mut [SeqInput {
                    tokens: &prompt[..5],
                    cache: &mut p3,
                }],
            );
            let rest = run(
                &model,
                &mut [SeqInput {
                    tokens: &prompt[5..],
                    cache: &mut p3,
                }],
            )
            .remove(0);
            assert_eq!(
                bits(&beside),
                bits(&first),
                "{ty:?}: a prompt beside another differs"
            );
            assert_eq!(
                bits(&rest),
                bits(&first),
                "{ty:?}: a prompt run in two parts differs"
            );

            for (step, (x, y)) in alone.iter().zip(&batched).enumerate() {
                assert_eq!(
                    bits(x),
                    bits(y),
                    "{ty:?} step {step}: batched logits differ from alone"
                );
            }
            let want = bits(alone.last().expect("steps"));
            assert_eq!(
                bits(&moved[0]),
                want,
                "{ty:?}: a moved sequence's logits differ"
            );
        }
    }
}
