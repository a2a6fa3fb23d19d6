//! The AVX2 and FMA kernels, 256-bit vectors; also the reference the AVX-512 kernels
//! match bit for bit.

use std::arch::x86_64::*;

use crate::engine::cpu::scales::x86::QuadScales;

#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Expands block `b` to four vectors of eight values (unscaled).
///
/// # Safety
/// Needs AVX2 and FMA; block `b` must be inside `qs`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn expand(nibble: bool, qs: &[u8], b: usize) -> [__m256; 4] {
    // SAFETY: the caller guarantees block `b` is in bounds.
    unsafe {
        let (a, c) = if nibble {
            let q = _mm_loadu_si128(qs.as_ptr().add(b * 16) as *const __m128i);
            let mask = _mm_set1_epi8(0x0F);
            (
                _mm_and_si128(q, mask),
                _mm_and_si128(_mm_srli_epi16(q, 4), mask),
            )
        } else {
            let q = qs.as_ptr().add(b * 32);
            (
                _mm_loadu_si128(q as *const __m128i),
                _mm_loadu_si128(q.add(16) as *const __m128i),
            )
        };
        [
            widen(nibble, a),
            widen(nibble, _mm_srli_si128(a, 8)),
            widen(nibble, c),
            widen(nibble, _mm_srli_si128(c, 8)),
        ]
    }
}

/// The low eight bytes of `v` as floats: unsigned for nibbles, signed for bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen(nibble: bool, v: __m128i) -> __m256 {
    if nibble {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    } else {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }
}

/// Input rows for the quad kernels: row `k`'s quads start `k · quads · 128`
/// values into `qz` and `k · quads · 16` into `ez`; its block sums (4-bit weights
/// only) `k · nb` into `sums`.
#[derive(Clone, Copy)]
pub(super) struct QuadRows {
    pub(super) qz: *const i16,
    pub(super) ez: *const f32,
    pub(super) sums: *const f32,
    pub(super) nb: usize,
}

impl QuadRows {
    /// The rows of `x` from row `j` on.
    ///
    /// # Safety
    /// Row `j` must be a row of `x` (`nb` blocks a row).
    pub(super) unsafe fn at(x: super::IntRows<'_>, nb: usize, j: usize, nibble: bool) -> Self {
        let quads = nb.div_ceil(4);
        // SAFETY: row `j` is in bounds by the caller's contract.
        unsafe {
            QuadRows {
                qz: x.qz.as_ptr().add(128 * quads * j),
                ez: x.ez.as_ptr().add(16 * quads * j),
                sums: if nibble {
                    x.sums.as_ptr().add(nb * j)
                } else {
                    x.sums.as_ptr()
                },
                nb,
            }
        }
    }
}

/// The weights of blocks `b`, `b + 1` (the half `h` of a quad) as four vectors of
/// sixteen i16, element groups 0..8, 8..16, 16..24 and 24..32 of block `b` in
/// the low eight and of block `b + 1` in the high eight (the scales come from
/// [`QuadScales::quad`]). Block `b + 1` reads as zeros when `two` is false.
///
/// # Safety
/// Needs AVX2 and FMA; block `b` (and `b + 1` when `two`) inside `qs`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_half<const NIBBLE: bool>(qs: &[u8], b: usize, two: bool) -> [__m256i; 4] {
    // SAFETY: the caller guarantees the blocks read are in bounds.
    unsafe {
        if NIBBLE {
            let p = qs.as_ptr().add(b * 16);
            let v = if two {
                _mm256_loadu_si256(p.cast())
            } else {
                _mm256_zextsi128_si256(_mm_loadu_si128(p.cast()))
            };
            // Byte i holds element i (low nibble) and i + 16 (high nibble); each
            // 128-bit lane is one block, so widening bytes 0..8 and 8..16 of
            // the low and the high nibbles within lanes gives the four groups.
            let low = _mm256_set1_epi8(0x0F);
            let lo = _mm256_and_si256(v, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            let zero = _mm256_setzero_si256();
            [
                _mm256_unpacklo_epi8(lo, zero),
                _mm256_unpackhi_epi8(lo, zero),
                _mm256_unpacklo_epi8(hi, zero),
                _mm256_unpackhi_epi8(hi, zero),
            ]
        } else {
            let p = qs.as_ptr().add(b * 32);
            let a = _mm256_loadu_si256(p.cast());
            let c = if two {
                _mm256_loadu_si256(p.add(32).cast())
            } else {
                _mm256_setzero_si256()
            };
            // Within each 128-bit half: eight bytes of `a`, eight of `c`.
            let even = _mm256_unpacklo_epi64(a, c); // groups 0 | 2
            let odd = _mm256_unpackhi_epi64(a, c); // groups 1 | 3
            [
                _mm256_cvtepi8_epi16(_mm256_castsi256_si128(even)),
                _mm256_cvtepi8_epi16(_mm256_castsi256_si128(odd)),
                _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(even)),
                _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(odd)),
            ]
        }
    }
}

/// [`super::dot_int_rows`] on 256-bit vectors: one weight row against `R` input
/// rows, half a quad (two blocks) at a time, the quad layout's lanes 0..8 in one
/// accumulator and 8..16 in another, so that every lane adds what the same lane
/// of [`dot_int_quad`] adds, in the same order.
///
/// # Safety
/// Needs AVX2 and FMA; `qs`, `scales` (and `mins` for nibbles) hold `x.nb`
/// blocks; `x` points at `R` rows laid out as [`super::IntRows`] describes.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` also offsets the input pointers
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_int_half<const NIBBLE: bool, const R: usize, S: QuadScales>(
    qs: &[u8],
    scales: S,
    x: QuadRows,
) -> [f32; R] {
    let nb = x.nb;
    let quads = nb.div_ceil(4);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    // SAFETY (the loads): blocks below `nb`, quads below `quads`, rows below `R`,
    // in bounds by the caller's contract.
    unsafe {
        for q in 0..quads {
            let ds = scales.quad(q, nb);
            // A quad is one line of 4-bit blocks, two of 8-bit ones.
            let bytes = if NIBBLE { 64 } else { 128 };
            for line in (0..bytes).step_by(64) {
                let ahead = q * bytes + line + 4096;
                _mm_prefetch::<_MM_HINT_T0>(qs.as_ptr().wrapping_add(ahead).cast());
            }
            if S::FLAT {
                let [sp, mp] = scales.ahead(4 * q + 256);
                _mm_prefetch::<_MM_HINT_T0>(sp.cast());
                if NIBBLE {
                    _mm_prefetch::<_MM_HINT_T0>(mp.cast());
                }
            }
            for (h, &d) in ds.iter().enumerate() {
                let b = 4 * q + 2 * h;
                if b >= nb {
                    break;
                }
                let two = b + 1 < nb;
                let w = widen_half::<NIBBLE>(qs, b, two);
                for k in 0..R {
                    let p = x.qz.add(128 * quads * k + 128 * q + 16 * h);
                    let mut s = _mm256_madd_epi16(w[0], _mm256_loadu_si256(p.cast()));
                    for (g, w) in w.iter().enumerate().skip(1) {
                        let pg = _mm256_loadu_si256(p.add(32 * g).cast());
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(*w, pg));
                    }
                    let e = _mm256_loadu_ps(x.ez.add(16 * quads * k + 16 * q + 8 * h));
                    acc[h][k] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, e), _mm256_cvtepi32_ps(s), acc[h][k]);
                }
            }
        }
        if NIBBLE {
            // The minimum terms, sixteen blocks at a time in lanes 0..16 (zeros
            // past the row's end), as `dot_int_quad` adds them.
            for c in 0..nb.div_ceil(16) {
                for h in 0..2 {
                    let mv = scales.mins8(16 * c + 8 * h, nb);
                    for k in 0..R {
                        let sk = load_tail(x.sums.add(nb * k), 16 * c + 8 * h, nb);
                        acc[h][k] = _mm256_fmadd_ps(mv, sk, acc[h][k]);
                    }
                }
            }
        }
        let mut out = [0.0f32; R];
        for k in 0..R {
            out[k] = hsum(_mm256_add_ps(acc[0][k], acc[1][k]));
        }
        out
    }
}

/// Eight floats from `p + at`, zeros for those at `nb` or past it.
///
/// # Safety
/// Needs AVX2; `p` points at `nb` readable floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn load_tail(p: *const f32, at: usize, nb: usize) -> __m256 {
    // SAFETY: a full load stays below `nb`; a partial one reads lanes below `nb`
    // alone (the mask's other lanes load nothing).
    unsafe {
        if at + 8 <= nb {
            _mm256_loadu_ps(p.add(at))
        } else if at >= nb {
            _mm256_setzero_ps()
        } else {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((nb - at) as i32), lanes);
            _mm256_maskload_ps(p.add(at), mask)
        }
    }
}

/// [`super::dot_int_rows`] with [`dot_int_half`]: weight rows in slices of
/// [`super::WEIGHT_SLICE`], each against every input row asked for, four input
/// rows at a time (then one).
///
/// # Safety
/// Needs AVX2 and FMA; the lengths as [`super::dot_int_rows`] checks them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_int_rows<const NIBBLE: bool, S: QuadScales>(
    nb: usize,
    qs: &[u8],
    scales: S,
    x: super::IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (m, n) = (scales.units() / nb, x.d.len() / nb);
    let qpb = if NIBBLE { 16 } else { 32 };
    for s0 in (0..m).step_by(super::WEIGHT_SLICE) {
        let s1 = (s0 + super::WEIGHT_SLICE).min(m);
        let mut j = rows.start;
        while j < rows.end {
            let take = if j + 4 <= rows.end { 4 } else { 1 };
            // SAFETY: input rows `j..j + take` (below `rows.end <= n`) and weight
            // row `r < m` are in bounds of every slice by the caller's checks.
            unsafe {
                let inputs = QuadRows::at(x, nb, j, NIBBLE);
                for r in s0..s1 {
                    let wq = qs.get_unchecked(qpb * nb * r..qpb * nb * (r + 1));
                    let ws = scales.slice(nb * r, nb * (r + 1), nb * r, nb * (r + 1));
                    let o = out.get_unchecked_mut(n * r + j..n * r + j + take);
                    if take == 4 {
                        o.copy_from_slice(&dot_int_half::<NIBBLE, 4, S>(wq, ws, inputs));
                    } else {
                        o[0] = dot_int_half::<NIBBLE, 1, S>(wq, ws, inputs)[0];
                    }
                }
            }
            j += take;
        }
    }
}

/// [`dot_int_rows`] for 4-bit (`nibble`) or 8-bit blocks.
///
/// # Safety
/// As [`dot_int_rows`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_int_rows_of<S: QuadScales>(
    nibble: bool,
    nb: usize,
    qs: &[u8],
    scales: S,
    x: super::IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe {
        if nibble {
            dot_int_rows::<true, S>(nb, qs, scales, x, rows, out);
        } else {
            dot_int_rows::<false, S>(nb, qs, scales, x, rows, out);
        }
    }
}

/// [`super::quantize_blocks`] on 256-bit vectors: the same operations on each
/// value (the maximum is exact in any order).
///
/// # Safety
/// Needs AVX2; `q` as long as `x`, `d` a 32nd of it.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_blocks(x: &[f32], q: &mut [i16], d: &mut [f32]) {
    // SAFETY: block `b < d.len()` covers `x` and `q` at `32 b .. 32 b + 32`.
    unsafe {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let half = _mm256_set1_ps(0.5);
        let neg_half = _mm256_set1_ps(-0.5);
        for b in 0..d.len() {
            let p = x.as_ptr().add(32 * b);
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let scale = amax / 32767.0;
            *d.get_unchecked_mut(b) = scale;
            let inv = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
            let round = |v: __m256| {
                let r = _mm256_mul_ps(v, inv);
                let t = _mm256_cvttps_epi32(r);
                let cut = _mm256_sub_ps(r, _mm256_cvtepi32_ps(t));
                // Compare masks are −1 where true.
                let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(cut, half));
                let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(cut, neg_half));
                _mm256_add_epi32(_mm256_sub_epi32(t, up), down)
            };
            // packs works within 128-bit halves: put the quarters back in order.
            let lo = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(
                round(v[0]),
                round(v[1]),
            ));
            let hi = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(
                round(v[2]),
                round(v[3]),
            ));
            let out = q.as_mut_ptr().add(32 * b);
            _mm256_storeu_si256(out.cast(), lo);
            _mm256_storeu_si256(out.add(16).cast(), hi);
        }
    }
}

/// `Σ w·x` over one block's 32 values, with `w` from [`expand`].
///
/// # Safety
/// Needs AVX2 and FMA; `xp` must point at 32 readable floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dot(w: &[__m256; 4], xp: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 32 floats at `xp`.
    unsafe {
        let mut s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
        s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), s);
        s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), s);
        _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), s)
    }
}

/// Four input rows against one weight row.
///
/// # Safety
/// Needs AVX2 and FMA; every `xs[k]` is `32 · scales.len()` long, `qs` holds
/// `scales.len()` blocks, and for nibbles `mins` and `sums[k]` are as long as
/// `scales`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot4(
    nibble: bool,
    qs: &[u8],
    scales: &[f32],
    mins: &[f32],
    xs: [&[f32]; 4],
    sums: [&[f32]; 4],
) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    for (b, &d) in scales.iter().enumerate() {
        // SAFETY: block `b` is in bounds of `qs` and of every `xs[k]`.
        unsafe {
            let w = expand(nibble, qs, b);
            let d = _mm256_set1_ps(d);
            for k in 0..4 {
                let s = block_dot(&w, xs[k].as_ptr().add(b * 32));
                acc[k] = _mm256_fmadd_ps(d, s, acc[k]);
            }
        }
    }
    // A plain loop, not a closure: closures do not inherit the target features.
    let mut out = [0.0f32; 4];
    for k in 0..4 {
        // SAFETY: AVX2/FMA by this function's contract.
        out[k] = hsum(acc[k]);
        if nibble {
            out[k] += unsafe { min_terms(mins, sums[k]) };
        }
    }
    out
}

/// `Σ_b m_b · s_b`, eight blocks at a time.
///
/// # Safety
/// Needs AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn min_terms(mins: &[f32], sums: &[f32]) -> f32 {
    let n = mins.len().min(sums.len());
    let full = n / 8 * 8;
    let mut macc = _mm256_setzero_ps();
    for b in (0..full).step_by(8) {
        // SAFETY: b + 8 <= full <= n, in bounds of both slices.
        unsafe {
            macc = _mm256_fmadd_ps(
                _mm256_loadu_ps(mins.as_ptr().add(b)),
                _mm256_loadu_ps(sums.as_ptr().add(b)),
                macc,
            );
        }
    }
    let mut tail = 0.0f32;
    for b in full..n {
        tail += mins[b] * sums[b];
    }
    hsum(macc) + tail
}

/// [`super::interleave_halves`], eight pairs at a time.
///
/// # Safety
/// Needs AVX2; `row` and `out` equally long, half of it a multiple of 8.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn interleave_halves(row: &[f32], out: &mut [f32]) {
    let half = row.len() / 2;
    // SAFETY: every load and store below is inside the two slices.
    unsafe {
        let (a, b) = (row.as_ptr(), row.as_ptr().add(half));
        let o = out.as_mut_ptr();
        for k in (0..half).step_by(8) {
            let (x, y) = (_mm256_loadu_ps(a.add(k)), _mm256_loadu_ps(b.add(k)));
            let (lo, hi) = (_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
            _mm256_storeu_ps(o.add(2 * k), _mm256_permute2f128_ps::<0x20>(lo, hi));
            _mm256_storeu_ps(o.add(2 * k + 8), _mm256_permute2f128_ps::<0x31>(lo, hi));
        }
    }
}

/// The pair-sums of `a`'s lanes (lane `2l` + lane `2l + 1`, the two halves' chains
/// of input row `l`) in its low four lanes.
///
/// # Safety
/// Needs AVX2.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pair_sums(a: __m256) -> __m256 {
    let t = _mm256_add_ps(a, _mm256_permute_ps::<0b10_11_00_01>(a));
    _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6))
}

/// [`super::panel_product`] on 256-bit vectors: each panel of eight input rows in
/// two vectors of four rows (times two halves), up to six weight rows at a time
/// (twelve accumulators), each pair of weights broadcast from memory.
///
/// # Safety
/// Needs AVX2 and FMA; the shapes as [`super::panel_product`] checks them.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn panel_product(
    panels: &[f32],
    n: usize,
    w: &[f32],
    m: usize,
    cols: usize,
    out: &mut [f32],
) {
    for b in 0..n.div_ceil(8) {
        let rows = (n - 8 * b).min(8);
        let mut r = 0;
        while r < m {
            let wr = (m - r).min(6);
            // SAFETY: panel `b`, weight rows r..r + wr and the outputs written are
            // in bounds by the shapes the caller checked.
            unsafe {
                macro_rules! run {
                    ($h:literal, $w:literal) => {
                        panel_rows::<$h, $w>(panels, b, w, r, cols, n, rows, out)
                    };
                }
                match (rows > 4, wr) {
                    (true, 6) => run!(2, 6),
                    (true, 5) => run!(2, 5),
                    (true, 4) => run!(2, 4),
                    (true, 3) => run!(2, 3),
                    (true, 2) => run!(2, 2),
                    (true, _) => run!(2, 1),
                    (false, 6) => run!(1, 6),
                    (false, 5) => run!(1, 5),
                    (false, 4) => run!(1, 4),
                    (false, 3) => run!(1, 3),
                    (false, 2) => run!(1, 2),
                    (false, _) => run!(1, 1),
                }
            }
            r += wr;
        }
    }
}

/// Panel `b`'s first `H` vectors (four of its `rows` rows each) by weight rows
/// `r..r + W`.
///
/// # Safety
/// Needs AVX2 and FMA; panel `b` and weight rows `r..r + W` in bounds, `out`
/// `[m, n]` with `r + W <= m`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_rows<const H: usize, const W: usize>(
    panels: &[f32],
    b: usize,
    w: &[f32],
    r: usize,
    cols: usize,
    n: usize,
    rows: usize,
    out: &mut [f32],
) {
    let mut acc = [[_mm256_setzero_ps(); H]; W];
    // SAFETY: in bounds by the caller's contract.
    unsafe {
        let p = panels.as_ptr().add(b * cols * 8);
        let wp = w.as_ptr().add(r * cols);
        for k in 0..cols / 2 {
            let mut xv = [_mm256_setzero_ps(); H];
            for (h, xv) in xv.iter_mut().enumerate() {
                *xv = _mm256_loadu_ps(p.add(16 * k + 8 * h));
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // Two f32 at any 4-byte boundary: read unaligned.
                let wv = _mm256_castpd_ps(_mm256_set1_pd(
                    wp.add(i * cols + 2 * k).cast::<f64>().read_unaligned(),
                ));
                for (a, x) in acc.iter_mut().zip(&xv) {
                    *a = _mm256_fmadd_ps(wv, *x, *a);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let at = (r + i) * n + 8 * b;
            for (h, a) in acc.iter().enumerate() {
                let lanes = rows.saturating_sub(4 * h).min(4);
                let mut v = [0.0f32; 8];
                _mm256_storeu_ps(v.as_mut_ptr(), pair_sums(*a));
                out[at + 4 * h..at + 4 * h + lanes].copy_from_slice(&v[..lanes]);
            }
        }
    }
}

/// One row's blocks dequantized: `out = q·d (+ m)`.
///
/// # Safety
/// Needs AVX2 and FMA; `out.len() == 32 · scales.len()`, `qs` holds
/// `scales.len()` blocks, and for nibbles `mins` is as long as `scales`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dequant_row(nibble: bool, qs: &[u8], scales: &[f32], mins: &[f32], out: &mut [f32]) {
    for (b, &d) in scales.iter().enumerate() {
        // SAFETY: block `b` of `qs` and floats `32b..32b + 32` of `out` are in
        // bounds by the length contract.
        unsafe {
            // The rows that follow, 256 blocks ahead (a caller dequantizes rows
            // in order): the hardware alone leaves these loads waiting.
            let qb = if nibble { 16 } else { 32 };
            _mm_prefetch::<_MM_HINT_T0>(qs.as_ptr().wrapping_add(qb * (b + 256)).cast());
            _mm_prefetch::<_MM_HINT_T0>(scales.as_ptr().wrapping_add(b + 256).cast());
            if nibble {
                _mm_prefetch::<_MM_HINT_T0>(mins.as_ptr().wrapping_add(b + 256).cast());
            }
            let w = expand(nibble, qs, b);
            let d = _mm256_set1_ps(d);
            let m = _mm256_set1_ps(if nibble { *mins.get_unchecked(b) } else { 0.0 });
            let op = out.as_mut_ptr().add(b * 32);
            for (k, w) in w.iter().enumerate() {
                _mm256_storeu_ps(op.add(8 * k), _mm256_fmadd_ps(*w, d, m));
            }
        }
    }
}

/// # Safety
/// Needs AVX2 and FMA; `qs.len() == x.len() == 32 · scales.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_byte(qs: &[u8], scales: &[f32], x: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, &d) in scales.iter().enumerate() {
        // SAFETY: block `b` spans qs[32b..32b+32] and x[32b..32b+32], in bounds
        // by the length contract.
        unsafe {
            let s = block_dot(&expand(false, qs, b), x.as_ptr().add(b * 32));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
        }
    }
    hsum(acc)
}

/// # Safety
/// Needs AVX2 and FMA; `2 · qs.len() == x.len() == 32 · scales.len()`, and
/// `mins`, `xsum` as long as `scales`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_nibble(qs: &[u8], scales: &[f32], mins: &[f32], x: &[f32], xsum: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, &d) in scales.iter().enumerate() {
        // SAFETY: block `b` spans qs[16b..16b+16] and x[32b..32b+32], in bounds
        // by the length contract.
        unsafe {
            let s = block_dot(&expand(true, qs, b), x.as_ptr().add(b * 32));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
        }
    }
    // The same additions in the same order as `dot4` for each of its rows.
    // SAFETY: AVX2/FMA by this function's contract.
    hsum(acc) + unsafe { min_terms(mins, xsum) }
}
