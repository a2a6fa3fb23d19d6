//! 5- and 6-bit weights kept packed as the file has them (GGUF Q5_0 and Q6_K), with
//! integer products that unpack them in registers.
//!
//! A 32-value block is its low nibbles (16 bytes: byte `i` holds element `i` in its low
//! nibble and element `i + 16` in its high one, as 4-bit blocks do) followed by its high
//! bits, laid out so that one widening puts them in the lanes the quad layout of the
//! inputs gives each element ([`super::Prepared`]: element group `g` of a block
//! is elements `8g..8g + 8`):
//! - 5-bit ([`QKind::Five`], Q5_0): 4 bytes; byte `k` holds lanes `l = k` (low nibble)
//!   and `l = k + 4` (high nibble), bit `g` of the nibble being element `8g + l`'s fifth
//!   bit. The value is `q − 16`, one scale a block: the block sum is the one an 8-bit
//!   block of the same values gives, so the products are bitwise those of Q5_0 kept as
//!   bytes, in 6 bits a weight instead of 9.
//! - 5-bit with a minimum ([`QKind::FiveMin`], Q5_1 and Q5_K): as 5-bit, the value
//!   `q` itself and a minimum a block (`w = q·d + m`, added as 4-bit blocks add theirs).
//! - 6-bit ([`QKind::Six`], Q6_K): 8 bytes; byte `l` holds the two high bits of
//!   elements `l`, `l + 8`, `l + 16`, `l + 24` at bits 0, 2, 4, 6. The value is `q − 32`
//!   and each half of a block (16 values) has its own scale (`d · sc`, exact in f32),
//!   so a block gives two sums, each scaled and added on its own: 8 bits a weight
//!   (the file's 6.56; 9 as the Q8_0 it was converted to before, with a second
//!   rounding).
//!
//! On x86-64 with AVX2 a block pair is unpacked to 16-bit lanes and multiplied as the
//! 8-bit kernel does ([`super::blocks`]); with AVX-512 a quad of blocks is unpacked to
//! 512-bit vectors by the wide kernel (`kernels::avx512`), every lane adding what the AVX2
//! kernel's adds in the same order, so every x86 worker gives these products the same
//! bits.

#[cfg(target_arch = "x86_64")]
use super::kernels::avx512::{self, kind as wide};
use super::kernels::IntKernel;
use super::scales::{ScaleRows, SUPER_BLOCKS};
use super::{IntRows, QKind, BLOCK};
use crate::engine::gguf::dequant::{scale_min_k4, IQ4_VALUES};

/// Bytes of one packed block of `kind` (values and high bits; scales apart).
pub const fn block_bytes(kind: QKind) -> usize {
    match kind {
        QKind::Five | QKind::FiveMin => 20,
        QKind::Six => 24,
        QKind::Nibble | QKind::Iq4 => 16,
        QKind::Byte => 32,
        // 32 values of 16 bits.
        QKind::F16 | QKind::Bf16 => 64,
    }
}

/// Scales per block: one, or one per half for 6-bit blocks (none for 16-bit floats).
pub const fn scales_per_block(kind: QKind) -> usize {
    match kind {
        QKind::Six => 2,
        QKind::F16 | QKind::Bf16 => 0,
        _ => 1,
    }
}

/// The values of 32 elements packed as `kind` (5- or 6-bit, or IQ4's table values;
/// signed but for [`QKind::FiveMin`]'s `0..32`).
pub fn unpack(kind: QKind, block: &[u8]) -> [i8; BLOCK] {
    let mut v = [0i8; BLOCK];
    let (low, high) = block.split_at(16);
    for i in 0..16 {
        v[i] = (low[i] & 0x0F) as i8;
        v[i + 16] = (low[i] >> 4) as i8;
    }
    match kind {
        QKind::Iq4 => {
            for v in &mut v {
                *v = IQ4_VALUES[*v as usize];
            }
        }
        QKind::Five | QKind::FiveMin => {
            let bias = if kind == QKind::Five { 16 } else { 0 };
            for (e, v) in v.iter_mut().enumerate() {
                let (g, l) = (e / 8, e % 8);
                let bit = (high[l % 4] >> (4 * (l / 4) + g)) & 1;
                *v = (*v | (bit << 4) as i8) - bias;
            }
        }
        QKind::Six => {
            for (e, v) in v.iter_mut().enumerate() {
                let (g, l) = (e / 8, e % 8);
                let bits = (high[l] >> (2 * g)) & 3;
                *v = (*v | (bits << 4) as i8) - 32;
            }
        }
        _ => unreachable!("not a packed kind"),
    }
    v
}

/// The unsigned values of 32 elements packed as `kind`, as stored (5- or 6-bit values
/// before their bias; IQ4's table values plus 128), into `out`; the bias to take off
/// is [`raw_offset`]. Written as whole-block byte operations so that it vectorises: a
/// prompt's products unpack every weight once a step.
pub fn unpack_raw(kind: QKind, block: &[u8], out: &mut [u8; BLOCK]) {
    let low: &[u8; 16] = block[..16].try_into().expect("a whole block");
    for i in 0..16 {
        out[i] = low[i] & 0x0F;
        out[i + 16] = low[i] >> 4;
    }
    match kind {
        QKind::Iq4 => {
            for v in out.iter_mut() {
                *v = (IQ4_VALUES[*v as usize] as u8) ^ 0x80;
            }
        }
        QKind::Five | QKind::FiveMin => {
            let high: &[u8; 4] = block[16..20].try_into().expect("a whole block");
            // Element 8g + l takes bit 4·(l / 4) + g of byte l % 4.
            let wide: [u8; 8] = std::array::from_fn(|l| high[l % 4] >> (4 * (l / 4)));
            for g in 0..4 {
                for l in 0..8 {
                    out[8 * g + l] |= ((wide[l] >> g) & 1) << 4;
                }
            }
        }
        QKind::Six => {
            let high: &[u8; 8] = block[16..24].try_into().expect("a whole block");
            for g in 0..4 {
                for l in 0..8 {
                    out[8 * g + l] |= ((high[l] >> (2 * g)) & 3) << 4;
                }
            }
        }
        _ => unreachable!("not a packed kind"),
    }
}

/// [`unpack_raw`] over whole rows of 5- and 6-bit blocks (`qs`, [`block_bytes`] each)
/// into `out` (32 bytes a block), a block at a time in 256-bit vectors where the CPU
/// has AVX2.
pub fn unpack_raw_blocks(kind: QKind, qs: &[u8], out: &mut [u8]) {
    let bb = block_bytes(kind);
    assert!(
        matches!(kind, QKind::Five | QKind::FiveMin | QKind::Six)
            && qs.len().is_multiple_of(bb)
            && out.len() == qs.len() / bb * BLOCK,
        "packed blocks disagree"
    );
    #[cfg(target_arch = "x86_64")]
    if super::kernels::available() {
        // SAFETY: AVX2 detected at run time; the lengths checked above.
        unsafe { x86::unpack_raw_blocks(kind == QKind::Six, qs, out) };
        return;
    }
    for (block, o) in qs.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        unpack_raw(kind, block, o.try_into().expect("whole blocks"));
    }
}

/// What [`unpack_raw`]'s values carry above the signed value [`unpack`] gives.
pub const fn raw_offset(kind: QKind) -> i32 {
    match kind {
        QKind::Five => 16,
        QKind::Six => 32,
        QKind::Iq4 => 128,
        _ => 0,
    }
}

/// Packs 32 values (`q + bias` in `0..32` or `0..64`) as `kind`, appending to `out`.
fn pack(kind: QKind, q: &[u8; BLOCK], out: &mut Vec<u8>) {
    out.extend((0..16).map(|i| (q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4)));
    match kind {
        QKind::Five | QKind::FiveMin => {
            let mut high = [0u8; 4];
            for (e, &q) in q.iter().enumerate() {
                let (g, l) = (e / 8, e % 8);
                high[l % 4] |= ((q >> 4) & 1) << (4 * (l / 4) + g);
            }
            out.extend_from_slice(&high);
        }
        QKind::Six => {
            let mut high = [0u8; 8];
            for (e, &q) in q.iter().enumerate() {
                let (g, l) = (e / 8, e % 8);
                high[l] |= ((q >> 4) & 3) << (2 * g);
            }
            out.extend_from_slice(&high);
        }
        _ => unreachable!("not a packed kind"),
    }
}

/// The 5-bit values of a Q5_0 or Q5_1 block: 32 fifth bits (`qh`, little-endian, bit
/// `e` for element `e`) and 16 bytes of nibbles (`lo`, byte `j` holding elements `j`
/// and `j + 16`).
fn q5_values(qh: &[u8], lo: &[u8]) -> [u8; BLOCK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; BLOCK];
    for (j, &byte) in lo.iter().enumerate() {
        q[j] = (byte & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Q5_0 blocks (`d`, 32 fifth bits, 16 bytes of nibbles) packed as [`QKind::Five`]:
/// appends the values to `qs` and each block's scale to `scales`.
pub fn from_q5_0(bytes: &[u8], qs: &mut Vec<u8>, scales: &mut Vec<f32>) {
    for b in bytes.chunks_exact(22) {
        scales.push(f16_at(b, 0));
        pack(QKind::Five, &q5_values(&b[2..6], &b[6..22]), qs);
    }
}

/// Q5_1 blocks (`d`, `m`, 32 fifth bits, 16 bytes of nibbles) packed as
/// [`QKind::FiveMin`]: appends the values to `qs` and each block's scale and minimum
/// to `scales` and `mins`.
pub fn from_q5_1(bytes: &[u8], qs: &mut Vec<u8>, scales: &mut Vec<f32>, mins: &mut Vec<f32>) {
    for b in bytes.chunks_exact(24) {
        scales.push(f16_at(b, 0));
        mins.push(f16_at(b, 2));
        pack(QKind::FiveMin, &q5_values(&b[4..8], &b[8..24]), qs);
    }
}

/// Q5_K super-blocks (`d`, `dmin`, 12 bytes of 6-bit scales and minimums, 32 bytes of
/// fifth bits, 128 of nibbles, for 256 values in 8 sub-blocks of 32) packed as
/// [`QKind::FiveMin`]: appends the values to `qs`, each sub-block's multipliers to
/// `mul` (scale) and `mmul` (minimum), and each super-block's `d` and `−dmin` to
/// `scales[0]` and `scales[1]` (as [`super::scales::Scales::Super`] keeps them).
pub fn from_q5_k(
    bytes: &[u8],
    qs: &mut Vec<u8>,
    [mul, mmul]: [&mut Vec<i8>; 2],
    [d, dmin]: [&mut Vec<f32>; 2],
) {
    for b in bytes.chunks_exact(176) {
        d.push(f16_at(b, 0));
        dmin.push(-f16_at(b, 2));
        let packed_scales = &b[4..16];
        let (qh, ql) = (&b[16..48], &b[48..176]);
        // Sub-block 2k: low nibbles of bytes 32k..32k + 32 and bit 2k of `qh`;
        // sub-block 2k + 1: their high nibbles and bit 2k + 1.
        for (k, ql) in ql.chunks_exact(32).enumerate() {
            for (sub, shift) in [(2 * k, 0), (2 * k + 1, 4)] {
                let (sc, mn) = scale_min_k4(sub, packed_scales);
                // 6-bit values: below 64.
                mul.push(sc as i8);
                mmul.push(mn as i8);
                let q: [u8; BLOCK] = std::array::from_fn(|l| {
                    ((ql[l] >> shift) & 0x0F) | (((qh[l] >> sub) & 1) << 4)
                });
                pack(QKind::FiveMin, &q, qs);
            }
        }
    }
}

/// Q6_K super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 signed 8-bit
/// scales, an f16 `d`, for 256 values in 16 groups of 16) packed as [`QKind::Six`]:
/// appends the values to `qs`, each 16 values' multiplier `sc` to `mul` and each
/// super-block's `d` to `d` (a unit's scale `d · sc` is exact in f32: an f16 times an
/// 8-bit integer).
pub fn from_q6_k(bytes: &[u8], qs: &mut Vec<u8>, mul: &mut Vec<i8>, d: &mut Vec<f32>) {
    for b in bytes.chunks_exact(210) {
        let (ql, rest) = b.split_at(128);
        let (qh, rest) = rest.split_at(64);
        let (sc, dd) = rest.split_at(16);
        d.push(f16_at(dd, 0));
        mul.extend(sc.iter().map(|&c| c as i8));
        // Element order as ggml's dequantization writes it.
        let mut q = [0u8; 256];
        for n in 0..2 {
            let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
            let y = &mut q[128 * n..];
            for l in 0..32 {
                y[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                y[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        for block in q.chunks_exact(BLOCK) {
            pack(QKind::Six, block.try_into().expect("32 values"), qs);
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// One row of `nb` packed blocks dequantized into `out` (`32 · nb` values), with the
/// blocks' scales ([`scales_per_block`] each) and minimums ([`QKind::FiveMin`]; empty
/// otherwise): `v·d`, then `+ m`, two roundings as ggml's dequantization has them.
pub fn dequant_row(kind: QKind, qs: &[u8], scales: &[f32], mins: &[f32], out: &mut [f32]) {
    let (bb, spb) = (block_bytes(kind), scales_per_block(kind));
    let nb = out.len() / BLOCK;
    assert!(
        kind.is_packed()
            && out.len() == nb * BLOCK
            && qs.len() == nb * bb
            && scales.len() == nb * spb
            && mins.len() == if kind.has_mins() { nb } else { 0 },
        "block slices disagree"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were detected at run time; the lengths are checked above.
        unsafe {
            match kind {
                QKind::Six => x86::dequant_row::<{ wide::SIX }>(qs, scales, mins, out),
                QKind::FiveMin => x86::dequant_row::<{ wide::FIVE_MIN }>(qs, scales, mins, out),
                QKind::Iq4 => x86::dequant_row::<{ wide::IQ4 }>(qs, scales, mins, out),
                _ => x86::dequant_row::<{ wide::FIVE }>(qs, scales, mins, out),
            }
        }
        return;
    }
    for (b, (block, o)) in qs
        .chunks_exact(bb)
        .zip(out.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let v = unpack(kind, block);
        for (i, (o, &v)) in o.iter_mut().zip(&v).enumerate() {
            *o = f32::from(v) * scales[spb * b + i * spb / BLOCK];
            if let Some(m) = mins.get(b) {
                *o += m;
            }
        }
    }
}

/// [`super::blocks`]'s integer product for packed weight rows: `m` rows of `nb` blocks
/// (`qs`, `scales` with [`scales_per_block`] a block) against input rows `rows` of `x`,
/// into `out: [m, n]`. With a vector `kernel` (inputs in the quad layout) every row's
/// result is bitwise the same on every x86 CPU, AVX2 or AVX-512, and whatever rows run
/// beside it; the portable loop gives the same sums up to the order of float additions.
#[allow(clippy::too_many_arguments)]
pub fn dot_int_rows(
    kernel: IntKernel,
    kind: QKind,
    nb: usize,
    qs: &[u8],
    scales: ScaleRows<'_>,
    x: IntRows<'_>,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (bb, spb) = (block_bytes(kind), scales_per_block(kind));
    assert!(kind.is_packed(), "not a packed kind");
    let m = scales.units().checked_div(nb * spb).unwrap_or(0);
    let n = x.d.len().checked_div(nb).unwrap_or(0);
    assert!(
        nb > 0
            && scales.units() == m * nb * spb
            && scales.min_blocks() == if kind.has_mins() { m * nb } else { 0 }
            && (!kind.has_mins() || x.sums.len() == x.d.len())
            && (matches!(scales, ScaleRows::Flat(_)) || nb.is_multiple_of(SUPER_BLOCKS))
            && qs.len() == m * nb * bb
            && x.d.len() == n * nb
            && x.q.len() == 32 * x.d.len()
            && rows.start <= rows.end
            && rows.end <= n
            && out.len() == m * n,
        "block slices disagree"
    );
    assert!(
        IntKernel::available().contains(&kernel),
        "{kernel:?} does not run on this CPU"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel != IntKernel::Portable {
        assert!(
            x.qz.len() == n * nb.div_ceil(4) * 128 && x.ez.len() == n * nb.div_ceil(4) * 16,
            "inputs in the quad layout missing"
        );
        // SAFETY: the kernel's features were detected at run time (above); the lengths
        // checked above put every block of every row asked for in bounds.
        unsafe {
            match (kernel, scales) {
                (IntKernel::Avx512, ScaleRows::Flat(f)) => {
                    avx512::dot_int_rows_of(kind, nb, qs, f, x, rows, out)
                }
                (IntKernel::Avx512, ScaleRows::Super(k)) => {
                    avx512::dot_int_rows_of(kind, nb, qs, k, x, rows, out)
                }
                (_, ScaleRows::Flat(f)) => x86::dot_int_rows_of(kind, nb, qs, f, x, rows, out),
                (_, ScaleRows::Super(k)) => x86::dot_int_rows_of(kind, nb, qs, k, x, rows, out),
            }
        }
        return;
    }
    for r in 0..m {
        for j in rows.clone() {
            let mut total = 0.0f32;
            for b in 0..nb {
                let (wb, xb) = (r * nb + b, j * nb + b);
                let p = &x.q[xb * 32..xb * 32 + 32];
                let v = unpack(kind, &qs[wb * bb..wb * bb + bb]);
                let half = |h: usize| -> i32 {
                    (16 * h..16 * h + 16)
                        .map(|i| i32::from(v[i]) * i32::from(p[i]))
                        .sum()
                };
                if kind == QKind::Six {
                    total += scales.unit(2 * wb) * x.d[xb] * half(0) as f32;
                    total += scales.unit(2 * wb + 1) * x.d[xb] * half(1) as f32;
                } else {
                    total += scales.unit(wb) * x.d[xb] * (half(0) + half(1)) as f32;
                }
                if kind.has_mins() {
                    total += scales.min(wb) * x.sums[xb];
                }
            }
            out[r * n + j] = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
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
                    0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1,
                    2, 3, 0, 1, 2, 3,
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
    pub unsafe fn dequant_row<const K: u8>(
        qs: &[u8],
        scales: &[f32],
        mins: &[f32],
        out: &mut [f32],
    ) {
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
                QKind::FiveMin => {
                    dot_int_rows::<{ wide::FIVE_MIN }, S>(nb, qs, scales, x, rows, out)
                }
                QKind::Iq4 => dot_int_rows::<{ wide::IQ4 }, S>(nb, qs, scales, x, rows, out),
                _ => dot_int_rows::<{ wide::FIVE }, S>(nb, qs, scales, x, rows, out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector dequantization gives the portable loop's bits.
    #[test]
    fn dequantized_rows_are_the_same_bits_everywhere() {
        for kind in [QKind::Five, QKind::Six, QKind::FiveMin] {
            for nb in [1, 2, 3, 8] {
                let qs: Vec<u8> = (0..nb * block_bytes(kind))
                    .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(7) as u8)
                    .collect();
                let scales: Vec<f32> = (0..nb * scales_per_block(kind))
                    .map(|i| 0.01 + i as f32 * 0.37e-3)
                    .collect();
                let mins: Vec<f32> = if kind.has_mins() {
                    (0..nb).map(|i| -0.3 + i as f32 * 0.071).collect()
                } else {
                    Vec::new()
                };
                let mut fast = vec![0.0f32; nb * BLOCK];
                dequant_row(kind, &qs, &scales, &mins, &mut fast);
                for (b, block) in qs.chunks_exact(block_bytes(kind)).enumerate() {
                    let v = unpack(kind, block);
                    for i in 0..BLOCK {
                        let d =
                            scales[b * scales_per_block(kind) + i * scales_per_block(kind) / BLOCK];
                        let mut want = f32::from(v[i]) * d;
                        if let Some(m) = mins.get(b) {
                            want += m;
                        }
                        assert_eq!(fast[b * BLOCK + i].to_bits(), want.to_bits(), "{kind:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn packing_round_trips() {
        for (kind, range) in [(QKind::Five, 32u32), (QKind::Six, 64), (QKind::FiveMin, 32)] {
            for seed in 0..50u32 {
                let q: [u8; BLOCK] = std::array::from_fn(|i| {
                    ((i as u32)
                        .wrapping_mul(2654435761)
                        .wrapping_add(seed * 40503)
                        >> 7) as u8
                        % range as u8
                });
                let mut packed = Vec::new();
                pack(kind, &q, &mut packed);
                assert_eq!(packed.len(), block_bytes(kind));
                let bias = if kind.has_mins() {
                    0
                } else {
                    (range / 2) as i8
                };
                let want: Vec<i8> = q.iter().map(|&v| v as i8 - bias).collect();
                assert_eq!(unpack(kind, &packed).to_vec(), want, "{kind:?}");
            }
        }
    }
}
