//! The AVX-512 kernels (F, BW, VNNI): a quad of blocks to one 512-bit vector. Every lane
//! adds what the same lane of the AVX2 kernel adds, in the same order, so both give the
//! same bits.

use std::arch::x86_64::*;

use super::avx2::{hsum, QuadRows};
use crate::engine::cpu::scales::x86_wide::WideScales;
use crate::engine::cpu::QKind;
use crate::engine::gguf::dequant::IQ4_VALUES;

/// The kinds of block [`dot_int_quad`] widens (a `const` parameter: the kernel is
/// compiled once for each).
pub mod kind {
    /// 4-bit values with a minimum ([`crate::engine::cpu::QKind::Nibble`]).
    pub const NIBBLE: u8 = 0;
    /// 8-bit values ([`crate::engine::cpu::QKind::Byte`]).
    pub const BYTE: u8 = 1;
    /// Packed 5-bit values `q − 16` ([`crate::engine::cpu::QKind::Five`]).
    pub const FIVE: u8 = 2;
    /// Packed 5-bit values with a minimum ([`crate::engine::cpu::QKind::FiveMin`]).
    pub const FIVE_MIN: u8 = 3;
    /// Packed 6-bit values `q − 32`, a scale a half-block ([`crate::engine::cpu::QKind::Six`]).
    pub const SIX: u8 = 4;
    /// 4-bit indices into IQ4's table ([`crate::engine::cpu::QKind::Iq4`]).
    pub const IQ4: u8 = 5;

    /// Bytes of one block of kind `k` (values and high bits; scales apart).
    pub const fn block_bytes(k: u8) -> usize {
        match k {
            NIBBLE | IQ4 => 16,
            BYTE => 32,
            FIVE | FIVE_MIN => 20,
            _ => 24,
        }
    }

    /// Whether blocks of kind `k` have minimums (and so the inputs' block sums).
    pub const fn has_mins(k: u8) -> bool {
        k == NIBBLE || k == FIVE_MIN
    }

    /// Scales a block: two for 6-bit blocks (one a half), else one.
    pub const fn units(k: u8) -> usize {
        if k == SIX {
            2
        } else {
            1
        }
    }
}

/// The first `bytes` (below 128) of the two 64-byte lines at `p`, zeros past them: a
/// partial quad read without touching memory beyond its last block.
///
/// # Safety
/// Needs AVX-512 BW; `bytes` readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn masked_lines(p: *const u8, bytes: usize) -> (__m512i, __m512i) {
    let mask = |n: usize| -> u64 {
        if n >= 64 {
            u64::MAX
        } else {
            (1u64 << n) - 1
        }
    };
    // SAFETY: the masks load no byte at or past `bytes`, readable by the contract.
    unsafe {
        (
            _mm512_maskz_loadu_epi8(mask(bytes), p.cast()),
            _mm512_maskz_loadu_epi8(mask(bytes.saturating_sub(64)), p.add(64).cast()),
        )
    }
}

/// A quad of packed blocks (`blocks` of them, 1..=4, from `p`) as the four vectors
/// of 32 i16 of the quad layout: 128-bit lane `i` holds element group `g` of block
/// `i` in vector `g`, as [`crate::engine::cpu::packed`]'s AVX2 widening puts block
/// pairs in 256-bit vectors. The blocks are gathered by one or two permutes of
/// 32- or 64-bit words (5-bit blocks are 20 bytes, 6-bit ones 24; IQ4's 16 need
/// none, their indices looked up by a byte shuffle); blocks past `blocks` read as
/// zeros.
///
/// # Safety
/// Needs AVX-512 F/BW; `blocks` whole blocks of kind `K` at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn widen_packed<const K: u8>(p: *const u8, blocks: usize) -> [__m512i; 4] {
    let bb = kind::block_bytes(K);
    // SAFETY: full quads lie inside the row by the caller's contract; a partial
    // one is read through masks that stop at its last block.
    unsafe {
        if K == kind::IQ4 {
            let v = if blocks == 4 {
                _mm512_loadu_si512(p.cast())
            } else {
                _mm512_maskz_loadu_epi8((1u64 << (16 * blocks)) - 1, p.cast())
            };
            let t = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
            let table = _mm512_broadcast_i32x4(t);
            let low = _mm512_set1_epi8(0x0F);
            let mut out = [_mm512_setzero_si512(); 4];
            for (k, nib) in [
                _mm512_and_si512(v, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
            ]
            .into_iter()
            .enumerate()
            {
                let y = _mm512_shuffle_epi8(table, nib);
                let sign = _mm512_movm_epi8(_mm512_movepi8_mask(y));
                out[2 * k] = _mm512_unpacklo_epi8(y, sign);
                out[2 * k + 1] = _mm512_unpackhi_epi8(y, sign);
            }
            return out;
        }
        let (v0, v1) = if blocks == 4 {
            let tail = if K == kind::SIX {
                _mm512_castsi256_si512(_mm256_loadu_si256(p.add(64).cast()))
            } else {
                _mm512_castsi128_si512(_mm_loadu_si128(p.add(64).cast()))
            };
            (_mm512_loadu_si512(p.cast()), tail)
        } else {
            masked_lines(p, bb * blocks)
        };
        if K == kind::SIX {
            // Block i: nibble bytes in qwords 3i and 3i + 1, high bit pairs in 3i + 2.
            let lows = _mm512_permutex2var_epi64(v0, _mm512_set_epi64(10, 7, 4, 1, 9, 6, 3, 0), v1);
            let highs =
                _mm512_permutex2var_epi64(v0, _mm512_set_epi64(0, 0, 0, 0, 11, 8, 5, 2), v1);
            // Bytes 0..8 (groups 0 and 2) and 8..16 (1 and 3) of each block, widened.
            let a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lows));
            let c = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(lows));
            let h = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(highs));
            let low = _mm512_set1_epi16(0x0F);
            let m = _mm512_set1_epi16(0x30);
            let bias = _mm512_set1_epi16(32);
            let nib = [
                _mm512_and_si512(a, low),
                _mm512_and_si512(c, low),
                _mm512_srli_epi16::<4>(a),
                _mm512_srli_epi16::<4>(c),
            ];
            let high = [
                _mm512_and_si512(_mm512_slli_epi16::<4>(h), m),
                _mm512_and_si512(_mm512_slli_epi16::<2>(h), m),
                _mm512_and_si512(h, m),
                _mm512_and_si512(_mm512_srli_epi16::<2>(h), m),
            ];
            return std::array::from_fn(|g| {
                _mm512_sub_epi16(_mm512_or_si512(nib[g], high[g]), bias)
            });
        }
        // 5-bit: block i's nibbles in dwords 5i..5i + 4, its fifth bits in 5i + 4
        // (copied to all four dwords of its lane, as the AVX2 shuffle does).
        let v = _mm512_permutex2var_epi32(
            v0,
            _mm512_setr_epi32(0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 18),
            v1,
        );
        let h = _mm512_permutex2var_epi32(
            v0,
            _mm512_setr_epi32(4, 4, 4, 4, 9, 9, 9, 9, 14, 14, 14, 14, 19, 19, 19, 19),
            v1,
        );
        let low = _mm512_set1_epi8(0x0F);
        let nib = [
            _mm512_and_si512(v, low),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
        ];
        // Bit of byte i: 4·((i % 8) / 4) + i / 8, plus 2 for the high nibbles.
        let bit = |i: i8, up: i8| 1i8.wrapping_shl((4 * ((i % 8) / 4) + i / 8 + up) as u32);
        let masks = [0i8, 2].map(|up| {
            let m: [i8; 16] = std::array::from_fn(|i| bit(i as i8, up));
            _mm512_broadcast_i32x4(_mm_loadu_si128(m.as_ptr().cast()))
        });
        let mut out = [_mm512_setzero_si512(); 4];
        for k in 0..2 {
            if K == kind::FIVE_MIN {
                let set = _mm512_test_epi8_mask(h, masks[k]);
                let y = _mm512_mask_add_epi8(nib[k], set, nib[k], _mm512_set1_epi8(0x10));
                let zero = _mm512_setzero_si512();
                out[2 * k] = _mm512_unpacklo_epi8(y, zero);
                out[2 * k + 1] = _mm512_unpackhi_epi8(y, zero);
            } else {
                // A clear fifth bit makes the value q − 16 < 0: the nibble with its
                // top four bits set, and a sign byte of ones.
                let clear = _mm512_testn_epi8_mask(h, masks[k]);
                let y = _mm512_mask_add_epi8(nib[k], clear, nib[k], _mm512_set1_epi8(0xF0u8 as i8));
                let sign = _mm512_movm_epi8(clear);
                out[2 * k] = _mm512_unpacklo_epi8(y, sign);
                out[2 * k + 1] = _mm512_unpackhi_epi8(y, sign);
            }
        }
        out
    }
}

/// `W` weight rows (`W · x.nb` blocks of kind `K` in `qs`, their scales and
/// minimums in either form: see [`WideScales`]) against `R` input rows on 512-bit
/// vectors, a quad of four blocks at a time: each weight quad is widened once to
/// four vectors of 32 i16 in the quad layout (for 4- and 8-bit blocks one `vpermq`
/// puts each block's bytes where its four lanes are; packed blocks as
/// [`widen_packed`] does), then every input row takes one `vpmaddwd`, three
/// `vpdpwssd` and one scaled FMA per weight row (two for 6-bit blocks, a scale a
/// half), four blocks to the vector. A last partial quad is read through masks
/// (zeros, scale 0). Minimum terms follow the quads, sixteen blocks to a vector
/// (one FMA per sixteen blocks, where folding them into the quads took one per
/// four). Every lane adds what the same lane of the AVX2 kernel (`dot_int_half`,
/// or the packed kinds' `dot_pairs`) adds, in the same order, so the results are
/// bitwise its results.
///
/// # Safety
/// Needs AVX-512 F/BW/VNNI, AVX2 and FMA; `qs` and `scales` (with minimums for the
/// kinds that have them) hold `W · x.nb` blocks, whole super-blocks for
/// super-block scales; `x` points at `R` rows laid out as [`super::IntRows`]
/// describes.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` also offsets the input pointers
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn dot_int_quad<const K: u8, const R: usize, const W: usize, S: WideScales>(
    qs: &[u8],
    scales: S,
    x: QuadRows,
) -> [[f32; R]; W] {
    let nb = x.nb;
    let quads = nb.div_ceil(4);
    let bb = kind::block_bytes(K);
    let mut acc = [[_mm512_setzero_ps(); R]; W];
    let mut out = [[0.0f32; R]; W];
    // SAFETY (the loads): full quads lie inside every row by the caller's
    // contract; a partial one is read through masks that stop at the row's end.
    unsafe {
        let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        // Two units a block: the first halves' (units 0, 2, 4, 6 of eight) and the
        // second halves' (1, 3, 5, 7).
        let spread_first = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
        let spread_second = _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1);
        // Quad bytes (qwords b0 b0' b1 b1' …) to b0 b1 b2 b3 | b0' b1' b2' b3'.
        let nibble_order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
        // Two 64-byte halves of a quad of bytes to groups 0, 1 | 2, 3.
        let byte_first = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
        let byte_second = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
        let low = _mm512_set1_epi16(0x0F);
        for q in 0..quads {
            let blocks = (nb - 4 * q).min(4);
            let mut w = [[_mm512_setzero_si512(); 4]; W];
            // Each block's scale in its four lanes; for 6-bit blocks those of the
            // first halves, and the second halves' in `d2`.
            let mut d = [_mm512_setzero_ps(); W];
            let mut d2 = [_mm512_setzero_ps(); W];
            for i in 0..W {
                let at = i * nb + 4 * q;
                let u = kind::units(K) * at;
                let [ahead_scale, ahead_min] = scales.ahead(u + 256);
                if S::FLAT {
                    _mm_prefetch::<_MM_HINT_T0>(ahead_scale.cast());
                }
                if K == kind::SIX {
                    let units = 2 * blocks;
                    let lo = scales.four(u, units.min(4));
                    let hi = if units > 4 {
                        scales.four(u + 4, units - 4)
                    } else {
                        _mm_setzero_ps()
                    };
                    let eight = _mm512_insertf32x4::<1>(_mm512_castps128_ps512(lo), hi);
                    d[i] = _mm512_permutexvar_ps(spread_first, eight);
                    d2[i] = _mm512_permutexvar_ps(spread_second, eight);
                } else {
                    let sc = _mm512_castps128_ps512(scales.four(at, blocks));
                    d[i] = _mm512_permutexvar_ps(spread, sc);
                }
                // The minimums as far ahead (256 blocks): they are read after the
                // quads, too late for the hardware to fetch them.
                if S::FLAT && kind::has_mins(K) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead_min.cast());
                }
                let p = qs.as_ptr().add(at * bb);
                w[i] = if K == kind::NIBBLE {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096).cast());
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
                } else if K == kind::BYTE {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(8192).cast());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(8192 + 64).cast());
                    let (v0, v1) = if blocks == 4 {
                        (
                            _mm512_loadu_si512(p.cast()),
                            _mm512_loadu_si512(p.add(64).cast()),
                        )
                    } else {
                        masked_lines(p, 32 * blocks)
                    };
                    let f = _mm512_permutex2var_epi64(v0, byte_first, v1);
                    let s = _mm512_permutex2var_epi64(v0, byte_second, v1);
                    [
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(f)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(f)),
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(s)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(s)),
                    ]
                } else {
                    // 64, 80 or 96 bytes a quad: up to two lines ahead.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096).cast());
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096 + 64).cast());
                    widen_packed::<K>(p, blocks)
                };
            }
            // `vpdpwssd` itself: without a tuning that says it is fast, the compiler
            // splits its intrinsic into `vpmaddwd` and `vpaddd`, one more operation
            // each.
            macro_rules! dp {
                ($s:expr, $w:expr, $x:expr) => {{
                    let mut s = $s;
                    std::arch::asm!(
                        "vpdpwssd {s}, {w}, {x}",
                        s = inout(zmm_reg) s,
                        w = in(zmm_reg) $w,
                        x = in(zmm_reg) $x,
                        options(pure, nomem, nostack),
                    );
                    s
                }};
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
                    // `vpdpwssd` itself: without a tuning that says it is fast,
                    // the compiler splits its intrinsic into `vpmaddwd` and
                    // `vpaddd`, one more operation each.
                    if K == kind::SIX {
                        // Each half's sum scaled on its own, the first half's first.
                        let s01 = dp!(_mm512_madd_epi16(w[i][0], xs[0]), w[i][1], xs[1]);
                        let s23 = dp!(_mm512_madd_epi16(w[i][2], xs[2]), w[i][3], xs[3]);
                        let a = _mm512_fmadd_ps(
                            _mm512_mul_ps(d[i], e),
                            _mm512_cvtepi32_ps(s01),
                            acc[i][k],
                        );
                        acc[i][k] =
                            _mm512_fmadd_ps(_mm512_mul_ps(d2[i], e), _mm512_cvtepi32_ps(s23), a);
                    } else {
                        let mut s = _mm512_madd_epi16(w[i][0], xs[0]);
                        for g in 1..4 {
                            s = dp!(s, w[i][g], xs[g]);
                        }
                        acc[i][k] = _mm512_fmadd_ps(
                            _mm512_mul_ps(d[i], e),
                            _mm512_cvtepi32_ps(s),
                            acc[i][k],
                        );
                    }
                }
            }
        }
        if kind::has_mins(K) {
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

/// [`super::dot_int_rows`] (and [`crate::engine::cpu::packed::dot_int_rows`]) with
/// [`dot_int_quad`]: weight rows in slices of [`super::WEIGHT_SLICE`], each slice
/// against every input row asked for (so a slice is read from memory once and stays
/// in cache while the inputs pass), four input rows at a time (then one) against
/// three weight rows at a time (then what is left).
///
/// # Safety
/// Needs AVX-512 F/BW/VNNI, AVX2 and FMA; the lengths as
/// [`super::dot_int_rows`] checks them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn dot_int_rows_wide<const K: u8, S: WideScales>(
    nb: usize,
    qs: &[u8],
    scales: S,
    x: super::IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let upb = kind::units(K);
    let (m, n) = (scales.units() / (upb * nb), x.d.len() / nb);
    let bb = kind::block_bytes(K);
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
                let inputs = QuadRows::at(x, nb, j, kind::has_mins(K));
                let take = if rows.end - j >= 4 { 4 } else { 1 };
                let mut r = s0;
                while r < s1 {
                    let wr = (s1 - r).min(if take == 4 { WMAX } else { 1 });
                    let wq = qs.get_unchecked(bb * nb * r..bb * nb * (r + wr));
                    let (b0, b1) = (nb * r, nb * (r + wr));
                    let ws = scales.slice(upb * b0, upb * b1, b0, b1);
                    macro_rules! run {
                        ($r:literal, $w:literal) => {{
                            let v = dot_int_quad::<K, $r, $w, S>(wq, ws, inputs);
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

/// [`dot_int_rows_wide`] for blocks of `kind`.
///
/// # Safety
/// As [`dot_int_rows_wide`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub unsafe fn dot_int_rows_of<S: WideScales>(
    kind: QKind,
    nb: usize,
    qs: &[u8],
    scales: S,
    x: super::IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe {
        match kind {
            QKind::Nibble => dot_int_rows_wide::<{ kind::NIBBLE }, S>(nb, qs, scales, x, rows, out),
            QKind::Byte => dot_int_rows_wide::<{ kind::BYTE }, S>(nb, qs, scales, x, rows, out),
            QKind::Five => dot_int_rows_wide::<{ kind::FIVE }, S>(nb, qs, scales, x, rows, out),
            QKind::FiveMin => {
                dot_int_rows_wide::<{ kind::FIVE_MIN }, S>(nb, qs, scales, x, rows, out)
            }
            QKind::Six => dot_int_rows_wide::<{ kind::SIX }, S>(nb, qs, scales, x, rows, out),
            QKind::Iq4 => dot_int_rows_wide::<{ kind::IQ4 }, S>(nb, qs, scales, x, rows, out),
            QKind::F16 | QKind::Bf16 => unreachable!("16-bit floats have no integer kernel"),
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
