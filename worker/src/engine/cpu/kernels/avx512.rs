//! The AVX-512 kernels (F, BW, VNNI): a quad of blocks to one 512-bit vector. Every lane
//! adds what the same lane of the AVX2 kernel adds, in the same order, so both give the
//! same bits.

use std::arch::x86_64::*;

use super::avx2::{hsum, QuadRows};
use crate::engine::cpu::scales::x86_wide::WideScales;

/// `W` weight rows (`W · x.nb` blocks of `qs`, `scales` and their minimums, in
/// either form: see [`WideScales`]) against `R` input rows on 512-bit vectors, a
/// quad of four blocks at a time: each weight quad is widened once to four
/// vectors of 32 i16 in the quad layout (one `vpermq` puts each block's bytes
/// where its four lanes are), then every input
/// row takes one `vpmaddwd`, three `vpdpwssd` and one scaled FMA per weight row,
/// four blocks to the vector. A last partial quad is read through masks (zeros,
/// scale 0). For nibbles the minimum terms follow the quads, sixteen blocks to a
/// vector (one FMA per sixteen blocks, where folding them into the quads took one
/// per four). Every lane adds what the same lane of [`dot_int_half`] adds, in the
/// same order, so the results are bitwise its results.
///
/// # Safety
/// Needs AVX-512 F/BW/VNNI, AVX2 and FMA; `qs` and `scales` (with minimums for
/// nibbles) hold `W · x.nb` blocks, whole super-blocks for super-block scales;
/// `x` points at `R` rows laid out as [`super::IntRows`] describes.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` also offsets the input pointers
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn dot_int_quad<const NIBBLE: bool, const R: usize, const W: usize, S: WideScales>(
    qs: &[u8],
    scales: S,
    x: QuadRows,
) -> [[f32; R]; W] {
    let nb = x.nb;
    let quads = nb.div_ceil(4);
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    let mut out = [[0.0f32; R]; W];
    // SAFETY (the loads): full quads lie inside every row by the caller's
    // contract; a partial one is read through masks that stop at the row's end.
    unsafe {
        let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        // Quad bytes (qwords b0 b0' b1 b1' …) to b0 b1 b2 b3 | b0' b1' b2' b3'.
        let nibble_order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
        // Two 64-byte halves of a quad of bytes to groups 0, 1 | 2, 3.
        let byte_first = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
        let byte_second = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
        let low = _mm512_set1_epi16(0x0F);
        for q in 0..quads {
            let blocks = (nb - 4 * q).min(4);
            let mut w = [[_mm512_setzero_si512(); 4]; W];
            let mut d = [_mm512_setzero_ps(); W];
            for i in 0..W {
                let at = i * nb + 4 * q;
                let [ahead_scale, ahead_min] = scales.ahead(at + 256);
                if S::FLAT {
                    _mm_prefetch::<_MM_HINT_T0>(ahead_scale.cast());
                }
                let sc = _mm512_castps128_ps512(scales.four(at, blocks));
                d[i] = _mm512_permutexvar_ps(spread, sc);
                w[i] = if NIBBLE {
                    let p = qs.as_ptr().add(at * 16);
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096).cast());
                    // The minimums as far ahead (256 blocks): they are read
                    // after the quads, too late for the hardware to fetch them.
                    if S::FLAT {
                        _mm_prefetch::<_MM_HINT_T0>(ahead_min.cast());
                    }
                    let v = if blocks == 4 {
                        _mm512_loadu_si512(p.cast())
                    } else {
                        _mm512_maskz_loadu_epi8((1u64 << (16 * blocks)) - 1, p.cast())
                    };
                    let v = _mm512_permutexvar_epi64(nibble_order, v);
                    let a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
                    let c = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(v));
                    [
                        _mm512_and_si512(a, low),
                        _mm512_and_si512(c, low),
                        _mm512_srli_epi16::<4>(a),
                        _mm512_srli_epi16::<4>(c),
                    ]
                } else {
                    let p = qs.as_ptr().add(at * 32);
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(8192).cast());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(8192 + 64).cast());
                    let (v0, v1) = if blocks == 4 {
                        (
                            _mm512_loadu_si512(p.cast()),
                            _mm512_loadu_si512(p.add(64).cast()),
                        )
                    } else {
                        let bytes = 32 * blocks;
                        let mask = |n: usize| -> u64 {
                            if n >= 64 {
                                u64::MAX
                            } else {
                                (1u64 << n) - 1
                            }
                        };
                        (
                            _mm512_maskz_loadu_epi8(mask(bytes), p.cast()),
                            _mm512_maskz_loadu_epi8(
                                mask(bytes.saturating_sub(64)),
                                p.add(64).cast(),
                            ),
                        )
                    };
                    let f = _mm512_permutex2var_epi64(v0, byte_first, v1);
                    let s = _mm512_permutex2var_epi64(v0, byte_second, v1);
                    [
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(f)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(f)),
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(s)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(s)),
                    ]
                };
            }
            for k in 0..R {
                let p = x.qz.add(128 * quads * k + 128 * q);
                let e = _mm512_loadu_ps(x.ez.add(16 * quads * k + 16 * q));
                let xs = [
                    _mm512_loadu_si512(p.cast()),
                    _mm512_loadu_si512(p.add(32).cast()),
                    _mm512_loadu_si512(p.add(64).cast()),
                    _mm512_loadu_si512(p.add(96).cast()),
                ];
                for i in 0..W {
                    let mut s = _mm512_madd_epi16(w[i][0], xs[0]);
                    // `vpdpwssd` itself: without a tuning that says it is fast,
                    // the compiler splits its intrinsic into `vpmaddwd` and
                    // `vpaddd`, one more operation each.
                    for g in 1..4 {
                        std::arch::asm!(
                            "vpdpwssd {s}, {w}, {x}",
                            s = inout(zmm_reg) s,
                            w = in(zmm_reg) w[i][g],
                            x = in(zmm_reg) xs[g],
                            options(pure, nomem, nostack),
                        );
                    }
                    acc[i][k] =
                        _mm512_fmadd_ps(_mm512_mul_ps(d[i], e), _mm512_cvtepi32_ps(s), acc[i][k]);
                }
            }
        }
        if NIBBLE {
            // The minimum terms `m_b · Σx_b`, sixteen blocks at a time in lanes
            // 0..16 (zeros past the row's end): one FMA per sixteen blocks
            // instead of one per quad.
            for c in 0..nb.div_ceil(16) {
                let count = (nb - 16 * c).min(16);
                let mask = if count == 16 {
                    u16::MAX
                } else {
                    (1u16 << count) - 1
                };
                let sk: [__m512; R] = std::array::from_fn(|k| {
                    _mm512_maskz_loadu_ps(mask, x.sums.add(nb * k + 16 * c))
                });
                for i in 0..W {
                    let mv = scales.sixteen_mins(i * nb + 16 * c, count);
                    for k in 0..R {
                        acc[i][k] = _mm512_fmadd_ps(mv, sk[k], acc[i][k]);
                    }
                }
            }
        }
        if R == 4 {
            // Four sums at once, transposed: the same additions as `hsum` of
            // each accumulator's halves, in the same order, in other lanes.
            for i in 0..W {
                let halves = |a: __m512, b: __m512| {
                    _mm512_add_ps(
                        _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                        _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
                    )
                };
                // Lanes 0..8 of accumulator 0 (1) plus lanes 8..16, beside 1 (3).
                let t01 = halves(acc[i][0], acc[i][1]);
                let t23 = halves(acc[i][2], acc[i][3]);
                // Each one's 128-bit halves added: four lanes an accumulator.
                let u = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(t01, t23),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(t01, t23),
                );
                // (s0 + s2, s1 + s3), then their sum, in lane 0 of each quarter.
                let v = _mm512_add_ps(u, _mm512_permute_ps::<0b11_10_11_10>(u));
                let z = _mm512_add_ps(v, _mm512_permute_ps::<0b01_01_01_01>(v));
                let lanes = _mm512_permutexvar_ps(
                    _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0),
                    z,
                );
                _mm_storeu_ps(out[i].as_mut_ptr(), _mm512_castps512_ps128(lanes));
            }
        } else {
            for i in 0..W {
                for k in 0..R {
                    let lo = _mm512_castps512_ps256(acc[i][k]);
                    let hi =
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[i][k])));
                    out[i][k] = hsum(_mm256_add_ps(lo, hi));
                }
            }
        }
    }
    out
}

/// [`super::dot_int_rows`] with [`dot_int_quad`]: weight rows in slices of
/// [`super::WEIGHT_SLICE`], each slice against every input row asked for (so a
/// slice is read from memory once and stays in cache while the inputs pass), four
/// input rows at a time (then one) against three weight rows at a time (then
/// what is left).
///
/// # Safety
/// Needs AVX-512 F/BW/VNNI, AVX2 and FMA; the lengths as
/// [`super::dot_int_rows`] checks them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn dot_int_rows_wide<const NIBBLE: bool, S: WideScales>(
    nb: usize,
    qs: &[u8],
    scales: S,
    x: super::IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (m, n) = (scales.units() / nb, x.d.len() / nb);
    let qpb = if NIBBLE { 16 } else { 32 };
    // Weight rows a kernel call takes (registers: four widened vectors each) for four
    // input rows; for one, a row at a time: three rows' lines interleaved stream a large
    // matrix more slowly than one (Zen 4), and one input row shares little.
    const WMAX: usize = 3;
    // SAFETY: input rows `j..j + take` (below `rows.end <= n`) and weight rows
    // `r..r + wr` (below `m`) are in bounds of every slice by the caller's checks.
    unsafe {
        for s0 in (0..m).step_by(super::WEIGHT_SLICE) {
            let s1 = (s0 + super::WEIGHT_SLICE).min(m);
            let mut j = rows.start;
            while j < rows.end {
                let inputs = QuadRows::at(x, nb, j, NIBBLE);
                let take = if rows.end - j >= 4 { 4 } else { 1 };
                let mut r = s0;
                while r < s1 {
                    let wr = (s1 - r).min(if take == 4 { WMAX } else { 1 });
                    let wq = qs.get_unchecked(qpb * nb * r..qpb * nb * (r + wr));
                    let (u0, u1) = (nb * r, nb * (r + wr));
                    let ws = scales.slice(u0, u1, u0, u1);
                    macro_rules! run {
                        ($r:literal, $w:literal) => {{
                            let v = dot_int_quad::<NIBBLE, $r, $w, S>(wq, ws, inputs);
                            for (i, v) in v.iter().enumerate() {
                                out.get_unchecked_mut(n * (r + i) + j..n * (r + i) + j + $r)
                                    .copy_from_slice(v);
                            }
                        }};
                    }
                    match (take, wr) {
                        (4, 3) => run!(4, 3),
                        (4, 2) => run!(4, 2),
                        (4, _) => run!(4, 1),
                        (_, 3) => run!(1, 3),
                        (_, 2) => run!(1, 2),
                        (_, _) => run!(1, 1),
                    }
                    r += wr;
                }
                j += take;
            }
        }
    }
}

/// [`dot_int_rows_wide`] for nibbles or bytes, as `nibble` says.
///
/// # Safety
/// As [`dot_int_rows_wide`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn dot_int_rows_of<S: WideScales>(
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
            dot_int_rows_wide::<true, S>(nb, qs, scales, x, rows, out);
        } else {
            dot_int_rows_wide::<false, S>(nb, qs, scales, x, rows, out);
        }
    }
}

/// [`super::panel_product`] on 512-bit vectors: a panel of eight input rows (times
/// two halves) to a vector, two panels by up to twelve weight rows at a time (24
/// accumulators) or one by twelve; every lane the same chain of FMAs as
/// [`panel_product`]'s and the same pair sums, so the results are bitwise its
/// results.
///
/// # Safety
/// Needs AVX-512 F, AVX2 and FMA; the shapes as [`super::panel_product`] checks
/// them.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn panel_product_wide(
    panels: &[f32],
    n: usize,
    w: &[f32],
    m: usize,
    cols: usize,
    out: &mut [f32],
) {
    let blocks = n.div_ceil(8);
    let mut b = 0;
    while b < blocks {
        let two = b + 1 < blocks;
        let mut r = 0;
        while r < m {
            let wr = (m - r).min(12);
            // SAFETY: panels b (and b + 1), weight rows r..r + wr and the outputs
            // written are in bounds by the shapes the caller checked.
            unsafe {
                macro_rules! run {
                    ($p:literal, $w:literal) => {
                        panel_rows_wide::<$p, $w>(panels, b, w, r, cols, n, out)
                    };
                }
                macro_rules! rows {
                    ($p:literal) => {
                        match wr {
                            12 => run!($p, 12),
                            11 => run!($p, 11),
                            10 => run!($p, 10),
                            9 => run!($p, 9),
                            8 => run!($p, 8),
                            7 => run!($p, 7),
                            6 => run!($p, 6),
                            5 => run!($p, 5),
                            4 => run!($p, 4),
                            3 => run!($p, 3),
                            2 => run!($p, 2),
                            _ => run!($p, 1),
                        }
                    };
                }
                if two {
                    rows!(2)
                } else {
                    rows!(1)
                }
            }
            r += wr;
        }
        b += if two { 2 } else { 1 };
    }
}

/// Panels `b..b + P` by weight rows `r..r + W`.
///
/// # Safety
/// Needs AVX-512 F, AVX2 and FMA; those panels and weight rows in bounds, `out`
/// `[m, n]` with `r + W <= m`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn panel_rows_wide<const P: usize, const W: usize>(
    panels: &[f32],
    b: usize,
    w: &[f32],
    r: usize,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); P]; W];
    // SAFETY: in bounds by the caller's contract.
    unsafe {
        let p = panels.as_ptr().add(b * cols * 8);
        let wp = w.as_ptr().add(r * cols);
        for k in 0..cols / 2 {
            let mut xv = [_mm512_setzero_ps(); P];
            for (q, xv) in xv.iter_mut().enumerate() {
                *xv = _mm512_loadu_ps(p.add(q * cols * 8 + 16 * k));
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let wv = _mm512_castpd_ps(_mm512_set1_pd(
                    wp.add(i * cols + 2 * k).cast::<f64>().read_unaligned(),
                ));
                for (a, x) in acc.iter_mut().zip(&xv) {
                    *a = _mm512_fmadd_ps(wv, *x, *a);
                }
            }
        }
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
        for (i, acc) in acc.iter().enumerate() {
            for (q, a) in acc.iter().enumerate() {
                let j0 = 8 * (b + q);
                let lanes = (n - j0).min(8);
                let t = _mm512_add_ps(*a, _mm512_permute_ps::<0b10_11_00_01>(*a));
                let sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, t));
                let at = (r + i) * n + j0;
                if lanes == 8 {
                    _mm256_storeu_ps(out.as_mut_ptr().add(at), sums);
                } else {
                    let mut v = [0.0f32; 8];
                    _mm256_storeu_ps(v.as_mut_ptr(), sums);
                    out[at..at + lanes].copy_from_slice(&v[..lanes]);
                }
            }
        }
    }
}
