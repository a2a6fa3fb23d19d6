//! Matrix products against weights kept in GGUF's 32-element block formats, on the CPU.
//!
//! Decoding one token reads every weight once, so its speed is bound by memory traffic
//! and by the instructions that unpack each weight: keeping the file's 4- to 8-bit
//! blocks (≈ 0.6–1.1 bytes a weight) instead of f32 (4 bytes) is what brings the CPU
//! within reach of its bandwidth. Blocks are repacked at load into struct-of-arrays
//! form — scales beside the packed integers, as f32 or as K-quant super-blocks' integer
//! multipliers ([`super::scales`]) — so the inner loop converts no f16 and reads
//! contiguous bytes; 5- and 6-bit blocks stay packed ([`super::packed`]).
//!
//! By default activations stay f32 and products accumulate in f32, so results match a
//! dequantize-then-multiply reference up to the order of additions. A matrix may
//! instead take integer activations ([`Blocks::with_int_inputs`]) for the input rows
//! its caller marks ([`Blocks::prepare`]; the forward pass marks generated tokens'
//! rows and leaves prompts in f32): each 32-value block of input is quantized to `i16`
//! with its own scale and the block dot products run in integers (exact i32 sums), with
//! fewer instructions per weight than widening every weight to f32, at the cost of a
//! rounding error of at most half a step (`max|x| / 65534`) per input value; the 4-bit
//! minimum terms still use the exact f32 sums. Integer rows are batch-invariant: a
//! row's result is bitwise the same whether it is multiplied alone or beside any other
//! rows, integer or f32, so a generated token never depends on what shares its step
//! (the f32 block kernels switch to a GEMM from 8 rows, whose order changes with the
//! row count). Prompts stay f32: 16-bit inputs through a whole prefill moved the
//! default model's last logits by 1.8e-2, against 5e-3 allowed; their rows take
//! dequantized tiles and a panel product (input rows in vector lanes, each weight
//! pair broadcast, two FMA chains an output, one a half of the columns), whose
//! order per output does not depend
//! on the row count either. (llama.cpp quantizes activations to `i8`;
//! on this model that moved logits by up to 1.7 and greedy text within a few tokens, so
//! 16 bits it is.) On x86-64 with AVX2 and FMA (checked at run time) the
//! dot products use 256-bit vectors; elsewhere a portable loop does the same arithmetic.
//! The vector kernels take a row's blocks four at a time (a quad; [`Prepared`] lays the
//! inputs out for it): one 512-bit multiply-add leaves each block's integer sum in four
//! lanes, so that one conversion, one scale product and one FMA serve four blocks; the
//! 4-bit minimum terms `m · Σx` follow a row's quads, sixteen blocks to an FMA. Where the
//! CPU has AVX-512 with VNNI a quad is one vector of each of four element groups
//! (`vpmaddwd`, then `vpdpwssd` three times), three weight rows against four input rows
//! at a time; with AVX2 a quad is two halves of 256 bits. Both add the same terms in the same lanes in the same order: a worker with
//! AVX-512 and one without give a stream the same bits, so a stream moved between them
//! continues the same text (`kernels::IntKernel`). On Zen 5 the 16-bit multiply-adds and
//! the f32 multiplies and FMAs share two pipes, which is what bounds these products at
//! 16 rows (docs/benchmarks.md, "Products at their bound").

use half::f16;

use super::float16;
use super::kernels;
use super::packed;
use super::scales::{FlatRows, ScaleRows, Scales, SUPER_BLOCKS};
use crate::engine::gguf::dequant::{iq4_xs_scale, scale_min_k4};
use crate::engine::gguf::GgmlType;

/// Elements per block in every format here.
pub const BLOCK: usize = 32;

/// How a matrix's blocks are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    /// 4-bit values `q` with a scale and a minimum per block: `w = q·d + m`
    /// (GGUF Q4_1; Q4_0 too, as `m = −8·d`).
    Nibble,
    /// 8-bit signed values with a scale per block: `w = q·d` (GGUF Q8_0).
    Byte,
    /// 5-bit values packed as the file has them, `w = (q − 16)·d` (GGUF Q5_0; see
    /// [`super::packed`]).
    Five,
    /// 6-bit values packed as the file has them, `w = (q − 32)·d`, a scale for each
    /// half block (GGUF Q6_K; see [`super::packed`]).
    Six,
    /// 5-bit values packed as [`QKind::Five`] with a scale and a minimum per block:
    /// `w = q·d + m` (GGUF Q5_1, Q5_K).
    FiveMin,
    /// 4-bit indices into IQ4's table of sixteen 8-bit values, laid out as
    /// [`QKind::Nibble`]'s, with a scale per block: `w = T[q]·d` (GGUF IQ4_NL, IQ4_XS;
    /// see [`super::packed`]).
    Iq4,
    /// IEEE half-precision floats as the file has them (GGUF F16; [`super::float16`]).
    F16,
    /// bfloat16 as the file has them (GGUF BF16; [`super::float16`]).
    Bf16,
}

impl QKind {
    /// Whether blocks have minimums (and so products need the inputs' block sums).
    pub fn has_mins(self) -> bool {
        matches!(self, QKind::Nibble | QKind::FiveMin)
    }

    /// Whether the values take [`super::packed`]'s kernels: 5- and 6-bit values, and
    /// IQ4's table indices.
    pub fn is_packed(self) -> bool {
        matches!(self, QKind::Five | QKind::Six | QKind::FiveMin | QKind::Iq4)
    }

    /// Whether the values are 16-bit floats, without scales ([`super::float16`]).
    pub fn is_float(self) -> bool {
        matches!(self, QKind::F16 | QKind::Bf16)
    }
}

/// A `rows × cols` weight matrix in block form; row `o` holds output `o`'s weights.
#[derive(Debug, Clone)]
pub struct Blocks {
    pub(super) kind: QKind,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Scale of each scale unit (a block; a half block for `Six`), row-major
    /// (`rows × cols/32 · units`), and the minimum of each block (`Nibble` only):
    /// f32, or as the K-quant file has them ([`Scales`]).
    pub(super) scales: Scales,
    /// Packed values: 16 bytes a block for `Nibble` and `Iq4` (low nibbles are elements
    /// 0..16, high nibbles 16..32, as in GGUF), 32 for `Byte`, 20 and 24 for `Five` and `Six`
    /// ([`super::packed`]).
    pub(super) qs: Vec<u8>,
    /// Whether products quantize the input rows asked for to 16-bit blocks.
    pub(super) int_inputs: bool,
    /// With `int_inputs`: whether the other (prompt) rows are quantized to 8-bit blocks
    /// ([`kernels::bytes`]) instead of multiplied in f32.
    pub(super) byte_prompts: bool,
}

/// Input rows prepared for products with one matrix ([`Blocks::prepare`]): the
/// per-block sums that 4-bit minimums need and, for integer activations, the rows
/// that take them quantized to 16-bit blocks.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// `Σ x` of each 32-value block, `[n, cols/32]` (4-bit matrices only).
    pub(super) sums: Vec<f32>,
    /// The rows that take integer inputs, in order.
    pub(super) int_rows: Vec<usize>,
    /// Those rows as 16-bit values, `[int_rows, cols]`.
    pub(super) q: Vec<i16>,
    /// Scale of each block of `q`, `[int_rows, cols/32]`.
    pub(super) d: Vec<f32>,
    /// For the vector kernels ([`kernels::IntKernel::Avx2`], [`kernels::IntKernel::Avx512`]):
    /// `q` in the quad layout. Each row's blocks go in quads of four (a last partial
    /// quad padded with zero blocks); a quad is four vectors of 32 values, vector `g`
    /// holding elements `8g..8g + 8` of each of its four blocks in turn, so that a
    /// 512-bit integer product of a quad leaves each block's sum in four adjacent
    /// 32-bit lanes. `ez` holds each quad's four block scales, each repeated four times
    /// (zero for padding). `[int_rows, 128 · ⌈cols/128⌉]` and `[int_rows, 16 · ⌈cols/128⌉]`.
    pub(super) qz: Vec<i16>,
    pub(super) ez: Vec<f32>,
    /// When only some rows are integer: their block sums, and the other rows (`x` and
    /// block sums) gathered, so that each kind runs over contiguous rows.
    pub(super) isums: Vec<f32>,
    pub(super) f_rows: Vec<usize>,
    pub(super) fx: Vec<f32>,
    pub(super) fsums: Vec<f32>,
    /// For a matrix with integer inputs: its f32 rows (all of them or those in `fx`)
    /// as panels for [`kernels::panel_product`].
    pub(super) panels: Vec<f32>,
    /// The same rows quantized to 8-bit blocks, for a matrix with byte prompts
    /// ([`Blocks::with_byte_prompts`]).
    pub(super) bytes: kernels::bytes::BytePanels,
}

impl Prepared {
    /// The integer rows with the block sums `sums` (all rows' or the integer rows').
    pub(super) fn int_inputs<'a>(&'a self, sums: &'a [f32]) -> kernels::IntRows<'a> {
        kernels::IntRows {
            q: &self.q,
            d: &self.d,
            sums,
            qz: &self.qz,
            ez: &self.ez,
        }
    }

    /// `qz` and `ez` from `q` and `d` (rows of `bpr` blocks).
    pub(super) fn interleave(&mut self, bpr: usize) {
        let quads = bpr.div_ceil(4);
        let rows = self.d.len() / bpr.max(1);
        self.qz.clear();
        self.ez.clear();
        self.qz.resize(rows * quads * 128, 0);
        self.ez.resize(rows * quads * 16, 0.0);
        for (row, (q, d)) in self
            .q
            .chunks_exact(bpr * BLOCK)
            .zip(self.d.chunks_exact(bpr))
            .enumerate()
        {
            let qz = &mut self.qz[row * quads * 128..(row + 1) * quads * 128];
            let ez = &mut self.ez[row * quads * 16..(row + 1) * quads * 16];
            for (b, (block, &e)) in q.chunks_exact(BLOCK).zip(d).enumerate() {
                let (quad, slot) = (b / 4, b % 4);
                for g in 0..4 {
                    let at = quad * 128 + g * 32 + slot * 8;
                    qz[at..at + 8].copy_from_slice(&block[g * 8..g * 8 + 8]);
                }
                ez[quad * 16 + slot * 4..quad * 16 + slot * 4 + 4].fill(e);
            }
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl Blocks {
    /// Whether GGUF data of this type can be kept as is.
    pub fn supports(ty: GgmlType) -> bool {
        matches!(
            ty,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q8_0
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q4K
                | GgmlType::Q5K
                | GgmlType::Q6K
                | GgmlType::IQ4NL
                | GgmlType::IQ4XS
                | GgmlType::F16
                | GgmlType::BF16
        )
    }

    /// Repacks `rows` rows of GGUF blocks of type `ty`, each value kept exactly:
    /// Q4_0, Q4_1 and Q4_K as 4-bit blocks; Q8_0 as 8-bit blocks; Q5_0, Q5_1, Q5_K and
    /// Q6_K packed as 5- and 6-bit blocks ([`super::packed`]); IQ4_NL and IQ4_XS as
    /// their 4-bit table indices ([`QKind::Iq4`]). K-quants and IQ4_XS keep their
    /// sub-blocks' 6- or 8-bit multipliers and super-blocks' scales ([`Scales::Super`]),
    /// the others an f32 scale (and minimum) a block. F16 and BF16 keep their 16-bit
    /// values ([`super::float16`]).
    /// Returns `None` for other types, a `cols` that is not a multiple of 32, or bytes
    /// of the wrong length.
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let per_file_block = ty.block_size()?;
        if !cols.is_multiple_of(BLOCK)
            || !cols.is_multiple_of(per_file_block)
            || !Self::supports(ty)
        {
            return None;
        }
        let n_blocks = rows.checked_mul(cols / BLOCK)?;
        let file_blocks = rows.checked_mul(cols / per_file_block)?;
        if bytes.len() != file_blocks.checked_mul(ty.block_bytes()?)? {
            return None;
        }
        let kind = match ty {
            GgmlType::Q8_0 => QKind::Byte,
            GgmlType::Q5_0 => QKind::Five,
            GgmlType::Q5_1 | GgmlType::Q5K => QKind::FiveMin,
            GgmlType::Q6K => QKind::Six,
            GgmlType::IQ4NL | GgmlType::IQ4XS => QKind::Iq4,
            GgmlType::F16 => QKind::F16,
            GgmlType::BF16 => QKind::Bf16,
            _ => QKind::Nibble,
        };
        let mut qs = Vec::with_capacity(n_blocks * packed::block_bytes(kind));
        let mut scales = Scales::flat();
        match (ty, &mut scales) {
            (GgmlType::Q8_0, Scales::Flat { scales, .. }) => {
                scales.reserve(n_blocks);
                for b in bytes.chunks_exact(34) {
                    scales.push(f16_at(b, 0));
                    qs.extend_from_slice(&b[2..34]);
                }
            }
            (GgmlType::Q4_1, Scales::Flat { scales, mins }) => {
                scales.reserve(n_blocks);
                mins.reserve(n_blocks);
                for b in bytes.chunks_exact(20) {
                    scales.push(f16_at(b, 0));
                    mins.push(f16_at(b, 2));
                    qs.extend_from_slice(&b[4..20]);
                }
            }
            (GgmlType::Q4_0, Scales::Flat { scales, mins }) => {
                scales.reserve(n_blocks);
                mins.reserve(n_blocks);
                for b in bytes.chunks_exact(18) {
                    let d = f16_at(b, 0);
                    scales.push(d);
                    // (q − 8)·d = q·d + (−8·d)
                    mins.push(-8.0 * d);
                    qs.extend_from_slice(&b[2..18]);
                }
            }
            (GgmlType::IQ4NL, Scales::Flat { scales, .. }) => {
                scales.reserve(n_blocks);
                for b in bytes.chunks_exact(18) {
                    scales.push(f16_at(b, 0));
                    qs.extend_from_slice(&b[2..18]);
                }
            }
            (GgmlType::IQ4XS, s) => {
                // 256 values a super-block: d, the sub-blocks' 6-bit scales (high bits
                // in a u16, low nibbles in 4 bytes), then 16 bytes of indices a
                // sub-block, laid out as IQ4_NL's.
                let (mul, d, _, _) = s.fill_super(SUPER_BLOCKS);
                mul.reserve(n_blocks);
                for b in bytes.chunks_exact(136) {
                    d.push(f16_at(b, 0));
                    let scales_h = u16::from_le_bytes([b[2], b[3]]);
                    // `ls − 32`: in −32..32.
                    mul.extend((0..8).map(|ib| iq4_xs_scale(ib, scales_h, &b[4..8]) as i8 - 32));
                    qs.extend_from_slice(&b[8..136]);
                }
            }
            // No scales: the values as they are.
            (GgmlType::F16 | GgmlType::BF16, _) => qs.extend_from_slice(bytes),
            (GgmlType::Q5_0, Scales::Flat { scales, .. }) => {
                packed::from_q5_0(bytes, &mut qs, scales)
            }
            (GgmlType::Q5_1, Scales::Flat { scales, mins }) => {
                packed::from_q5_1(bytes, &mut qs, scales, mins)
            }
            (GgmlType::Q5K, s) => {
                let (mul, d, mmul, dmin) = s.fill_super(SUPER_BLOCKS);
                packed::from_q5_k(bytes, &mut qs, [mul, mmul], [d, dmin]);
            }
            (GgmlType::Q6K, s) => {
                let (mul, d, _, _) = s.fill_super(2 * SUPER_BLOCKS);
                packed::from_q6_k(bytes, &mut qs, mul, d);
            }
            (GgmlType::Q4K, s) => {
                // 256 values a super-block: d, dmin, 12 bytes of 6-bit scales and
                // minimums, then 128 bytes whose low nibbles are sub-block 2k and high
                // nibbles sub-block 2k + 1 (32 bytes for each k).
                let (mul, d, mmul, dmin) = s.fill_super(SUPER_BLOCKS);
                mul.reserve(n_blocks);
                mmul.reserve(n_blocks);
                for b in bytes.chunks_exact(144) {
                    d.push(f16_at(b, 0));
                    // Negated: the minimum is `−dmin·m`.
                    dmin.push(-f16_at(b, 2));
                    let packed_scales = &b[4..16];
                    for (k, q) in b[16..144].chunks_exact(32).enumerate() {
                        for (sub, shift) in [(2 * k, 0), (2 * k + 1, 4)] {
                            let (sc, mn) = scale_min_k4(sub, packed_scales);
                            // 6-bit values: below 64.
                            mul.push(sc as i8);
                            mmul.push(mn as i8);
                            // Into this form's layout: values 0..16 low, 16..32 high.
                            let v = |l: usize| (q[l] >> shift) & 0x0F;
                            qs.extend((0..16).map(|l| v(l) | (v(l + 16) << 4)));
                        }
                    }
                }
            }
            _ => return None,
        }
        let m = Blocks {
            kind,
            rows,
            cols,
            scales,
            qs,
            int_inputs: false,
            byte_prompts: false,
        };
        Some(m)
    }

    /// Quantizes f32 rows to 8-bit blocks (for weights stored in formats without a
    /// kernel here). `cols` must be a multiple of 32.
    pub fn quantize_q8(values: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(BLOCK) || values.len() != rows.checked_mul(cols)? {
            return None;
        }
        let n_blocks = rows * cols / BLOCK;
        let mut scales = Vec::with_capacity(n_blocks);
        let mut qs = Vec::with_capacity(values.len());
        for block in values.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            // Stored like GGUF's Q8_0: the scale rounded to f16.
            scales.push(f16::from_f32(d).to_f32());
            qs.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
        }
        Some(Blocks {
            kind: QKind::Byte,
            rows,
            cols,
            scales: Scales::Flat {
                scales,
                mins: Vec::new(),
            },
            qs,
            int_inputs: false,
            byte_prompts: false,
        })
    }

    /// The same matrix, taking 16-bit integer activations for the input rows
    /// [`Blocks::prepare`] is asked to quantize when `on`.
    pub fn with_int_inputs(mut self, on: bool) -> Self {
        self.int_inputs = on;
        self
    }

    /// The same matrix, with the prompt rows beside integer-input rows quantized to
    /// 8-bit blocks when `on` (`cpu/kernels/bytes.rs`; 16-bit floats stay f32). Only
    /// matrices with integer inputs ([`Blocks::with_int_inputs`]) have prompt rows.
    pub fn with_byte_prompts(mut self, on: bool) -> Self {
        self.byte_prompts = on;
        self
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The block format.
    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.scales.bytes() + self.qs.len()
    }

    pub(super) fn qs_per_block(&self) -> usize {
        packed::block_bytes(self.kind)
    }

    /// Scale units a row has: a block each, two for 6-bit blocks.
    pub(super) fn units_per_row(&self) -> usize {
        self.cols / BLOCK * packed::scales_per_block(self.kind)
    }

    /// Whether two matrices keep their scales alike (and so can be stacked).
    pub(super) fn same_form(&self, other: &Blocks) -> bool {
        self.kind == other.kind && self.cols == other.cols && self.scales.same_form(&other.scales)
    }

    /// A matrix of the rows in `order` (row `i` of the result is row `order[i]`).
    pub fn select_rows(&self, order: &[usize]) -> Self {
        let (bpr, upr, qpb) = (self.cols / BLOCK, self.units_per_row(), self.qs_per_block());
        let mut out = Blocks {
            kind: self.kind,
            rows: order.len(),
            cols: self.cols,
            scales: self.scales.empty_like(),
            qs: Vec::with_capacity(order.len() * bpr * qpb),
            int_inputs: self.int_inputs,
            byte_prompts: self.byte_prompts,
        };
        self.scales.pick_rows(&mut out.scales, order, upr, bpr);
        for &r in order {
            out.qs
                .extend_from_slice(&self.qs[r * bpr * qpb..(r + 1) * bpr * qpb]);
        }
        out
    }

    /// Stacks matrices of one kind, width and form of scales; `None` if they differ.
    pub fn concat_rows(parts: Vec<Blocks>) -> Option<Self> {
        let mut iter = parts.into_iter();
        let mut out = iter.next()?;
        for p in iter {
            if !out.same_form(&p) {
                return None;
            }
            out.append(p);
        }
        Some(out)
    }

    /// Appends the rows of `p`, which has the same form ([`Blocks::same_form`]).
    pub(super) fn append(&mut self, p: Blocks) {
        assert!(self.same_form(&p), "stacked matrices differ in form");
        self.rows += p.rows;
        self.scales.append(&p.scales);
        self.qs.extend_from_slice(&p.qs);
    }

    /// The scales (a row's units after another's) and, for 4-bit blocks, the minimums
    /// of rows `r0..r1`.
    pub(super) fn scales_of(&self, r0: usize, r1: usize) -> ScaleRows<'_> {
        self.scales
            .rows(r0, r1, self.units_per_row(), self.cols / BLOCK)
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row(&self, r: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.cols);
        self.row_into(r, &mut out);
        out
    }

    /// Appends row `r`, dequantized, to `out`.
    pub(super) fn row_into(&self, r: usize, out: &mut Vec<f32>) {
        let start = out.len();
        out.resize(start + self.cols, 0.0);
        self.dequant_into(r, &mut out[start..]);
    }

    /// Row `r`, dequantized, into `out` (`cols` long).
    pub(super) fn dequant_into(&self, r: usize, out: &mut [f32]) {
        let bpr = self.cols / BLOCK;
        let qpb = self.qs_per_block();
        let qs = &self.qs[r * bpr * qpb..(r + 1) * bpr * qpb];
        if self.kind.is_float() {
            float16::to_f32(self.kind == QKind::Bf16, qs, out);
            return;
        }
        let mut buf = Default::default();
        let FlatRows { scales, mins } = self.scales_of(r, r + 1).flat(&mut buf);
        if self.kind.is_packed() {
            packed::dequant_row(self.kind, qs, scales, mins, out);
        } else if kernels::available() {
            kernels::dequant_row(self.kind, qs, scales, mins, out);
        } else {
            for (i, (q, o)) in qs
                .chunks_exact(qpb)
                .zip(out.chunks_exact_mut(BLOCK))
                .enumerate()
            {
                let d = scales[i];
                if self.kind == QKind::Nibble {
                    let m = mins[i];
                    let (lo, hi) = o.split_at_mut(16);
                    for ((l, h), &v) in lo.iter_mut().zip(hi).zip(q) {
                        *l = f32::from(v & 0x0F) * d + m;
                        *h = f32::from(v >> 4) * d + m;
                    }
                } else {
                    for (o, &v) in o.iter_mut().zip(q) {
                        *o = f32::from(v as i8) * d;
                    }
                }
            }
        }
    }

    /// Rows of input from which products dequantize tiles of weights and run a dense
    /// product instead of block dot products per pair of rows.
    pub const DENSE_FROM: usize = 8;

    /// Weight rows dequantized per dense tile.
    pub(super) const TILE: usize = 64;

    /// Prepares the input rows `x: [n, cols]` for [`Blocks::product_rows`]: per-block
    /// sums for the minimums of 4-bit blocks (`Σ(q·d + m)·x = d·Σq·x + m·Σx`; none for
    /// 8-bit blocks, which have no minimum) and, when this matrix takes integer
    /// activations, the rows `j` with `int_rows[j]` quantized to 16-bit blocks
    /// (`x ≈ q·d`, `d = max|x| / 32767` per block); `int_rows` is empty or `n` long.
    /// Every block is prepared on its own, so a row's preparation does not depend on the
    /// rows beside it.
    pub fn prepare(&self, x: &[f32], int_rows: &[bool], out: &mut Prepared) {
        let floats = self.kind.is_float();
        self.prepare_with(x, int_rows, self.kind.has_mins(), floats, out);
    }

    /// [`Blocks::prepare`], with the block sums when `sums` (for a stack of matrices
    /// that prepares once for all, some of them 4-bit) and, with byte prompts, f32
    /// panels too when `floats` (some of them 16-bit floats).
    pub fn prepare_with(
        &self,
        x: &[f32],
        int_rows: &[bool],
        sums: bool,
        floats: bool,
        out: &mut Prepared,
    ) {
        let (cols, bpr) = (self.cols, self.cols / BLOCK);
        let n = x.len() / cols;
        assert!(
            x.len() == n * cols && (int_rows.is_empty() || int_rows.len() == n),
            "prepared rows disagree with the input"
        );
        out.sums.clear();
        out.int_rows.clear();
        out.q.clear();
        out.d.clear();
        out.qz.clear();
        out.ez.clear();
        out.isums.clear();
        out.f_rows.clear();
        out.fx.clear();
        out.fsums.clear();
        out.panels.clear();
        if sums {
            out.sums
                .extend(x.chunks_exact(BLOCK).map(|c| c.iter().sum::<f32>()));
        }
        if !self.int_inputs {
            return;
        }
        out.int_rows
            .extend((0..int_rows.len()).filter(|&j| int_rows[j]));
        if out.int_rows.is_empty() {
            self.prompt_panels(x, floats, out);
            return;
        }
        out.q.reserve(out.int_rows.len() * cols);
        out.d.reserve(out.int_rows.len() * bpr);
        for &j in &out.int_rows {
            let (at, dat) = (out.q.len(), out.d.len());
            out.q.resize(at + cols, 0);
            out.d.resize(dat + bpr, 0.0);
            kernels::quantize_blocks(
                kernels::available(),
                &x[j * cols..(j + 1) * cols],
                &mut out.q[at..],
                &mut out.d[dat..],
            );
        }
        if kernels::IntKernel::best() != kernels::IntKernel::Portable {
            out.interleave(bpr);
        }
        if out.int_rows.len() == n {
            return;
        }
        // Mixed: gather each kind's rows.
        let nibble = !out.sums.is_empty();
        for (j, &int) in int_rows.iter().enumerate() {
            if !int {
                out.f_rows.push(j);
                out.fx.extend_from_slice(&x[j * cols..(j + 1) * cols]);
            }
            if nibble {
                let sums = &out.sums[j * bpr..(j + 1) * bpr];
                let to = if int { &mut out.isums } else { &mut out.fsums };
                to.extend_from_slice(sums);
            }
        }
        let fx = std::mem::take(&mut out.fx);
        self.prompt_panels(&fx, floats, out);
        out.fx = fx;
    }

    /// The prompt rows `x` as f32 panels, or as byte panels with byte prompts (and f32
    /// panels too when the stack holds 16-bit floats, which take f32 rows).
    fn prompt_panels(&self, x: &[f32], floats: bool, out: &mut Prepared) {
        if self.byte_prompts {
            out.bytes.fill(x, self.cols);
        }
        if !self.byte_prompts || floats {
            kernels::panels(x, self.cols, &mut out.panels);
        }
    }
}

#[cfg(test)]
mod byte_tests;
#[cfg(test)]
pub(super) mod tests;
