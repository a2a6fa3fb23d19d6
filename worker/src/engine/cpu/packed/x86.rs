//! The AVX2 paths of the packed kinds: unpacking to bytes, dequantization, and the
//! integer products of block pairs.

use std::arch::x86_64::*;

/// [`super::unpack_raw_blocks`] for 6-bit (`six`) or 5-bit blocks. A block's values
/// are its nibbles (low nibbles, then high) with two high bits (one for 5-bit) put
/// above them: element `8g + l` takes bits `2g, 2g + 1` of high byte `l` (6-bit), or
/// bit `g` of byte `l % 4` shifted down by `4 · (l / 4)` (5-bit). Broadcasting the
/// high bytes to the four 64-bit lanes and shifting lane `g` right by `2g` (or `g`)
/// puts each element's bits at the bottom of its byte: the bits a shift pulls in
/// from the next byte lie above those the mask keeps.
///
/// # Safety
/// Needs AVX2; `qs` whole blocks and `out` 32 bytes for each.
#[target_feature(enable = "avx2")]
pub unsafe fn unpack_raw_blocks(six: bool, qs: &[u8], out: &mut [u8]) {
    let bb = if six { 24 } else { 20 };
    // SAFETY: block `i` reads `bb` bytes at `bb·i` and writes 32 at `32·i`, in bounds
    // by the caller's contract.
    unsafe {
        let nib = _mm_set1_epi8(0x0F);
        let (shifts, keep) = if six {
            (_mm256_setr_epi64x(0, 2, 4, 6), _mm256_set1_epi8(3))
        } else {
            (_mm256_setr_epi64x(0, 1, 2, 3), _mm256_set1_epi8(1))
        };
        for (i, block) in qs.chunks_exact(bb).enumerate() {
            let v = _mm_loadu_si128(block.as_ptr().cast());
            let lo = _mm_and_si128(v, nib);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
            let values = _mm256_set_m128i(hi, lo);
            let high = if six {
                u64::from_le_bytes(block[16..24].try_into().expect("a whole block"))
            } else {
                let h = u32::from_le_bytes(block[16..20].try_into().expect("a whole block"));
                // Bytes 4..8: the same four shifted down by 4 (each byte on its own).
                u64::from(h) | (u64::from((h >> 4) & 0x0F0F_0F0F) << 32)
            };
            let bits = _mm256_srlv_epi64(_mm256_set1_epi64x(high as i64), shifts);
            let bits = _mm256_slli_epi16(_mm256_and_si256(bits, keep), 4);
            let o = out.as_mut_ptr().add(32 * i);
            _mm256_storeu_si256(o.cast(), _mm256_or_si256(values, bits));
        }
    }
}

use super::super::kernels::avx512::kind as wide;
use super::super::scales::x86::QuadScales;
use super::super::{hsum, load_tail, IntRows, QKind, WEIGHT_SLICE};
use super::IQ4_VALUES;

/// [`widen_pair`] for 5-bit blocks, in bytes: block `b` in the low 128-bit lane and
/// `b + 1` in the high one, each byte's fifth bit picked from the high bytes by a
/// shuffle and a mask (byte `i` of the nibbles is element `i`, or `16 + i` for the
/// high nibbles; its bit is bit `4·(l / 4) + g` of high byte `l % 4`, `l = i % 8`,
/// `g` its element group), then widened within lanes. Without `MINS` a clear fifth
/// bit makes the byte `q − 16 < 0`: the nibble with its top four bits set, and a
/// sign byte of ones.
///
/// # Safety
/// Needs AVX2; `p0` (and `p1` when `two`) point at whole blocks; `lo0`, `lo1` are
/// their nibbles (`lo1` zero when not `two`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_five<const MINS: bool>(
    p0: *const u8,
    p1: *const u8,
    lo0: __m128i,
    lo1: __m128i,
    two: bool,
) -> [__m256i; 4] {
    // SAFETY: the caller guarantees the blocks read are in bounds.
    unsafe {
        let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo0), lo1);
        let h0 = std::ptr::read_unaligned(p0.add(16).cast::<i32>());
        let h1 = if two {
            std::ptr::read_unaligned(p1.add(16).cast::<i32>())
        } else {
            0
        };
        let h = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_cvtsi32_si128(h0)),
            _mm_cvtsi32_si128(h1),
        );
        let h = _mm256_shuffle_epi8(
            h,
            _mm256_setr_epi8(
                0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                0, 1, 2, 3,
            ),
        );
        let low = _mm256_set1_epi8(0x0F);
        let nib = [
            _mm256_and_si256(v, low),
            _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
        ];
        // Bit of byte i: 4·((i % 8) / 4) + i / 8, plus 2 for the high nibbles.
        let bit = |i: i8, up: i8| 1i8.wrapping_shl((4 * ((i % 8) / 4) + i / 8 + up) as u32);
        let masks = [0i8, 2].map(|up| {
            let m: [i8; 16] = std::array::from_fn(|i| bit(i as i8, up));
            let m = _mm_loadu_si128(m.as_ptr().cast());
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(m), m)
        });
        let zero = _mm256_setzero_si256();
        let mut out = [zero; 4];
        for k in 0..2 {
            let t = _mm256_and_si256(h, masks[k]);
            if MINS {
                let set = _mm256_cmpeq_epi8(t, masks[k]);
                let y = _mm256_or_si256(nib[k], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
                out[2 * k] = _mm256_unpacklo_epi8(y, zero);
                out[2 * k + 1] = _mm256_unpackhi_epi8(y, zero);
            } else {
                let clear = _mm256_cmpeq_epi8(t, zero);
                let f0 = _mm256_set1_epi8(0xF0u8 as i8);
                let y = _mm256_or_si256(nib[k], _mm256_and_si256(clear, f0));
                out[2 * k] = _mm256_unpacklo_epi8(y, clear);
                out[2 * k + 1] = _mm256_unpackhi_epi8(y, clear);
            }
        }
        out
    }
}

/// [`widen_pair`] for IQ4's table indices: block `b` in the low 128-bit lane and
/// `b + 1` in the high one, each nibble looked up in the table by a byte shuffle,
/// then sign-extended within lanes.
///
/// # Safety
/// Needs AVX2; `lo0`, `lo1` are the blocks' index bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_table(lo0: __m128i, lo1: __m128i) -> [__m256i; 4] {
    // SAFETY: register operations only (the table is a local array).
    unsafe {
        let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo0), lo1);
        let t = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
        let table = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(t), t);
        let low = _mm256_set1_epi8(0x0F);
        let mut out = [_mm256_setzero_si256(); 4];
        for (k, nib) in [
            _mm256_and_si256(v, low),
            _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
        ]
        .into_iter()
        .enumerate()
        {
            let y = _mm256_shuffle_epi8(table, nib);
            let sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), y);
            out[2 * k] = _mm256_unpacklo_epi8(y, sign);
            out[2 * k + 1] = _mm256_unpackhi_epi8(y, sign);
        }
        out
    }
}

/// The weights of blocks `b`, `b + 1` of kind `K` ([`wide`]'s kinds) as four
/// vectors of sixteen i16 (element groups 0..4 of block `b` in the low eight
/// lanes, of block `b + 1` in the high eight), signed (5-bit values `q` as they are
/// with minimums, else `q − 16`; 6-bit `q − 32`; IQ4's table values). Block `b + 1`
/// reads as zeros when `two` is false.
///
/// # Safety
/// Needs AVX2; block `b` (and `b + 1` when `two`) inside `qs`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_pair<const K: u8>(qs: &[u8], b: usize, two: bool) -> [__m256i; 4] {
    let bb = wide::block_bytes(K);
    // SAFETY: the caller guarantees the blocks read are in bounds.
    unsafe {
        let p0 = qs.as_ptr().add(b * bb);
        let p1 = p0.add(bb);
        let lo0 = _mm_loadu_si128(p0.cast());
        let lo1 = if two {
            _mm_loadu_si128(p1.cast())
        } else {
            _mm_setzero_si128()
        };
        if K == wide::IQ4 {
            return widen_table(lo0, lo1);
        }
        if K == wide::FIVE_MIN {
            return widen_five::<true>(p0, p1, lo0, lo1, two);
        }
        if K != wide::SIX {
            return widen_five::<false>(p0, p1, lo0, lo1, two);
        }
        // Bytes 0..8 of both blocks (groups 0 and 2), then bytes 8..16 (1 and 3).
        let a = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(lo0, lo1));
        let c = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(lo0, lo1));
        let low = _mm256_set1_epi16(0x0F);
        let nib = [
            _mm256_and_si256(a, low),
            _mm256_and_si256(c, low),
            _mm256_srli_epi16(a, 4),
            _mm256_srli_epi16(c, 4),
        ];
        let h0 = _mm_loadl_epi64(p0.add(16).cast());
        let h1 = if two {
            _mm_loadl_epi64(p1.add(16).cast())
        } else {
            _mm_setzero_si128()
        };
        // Lane l of each half: the high bit pairs of elements l + 8g at 2g.
        let h = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(h0, h1));
        let m = _mm256_set1_epi16(0x30);
        let bias = _mm256_set1_epi16(32);
        let high = [
            _mm256_and_si256(_mm256_slli_epi16(h, 4), m),
            _mm256_and_si256(_mm256_slli_epi16(h, 2), m),
            _mm256_and_si256(h, m),
            _mm256_and_si256(_mm256_srli_epi16(h, 2), m),
        ];
        std::array::from_fn(|g| _mm256_sub_epi16(_mm256_or_si256(nib[g], high[g]), bias))
    }
}

/// One weight row against `R` input rows starting at `x` (quad layout), a block
/// pair at a time: the lanes of the 8-bit kernel, one sum a block (5-bit) or one
/// per half (6-bit, each scaled on its own); for kinds with minimums, their terms after
/// the quads, sixteen blocks at a time, as the 4-bit kernel adds them.
///
/// # Safety
/// Needs AVX2 and FMA; `qs` and `scales` hold `nb` blocks; `qz`, `ez` point at `R`
/// rows in the quad layout, and for kinds with minimums `sums` at their `R` rows of
/// block sums.
#[inline]
#[allow(clippy::needless_range_loop)] // `k` also offsets the input pointers
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_pairs<const K: u8, const R: usize, S: QuadScales>(
    nb: usize,
    qs: &[u8],
    scales: S,
    qz: *const i16,
    ez: *const f32,
    sums: *const f32,
) -> [f32; R] {
    let (six, mins) = (K == wide::SIX, wide::has_mins(K));
    let quads = nb.div_ceil(4);
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    // SAFETY (the loads): blocks below `nb`, quads below `quads`, rows below `R`,
    // in bounds by the caller's contract.
    unsafe {
        for q in 0..quads {
            let halves = if six {
                scales.quad_halves(q, nb)
            } else {
                scales.quad(q, nb).map(|d| [d, d])
            };
            for (h, &[da, db]) in halves.iter().enumerate() {
                let b = 4 * q + 2 * h;
                if b >= nb {
                    break;
                }
                let bb = wide::block_bytes(K);
                _mm_prefetch::<_MM_HINT_T0>(qs.as_ptr().wrapping_add(b * bb + 4096).cast());
                let two = b + 1 < nb;
                let w = widen_pair::<K>(qs, b, two);
                for k in 0..R {
                    let p = qz.add(128 * quads * k + 128 * q + 16 * h);
                    let x = |g: usize| _mm256_loadu_si256(p.add(32 * g).cast());
                    let s01 = _mm256_add_epi32(
                        _mm256_madd_epi16(w[0], x(0)),
                        _mm256_madd_epi16(w[1], x(1)),
                    );
                    let s23 = _mm256_add_epi32(
                        _mm256_madd_epi16(w[2], x(2)),
                        _mm256_madd_epi16(w[3], x(3)),
                    );
                    let e = _mm256_loadu_ps(ez.add(16 * quads * k + 16 * q + 8 * h));
                    acc[h][k] = if six {
                        let a = _mm256_fmadd_ps(
                            _mm256_mul_ps(da, e),
                            _mm256_cvtepi32_ps(s01),
                            acc[h][k],
                        );
                        _mm256_fmadd_ps(_mm256_mul_ps(db, e), _mm256_cvtepi32_ps(s23), a)
                    } else {
                        _mm256_fmadd_ps(
                            _mm256_mul_ps(da, e),
                            _mm256_cvtepi32_ps(_mm256_add_epi32(s01, s23)),
                            acc[h][k],
                        )
                    };
                }
            }
        }
        if mins {
            for c in 0..nb.div_ceil(16) {
                for h in 0..2 {
                    let at = 16 * c + 8 * h;
                    let mv = scales.mins8(at, nb);
                    for k in 0..R {
                        let sk = load_tail(sums.add(nb * k), at, nb);
                        acc[h][k] = _mm256_fmadd_ps(mv, sk, acc[h][k]);
                    }
                }
            }
        }
    }
    std::array::from_fn(|k| hsum(_mm256_add_ps(acc[0][k], acc[1][k])))
}

/// [`super::dequant_row`] on AVX2: each value times its scale (then plus its
/// minimum, for kinds with minimums), the portable loop's roundings.
///
/// # Safety
/// Needs AVX2 and FMA; `qs`, `scales`, `out` (and `mins` for kinds with minimums)
/// hold the same number of blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dequant_row<const K: u8>(qs: &[u8], scales: &[f32], mins: &[f32], out: &mut [f32]) {
    let nb = out.len() / 32;
    let (six, mins_too) = (K == wide::SIX, wide::has_mins(K));
    let spb = wide::units(K);
    let mut b = 0;
    while b < nb {
        let two = b + 1 < nb;
        // SAFETY: blocks `b` (and `b + 1` when `two`) are inside every slice.
        unsafe {
            let w = widen_pair::<K>(qs, b, two);
            for (k, blk) in [(0usize, b), (1, b + 1)] {
                if k == 1 && !two {
                    break;
                }
                for (g, w) in w.iter().enumerate() {
                    let half = if k == 0 {
                        _mm256_castsi256_si128(*w)
                    } else {
                        _mm256_extracti128_si256::<1>(*w)
                    };
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half));
                    let d = *scales.get_unchecked(spb * blk + if six { g / 2 } else { 0 });
                    let o = out.as_mut_ptr().add(32 * blk + 8 * g);
                    let mut y = _mm256_mul_ps(v, _mm256_set1_ps(d));
                    if mins_too {
                        y = _mm256_add_ps(y, _mm256_set1_ps(*mins.get_unchecked(blk)));
                    }
                    _mm256_storeu_ps(o, y);
                }
            }
        }
        b += 2;
    }
}

/// [`super::dot_int_rows`] on AVX2: weight rows in slices that stay in cache while
/// every input row asked for passes, four input rows at a time (then one).
///
/// # Safety
/// Needs AVX2 and FMA; the lengths as [`super::dot_int_rows`] checks them.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_int_rows<const K: u8, S: QuadScales>(
    nb: usize,
    qs: &[u8],
    scales: S,
    x: IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (bb, spb, mins) = (wide::block_bytes(K), wide::units(K), wide::has_mins(K));
    let (m, n) = (scales.units() / (nb * spb), x.d.len() / nb);
    let quads = nb.div_ceil(4);
    for s0 in (0..m).step_by(WEIGHT_SLICE) {
        let s1 = (s0 + WEIGHT_SLICE).min(m);
        let mut j = rows.start;
        while j < rows.end {
            let take = if j + 4 <= rows.end { 4 } else { 1 };
            // SAFETY: input rows `j..j + take` (below `rows.end <= n`) and weight
            // row `r < m` are in bounds of every slice by the caller's checks.
            unsafe {
                let qz = x.qz.as_ptr().add(128 * quads * j);
                let ez = x.ez.as_ptr().add(16 * quads * j);
                let sums = if mins {
                    x.sums.as_ptr().add(nb * j)
                } else {
                    x.sums.as_ptr()
                };
                for r in s0..s1 {
                    let wq = qs.get_unchecked(bb * nb * r..bb * nb * (r + 1));
                    let (u0, u1) = (spb * nb * r, spb * nb * (r + 1));
                    let ws = if mins {
                        scales.slice(u0, u1, nb * r, nb * (r + 1))
                    } else {
                        scales.slice(u0, u1, 0, 0)
                    };
                    let o = out.get_unchecked_mut(n * r + j..n * r + j + take);
                    if take == 4 {
                        let v = dot_pairs::<K, 4, S>(nb, wq, ws, qz, ez, sums);
                        o.copy_from_slice(&v);
                    } else {
                        o[0] = dot_pairs::<K, 1, S>(nb, wq, ws, qz, ez, sums)[0];
                    }
                }
            }
            j += take;
        }
    }
}

/// [`dot_int_rows`] for the kind `kind`.
///
/// # Safety
/// As [`dot_int_rows`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_int_rows_of<S: QuadScales>(
    kind: QKind,
    nb: usize,
    qs: &[u8],
    scales: S,
    x: IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe {
        match kind {
            QKind::Six => dot_int_rows::<{ wide::SIX }, S>(nb, qs, scales, x, rows, out),
            QKind::FiveMin => dot_int_rows::<{ wide::FIVE_MIN }, S>(nb, qs, scales, x, rows, out),
            QKind::Iq4 => dot_int_rows::<{ wide::IQ4 }, S>(nb, qs, scales, x, rows, out),
            _ => dot_int_rows::<{ wide::FIVE }, S>(nb, qs, scales, x, rows, out),
        }
    }
}
