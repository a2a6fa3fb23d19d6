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
mod x86;

#[cfg(test)]
mod tests;
