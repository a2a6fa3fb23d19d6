//! ggml tensor types — ids, block layouts — and turning their data into f32.
//!
//! Each function follows ggml's reference `dequantize_row_*` (ggml-quants.c) operation for
//! operation — same conversions, same order of multiplies and adds, no fused multiply-add —
//! so results are bit-identical to ggml's reference code and to the `gguf` Python package.
//!
//! Large inputs are split into chunks of whole blocks and dequantized in parallel with
//! rayon; the split does not change any result.

use half::{bf16, f16};
use rayon::prelude::*;

use super::reader::GgufError;

/// Elements per parallel task; inputs below twice this run on the calling thread.
const CHUNK_ELEMENTS: usize = 1 << 15;

/// Placeholder tensor name in errors raised without one; [`super::GgufFile`] replaces it.
const UNNAMED: &str = "<data>";

/// Defines [`GgmlType`] and its per-type tables from one list of
/// `Variant = id, "name", elements per block, bytes per block;` lines.
macro_rules! ggml_types {
    ($( $(#[$doc:meta])* $variant:ident = $id:literal, $name:literal, $block:literal, $bytes:literal; )*) => {
        /// A ggml tensor element type, with the ids of ggml's `ggml_type` enum.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $( $(#[$doc])* $variant, )*
            /// An id this code does not know (or one ggml has retired).
            Other(u32),
        }

        impl GgmlType {
            /// The ggml type id.
            pub fn id(self) -> u32 {
                match self {
                    $( GgmlType::$variant => $id, )*
                    GgmlType::Other(id) => id,
                }
            }

            /// The type of a ggml type id; unknown ids give [`GgmlType::Other`].
            pub fn from_id(id: u32) -> GgmlType {
                match id {
                    $( $id => GgmlType::$variant, )*
                    other => GgmlType::Other(other),
                }
            }

            /// Elements per block (1 for plain float and integer types).
            pub fn block_size(self) -> Option<usize> {
                match self {
                    $( GgmlType::$variant => Some($block), )*
                    GgmlType::Other(_) => None,
                }
            }

            /// Bytes per block.
            pub fn block_bytes(self) -> Option<usize> {
                match self {
                    $( GgmlType::$variant => Some($bytes), )*
                    GgmlType::Other(_) => None,
                }
            }

            /// The type's name as ggml spells it (`q4_0`, `q4_K`, `f32`...).
            pub fn name(self) -> &'static str {
                match self {
                    $( GgmlType::$variant => $name, )*
                    GgmlType::Other(_) => "unknown",
                }
            }
        }
    };
}

// Ids, names and block layouts as in ggml's `ggml.h` and `ggml-common.h` (ids 4, 5 and
// 31–33, 36–38 belong to retired types and read as `Other`).
ggml_types! {
    /// 32-bit float.
    F32 = 0, "f32", 1, 4;
    /// IEEE half float.
    F16 = 1, "f16", 1, 2;
    /// 32 × 4-bit, one f16 scale.
    Q4_0 = 2, "q4_0", 32, 18;
    /// 32 × 4-bit, f16 scale and minimum.
    Q4_1 = 3, "q4_1", 32, 20;
    /// 32 × 5-bit, one f16 scale.
    Q5_0 = 6, "q5_0", 32, 22;
    /// 32 × 5-bit, f16 scale and minimum.
    Q5_1 = 7, "q5_1", 32, 24;
    /// 32 × 8-bit, one f16 scale.
    Q8_0 = 8, "q8_0", 32, 34;
    /// 32 × 8-bit, f16 scale and sum (an intermediate type).
    Q8_1 = 9, "q8_1", 32, 36;
    /// K-quant, 2-bit.
    Q2K = 10, "q2_K", 256, 84;
    /// K-quant, 3-bit.
    Q3K = 11, "q3_K", 256, 110;
    /// K-quant, 4-bit: 8 sub-blocks of 32 with 6-bit scales and minimums.
    Q4K = 12, "q4_K", 256, 144;
    /// K-quant, 5-bit.
    Q5K = 13, "q5_K", 256, 176;
    /// K-quant, 6-bit: 16 sub-blocks of 16 with 8-bit scales.
    Q6K = 14, "q6_K", 256, 210;
    /// K-quant, 8-bit (an intermediate type).
    Q8K = 15, "q8_K", 256, 292;
    /// i-quant.
    IQ2XXS = 16, "iq2_xxs", 256, 66;
    /// i-quant.
    IQ2XS = 17, "iq2_xs", 256, 74;
    /// i-quant.
    IQ3XXS = 18, "iq3_xxs", 256, 98;
    /// i-quant.
    IQ1S = 19, "iq1_s", 256, 50;
    /// i-quant.
    IQ4NL = 20, "iq4_nl", 32, 18;
    /// i-quant.
    IQ3S = 21, "iq3_s", 256, 110;
    /// i-quant.
    IQ2S = 22, "iq2_s", 256, 82;
    /// i-quant.
    IQ4XS = 23, "iq4_xs", 256, 136;
    /// 8-bit integer.
    I8 = 24, "i8", 1, 1;
    /// 16-bit integer.
    I16 = 25, "i16", 1, 2;
    /// 32-bit integer.
    I32 = 26, "i32", 1, 4;
    /// 64-bit integer.
    I64 = 27, "i64", 1, 8;
    /// 64-bit float.
    F64 = 28, "f64", 1, 8;
    /// i-quant.
    IQ1M = 29, "iq1_m", 256, 56;
    /// bfloat16.
    BF16 = 30, "bf16", 1, 2;
    /// Ternary quant.
    TQ1_0 = 34, "tq1_0", 256, 54;
    /// Ternary quant.
    TQ2_0 = 35, "tq2_0", 256, 66;
    /// Microscaling FP4.
    MXFP4 = 39, "mxfp4", 32, 17;
}

impl GgmlType {
    /// Whether [`dequantize`] can turn this type into f32.
    pub fn dequant_supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q4K
                | GgmlType::Q5K
                | GgmlType::Q6K
                | GgmlType::IQ4NL
                | GgmlType::IQ4XS
        )
    }

    /// Bytes taken by `n_elements` values of this type, or `None` when the type's size is
    /// unknown, `n_elements` is not a whole number of blocks, or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = u64::try_from(self.block_size()?).ok()?;
        let bytes = u64::try_from(self.block_bytes()?).ok()?;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(bytes)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GgmlType::Other(id) => write!(f, "unknown type {id}"),
            ty => f.write_str(ty.name()),
        }
    }
}

/// Dequantize `n_elements` values of type `ty` from `bytes` into a new vector.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, GgufError> {
    // Check before allocating: `n_elements` may come from an untrusted caller.
    expected_len(ty, n_elements, bytes.len())?;
    let mut out = vec![0.0f32; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantize `bytes` of type `ty` into `out`; `bytes` must hold exactly `out.len()` values.
///
/// Works on any whole number of blocks, e.g. one row of a quantized matrix.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    expected_len(ty, out.len(), bytes.len())?;
    let (bs, bb) = (ty.block_size().unwrap_or(1), ty.block_bytes().unwrap_or(1));
    match ty {
        GgmlType::F32 => drive(bytes, out, bs, bb, f32_row),
        GgmlType::F16 => drive(bytes, out, bs, bb, f16_row),
        GgmlType::BF16 => drive(bytes, out, bs, bb, bf16_row),
        GgmlType::Q8_0 => drive(bytes, out, bs, bb, blocks(bb, bs, q8_0_block)),
        GgmlType::Q4_0 => drive(bytes, out, bs, bb, blocks(bb, bs, q4_0_block)),
        GgmlType::Q4_1 => drive(bytes, out, bs, bb, blocks(bb, bs, q4_1_block)),
        GgmlType::Q5_0 => drive(bytes, out, bs, bb, blocks(bb, bs, q5_0_block)),
        GgmlType::Q5_1 => drive(bytes, out, bs, bb, blocks(bb, bs, q5_1_block)),
        GgmlType::Q4K => drive(bytes, out, bs, bb, blocks(bb, bs, q4_k_block)),
        GgmlType::Q5K => drive(bytes, out, bs, bb, blocks(bb, bs, q5_k_block)),
        GgmlType::Q6K => drive(bytes, out, bs, bb, blocks(bb, bs, q6_k_block)),
        GgmlType::IQ4NL => drive(bytes, out, bs, bb, blocks(bb, bs, iq4_nl_block)),
        GgmlType::IQ4XS => drive(bytes, out, bs, bb, blocks(bb, bs, iq4_xs_block)),
        other => return Err(GgufError::unsupported(UNNAMED, other)),
    }
    Ok(())
}

/// Check that `ty` is supported and that `n_bytes` holds exactly `n_elements` values.
fn expected_len(ty: GgmlType, n_elements: usize, n_bytes: usize) -> Result<(), GgufError> {
    if !ty.dequant_supported() {
        return Err(GgufError::unsupported(UNNAMED, ty));
    }
    let bad = |reason: String| GgufError::BadShape {
        name: UNNAMED.to_owned(),
        reason,
    };
    match ty.bytes_for(n_elements as u64) {
        None => Err(bad(format!(
            "{n_elements} values are not a whole number of {} blocks",
            ty.name()
        ))),
        Some(want) if want != n_bytes as u64 => Err(bad(format!(
            "{n_elements} {} values take {want} bytes, got {n_bytes}",
            ty.name()
        ))),
        Some(_) => Ok(()),
    }
}

/// Run `f` over `(bytes, out)`, in parallel chunks of whole blocks when the input is large.
fn drive<F>(bytes: &[u8], out: &mut [f32], block_size: usize, block_bytes: usize, f: F)
where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    if out.len() < 2 * CHUNK_ELEMENTS {
        f(bytes, out);
        return;
    }
    let blocks_per_chunk = (CHUNK_ELEMENTS / block_size).max(1);
    out.par_chunks_mut(blocks_per_chunk * block_size)
        .zip(bytes.par_chunks(blocks_per_chunk * block_bytes))
        .for_each(|(o, b)| f(b, o));
}

/// Lift a one-block function to a function over consecutive blocks.
fn blocks(
    block_bytes: usize,
    block_size: usize,
    f: fn(&[u8], &mut [f32]),
) -> impl Fn(&[u8], &mut [f32]) + Sync {
    move |bytes, out| {
        for (b, o) in bytes
            .chunks_exact(block_bytes)
            .zip(out.chunks_exact_mut(block_size))
        {
            f(b, o);
        }
    }
}

#[inline]
fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn f32_row(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

fn f16_row(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

fn bf16_row(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// `block_q8_0`: d: f16, qs: [i8; 32]. y = q·d.
fn q8_0_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// `block_q4_0`: d: f16, qs: [u8; 16]; low nibbles are values 0..16, high nibbles 16..32.
/// y = (q − 8)·d.
fn q4_0_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// The sixteen values a 4-bit index of IQ4_NL and IQ4_XS stands for (ggml's
/// `kvalues_iq4nl`): a non-uniform grid, denser near zero.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `block_iq4_nl`: d: f16, qs: [u8; 16] of indices laid out as Q4_0's nibbles.
/// y = d·T[q].
fn iq4_nl_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = d * f32::from(IQ4_VALUES[usize::from(q & 0x0F)]);
        hi[j] = d * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
    }
}

/// The 6-bit scale of sub-block `ib` (of 8) of an IQ4_XS super-block, `0..64`: its low
/// four bits from `scales_l` (two a byte), its high two from `scales_h`.
pub fn iq4_xs_scale(ib: usize, scales_h: u16, scales_l: &[u8]) -> u8 {
    ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((((scales_h >> (2 * ib)) & 3) as u8) << 4)
}

/// `block_iq4_xs`: d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128] for 256
/// values in 8 sub-blocks of 32, each scaled by `d·(ls − 32)` (`ls` from
/// [`iq4_xs_scale`]) and laid out as IQ4_NL's indices.
fn iq4_xs_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for (ib, (q, out)) in qs.chunks_exact(16).zip(y.chunks_exact_mut(32)).enumerate() {
        let dl = d * f32::from(i16::from(iq4_xs_scale(ib, scales_h, scales_l)) - 32);
        let (lo, hi) = out.split_at_mut(16);
        for (j, &q) in q.iter().enumerate() {
            lo[j] = dl * f32::from(IQ4_VALUES[usize::from(q & 0x0F)]);
            hi[j] = dl * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
        }
    }
}

/// `block_q4_1`: d: f16, m: f16, qs: [u8; 16]. y = q·d + m.
fn q4_1_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = f32::from(q & 0x0F) * d + m;
        hi[j] = f32::from(q >> 4) * d + m;
    }
}

/// The 5-bit values of a `block_q5_0` / `block_q5_1`: low nibbles in `qs` as in Q4_0
/// (values 0..16 low, 16..32 high), the fifth bits in the little-endian `qh`, bit `j`
/// for value `j`.
#[inline]
fn q5_values(qh: u32, qs: &[u8], mut f: impl FnMut(usize, u8)) {
    for (j, &q) in qs.iter().enumerate() {
        let h0 = ((qh >> j) & 1) as u8;
        let h1 = ((qh >> (j + 16)) & 1) as u8;
        f(j, (q & 0x0F) | (h0 << 4));
        f(j + 16, (q >> 4) | (h1 << 4));
    }
}

/// `block_q5_0`: d: f16, qh: [u8; 4], qs: [u8; 16]. y = (q − 16)·d.
fn q5_0_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    q5_values(qh, &b[6..22], |j, q| y[j] = (q as i32 - 16) as f32 * d);
}

/// `block_q5_1`: d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]. y = q·d + m.
fn q5_1_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let m = half_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    q5_values(qh, &b[8..24], |j, q| y[j] = f32::from(q) * d + m);
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and minimum of sub-block `j` (0..8) packed
/// into the 12 bytes `q`.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K`: d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]. Eight sub-blocks of
/// 32; each 32 bytes of `qs` hold two sub-blocks (low nibbles, then high nibbles).
/// y = (d·sc)·q − dmin·m.
fn q4_k_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let min = half_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (k, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * f32::from(q[l] & 0x0F) - m1;
            hi[l] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// `block_q5_K`: d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]. As
/// Q4_K, with the fifth bit of value `l` of sub-block `s` in bit `s` of `qh[l]`.
fn q5_k_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let min = half_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (k, (ql, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * k, scales);
        let (sc2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * k), 2u8 << (2 * k));
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            lo[l] = d1 * f32::from((ql[l] & 0x0F) + h1) - m1;
            hi[l] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
        }
    }
}

/// `block_q6_K`: ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16. Two halves of 128
/// values; value = (4 low bits from `ql` | 2 high bits from `qh`) − 32, y = (d·sc)·q.
fn q6_k_block(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for (n, out) in y.chunks_exact_mut(128).enumerate() {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| d * f32::from(sc[is + i] as i8);
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(2) * q2 as f32;
            out[l + 64] = s(4) * q3 as f32;
            out[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q8_0_by_hand() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16_bytes(0.5));
        b[2] = 3;
        b[3] = (-4i8) as u8;
        let y = dequantize(GgmlType::Q8_0, &b, 32).expect("valid block");
        assert_eq!(&y[..3], &[1.5, -2.0, 0.0]);
    }

    #[test]
    fn q4_1_by_hand() {
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&f16_bytes(2.0));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4] = 0x3A; // low nibble 10 → element 0, high nibble 3 → element 16
        let y = dequantize(GgmlType::Q4_1, &b, 32).expect("valid block");
        assert_eq!((y[0], y[16], y[1]), (19.0, 5.0, -1.0));
    }

    #[test]
    fn q4_0_by_hand() {
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16_bytes(0.25));
        b[2] = 0xF0;
        let y = dequantize(GgmlType::Q4_0, &b, 32).expect("valid block");
        assert_eq!((y[0], y[16], y[1]), (-2.0, 1.75, -2.0));
    }

    #[test]
    fn scale_min_unpacking() {
        let q: Vec<u8> = (0..12).map(|i| (i * 37 + 11) as u8).collect();
        assert_eq!(scale_min_k4(1, &q), (q[1] & 63, q[5] & 63));
        assert_eq!(
            scale_min_k4(6, &q),
            (
                (q[10] & 15) | ((q[2] >> 6) << 4),
                (q[10] >> 4) | ((q[6] >> 6) << 4)
            )
        );
    }

    #[test]
    fn rejects_wrong_sizes_and_types() {
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 33], 32).map_err(|e| e.kind()),
            Err("bad_shape")
        );
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 34], 31).map_err(|e| e.kind()),
            Err("bad_shape")
        );
        assert_eq!(
            dequantize(GgmlType::Q2K, &[0; 84], 256).map_err(|e| e.kind()),
            Err("unsupported_type")
        );
        // A huge element count is refused before anything is allocated.
        assert!(dequantize(GgmlType::F32, &[], usize::MAX / 2).is_err());
    }

    #[test]
    fn parallel_split_matches_serial() {
        let n_blocks = 4 * CHUNK_ELEMENTS / 256 + 3;
        let bytes: Vec<u8> = (0..n_blocks * 144)
            .map(|i| ((i * 2654435761usize) >> 7) as u8)
            .collect();
        let mut par = vec![0.0; n_blocks * 256];
        dequantize_into(GgmlType::Q4K, &bytes, &mut par).expect("valid");
        let mut serial = vec![0.0; n_blocks * 256];
        blocks(144, 256, q4_k_block)(&bytes, &mut serial);
        assert_eq!(
            par.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            serial.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
