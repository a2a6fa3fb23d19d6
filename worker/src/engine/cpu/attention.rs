//! Attention of query rows against cached keys and values on the host: a plain loop for
//! one head, and several query heads of one KV head at once with AVX2 or AVX-512 (checked
//! at run time), each giving the same bits as the other vector path.

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::activation::exp_avx2;

/// An element type of cached keys and values: f32, or f16 widened at every read.
pub(crate) trait KvValue: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// Whether elements are f16 (widened to f32 at every read).
    const HALF: bool;
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// `src` rounded into `dst` (as long) to this type, to nearest, ties to even.
    fn store(dst: &mut [Self], src: &[f32]);
}

impl KvValue for f32 {
    const HALF: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
    fn store(dst: &mut [Self], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvValue for f16 {
    const HALF: bool = true;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn store(dst: &mut [Self], src: &[f32]) {
        // Vector conversions (F16C) where the CPU has them, the same rounding.
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

/// Sum of `a[i]·b[i]`, in eight lanes (vectorised by the compiler); `b` may be keys
/// kept as f16, widened as they are read.
#[inline]
pub(super) fn dot<E: KvValue>(a: &[f32], b: &[E]) -> f32 {
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
fn axpy<E: KvValue>(y: &mut [f32], a: f32, x: &[E]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x.to_f32();
    }
}

/// One query head (`q`, `d` wide) against the first `keys` positions of one KV head:
/// `k` and `v` hold position-major rows `stride` wide, the head at offset `off`.
/// `scores` is scratch of at least `keys` values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_head<E: KvValue>(
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
pub(crate) fn attend_heads<E: KvValue>(
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
unsafe fn load8<E: KvValue>(p: *const E) -> std::arch::x86_64::__m256 {
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
unsafe fn load16<E: KvValue>(p: *const E) -> std::arch::x86_64::__m512 {
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
unsafe fn attend_heads_avx2<E: KvValue>(
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
unsafe fn attend_heads_avx512<E: KvValue>(
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
    unsafe fn weigh_values<E: KvValue, const W: usize>(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
