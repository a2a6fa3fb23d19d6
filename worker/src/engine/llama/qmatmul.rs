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
//! continues the same text (`simd::IntKernel`). On Zen 5 the 16-bit multiply-adds and
//! the f32 multiplies and FMAs share two pipes, which is what bounds these products at
//! 16 rows (docs/benchmarks.md, "Products at their bound").

use half::f16;

use super::float16;
use super::packed;
use super::scales::{FlatRows, ScaleRows, Scales, SUPER_BLOCKS};
use crate::engine::gguf::{dequant::scale_min_k4, GgmlType};

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

    /// Whether the values are packed 5- or 6-bit ([`super::packed`]).
    pub fn is_packed(self) -> bool {
        matches!(self, QKind::Five | QKind::Six | QKind::FiveMin)
    }

    /// Whether the values are 16-bit floats, without scales ([`super::float16`]).
    pub fn is_float(self) -> bool {
        matches!(self, QKind::F16 | QKind::Bf16)
    }
}

/// A `rows × cols` weight matrix in block form; row `o` holds output `o`'s weights.
#[derive(Debug, Clone)]
pub struct Blocks {
    kind: QKind,
    rows: usize,
    cols: usize,
    /// Scale of each scale unit (a block; a half block for `Six`), row-major
    /// (`rows × cols/32 · units`), and the minimum of each block (`Nibble` only):
    /// f32, or as the K-quant file has them ([`Scales`]).
    scales: Scales,
    /// Packed values: 16 bytes a block for `Nibble` (low nibbles are elements 0..16,
    /// high nibbles 16..32, as in GGUF), 32 for `Byte`, 20 and 24 for `Five` and `Six`
    /// ([`super::packed`]).
    qs: Vec<u8>,
    /// Whether products quantize the input rows asked for to 16-bit blocks.
    int_inputs: bool,
}

/// Input rows prepared for products with one matrix ([`Blocks::prepare`]): the
/// per-block sums that 4-bit minimums need and, for integer activations, the rows
/// that take them quantized to 16-bit blocks.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// `Σ x` of each 32-value block, `[n, cols/32]` (4-bit matrices only).
    sums: Vec<f32>,
    /// The rows that take integer inputs, in order.
    int_rows: Vec<usize>,
    /// Those rows as 16-bit values, `[int_rows, cols]`.
    q: Vec<i16>,
    /// Scale of each block of `q`, `[int_rows, cols/32]`.
    d: Vec<f32>,
    /// For the vector kernels ([`simd::IntKernel::Avx2`], [`simd::IntKernel::Avx512`]):
    /// `q` in the quad layout. Each row's blocks go in quads of four (a last partial
    /// quad padded with zero blocks); a quad is four vectors of 32 values, vector `g`
    /// holding elements `8g..8g + 8` of each of its four blocks in turn, so that a
    /// 512-bit integer product of a quad leaves each block's sum in four adjacent
    /// 32-bit lanes. `ez` holds each quad's four block scales, each repeated four times
    /// (zero for padding). `[int_rows, 128 · ⌈cols/128⌉]` and `[int_rows, 16 · ⌈cols/128⌉]`.
    qz: Vec<i16>,
    ez: Vec<f32>,
    /// When only some rows are integer: their block sums, and the other rows (`x` and
    /// block sums) gathered, so that each kind runs over contiguous rows.
    isums: Vec<f32>,
    f_rows: Vec<usize>,
    fx: Vec<f32>,
    fsums: Vec<f32>,
    /// For a matrix with integer inputs: its f32 rows (all of them or those in `fx`)
    /// as panels for [`simd::panel_product`].
    panels: Vec<f32>,
}

impl Prepared {
    /// The integer rows with the block sums `sums` (all rows' or the integer rows').
    fn int_inputs<'a>(&'a self, sums: &'a [f32]) -> simd::IntRows<'a> {
        simd::IntRows {
            q: &self.q,
            d: &self.d,
            sums,
            qz: &self.qz,
            ez: &self.ez,
        }
    }

    /// `qz` and `ez` from `q` and `d` (rows of `bpr` blocks).
    fn interleave(&mut self, bpr: usize) {
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
                | GgmlType::F16
                | GgmlType::BF16
        )
    }

    /// Repacks `rows` rows of GGUF blocks of type `ty`, each value kept exactly:
    /// Q4_0, Q4_1 and Q4_K as 4-bit blocks; Q8_0 as 8-bit blocks; Q5_0, Q5_1, Q5_K and
    /// Q6_K packed as 5- and 6-bit blocks ([`super::packed`]). K-quants keep their
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
        })
    }

    /// The same matrix, taking 16-bit integer activations for the input rows
    /// [`Blocks::prepare`] is asked to quantize when `on`.
    pub fn with_int_inputs(mut self, on: bool) -> Self {
        self.int_inputs = on;
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

    fn qs_per_block(&self) -> usize {
        packed::block_bytes(self.kind)
    }

    /// Scale units a row has: a block each, two for 6-bit blocks.
    fn units_per_row(&self) -> usize {
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
    fn scales_of(&self, r0: usize, r1: usize) -> ScaleRows<'_> {
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
    fn row_into(&self, r: usize, out: &mut Vec<f32>) {
        let start = out.len();
        out.resize(start + self.cols, 0.0);
        self.dequant_into(r, &mut out[start..]);
    }

    /// Row `r`, dequantized, into `out` (`cols` long).
    fn dequant_into(&self, r: usize, out: &mut [f32]) {
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
        } else if simd::available() {
            simd::dequant_row(self.kind, qs, scales, mins, out);
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
        self.prepare_with(x, int_rows, self.kind.has_mins(), out);
    }

    /// [`Blocks::prepare`], with the block sums when `sums` (for a stack of matrices
    /// that prepares once for all, some of them 4-bit).
    pub fn prepare_with(&self, x: &[f32], int_rows: &[bool], sums: bool, out: &mut Prepared) {
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
            simd::panels(x, cols, &mut out.panels);
            return;
        }
        out.q.reserve(out.int_rows.len() * cols);
        out.d.reserve(out.int_rows.len() * bpr);
        for &j in &out.int_rows {
            let (at, dat) = (out.q.len(), out.d.len());
            out.q.resize(at + cols, 0);
            out.d.resize(dat + bpr, 0.0);
            simd::quantize_blocks(
                simd::available(),
                &x[j * cols..(j + 1) * cols],
                &mut out.q[at..],
                &mut out.d[dat..],
            );
        }
        if simd::IntKernel::best() != simd::IntKernel::Portable {
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
        simd::panels(&out.fx, cols, &mut out.panels);
    }

    /// Products of weight rows `r0..r1` with every row of `x: [n, cols]`, into
    /// `out: [r1 − r0, n]` (weight-row-major). `prep` comes from
    /// [`Blocks::prepare`] of the same `x`; `tile` is scratch for dense tiles.
    #[allow(clippy::too_many_arguments)]
    pub fn product_rows(
        &self,
        x: &[f32],
        n: usize,
        prep: &Prepared,
        r0: usize,
        r1: usize,
        tile: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        assert!(
            x.len() == n * self.cols && r0 <= r1 && r1 <= self.rows && out.len() == (r1 - r0) * n,
            "product shapes disagree"
        );
        let n_int = prep.int_rows.len();
        if self.kind.is_float() && n_int > 0 {
            // 16-bit floats take the generated rows' f32 inputs as they are, each dot
            // product in one fixed order; prompt rows beside them go as f32 rows do.
            let brain = self.kind == QKind::Bf16;
            let (cols, bytes) = (self.cols, 2 * self.cols);
            for (i, o) in out.chunks_exact_mut(n).enumerate() {
                let w = &self.qs[(r0 + i) * bytes..(r0 + i + 1) * bytes];
                for &j in &prep.int_rows {
                    o[j] = float16::dot(brain, w, &x[j * cols..(j + 1) * cols]);
                }
            }
            if n_int < n {
                let mut part = vec![0.0f32; (r1 - r0) * (n - n_int)];
                let (fx, fsums, panels) = (&prep.fx, &prep.fsums, &prep.panels);
                self.product_rows_f32(fx, n - n_int, fsums, panels, r0, r1, tile, &mut part);
                scatter(&part, &prep.f_rows, n, out);
            }
        } else if n_int == 0 {
            self.product_rows_f32(x, n, &prep.sums, &prep.panels, r0, r1, tile, out);
        } else if n_int == n {
            self.product_rows_int(n, prep.int_inputs(&prep.sums), r0, out);
        } else {
            // Each kind over its own rows, then back into their columns.
            let tr = r1 - r0;
            let n_f = n - n_int;
            let mut part = vec![0.0f32; tr * n_int.max(n_f)];
            self.product_rows_int(
                n_int,
                prep.int_inputs(&prep.isums),
                r0,
                &mut part[..tr * n_int],
            );
            scatter(&part[..tr * n_int], &prep.int_rows, n, out);
            let part = &mut part[..tr * n_f];
            let (fx, fsums) = (&prep.fx, &prep.fsums);
            self.product_rows_f32(fx, n_f, fsums, &prep.panels, r0, r1, tile, part);
            scatter(part, &prep.f_rows, n, out);
        }
    }

    /// [`Blocks::product_rows`] with f32 inputs `x: [n, cols]`, their block sums and
    /// (for a matrix with integer inputs) their panels.
    #[allow(clippy::too_many_arguments)]
    fn product_rows_f32(
        &self,
        x: &[f32],
        n: usize,
        xsum: &[f32],
        panels: &[f32],
        r0: usize,
        r1: usize,
        tile: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let bpr = self.cols / BLOCK;
        let qpb = self.qs_per_block();
        if self.int_inputs {
            // Prompt rows beside integer-input generated rows: dequantized tiles and a
            // product whose additions for each output are one fixed sequence, however
            // many rows run. A prompt's keys and values are then the same bits whether
            // it runs alone, beside other prompts, or in part after a prefix-cache hit.
            // (The GEMM's order changes with the number of rows.)
            let (tr, cols) = (r1 - r0, self.cols);
            if tile.len() < (tr + 1) * cols {
                tile.resize((tr + 1) * cols, 0.0);
            }
            let (rows, row) = tile.split_at_mut(tr * cols);
            for (i, r) in (r0..r1).enumerate() {
                self.dequant_into(r, &mut row[..cols]);
                simd::interleave_halves(&row[..cols], &mut rows[i * cols..(i + 1) * cols]);
            }
            simd::panel_product(
                simd::available(),
                panels,
                n,
                &tile[..tr * cols],
                tr,
                cols,
                out,
            );
            return;
        }
        if n >= Self::DENSE_FROM {
            // Many input rows (prefill): dequantize the weight rows once and multiply
            // them by all input rows with an f32 GEMM.
            let tr = r1 - r0;
            let cols = self.cols;
            // Sized once and overwritten: no zero-fill per tile.
            if tile.len() < tr * cols {
                tile.resize(tr * cols, 0.0);
            }
            for (i, r) in (r0..r1).enumerate() {
                self.dequant_into(r, &mut tile[i * cols..(i + 1) * cols]);
            }
            // SAFETY: `out` is [tr, n] row-major (row stride n, column stride 1), read
            // here as the [n, tr] product with row stride 1 and column stride n; `x` is
            // [n, cols] row-major, and `tile` holds `tr` rows of `cols`, read as its
            // transpose [cols, tr] (row stride 1, column stride cols); every pointer
            // stays inside its buffer for these sizes and strides.
            unsafe {
                gemm::gemm(
                    n,
                    tr,
                    cols,
                    out.as_mut_ptr(),
                    n as isize,
                    1,
                    false,
                    x.as_ptr(),
                    1,
                    cols as isize,
                    tile.as_ptr(),
                    cols as isize,
                    1,
                    0.0f32,
                    1.0f32,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            return;
        }
        let avx2 = simd::available();
        let mut row = Vec::new();
        let mut buf = Default::default();
        for (i, o) in out.chunks_exact_mut(n).enumerate() {
            let r = r0 + i;
            let qs = &self.qs[r * bpr * qpb..(r + 1) * bpr * qpb];
            if self.kind.is_float() {
                let brain = self.kind == QKind::Bf16;
                for (j, y) in o.iter_mut().enumerate() {
                    *y = float16::dot(brain, qs, &x[j * self.cols..(j + 1) * self.cols]);
                }
                continue;
            }
            if self.kind.is_packed() {
                // Few f32 rows against packed blocks (the `native` weights' decode):
                // the row dequantized once, then plain dot products.
                row.resize(self.cols, 0.0);
                self.dequant_into(r, &mut row);
                for (j, y) in o.iter_mut().enumerate() {
                    let xr = &x[j * self.cols..(j + 1) * self.cols];
                    *y = row.iter().zip(xr).map(|(w, x)| w * x).sum();
                }
                continue;
            }
            let FlatRows { scales, mins } = self.scales_of(r, r + 1).flat(&mut buf);
            // Four input rows at a time: each block is expanded once for all four.
            let mut j0 = 0;
            while avx2 && j0 + 4 <= n {
                let xs: [&[f32]; 4] =
                    std::array::from_fn(|k| &x[(j0 + k) * self.cols..(j0 + k + 1) * self.cols]);
                let sums: [&[f32]; 4] = std::array::from_fn(|k| {
                    if xsum.is_empty() {
                        &[][..]
                    } else {
                        &xsum[(j0 + k) * bpr..(j0 + k + 1) * bpr]
                    }
                });
                o[j0..j0 + 4].copy_from_slice(&simd::dot4(self.kind, qs, scales, mins, xs, sums));
                j0 += 4;
            }
            for (j, y) in o.iter_mut().enumerate().skip(j0) {
                let xr = &x[j * self.cols..(j + 1) * self.cols];
                *y = if self.kind == QKind::Nibble {
                    let xs = &xsum[j * bpr..(j + 1) * bpr];
                    simd::dot_nibble(avx2, qs, scales, mins, xr, xs)
                } else {
                    simd::dot_byte(avx2, qs, scales, xr)
                };
            }
        }
    }

    /// [`Blocks::product_rows`] with integer inputs: four input rows at a time share
    /// each widened weight block, the rest go one by one, and every row's result is
    /// bitwise the one it gets alone ([`simd::dot_int_rows`], [`packed::dot_int_rows`]),
    /// so a sequence's numbers do not depend on what shares its step. Input rows run in
    /// groups small enough to stay in cache while the weight rows pass over them.
    fn product_rows_int(&self, n: usize, x: simd::IntRows<'_>, r0: usize, out: &mut [f32]) {
        const GROUP: usize = 16;
        let (bpr, qpb) = (self.cols / BLOCK, self.qs_per_block());
        let r1 = r0 + out.len() / n.max(1);
        let kernel = simd::IntKernel::best();
        let qs = &self.qs[r0 * bpr * qpb..r1 * bpr * qpb];
        let scales = self.scales_of(r0, r1);
        for g0 in (0..n).step_by(GROUP) {
            let rows = g0..(g0 + GROUP).min(n);
            if self.kind.is_packed() {
                let vector = kernel != simd::IntKernel::Portable;
                packed::dot_int_rows(vector, self.kind, bpr, qs, scales, x, rows, out);
            } else {
                simd::dot_int_rows(kernel, self.kind, bpr, qs, scales, x, rows, out);
            }
        }
    }

    /// `x: [n, cols]` → `[n, rows]` ([`super::qmatrix::QMatrix::matmul`]).
    #[cfg(test)]
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        super::qmatrix::QMatrix::from(self.clone()).matmul(x, n)
    }
}

/// `out[i][cols[k]] = part[i][k]`: the columns of a product over some input rows put
/// back among all `n`.
fn scatter(part: &[f32], cols: &[usize], n: usize, out: &mut [f32]) {
    for (o, p) in out.chunks_exact_mut(n).zip(part.chunks_exact(cols.len())) {
        for (&j, &v) in cols.iter().zip(p) {
            o[j] = v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use simd::x86::{hsum, load_tail};
pub(super) use simd::{IntRows, WEIGHT_SLICE};

mod simd {
    //! Block dot products, vectorised where the CPU allows.

    use super::{FlatRows, ScaleRows, SUPER_BLOCKS};

    /// Whether the AVX2+FMA kernels can run on this CPU.
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Four rows of input against one weight row at once (AVX2 only: the caller checks
    /// [`available`]). `mins` and `sums` are empty for 8-bit blocks.
    pub fn dot4(
        kind: super::QKind,
        qs: &[u8],
        scales: &[f32],
        mins: &[f32],
        xs: [&[f32]; 4],
        sums: [&[f32]; 4],
    ) -> [f32; 4] {
        let n = scales.len();
        let nibble = kind == super::QKind::Nibble;
        let q_ok = qs.len() == if nibble { 16 * n } else { 32 * n };
        let side_ok = !nibble || (mins.len() == n && sums.iter().all(|s| s.len() == n));
        assert!(
            q_ok && side_ok && xs.iter().all(|x| x.len() == 32 * n),
            "block slices disagree"
        );
        #[cfg(target_arch = "x86_64")]
        {
            assert!(available(), "dot4 needs AVX2 and FMA");
            // SAFETY: AVX2/FMA checked just above; every slice length matches the block
            // count, so each block's reads stay in bounds.
            unsafe { x86::dot4(nibble, qs, scales, mins, xs, sums) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (mins, sums, nibble);
            unreachable!("dot4 is only called when AVX2 is available")
        }
    }

    /// Rows of panels for [`panel_product`]: `x: [n, cols]` in blocks of eight rows
    /// (the last padded with zeros), each column `k` of the first half beside column
    /// `cols/2 + k` of the second: lane `2l` of a panel's `k`-th sixteen holds row `l`'s
    /// `x[k]`, lane `2l + 1` its `x[cols/2 + k]` (`[⌈n/8⌉, cols/2, 16]`).
    pub fn panels(x: &[f32], cols: usize, out: &mut Vec<f32>) {
        let n = x.len() / cols.max(1);
        let half = cols / 2;
        out.clear();
        out.resize(n.div_ceil(8) * cols * 8, 0.0);
        for (b, panel) in out.chunks_exact_mut(cols * 8).enumerate() {
            for l in 0..(n - 8 * b).min(8) {
                let row = &x[(8 * b + l) * cols..(8 * b + l + 1) * cols];
                for k in 0..half {
                    panel[16 * k + 2 * l] = row[k];
                    panel[16 * k + 2 * l + 1] = row[half + k];
                }
            }
        }
    }

    /// A weight row for [`panel_product`]: `out[2k] = row[k]`, `out[2k + 1] =
    /// row[cols/2 + k]`.
    pub fn interleave_halves(row: &[f32], out: &mut [f32]) {
        assert!(
            row.len() == out.len() && row.len().is_multiple_of(2),
            "halves disagree"
        );
        let half = row.len() / 2;
        #[cfg(target_arch = "x86_64")]
        if available() && half.is_multiple_of(8) {
            // SAFETY: AVX2 detected at run time; the lengths checked above.
            unsafe { x86::interleave_halves(row, out) };
            return;
        }
        let (a, b) = row.split_at(half);
        for (o, (&a, &b)) in out.chunks_exact_mut(2).zip(a.iter().zip(b)) {
            o[0] = a;
            o[1] = b;
        }
    }

    /// `out[r][j] = Σ_c w[r][c] · x[j][c]` for weight rows `w: [m, cols]` (each laid out
    /// by [`interleave_halves`]) and the `n` input rows laid out by [`panels`], into
    /// `out: [m, n]`. Every output is two chains of fused multiply-adds from zero, one
    /// over each half of the columns in order, then their sum, whatever `n`, `m`, the
    /// row's place and the CPU: the vector kernels put eight input rows times the two
    /// halves in sixteen lanes and broadcast each pair of weights (`w[k]`,
    /// `w[cols/2 + k]`), the portable loop runs the same chains with `mul_add`, so all of
    /// them give the same bits, and a prompt row's result never depends on the rows
    /// beside it. (Eight rows a vector keep a short prompt's vectors full.)
    pub fn panel_product(
        avx2: bool,
        panels: &[f32],
        n: usize,
        w: &[f32],
        m: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        assert!(
            cols.is_multiple_of(2)
                && panels.len() == n.div_ceil(8) * cols * 8
                && w.len() == m * cols
                && out.len() == m * n,
            "panel shapes disagree"
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA were detected at run time (and AVX-512 F for the wide
            // version, by `IntKernel::best`); the shapes are checked above.
            unsafe {
                if IntKernel::best() == IntKernel::Avx512 {
                    x86::panel_product_wide(panels, n, w, m, cols, out);
                } else {
                    x86::panel_product(panels, n, w, m, cols, out);
                }
            }
            return;
        }
        let _ = avx2;
        let half = cols / 2;
        for r in 0..m {
            let wr = &w[r * cols..(r + 1) * cols];
            for j in 0..n {
                let panel = &panels[(j / 8) * cols * 8..];
                let lane = 2 * (j % 8);
                let (mut a, mut b) = (0.0f32, 0.0f32);
                for k in 0..half {
                    a = wr[2 * k].mul_add(panel[16 * k + lane], a);
                    b = wr[2 * k + 1].mul_add(panel[16 * k + lane + 1], b);
                }
                out[r * n + j] = a + b;
            }
        }
    }

    /// One weight row dequantized into `out` (AVX2 only: the caller checks
    /// [`available`]): `w = q·d (+ m)`.
    pub fn dequant_row(
        kind: super::QKind,
        qs: &[u8],
        scales: &[f32],
        mins: &[f32],
        out: &mut [f32],
    ) {
        let n = scales.len();
        let nibble = kind == super::QKind::Nibble;
        let q_ok = qs.len() == if nibble { 16 * n } else { 32 * n };
        assert!(
            q_ok && out.len() == 32 * n && (!nibble || mins.len() == n),
            "block slices disagree"
        );
        #[cfg(target_arch = "x86_64")]
        {
            assert!(available(), "dequant_row needs AVX2 and FMA");
            // SAFETY: AVX2/FMA checked just above; lengths checked above.
            unsafe { x86::dequant_row(nibble, qs, scales, mins, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (mins, nibble, out);
            unreachable!("dequant_row is only called when AVX2 is available")
        }
    }

    /// Each 32-value block of `x` as 16-bit integers `q` with its scale `d`
    /// (`d = max|x| / 32767`, `q = round(x / d)`, halves away from zero; all zero for a
    /// block of zeros). The AVX2 path (`avx2`, checked by the caller with
    /// [`available`]) gives bitwise the portable loop's values.
    pub fn quantize_blocks(avx2: bool, x: &[f32], q: &mut [i16], d: &mut [f32]) {
        assert!(
            x.len() == q.len() && x.len() == d.len() * 32,
            "quantized shapes disagree"
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            assert!(available(), "quantize_blocks: no AVX2");
            // SAFETY: AVX2 checked just above; the lengths checked above.
            unsafe { x86::quantize_blocks(x, q, d) };
            return;
        }
        let _ = avx2;
        for ((block, q), d) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).zip(d) {
            let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            *d = amax / 32767.0;
            let inv = if *d > 0.0 { 1.0 / *d } else { 0.0 };
            // `(v · inv).round()` (halves away from zero) without the library call:
            // truncate, then step away from zero when the part cut off is at least a
            // half (exact: |v · inv| ≤ 32767).
            for (q, v) in q.iter_mut().zip(block) {
                let r = v * inv;
                let t = r as i32;
                let cut = r - t as f32;
                *q = (t + i32::from(cut >= 0.5) - i32::from(cut <= -0.5)) as i16;
            }
        }
    }

    /// The kernels for products with 16-bit integer inputs. The vector kernels give
    /// every output bitwise the same value: the block sums are exact in integers and
    /// they add the floating-point terms in the same lanes in the same order (sixteen
    /// lanes, four a block of each quad, folded in halves at the end); the portable
    /// loop adds block by block, so it agrees with them only up to rounding.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum IntKernel {
        /// Plain Rust, any CPU.
        Portable,
        /// AVX2 and FMA: half a quad (two blocks) at a time, `vpmaddwd` on 256-bit
        /// vectors.
        Avx2,
        /// AVX-512 (F, BW) with VNNI: a quad at a time, `vpmaddwd` then `vpdpwssd` on
        /// 512-bit vectors; half the vector operations of [`Self::Avx2`].
        Avx512,
    }

    impl IntKernel {
        /// The fastest kernel this CPU runs (detected once). `BATON_NO_AVX512=1` in the
        /// environment holds it to AVX2, for comparisons.
        pub fn best() -> Self {
            static BEST: std::sync::OnceLock<IntKernel> = std::sync::OnceLock::new();
            *BEST.get_or_init(|| {
                let no_wide = std::env::var_os("BATON_NO_AVX512").is_some_and(|v| v == "1");
                let all = Self::available();
                if no_wide {
                    all.iter()
                        .copied()
                        .rfind(|&k| k != IntKernel::Avx512)
                        .unwrap_or(IntKernel::Portable)
                } else {
                    all.last().copied().unwrap_or(IntKernel::Portable)
                }
            })
        }

        /// Every kernel this CPU runs, slowest first (detected once).
        pub fn available() -> &'static [Self] {
            static ALL: std::sync::OnceLock<Vec<IntKernel>> = std::sync::OnceLock::new();
            ALL.get_or_init(Self::detect)
        }

        fn detect() -> Vec<Self> {
            let mut all = vec![IntKernel::Portable];
            if available() {
                all.push(IntKernel::Avx2);
            }
            #[cfg(target_arch = "x86_64")]
            if available()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                all.push(IntKernel::Avx512);
            }
            all
        }
    }

    /// Weight rows the integer kernels take through every input row before the next
    /// ones: 48 rows of 576 values are 14–28 KiB, which stay in the core's first- or
    /// second-level cache while the input rows pass (the output projection's slices of
    /// thousands of rows did not, and were read from memory again for every four inputs).
    pub const WEIGHT_SLICE: usize = 48;

    /// Input rows quantized to 16-bit blocks, from [`super::Prepared`]: values `q`
    /// (rows of `32 · nb`), block scales `d` (rows of `nb`), exact block sums `sums`
    /// (laid out as `d`; 4-bit weights only), and, for the vector kernels, the values
    /// and scales in the quad layout: `qz`, `ez` (see [`super::Prepared`]).
    #[derive(Debug, Clone, Copy)]
    pub struct IntRows<'a> {
        pub q: &'a [i16],
        pub d: &'a [f32],
        pub sums: &'a [f32],
        pub qz: &'a [i16],
        pub ez: &'a [f32],
    }

    /// Weight rows (`qs`, `scales`, `mins`: `m` rows of `nb` blocks each) against input
    /// rows `rows` of `x` (rows of 16-bit blocks `p` with scales `e`), into
    /// `out: [m, n]` (`n = x.d.len() / nb`; columns `rows` written):
    /// `Σ_b d_b · e_b · Σ_i q_bi · p_bi`, plus `Σ_b m_b · Σ_i x_bi` for 4-bit blocks
    /// (from the exact per-block input sums; empty for 8-bit blocks, as is `mins`).
    /// Block sums are exact in integers and each product's floating-point additions run
    /// in one fixed order, so every input row's result is bitwise the one it gets
    /// alone, whichever rows run beside it (see [`IntKernel`]).
    #[allow(clippy::too_many_arguments)]
    pub fn dot_int_rows(
        kernel: IntKernel,
        kind: super::QKind,
        nb: usize,
        qs: &[u8],
        scales: ScaleRows<'_>,
        x: IntRows<'_>,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let IntRows {
            q: xq,
            d: xd,
            sums,
            qz,
            ez,
        } = x;
        let nibble = kind == super::QKind::Nibble;
        let m = scales.units().checked_div(nb).unwrap_or(0);
        let n = xd.len().checked_div(nb).unwrap_or(0);
        let w_ok = nb > 0
            && scales.units() == m * nb
            && qs.len() == if nibble { 16 } else { 32 } * m * nb
            && scales.min_blocks() == if nibble { m * nb } else { 0 }
            && match scales {
                // Super-blocks: whole ones a row.
                ScaleRows::Super(_) => nb.is_multiple_of(SUPER_BLOCKS),
                ScaleRows::Flat(_) => true,
            };
        let x_ok = xd.len() == n * nb
            && xq.len() == 32 * xd.len()
            && (!nibble || sums.len() == xd.len())
            && rows.start <= rows.end
            && rows.end <= n
            && out.len() == m * n;
        assert!(w_ok && x_ok, "block slices disagree");
        assert!(
            IntKernel::available().contains(&kernel),
            "{kernel:?} does not run on this CPU"
        );
        #[cfg(target_arch = "x86_64")]
        if kernel != IntKernel::Portable {
            assert!(
                qz.len() == n * nb.div_ceil(4) * 128 && ez.len() == n * nb.div_ceil(4) * 16,
                "inputs in the quad layout missing"
            );
        }
        #[cfg(target_arch = "x86_64")]
        match (kernel, scales) {
            (IntKernel::Avx512, ScaleRows::Flat(FlatRows { scales, mins })) => {
                // SAFETY: AVX-512 F/BW/VNNI, AVX2 and FMA were detected at run time (the
                // assertion above); the lengths checked above put every block of every
                // row asked for in bounds.
                unsafe {
                    if nibble {
                        x86::dot_int_rows_wide::<true>(nb, qs, scales, mins, x, rows, out);
                    } else {
                        x86::dot_int_rows_wide::<false>(nb, qs, scales, mins, x, rows, out);
                    }
                }
                return;
            }
            (IntKernel::Avx2, ScaleRows::Flat(f)) => {
                // SAFETY: AVX2 and FMA were detected at run time; the lengths checked
                // above put every block of every row asked for in bounds.
                unsafe { x86::dot_int_rows_of(nibble, nb, qs, f, x, rows, out) };
                return;
            }
            // Super-block scales take the AVX2 kernel on AVX-512 CPUs too: the same
            // bits (see `IntKernel`).
            (IntKernel::Avx2 | IntKernel::Avx512, ScaleRows::Super(k)) => {
                // SAFETY: AVX2 and FMA were detected at run time (AVX-512 CPUs have
                // them); the lengths checked above put every block of every row asked
                // for in bounds, and rows hold whole super-blocks.
                unsafe { x86::dot_int_rows_of(nibble, nb, qs, k, x, rows, out) };
                return;
            }
            (IntKernel::Portable, _) => {}
        }
        let _ = (qz, ez);
        let qpb = if nibble { 16 } else { 32 };
        for r in 0..m {
            for j in rows.clone() {
                let mut total = 0.0f32;
                for b in 0..nb {
                    let (wb, xb) = (r * nb + b, j * nb + b);
                    let p = &xq[xb * 32..xb * 32 + 32];
                    let q = &qs[wb * qpb..wb * qpb + qpb];
                    let s: i32 = if nibble {
                        let (lo, hi) = p.split_at(16);
                        q.iter()
                            .zip(lo.iter().zip(hi))
                            .map(|(&q, (&l, &h))| {
                                i32::from(q & 0x0F) * i32::from(l)
                                    + i32::from(q >> 4) * i32::from(h)
                            })
                            .sum()
                    } else {
                        q.iter()
                            .zip(p)
                            .map(|(&q, &p)| i32::from(q as i8) * i32::from(p))
                            .sum()
                    };
                    total += scales.unit(wb) * xd[xb] * s as f32;
                    if nibble {
                        total += scales.min(wb) * sums[xb];
                    }
                }
                out[r * n + j] = total;
            }
        }
    }

    /// `Σ_b d_b · Σ_i q_bi · x_bi` over 8-bit blocks.
    pub fn dot_byte(avx2: bool, qs: &[u8], scales: &[f32], x: &[f32]) -> f32 {
        assert!(
            qs.len() == x.len() && scales.len() * 32 == x.len(),
            "block slices disagree"
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA were detected at run time; lengths are checked above
            // (every block reads 32 bytes of `qs` and 32 floats of `x`).
            return unsafe { x86::dot_byte(qs, scales, x) };
        }
        let _ = avx2;
        let mut total = 0.0f32;
        for ((q, x), d) in qs.chunks_exact(32).zip(x.chunks_exact(32)).zip(scales) {
            let s: f32 = q.iter().zip(x).map(|(&q, &x)| f32::from(q as i8) * x).sum();
            total += d * s;
        }
        total
    }

    /// `Σ_b (d_b · Σ_i q_bi · x_bi + m_b · Σ_i x_bi)` over 4-bit blocks, given the
    /// per-block sums of `x`.
    pub fn dot_nibble(
        avx2: bool,
        qs: &[u8],
        scales: &[f32],
        mins: &[f32],
        x: &[f32],
        xsum: &[f32],
    ) -> f32 {
        assert!(
            qs.len() * 2 == x.len()
                && scales.len() * 32 == x.len()
                && mins.len() == scales.len()
                && xsum.len() == scales.len(),
            "block slices disagree"
        );
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA were detected at run time; every block reads 16
            // bytes of `qs` and 32 floats of `x`, which the lengths above guarantee.
            return unsafe { x86::dot_nibble(qs, scales, mins, x, xsum) };
        }
        let _ = avx2;
        let mut total = 0.0f32;
        for (b, (q, x)) in qs.chunks_exact(16).zip(x.chunks_exact(32)).enumerate() {
            let (lo, hi) = x.split_at(16);
            let mut s = 0.0f32;
            for j in 0..16 {
                s += f32::from(q[j] & 0x0F) * lo[j] + f32::from(q[j] >> 4) * hi[j];
            }
            total += scales[b] * s + mins[b] * xsum[b];
        }
        total
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) mod x86 {
        use std::arch::x86_64::*;

        use crate::engine::llama::scales::x86::QuadScales;

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
        struct QuadRows {
            qz: *const i16,
            ez: *const f32,
            sums: *const f32,
            nb: usize,
        }

        impl QuadRows {
            /// The rows of `x` from row `j` on.
            ///
            /// # Safety
            /// Row `j` must be a row of `x` (`nb` blocks a row).
            unsafe fn at(x: super::IntRows<'_>, nb: usize, j: usize, nibble: bool) -> Self {
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
                            acc[h][k] = _mm256_fmadd_ps(
                                _mm256_mul_ps(d, e),
                                _mm256_cvtepi32_ps(s),
                                acc[h][k],
                            );
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

        /// `W` weight rows (`W · x.nb` blocks of `qs`, `scales`, `mins`) against `R`
        /// input rows on 512-bit vectors, a quad of four blocks at a time: each weight
        /// quad is widened once to four vectors of 32 i16 in the quad layout (one
        /// `vpermq` puts each block's bytes where its four lanes are), then every input
        /// row takes one `vpmaddwd`, three `vpdpwssd` and one scaled FMA per weight row,
        /// four blocks to the vector. A last partial quad is read through masks (zeros,
        /// scale 0). For nibbles the minimum terms follow the quads, sixteen blocks to a
        /// vector (one FMA per sixteen blocks, where folding them into the quads took one
        /// per four). Every lane adds what the same lane of [`dot_int_half`] adds, in the
        /// same order, so the results are bitwise its results.
        ///
        /// # Safety
        /// Needs AVX-512 F/BW/VNNI, AVX2 and FMA; `qs`, `scales` (and `mins` for
        /// nibbles) hold `W · x.nb` blocks; `x` points at `R` rows laid out as
        /// [`super::IntRows`] describes.
        #[inline]
        #[allow(clippy::needless_range_loop)] // `k` also offsets the input pointers
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
        unsafe fn dot_int_quad<const NIBBLE: bool, const R: usize, const W: usize>(
            qs: &[u8],
            scales: &[f32],
            mins: &[f32],
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
                        _mm_prefetch::<_MM_HINT_T0>(scales.as_ptr().wrapping_add(at + 256).cast());
                        let sc = if blocks == 4 {
                            _mm512_castps128_ps512(_mm_loadu_ps(scales.as_ptr().add(at)))
                        } else {
                            _mm512_maskz_loadu_ps((1u16 << blocks) - 1, scales.as_ptr().add(at))
                        };
                        d[i] = _mm512_permutexvar_ps(spread, sc);
                        w[i] = if NIBBLE {
                            let p = qs.as_ptr().add(at * 16);
                            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096).cast());
                            // The minimums as far ahead (256 blocks): they are read
                            // after the quads, too late for the hardware to fetch them.
                            _mm_prefetch::<_MM_HINT_T0>(
                                mins.as_ptr().wrapping_add(at + 256).cast(),
                            );
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
                            acc[i][k] = _mm512_fmadd_ps(
                                _mm512_mul_ps(d[i], e),
                                _mm512_cvtepi32_ps(s),
                                acc[i][k],
                            );
                        }
                    }
                }
                if NIBBLE {
                    // The minimum terms `m_b · Σx_b`, sixteen blocks at a time in lanes
                    // 0..16 (zeros past the row's end): one FMA per sixteen blocks
                    // instead of one per quad.
                    for c in 0..nb.div_ceil(16) {
                        let mask = if nb - 16 * c >= 16 {
                            u16::MAX
                        } else {
                            (1u16 << (nb - 16 * c)) - 1
                        };
                        let sk: [__m512; R] = std::array::from_fn(|k| {
                            _mm512_maskz_loadu_ps(mask, x.sums.add(nb * k + 16 * c))
                        });
                        for i in 0..W {
                            let mv =
                                _mm512_maskz_loadu_ps(mask, mins.as_ptr().add(i * nb + 16 * c));
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
                            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                                _mm512_castps_pd(acc[i][k]),
                            ));
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
        pub unsafe fn dot_int_rows_wide<const NIBBLE: bool>(
            nb: usize,
            qs: &[u8],
            scales: &[f32],
            mins: &[f32],
            x: super::IntRows<'_>,
            rows: std::ops::Range<usize>,
            out: &mut [f32],
        ) {
            let (m, n) = (scales.len() / nb, x.d.len() / nb);
            let qpb = if NIBBLE { 16 } else { 32 };
            // Weight rows a kernel call takes (registers: four widened vectors each).
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
                            let wr = (s1 - r).min(WMAX);
                            let wq = qs.get_unchecked(qpb * nb * r..qpb * nb * (r + wr));
                            let ws = scales.get_unchecked(nb * r..nb * (r + wr));
                            let wm = if NIBBLE {
                                mins.get_unchecked(nb * r..nb * (r + wr))
                            } else {
                                &[][..]
                            };
                            macro_rules! run {
                                ($r:literal, $w:literal) => {{
                                    let v = dot_int_quad::<NIBBLE, $r, $w>(wq, ws, wm, inputs);
                                    for (i, v) in v.iter().enumerate() {
                                        out.get_unchecked_mut(
                                            n * (r + i) + j..n * (r + i) + j + $r,
                                        )
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

        /// One row's blocks dequantized: `out = q·d (+ m)`.
        ///
        /// # Safety
        /// Needs AVX2 and FMA; `out.len() == 32 · scales.len()`, `qs` holds
        /// `scales.len()` blocks, and for nibbles `mins` is as long as `scales`.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dequant_row(
            nibble: bool,
            qs: &[u8],
            scales: &[f32],
            mins: &[f32],
            out: &mut [f32],
        ) {
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
        pub unsafe fn dot_nibble(
            qs: &[u8],
            scales: &[f32],
            mins: &[f32],
            x: &[f32],
            xsum: &[f32],
        ) -> f32 {
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
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::engine::gguf::{dequant::dequantize, writer::quantize};

    pub(in crate::engine::llama) fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32
                    / 1000.0
                    - 1.0
            })
            .collect()
    }

    fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0f64; n * rows];
        for j in 0..n {
            for r in 0..rows {
                y[j * rows + r] = (0..cols)
                    .map(|c| w[r * cols + c] as f64 * x[j * cols + c] as f64)
                    .sum();
            }
        }
        y.into_iter().map(|v| v as f32).collect()
    }

    #[test]
    fn products_match_dequantized_weights() {
        let (rows, cols) = (70, 96);
        let w = values(rows * cols, 1);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4_0] {
            let bytes = quantize(ty, &w).expect("quantize");
            let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes).expect("repack");
            for r in [0, 33, 69] {
                let row = q.row(r);
                for c in 0..cols {
                    assert!((row[c] - deq[r * cols + c]).abs() < 1e-6, "{ty:?} row {r}");
                }
            }
            for n in [1, 3, 4, 6, 9, 17] {
                let x = values(n * cols, 7 + n as u32);
                let want = reference(&deq, rows, cols, &x, n);
                // Both the vector kernel and the portable loop.
                let got = q.matmul(&x, n);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{ty:?} n={n}: {a} vs {b}");
                }
                let bpr = cols / BLOCK;
                let qpb = q.qs_per_block();
                let r = 5;
                let xs = &x[..cols];
                let qs = &q.qs[r * bpr * qpb..(r + 1) * bpr * qpb];
                let mut buf = Default::default();
                let FlatRows { scales: sc, mins } = q.scales_of(r, r + 1).flat(&mut buf);
                let portable = match q.kind {
                    QKind::Byte => simd::dot_byte(false, qs, sc, xs),
                    QKind::Nibble => {
                        let xsum: Vec<f32> = xs.chunks(32).map(|c| c.iter().sum()).collect();
                        simd::dot_nibble(false, qs, sc, mins, xs, &xsum)
                    }
                    _ => unreachable!("not made here"),
                };
                assert!((portable - want[r]).abs() < 1e-4);
            }
        }
    }

    /// `n` valid blocks of `ty` (Q5_0, Q5_1, Q4_K, Q5_K or Q6_K) from a seed: random bytes with
    /// sane f16 scales.
    fn random_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let size = ty.block_bytes().expect("known size");
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let mut out = Vec::with_capacity(n * size);
        for _ in 0..n {
            let mut b: Vec<u8> = (0..size).map(|_| next() as u8).collect();
            let scale = |r: u32| f16::from_f32(2e-4 + (r % 1000) as f32 * 2e-5).to_le_bytes();
            if ty == GgmlType::Q6K {
                // Q6_K keeps its `d` last.
                b[208..210].copy_from_slice(&scale(next()));
            } else {
                b[0..2].copy_from_slice(&scale(next()));
            }
            if matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q5_1) {
                // The minimum's scale (`dmin`, or Q5_1's `m`).
                b[2..4].copy_from_slice(&scale(next()));
            }
            out.extend(b);
        }
        out
    }

    #[test]
    fn packed_and_k_quant_blocks_repack_without_rounding() {
        let (rows, cols) = (12, 512);
        let types = [
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ];
        for ty in types {
            let per = ty.block_size().expect("block size");
            let bytes = random_blocks(ty, rows * cols / per, ty.id().into());
            let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes).expect("repack");
            for r in 0..rows {
                for (c, (a, b)) in q
                    .row(r)
                    .iter()
                    .zip(&deq[r * cols..(r + 1) * cols])
                    .enumerate()
                {
                    // The same value, up to the rounding of one fused multiply-add.
                    assert!(
                        (a - b).abs() <= b.abs() * 2e-7 + 1e-9,
                        "{ty:?} [{r}, {c}]: {a} vs {b}"
                    );
                }
            }
            for n in [1, 4, 9] {
                let x = values(n * cols, 3 + n as u32);
                let want = reference(&deq, rows, cols, &x, n);
                // Q6_K's random scales reach 2.5 a weight: f32 sums of terms in the
                // hundreds, so a bound relative to the sum of their magnitudes.
                let abs = |v: &[f32]| v.iter().map(|v| v.abs()).collect::<Vec<_>>();
                let mag = reference(&abs(&deq), rows, cols, &abs(&x), n);
                for ((a, b), m) in q.matmul(&x, n).iter().zip(&want).zip(&mag) {
                    let tol = 1e-4 + 1e-6 * m;
                    assert!((a - b).abs() < tol, "{ty:?} n={n}: {a} vs {b}");
                }
            }
        }
    }

    /// The same matrix with its scales expanded to f32 (the form K-quant scales were
    /// kept in before).
    fn flat_scales(q: &Blocks) -> Blocks {
        let mut out = q.clone();
        let mut buf = Default::default();
        let f = q.scales_of(0, q.rows).flat(&mut buf);
        out.scales = Scales::Flat {
            scales: f.scales.to_vec(),
            mins: f.mins.to_vec(),
        };
        out
    }

    /// The same matrix with 5-bit blocks as bytes: the form Q5_0 was kept in before
    /// being packed.
    fn unpacked(q: &Blocks) -> Blocks {
        let mut out = q.clone();
        if q.kind == QKind::Five {
            out.kind = QKind::Byte;
            out.qs =
                q.qs.chunks_exact(20)
                    .flat_map(|b| packed::unpack(QKind::Five, b).map(|v| v as u8))
                    .collect();
        }
        out
    }

    /// Q5_0, Q5_1, Q4_K, Q5_K and Q6_K kept in their blocks, with integer inputs: within
    /// the inputs' rounding of the dequantized product; the vector kernels bitwise alike
    /// and the portable loop within float rounding; every row as it is alone; K-quant
    /// scales formed in the kernels bitwise the expanded ones'; and Q5_0 bitwise what it
    /// gave as bytes.
    #[test]
    fn packed_and_k_quant_integer_products() {
        for (ty, cols) in [
            (GgmlType::Q5_0, 160),
            (GgmlType::Q5_0, 576),
            (GgmlType::Q5_1, 160),
            (GgmlType::Q5_1, 576),
            (GgmlType::Q4K, 512),
            (GgmlType::Q5K, 768),
            (GgmlType::Q6K, 512),
            (GgmlType::Q6K, 768),
        ] {
            let rows = 53;
            let per = ty.block_size().expect("block size");
            let bytes = random_blocks(ty, rows * cols / per, cols as u64 + u64::from(ty.id()));
            let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes)
                .expect("repack")
                .with_int_inputs(true);
            // Bits a weight: Q5_0 6 for the file's 5.5, Q5_1 7 for 6 (f32 scales and
            // minimums); Q6_K 6.625 for 6.5625 (the values packed, a byte for each 16
            // and an f32 `d` a super-block); Q4_K 4.75 for 4.5 and Q5_K 5.75 for 5.5 (a
            // byte each for a block's scale and minimum, f32 `d` and `dmin` a
            // super-block).
            let per_weight = q.bytes() as f64 * 8.0 / (rows * cols) as f64;
            let want = match ty {
                GgmlType::Q5_0 => 6.0,
                GgmlType::Q5_1 => 7.0,
                GgmlType::Q6K => 6.625,
                GgmlType::Q5K => 5.75,
                _ => 4.75,
            };
            assert_eq!(per_weight, want, "{ty:?}: bits a weight held");
            let n = 21;
            let x: Vec<f32> = values(n * cols, 17)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (0.5 + (i % 11) as f32))
                .collect();
            let exact = reference(&deq, rows, cols, &x, n);
            let got = q.matmul(&x, n);
            let mut prep = Prepared::default();
            q.prepare(&x, &vec![true; n], &mut prep);
            let bpr = cols / BLOCK;
            for j in 0..n {
                for r in 0..rows {
                    let bound: f64 = (0..cols)
                        .map(|c| f64::from(deq[r * cols + c].abs() * prep.d[j * bpr + c / BLOCK]))
                        .sum::<f64>()
                        / 2.0;
                    let (a, e) = (f64::from(got[j * rows + r]), f64::from(exact[j * rows + r]));
                    assert!(
                        (a - e).abs() <= bound * 1.001 + 1e-4,
                        "{ty:?} ({j}, {r}): {a} vs {e}, bound {bound}"
                    );
                }
            }
            // Each row alone, and every group of rows, gives the bits it gets in the batch.
            for j in [0, 5, 20] {
                let alone = q.matmul(&x[j * cols..(j + 1) * cols], 1);
                for r in 0..rows {
                    assert_eq!(
                        alone[r].to_bits(),
                        got[j * rows + r].to_bits(),
                        "{ty:?} {j}"
                    );
                }
            }
            // The portable loop against the vector kernels.
            let kernels = simd::IntKernel::available();
            let runs: Vec<Vec<f32>> = kernels
                .iter()
                .map(|&kernel| {
                    let mut out = vec![0.0f32; rows * n];
                    let x = prep.int_inputs(&prep.sums);
                    let scales = q.scales_of(0, rows);
                    match q.kind {
                        k if k.is_packed() => packed::dot_int_rows(
                            kernel != simd::IntKernel::Portable,
                            q.kind,
                            bpr,
                            &q.qs,
                            scales,
                            x,
                            0..n,
                            &mut out,
                        ),
                        _ => simd::dot_int_rows(
                            kernel,
                            q.kind,
                            bpr,
                            &q.qs,
                            scales,
                            x,
                            0..n,
                            &mut out,
                        ),
                    }
                    out
                })
                .collect();
            for (k, run) in runs.iter().enumerate().skip(1) {
                for (p, v) in runs[0].iter().zip(run) {
                    // Random K-quant minimums make large terms that cancel.
                    assert!(
                        (p - v).abs() <= 1e-4 * (1.0 + p.abs()),
                        "{ty:?}: {p} vs {v}"
                    );
                }
                assert!(
                    run.iter()
                        .zip(&runs[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?}: {:?} differs from {:?}",
                    kernels[k],
                    kernels[1]
                );
            }
            if matches!(q.scales, Scales::Super { .. }) {
                // Scales formed in the kernels from the super-blocks: bitwise the
                // products of the expanded f32 scales, integer and f32 inputs, one row
                // and many (dequantized tiles).
                let flat = flat_scales(&q);
                assert!(flat.bytes() > q.bytes());
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                for m in [1, 4, 5, n] {
                    let x = &x[..m * cols];
                    assert_eq!(
                        bits(&q.matmul(x, m)),
                        bits(&flat.matmul(x, m)),
                        "{ty:?} {m}"
                    );
                    let (qf, ff) = (
                        q.clone().with_int_inputs(false),
                        flat.clone().with_int_inputs(false),
                    );
                    assert_eq!(
                        bits(&qf.matmul(x, m)),
                        bits(&ff.matmul(x, m)),
                        "{ty:?} f32 {m}"
                    );
                }
                for r in [0, 17, rows - 1] {
                    assert_eq!(bits(&q.row(r)), bits(&flat.row(r)), "{ty:?} row {r}");
                }
            }
            if ty == GgmlType::Q5_0 {
                let before = unpacked(&q).matmul(&x, n);
                assert!(
                    before
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?}: packed blocks change the products"
                );
            }
        }
    }

    #[test]
    fn sixteen_bit_activations_stay_within_their_rounding() {
        // Four to seven blocks a row: a whole quad of blocks for the vector kernels, then
        // one with one, two or three more; 17 and 18 blocks (the model's 576 columns): the
        // minimum terms' sixteen-block runs, a whole one and then one or two blocks.
        for cols in [128, 160, 192, 224, 544, 576] {
            sixteen_bit_activations_with(cols);
        }
    }

    fn sixteen_bit_activations_with(cols: usize) {
        let rows = 40;
        let w = values(rows * cols, 11);
        let bpr = cols / BLOCK;
        for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4_0] {
            let bytes = quantize(ty, &w).expect("quantize");
            let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes)
                .expect("repack")
                .with_int_inputs(true);
            for n in [1, 2, 3, 4, 7, 9] {
                let x: Vec<f32> = values(n * cols, 5 + n as u32)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (1.0 + (i % 7) as f32))
                    .collect();
                let exact = reference(&deq, rows, cols, &x, n);
                let got = q.matmul(&x, n);
                let mut prep = Prepared::default();
                q.prepare(&x, &vec![true; n], &mut prep);
                assert_eq!(
                    prep.q.len(),
                    x.len(),
                    "{ty:?} n={n}: integer inputs prepared"
                );
                for j in 0..n {
                    for r in 0..rows {
                        // The rounding of each input value is at most half its block's
                        // step, so the product moves by at most Σ |w| · step / 2.
                        let bound: f64 = (0..bpr)
                            .map(|b| {
                                let step = f64::from(prep.d[j * bpr + b]);
                                (0..BLOCK)
                                    .map(|i| f64::from(deq[r * cols + b * BLOCK + i].abs()))
                                    .sum::<f64>()
                                    * step
                                    / 2.0
                            })
                            .sum();
                        let (a, e) = (f64::from(got[j * rows + r]), f64::from(exact[j * rows + r]));
                        assert!(
                            (a - e).abs() <= bound * 1.001 + 1e-4,
                            "{ty:?} n={n} ({j}, {r}): {a} vs {e}, bound {bound}"
                        );
                    }
                }
                // Every kernel this CPU runs against every weight row and input row:
                // the vector kernels bitwise alike, the portable loop within rounding.
                assert!(
                    !prep.qz.is_empty() || simd::IntKernel::best() == simd::IntKernel::Portable,
                    "inputs laid out for the vector kernels"
                );
                let outs: Vec<(simd::IntKernel, Vec<f32>)> = simd::IntKernel::available()
                    .iter()
                    .map(|&kernel| {
                        let mut out = vec![0.0f32; rows * n];
                        simd::dot_int_rows(
                            kernel,
                            q.kind,
                            bpr,
                            &q.qs,
                            q.scales_of(0, rows),
                            prep.int_inputs(&prep.sums),
                            0..n,
                            &mut out,
                        );
                        (kernel, out)
                    })
                    .collect();
                let portable = &outs[0].1;
                for (kernel, out) in &outs[1..] {
                    for (p, v) in portable.iter().zip(out) {
                        assert!(
                            (p - v).abs() <= 1e-5 * (1.0 + p.abs()),
                            "{ty:?}: portable {p} vs {kernel:?} {v}"
                        );
                    }
                    let first = &outs[1].1;
                    assert!(
                        first
                            .iter()
                            .zip(out)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} n={n}: {kernel:?} differs from {:?}",
                        outs[1].0
                    );
                }
            }
        }
    }

    /// With integer inputs, every row's product is bitwise the one it gets alone,
    /// however many rows share the product (one to a prefill's worth, through every
    /// grouping of the kernels); the f32 kernels, which change summation order with the
    /// number of rows, make no such promise.
    #[test]
    fn integer_products_do_not_depend_on_the_batch() {
        let (rows, cols) = (37, 160);
        let w = values(rows * cols, 23);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4_0] {
            let bytes = quantize(ty, &w).expect("quantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes)
                .expect("repack")
                .with_int_inputs(true);
            let n = 41;
            let x: Vec<f32> = values(n * cols, 9)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (0.5 + (i % 13) as f32))
                .collect();
            let alone: Vec<Vec<f32>> = (0..n)
                .map(|j| q.matmul(&x[j * cols..(j + 1) * cols], 1))
                .collect();
            // Some rows integer, the others f32 (a prompt joining generated tokens): the
            // integer rows as alone, the f32 rows as the f32 product of those rows.
            let mixed: Vec<bool> = (0..n).map(|j| j % 3 != 1).collect();
            let mut prep = Prepared::default();
            q.prepare(&x, &mixed, &mut prep);
            let (mut tile, mut yt) = (Vec::new(), vec![0.0f32; rows * n]);
            q.product_rows(&x, n, &prep, 0, rows, &mut tile, &mut yt);
            // f32 rows (a prompt's) of the same matrix, each alone.
            let alone_f32: Vec<Vec<f32>> = (0..n)
                .map(|j| {
                    let mut prep = Prepared::default();
                    let row = &x[j * cols..(j + 1) * cols];
                    q.prepare(row, &[false], &mut prep);
                    let mut y = vec![0.0f32; rows];
                    q.product_rows(row, 1, &prep, 0, rows, &mut Vec::new(), &mut y);
                    y
                })
                .collect();
            // ... which is the f32 product up to the order of additions.
            let plain = q.clone().with_int_inputs(false);
            for (j, a) in alone_f32.iter().enumerate() {
                let want = plain.matmul(&x[j * cols..(j + 1) * cols], 1);
                for (a, b) in a.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{ty:?}: {a} vs {b}"
                    );
                }
            }
            for j in 0..n {
                for r in 0..rows {
                    let got = yt[r * n + j];
                    let want = if mixed[j] { &alone } else { &alone_f32 }[j][r];
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty:?}: mixed row {j}");
                }
            }
            // A matrix with integer inputs keeps its f32 rows (prompts) batch-invariant
            // too: the fixed-order panel product at every row count, never the GEMM.
            for m in [5, 8, 9, 16, 41] {
                let mut prep = Prepared::default();
                q.prepare(&x[..m * cols], &vec![false; m], &mut prep);
                let mut yt = vec![0.0f32; rows * m];
                q.product_rows(&x[..m * cols], m, &prep, 0, rows, &mut tile, &mut yt);
                for j in 0..m {
                    for r in 0..rows {
                        let (got, want) = (yt[r * m + j], alone_f32[j][r]);
                        assert_eq!(got.to_bits(), want.to_bits(), "{ty:?}: f32 row {j} of {m}");
                    }
                }
            }
            for m in [2, 3, 4, 5, 8, 9, 16, 17, 33, 41] {
                for start in [0, n - m] {
                    let y = q.matmul(&x[start * cols..(start + m) * cols], m);
                    for j in 0..m {
                        let got = &y[j * rows..(j + 1) * rows];
                        let want = &alone[start + j];
                        let same = got
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{ty:?}: row {} of {m} differs from its product alone",
                            start + j
                        );
                    }
                }
            }
        }
    }

    /// The panel product (prompt rows beside integer inputs) gives the same bits on
    /// every kernel this CPU runs and the portable loop, every row the bits it gets
    /// alone, and the exact product within f32 rounding; panels of eight rows, pairs of
    /// them, partial ones, and weight-row counts around the kernels' groups of six and
    /// twelve.
    #[test]
    fn panel_products_give_the_same_bits_everywhere() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (n, m, cols) in [
            (1, 1, 32),
            (3, 7, 64),
            (16, 6, 96),
            (17, 13, 128),
            (33, 12, 96),
            (40, 25, 32),
            (8, 5, 576),
            (4, 13, 64),
            (9, 24, 96),
            (20, 7, 160),
        ] {
            let x = values(n * cols, 17);
            let w = values(m * cols, 19);
            let mut panels = Vec::new();
            simd::panels(&x, cols, &mut panels);
            let mut wl = vec![0.0f32; m * cols];
            for (row, out) in w.chunks_exact(cols).zip(wl.chunks_exact_mut(cols)) {
                simd::interleave_halves(row, out);
                for k in 0..cols / 2 {
                    assert_eq!((out[2 * k], out[2 * k + 1]), (row[k], row[cols / 2 + k]));
                }
            }
            let run = |avx2: bool| {
                let mut out = vec![0.0f32; m * n];
                simd::panel_product(avx2, &panels, n, &wl, m, cols, &mut out);
                out
            };
            let portable = run(false);
            let want = reference(&w, m, cols, &x, n);
            for r in 0..m {
                for j in 0..n {
                    let (got, e) = (portable[r * n + j], want[j * m + r]);
                    assert!((got - e).abs() <= 1e-4 * (1.0 + e.abs()), "{got} vs {e}");
                }
            }
            if simd::available() {
                assert_eq!(bits(&run(true)), bits(&portable), "n={n} m={m} cols={cols}");
                #[cfg(target_arch = "x86_64")]
                {
                    let mut narrow = vec![0.0f32; m * n];
                    // SAFETY: AVX2 and FMA are available (checked above); the shapes
                    // match.
                    unsafe { simd::x86::panel_product(&panels, n, &wl, m, cols, &mut narrow) };
                    assert_eq!(bits(&narrow), bits(&portable), "AVX2 n={n} m={m}");
                }
            }
            // Row j alone gives column j.
            for j in [0, n / 2, n - 1] {
                let mut one = Vec::new();
                simd::panels(&x[j * cols..(j + 1) * cols], cols, &mut one);
                let mut out = vec![0.0f32; m];
                simd::panel_product(simd::available(), &one, 1, &wl, m, cols, &mut out);
                let column: Vec<f32> = (0..m).map(|r| portable[r * n + j]).collect();
                assert_eq!(bits(&out), bits(&column), "row {j} of {n} alone");
            }
        }
    }

    /// The vector quantization gives bitwise the portable loop's values and scales.
    #[test]
    fn vector_quantization_matches_the_portable_loop() {
        let n = 64 * 32;
        let mut x: Vec<f32> = values(n, 3)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1.0 + (i % 29) as f32 * 3.7))
            .collect();
        // A block of zeros, one of a single value, exact halves after scaling.
        x[32..64].fill(0.0);
        x[64..96].fill(-2.5);
        for (i, v) in x[96..128].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5;
        }
        let run = |avx2: bool| {
            let (mut q, mut d) = (vec![0i16; n], vec![0.0f32; n / 32]);
            simd::quantize_blocks(avx2, &x, &mut q, &mut d);
            (q, d.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        };
        let portable = run(false);
        if simd::available() {
            assert_eq!(run(true), portable, "AVX2 quantization differs");
        }
        assert!(portable.0[32..64].iter().all(|&q| q == 0));
        assert!(portable.0[64..96].iter().all(|&q| q == -32767));
    }

    /// Inputs are rounded as `f32::round` does (halves away from zero), ties included.
    #[test]
    fn inputs_round_halves_away_from_zero() {
        let w = values(2 * 32, 1);
        let q = Blocks::quantize_q8(&w, 2, 32)
            .expect("q8")
            .with_int_inputs(true);
        // The block's largest value maps to 32767, so each of these lands on (or next
        // to) a half step.
        let mut x: Vec<f32> = (0..31)
            .map(|i| (i as f32 - 15.0) * 0.5 + 0.25 * (i % 3) as f32)
            .collect();
        x.push(32767.0);
        let mut prep = Prepared::default();
        q.prepare(&x, &[true], &mut prep);
        let inv = 1.0 / (32767.0f32 / 32767.0);
        for (got, v) in prep.q.iter().zip(&x) {
            assert_eq!(i32::from(*got), (v * inv).round() as i32, "{v}");
        }
    }

    #[test]
    fn rows_can_be_selected_and_stacked() {
        let (rows, cols) = (8, 64);
        let w = values(rows * cols, 3);
        let bytes = quantize(GgmlType::Q4_1, &w).expect("quantize");
        let q = Blocks::from_gguf(GgmlType::Q4_1, rows, cols, &bytes).expect("repack");
        let picked = q.select_rows(&[7, 0]);
        assert_eq!(picked.row(0), q.row(7));
        assert_eq!(picked.row(1), q.row(0));
        let both = Blocks::concat_rows(vec![q.clone(), picked]).expect("same kind");
        assert_eq!(both.rows(), 10);
        assert_eq!(both.row(9), q.row(0));
        let q8 = Blocks::quantize_q8(&w, rows, cols).expect("q8");
        assert!(Blocks::concat_rows(vec![q, q8.clone()]).is_none());
        for (a, b) in q8.row(2).iter().zip(&w[2 * cols..3 * cols]) {
            assert!((a - b).abs() < 0.01);
        }
    }

    /// F16 and BF16 matrices keep their 16-bit values: rows are the file's values
    /// exactly, products within f32 rounding of the exact ones, and a generated row's
    /// product is bitwise the same alone, in a batch, and beside prompt rows.
    #[test]
    fn sixteen_bit_float_matrices_keep_their_values() {
        let (rows, cols) = (37, 96);
        let w = values(rows * cols, 23);
        for (ty, kind) in [(GgmlType::F16, QKind::F16), (GgmlType::BF16, QKind::Bf16)] {
            let bytes: Vec<u8> = w
                .iter()
                .flat_map(|&v| {
                    if ty == GgmlType::F16 {
                        f16::from_f32(v).to_le_bytes()
                    } else {
                        half::bf16::from_f32(v).to_le_bytes()
                    }
                })
                .collect();
            let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
            let q = Blocks::from_gguf(ty, rows, cols, &bytes).expect("kept");
            assert_eq!(q.kind(), kind);
            assert_eq!(q.bytes(), 2 * rows * cols, "{ty:?}: 16 bits a weight");
            for r in [0, 20, rows - 1] {
                let row = q.row(r);
                assert_eq!(
                    row,
                    deq[r * cols..(r + 1) * cols].to_vec(),
                    "{ty:?} row {r}"
                );
            }
            let n = 9;
            let x = values(n * cols, 5);
            let want = reference(&deq, rows, cols, &x, n);
            for int in [false, true] {
                let m = q.clone().with_int_inputs(int);
                for k in [1, 3, n] {
                    let got = m.matmul(&x[..k * cols], k);
                    for (a, b) in got.iter().zip(&want[..k * rows]) {
                        assert!((a - b).abs() < 1e-5, "{ty:?} int={int} n={k}: {a} vs {b}");
                    }
                }
            }
            // A generated row alone, in a batch, and beside prompt rows.
            let m = q.clone().with_int_inputs(true);
            let alone = m.matmul(&x[4 * cols..5 * cols], 1);
            let batch = m.matmul(&x, n);
            let mut prep = Prepared::default();
            let marks: Vec<bool> = (0..n).map(|j| j == 4 || j == 7).collect();
            m.prepare(&x, &marks, &mut prep);
            let mut mixed = vec![0.0f32; rows * n];
            m.product_rows(&x, n, &prep, 0, rows, &mut Vec::new(), &mut mixed);
            for r in 0..rows {
                assert_eq!(alone[r].to_bits(), batch[4 * rows + r].to_bits(), "{ty:?}");
                assert_eq!(alone[r].to_bits(), mixed[r * n + 4].to_bits(), "{ty:?}");
                assert!((mixed[r * n] - want[r]).abs() < 1e-5, "{ty:?}: prompt row");
            }
        }
    }

    #[test]
    fn unsupported_shapes_are_refused() {
        assert!(Blocks::from_gguf(GgmlType::Q4_1, 2, 48, &[0; 60]).is_none());
        assert!(Blocks::from_gguf(GgmlType::Q4_1, 2, 32, &[0; 39]).is_none());
        assert!(Blocks::from_gguf(GgmlType::F32, 2, 32, &[0; 256]).is_none());
    }
}
