//! Prompt rows against block weights in 8-bit integers (the `native-i8` weights): each
//! 32-value block of a prompt row is quantized to `i8` with its own scale, each weight
//! row is unpacked to its file's integers with a scale a unit (and a minimum a block),
//! and every unit's dot product is an exact `i32` sum. Where the CPU has AVX-512 VNNI,
//! one `vpdpbusd` does 64 of those multiply-adds, twice the f32 panel product's
//! arithmetic a cycle; elsewhere a portable loop gives the same bits, slowly.
//!
//! Weights go in as unsigned bytes `u` (their value plus an offset, `v = u − off`),
//! inputs as signed bytes `q`, the two sides `vpdpbusd` takes. Every output is one chain
//! from zero over its row's units in order: `acc ← fma(t, w_scale · x_scale, acc)` with
//! `t = Σu·q − off · Σq` the unit's integer sum as f32 (exact), then for a block with a
//! minimum `acc ← fma(m, x_scale · Σq, acc)`. Each lane of the vector kernel runs that
//! chain for one input row, so a prompt row's result is the same bits whatever rows run
//! beside it and whichever path runs it.

use super::super::BLOCK;

/// Input rows a vector of the kernel holds: lane `l` of group `g` is row `16g + l`.
pub const LANES: usize = 16;

/// The largest magnitude of a quantized input (symmetric, `−127..=127`).
const QMAX: f32 = 127.0;

/// Input rows quantized to 8-bit blocks, laid out for [`product`].
#[derive(Debug, Clone, Default)]
pub struct BytePanels {
    /// `[⌈n/16⌉, cols/4, 16, 4]`: in group `g`, the `c`-th 64 bytes hold each lane's
    /// row's values `4c..4c + 4` (padding rows: zeros).
    pub q: Vec<i8>,
    /// `[⌈n/16⌉, cols/32, 16]`: each block's scale (zero for padding rows).
    pub d: Vec<f32>,
    /// `[⌈n/16⌉, cols/32, 16]`: each block's `d · Σq`, for the weights' minimums.
    pub s: Vec<f32>,
    /// `[⌈n/16⌉, cols/16, 16]`: `Σq` of each half block, for the weights' offsets.
    pub half_sums: Vec<i32>,
    /// Columns of the rows held.
    pub cols: usize,
}

impl BytePanels {
    /// Quantizes `x: [n, cols]` into these panels: `d = max|x| / 127` a block, `q` the
    /// nearest integer to `x / d` (halves away from zero).
    pub fn fill(&mut self, x: &[f32], cols: usize) {
        assert!(
            cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols.max(1)),
            "rows of whole blocks"
        );
        let n = x.len() / cols.max(1);
        let (groups, bpr) = (n.div_ceil(LANES), cols / BLOCK);
        self.cols = cols;
        self.q.clear();
        self.q.resize(groups * cols * LANES, 0);
        self.d.clear();
        self.d.resize(groups * bpr * LANES, 0.0);
        self.s.clear();
        self.s.resize(groups * bpr * LANES, 0.0);
        self.half_sums.clear();
        self.half_sums.resize(groups * 2 * bpr * LANES, 0);
        #[cfg(target_arch = "x86_64")]
        let avx2 = super::available();
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        let mut v = [0i8; BLOCK];
        for (j, row) in x.chunks_exact(cols).enumerate() {
            let (g, l) = (j / LANES, j % LANES);
            let q = &mut self.q[g * cols * LANES..(g + 1) * cols * LANES];
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                let block: &[f32; BLOCK] = block.try_into().expect("whole blocks");
                let (d, sums) = if avx2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 detected at run time.
                    unsafe {
                        quantize_block_avx2(block, &mut v)
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!()
                } else {
                    quantize_block(block, &mut v)
                };
                // Four values a lane, eight quads a block.
                for (c, four) in v.chunks_exact(4).enumerate() {
                    let at = (b * 8 + c) * 4 * LANES + 4 * l;
                    q[at..at + 4].copy_from_slice(four);
                }
                let at = (g * bpr + b) * LANES + l;
                self.d[at] = d;
                self.s[at] = d * (sums[0] + sums[1]) as f32;
                for (u, sum) in sums.into_iter().enumerate() {
                    self.half_sums[(g * 2 * bpr + 2 * b + u) * LANES + l] = sum;
                }
            }
        }
    }

    /// Rows of panels held (a whole number of groups).
    fn groups(&self) -> usize {
        self.q.len() / (self.cols * LANES).max(1)
    }

    /// `Σq` of lane `l` in group `g` over unit `unit` of `upb` a block.
    fn unit_sum(&self, g: usize, unit: usize, upb: usize, l: usize) -> i32 {
        let bpr = self.cols / BLOCK;
        let at = |h: usize| self.half_sums[(g * 2 * bpr + h) * LANES + l];
        if upb == 2 {
            at(unit)
        } else {
            at(2 * unit) + at(2 * unit + 1)
        }
    }
}

/// One block of 32 inputs quantized into `v`: returns its scale and the sums of its
/// two halves' values.
fn quantize_block(block: &[f32; BLOCK], v: &mut [i8; BLOCK]) -> (f32, [i32; 2]) {
    let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / QMAX;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &x) in v.iter_mut().zip(block) {
        *o = round_half_away(x * inv).clamp(-127, 127) as i8;
    }
    let (h0, h1) = v.split_at(BLOCK / 2);
    (
        d,
        [h0, h1].map(|h| h.iter().map(|&x| i32::from(x)).sum::<i32>()),
    )
}

/// [`quantize_block`] on 256-bit vectors, the same operations lane by lane (the
/// largest magnitude is exact in any order).
///
/// # Safety
/// Needs AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(block: &[f32; BLOCK], v: &mut [i8; BLOCK]) -> (f32, [i32; 2]) {
    use std::arch::x86_64::*;
    // SAFETY: four loads of eight inside the block and one store of 32 bytes into `v`.
    unsafe {
        let x: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
        let sign = _mm256_set1_ps(-0.0);
        let abs = x.map(|x| _mm256_andnot_ps(sign, x));
        let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        let d = amax / QMAX;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (half, neg_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
        let (hi, lo) = (_mm256_set1_epi32(127), _mm256_set1_epi32(-127));
        let q = x.map(|x| {
            let r = _mm256_mul_ps(x, inv);
            let t = _mm256_cvttps_epi32(r);
            let cut = _mm256_sub_ps(r, _mm256_cvtepi32_ps(t));
            // The compares give −1 where true: `t + up − down` as the scalar loop adds.
            let up = _mm256_castps_si256(_mm256_cmp_ps(cut, half, _CMP_GE_OQ));
            let down = _mm256_castps_si256(_mm256_cmp_ps(cut, neg_half, _CMP_LE_OQ));
            let t = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
            _mm256_max_epi32(_mm256_min_epi32(t, hi), lo)
        });
        let hsum = |a: __m256i, b: __m256i| {
            let s = _mm256_add_epi32(a, b);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)))
        };
        let sums = [hsum(q[0], q[1]), hsum(q[2], q[3])];
        // Packing interleaves 128-bit lanes; the permute puts the 32 values back in order.
        let p16a = _mm256_packs_epi32(q[0], q[1]);
        let p16b = _mm256_packs_epi32(q[2], q[3]);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256(
            v.as_mut_ptr().cast(),
            _mm256_permutevar8x32_epi32(p8, order),
        );
        (d, sums)
    }
}

/// The nearest integer, halves away from zero, without the library call (exact for
/// the magnitudes here, at most 127 and a rounding).
fn round_half_away(r: f32) -> i32 {
    let t = r as i32;
    let cut = r - t as f32;
    t + i32::from(cut >= 0.5) - i32::from(cut <= -0.5)
}

/// Weight rows as their file's integers, for [`product`]: `w = (u − offset) · scale +
/// min`, a scale a unit (a block, or a half block for 6-bit blocks) and a minimum a
/// block (for blocks that have one).
#[derive(Debug, Clone, Default)]
pub struct ByteTile {
    /// `[rows, cols]`: each weight's unsigned integer `u`.
    pub u: Vec<u8>,
    /// `[rows, units]`: each unit's scale.
    pub scale: Vec<f32>,
    /// `[rows, cols/32]` for blocks with minimums, else empty.
    pub min: Vec<f32>,
    /// What every `u` carries above its signed value.
    pub offset: i32,
    /// Units a block: 1, or 2 for 6-bit blocks.
    pub units_per_block: usize,
    /// Rows and columns held.
    pub rows: usize,
    pub cols: usize,
}

impl ByteTile {
    /// Makes the tile `rows × cols` weights with `units_per_block` scales a block and
    /// `offset`, its values, scales and minimums emptied for the caller to fill.
    pub fn reset(&mut self, rows: usize, cols: usize, units_per_block: usize, offset: i32) {
        assert!(
            cols.is_multiple_of(BLOCK) && (units_per_block == 1 || units_per_block == 2),
            "tile shape"
        );
        // Every value is written before it is read: values kept from the last tile are
        // not cleared (only growth is zero-filled).
        self.u.resize(rows * cols, 0);
        self.scale.clear();
        self.min.clear();
        self.offset = offset;
        self.units_per_block = units_per_block;
        self.rows = rows;
        self.cols = cols;
    }

    fn has_mins(&self) -> bool {
        !self.min.is_empty()
    }
}

/// 4-bit blocks (16 bytes each, low nibbles the first 16 values, high nibbles the
/// next) as one byte a value, into `out` (32 bytes a block): the nibble itself, or
/// `table[nibble]` (IQ4's values, offset to unsigned).
pub fn split_nibbles(qs: &[u8], table: Option<&[u8; 16]>, out: &mut [u8]) {
    assert!(
        qs.len().is_multiple_of(16) && out.len() == 2 * qs.len(),
        "nibble blocks disagree"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::available() {
        // SAFETY: AVX2 detected at run time; the lengths checked above.
        done = unsafe { split_nibbles_avx2(qs, table, out) };
    }
    let look = |v: u8| table.map_or(v, |t| t[usize::from(v)]);
    for (block, o) in qs[done..]
        .chunks_exact(16)
        .zip(out[2 * done..].chunks_exact_mut(32))
    {
        for i in 0..16 {
            o[i] = look(block[i] & 0x0F);
            o[i + 16] = look(block[i] >> 4);
        }
    }
}

/// [`split_nibbles`] two blocks at a time (the table looked up with `vpshufb`); returns
/// the input bytes it did.
///
/// # Safety
/// Needs AVX2; `out` twice as long as `qs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_nibbles_avx2(qs: &[u8], table: Option<&[u8; 16]>, out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let pairs = qs.len() / 32;
    // SAFETY: pair `i` reads bytes `32i..32i + 32` of `qs` and writes `64i..64i + 64`
    // of `out`, both in bounds; the table is 16 bytes.
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let lut = table.map(|t| _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr().cast())));
        for i in 0..pairs {
            let v = _mm256_loadu_si256(qs.as_ptr().add(32 * i).cast());
            let mut lo = _mm256_and_si256(v, mask);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if let Some(lut) = lut {
                lo = _mm256_shuffle_epi8(lut, lo);
                hi = _mm256_shuffle_epi8(lut, hi);
            }
            let o = out.as_mut_ptr().add(64 * i);
            _mm256_storeu_si256(o.cast(), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256(o.add(32).cast(), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
    }
    pairs * 32
}

/// `out[r][j] = Σ_c w[r][c] · x[j][c]` for the tile's rows and the first `n` rows of
/// `x` (as quantized in `p`), into `out: [rows, n]`.
pub fn product(p: &BytePanels, n: usize, t: &ByteTile, out: &mut [f32]) {
    product_on(super::IntKernel::best(), p, n, t, out);
}

/// [`product`] on one `kernel` (every kernel gives the same bits), which must be one this
/// CPU runs ([`super::IntKernel::available`]).
pub fn product_on(
    kernel: super::IntKernel,
    p: &BytePanels,
    n: usize,
    t: &ByteTile,
    out: &mut [f32],
) {
    assert!(
        super::IntKernel::available().contains(&kernel),
        "{kernel:?} does not run here"
    );
    let units = t.cols / BLOCK * t.units_per_block;
    let (groups, bpr) = (p.groups(), p.cols / BLOCK);
    assert!(
        p.cols == t.cols
            && p.q.len() == groups * p.cols * LANES
            && p.d.len() == groups * bpr * LANES
            && p.s.len() == groups * bpr * LANES
            && p.half_sums.len() == 2 * groups * bpr * LANES
            && n.div_ceil(LANES) <= groups
            && t.u.len() == t.rows * t.cols
            && t.scale.len() == t.rows * units
            && out.len() == t.rows * n
            && (t.min.is_empty() || t.min.len() == t.rows * t.cols / BLOCK),
        "byte product shapes disagree"
    );
    match kernel {
        // SAFETY: `Avx512` runs only where AVX-512 F, BW and VNNI were detected, `Avx2`
        // where AVX2 and FMA were (checked just above); the shapes checked above.
        #[cfg(target_arch = "x86_64")]
        super::IntKernel::Avx512 => unsafe { wide::product(p, n, t, out) },
        #[cfg(target_arch = "x86_64")]
        super::IntKernel::Avx2 => unsafe { narrow::product(p, n, t, out) },
        _ => portable(p, n, t, out),
    }
}

/// [`product`] in plain Rust: the same operations per output, in the same order.
fn portable(p: &BytePanels, n: usize, t: &ByteTile, out: &mut [f32]) {
    let (cols, upb) = (t.cols, t.units_per_block);
    let (bpr, len) = (cols / BLOCK, BLOCK / upb);
    let units = bpr * upb;
    for r in 0..t.rows {
        let u = &t.u[r * cols..(r + 1) * cols];
        for j in 0..n {
            let (g, l) = (j / LANES, j % LANES);
            let q = &p.q[g * cols * LANES..(g + 1) * cols * LANES];
            let mut acc = 0.0f32;
            for b in 0..bpr {
                let at = (g * bpr + b) * LANES + l;
                for h in 0..upb {
                    let k0 = b * BLOCK + h * len;
                    let sum: i32 = (k0..k0 + len)
                        .map(|k| {
                            i32::from(u[k]) * i32::from(q[(k / 4) * 4 * LANES + 4 * l + k % 4])
                        })
                        .sum();
                    let unit = b * upb + h;
                    let t_int = sum - t.offset * p.unit_sum(g, unit, upb, l);
                    let s = t.scale[r * units + unit] * p.d[at];
                    acc = (t_int as f32).mul_add(s, acc);
                }
                if t.has_mins() {
                    acc = t.min[r * bpr + b].mul_add(p.s[at], acc);
                }
            }
            out[r * n + j] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use super::{BytePanels, ByteTile, BLOCK, LANES};

    /// [`super::product`] on 512-bit vectors: four weight rows against two groups of
    /// sixteen input rows at a time (eight integer and eight f32 accumulators).
    ///
    /// # Safety
    /// Needs AVX-512 F, BW and VNNI; the shapes as [`super::product`] checks them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn product(p: &BytePanels, n: usize, t: &ByteTile, out: &mut [f32]) {
        let groups = n.div_ceil(LANES);
        let mut r = 0;
        while r < t.rows {
            let rr = (t.rows - r).min(4);
            let mut g = 0;
            while g < groups {
                let gg = (groups - g).min(2);
                // SAFETY: the caller's features; rows `r..r + rr` and groups `g..g + gg`
                // lie within the tile and the panels.
                unsafe {
                    match (rr, gg) {
                        (4, 2) => run::<4, 2>(p, n, t, r, g, out),
                        (4, _) => run::<4, 1>(p, n, t, r, g, out),
                        _ => {
                            for i in 0..rr {
                                for h in 0..gg {
                                    run::<1, 1>(p, n, t, r + i, g + h, out);
                                }
                            }
                        }
                    }
                }
                g += gg;
            }
            r += rr;
        }
    }

    /// [`block`] for the tile's units a block and minimums.
    ///
    /// # Safety
    /// As [`block`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn run<const R: usize, const G: usize>(
        p: &BytePanels,
        n: usize,
        t: &ByteTile,
        r0: usize,
        g0: usize,
        out: &mut [f32],
    ) {
        // SAFETY: passed on from the caller.
        unsafe {
            match (t.units_per_block, t.has_mins()) {
                (1, false) => block::<R, G, 1, false>(p, n, t, r0, g0, out),
                (1, true) => block::<R, G, 1, true>(p, n, t, r0, g0, out),
                (_, false) => block::<R, G, 2, false>(p, n, t, r0, g0, out),
                (_, true) => block::<R, G, 2, true>(p, n, t, r0, g0, out),
            }
        }
    }

    /// Weight rows `r0..r0 + R` against groups `g0..g0 + G`, each output's chain as
    /// the portable loop runs it.
    ///
    /// # Safety
    /// As [`product`]; `r0 + R ≤ rows`, `g0 + G` groups within the panels.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop)] // `i` and `h` also name rows and groups
    unsafe fn block<const R: usize, const G: usize, const UPB: usize, const MINS: bool>(
        p: &BytePanels,
        n: usize,
        t: &ByteTile,
        r0: usize,
        g0: usize,
        out: &mut [f32],
    ) {
        let cols = t.cols;
        let (bpr, len) = (cols / BLOCK, BLOCK / UPB);
        let units = bpr * UPB;
        let (xq, xd, xs, xh) = (
            p.q.as_ptr(),
            p.d.as_ptr(),
            p.s.as_ptr(),
            p.half_sums.as_ptr(),
        );
        let w = t.u.as_ptr();
        let offset = _mm512_set1_epi32(t.offset);
        // SAFETY: the caller's features and bounds (see above).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); G]; R];
            for b in 0..bpr {
                for u in 0..UPB {
                    let mut sum = [[_mm512_setzero_si512(); G]; R];
                    let kq0 = (b * BLOCK + u * len) / 4;
                    for kq in kq0..kq0 + len / 4 {
                        let x: [__m512i; G] = std::array::from_fn(|h| {
                            _mm512_loadu_si512(xq.add(((g0 + h) * cols / 4 + kq) * 64).cast())
                        });
                        for i in 0..R {
                            let wv = w
                                .add((r0 + i) * cols + 4 * kq)
                                .cast::<i32>()
                                .read_unaligned();
                            let wb = _mm512_set1_epi32(wv);
                            for h in 0..G {
                                sum[i][h] = _mm512_dpbusd_epi32(sum[i][h], wb, x[h]);
                            }
                        }
                    }
                    // `off · Σq` of each lane over this unit, once for all R rows.
                    let bias: [__m512i; G] = std::array::from_fn(|h| {
                        let half = |k: usize| {
                            _mm512_loadu_si512(xh.add(((g0 + h) * 2 * bpr + k) * LANES).cast())
                        };
                        let q = if UPB == 2 {
                            half(2 * b + u)
                        } else {
                            _mm512_add_epi32(half(2 * b), half(2 * b + 1))
                        };
                        _mm512_mullo_epi32(q, offset)
                    });
                    for i in 0..R {
                        let scale = _mm512_set1_ps(t.scale[(r0 + i) * units + b * UPB + u]);
                        for h in 0..G {
                            let d = _mm512_loadu_ps(xd.add(((g0 + h) * bpr + b) * LANES));
                            let s = _mm512_mul_ps(scale, d);
                            let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[i][h], bias[h]));
                            acc[i][h] = _mm512_fmadd_ps(v, s, acc[i][h]);
                        }
                    }
                }
                if MINS {
                    for i in 0..R {
                        let m = _mm512_set1_ps(t.min[(r0 + i) * bpr + b]);
                        for h in 0..G {
                            let s = _mm512_loadu_ps(xs.add(((g0 + h) * bpr + b) * LANES));
                            acc[i][h] = _mm512_fmadd_ps(m, s, acc[i][h]);
                        }
                    }
                }
            }
            for i in 0..R {
                for h in 0..G {
                    let j0 = (g0 + h) * LANES;
                    let lanes = (n - j0).min(LANES);
                    let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
                    let o = out.as_mut_ptr().add((r0 + i) * n + j0);
                    _mm512_mask_storeu_ps(o, mask, acc[i][h]);
                }
            }
        }
    }
}

/// [`super::product`] on 256-bit vectors without VNNI: half a group (eight input rows) a
/// vector. The weights go in signed (`u − offset`, at most 128 in magnitude), their
/// magnitudes against the inputs with the weights' signs (`vpsignb`), so that
/// `vpmaddubsw`'s 16-bit pair sums never saturate (2 · 128 · 127 < 2¹⁵); `vpmaddwd`
/// by ones makes the sums of four. The unit's integer sum is then `Σ(u − off)·q`, the
/// one the 512-bit kernel forms as `Σu·q − off·Σq`.
#[cfg(target_arch = "x86_64")]
mod narrow {
    use std::arch::x86_64::*;

    use super::{BytePanels, ByteTile, BLOCK, LANES};

    /// # Safety
    /// Needs AVX2 and FMA; the shapes as [`super::product`] checks them.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn product(p: &BytePanels, n: usize, t: &ByteTile, out: &mut [f32]) {
        let halves = n.div_ceil(LANES / 2);
        for r in (0..t.rows).step_by(2) {
            for h in 0..halves {
                // SAFETY: the caller's features; rows and halves within the shapes.
                unsafe {
                    match (t.rows - r >= 2, t.units_per_block, t.has_mins()) {
                        (true, 1, false) => block::<2, 1, false>(p, n, t, r, h, out),
                        (true, 1, true) => block::<2, 1, true>(p, n, t, r, h, out),
                        (true, _, false) => block::<2, 2, false>(p, n, t, r, h, out),
                        (true, _, true) => block::<2, 2, true>(p, n, t, r, h, out),
                        (false, 1, false) => block::<1, 1, false>(p, n, t, r, h, out),
                        (false, 1, true) => block::<1, 1, true>(p, n, t, r, h, out),
                        (false, _, false) => block::<1, 2, false>(p, n, t, r, h, out),
                        (false, _, true) => block::<1, 2, true>(p, n, t, r, h, out),
                    }
                }
            }
        }
    }

    /// Weight rows `r0..r0 + R` against input rows `8·half..8·half + 8`.
    ///
    /// # Safety
    /// As [`product`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // `i` also names a row
    unsafe fn block<const R: usize, const UPB: usize, const MINS: bool>(
        p: &BytePanels,
        n: usize,
        t: &ByteTile,
        r0: usize,
        half: usize,
        out: &mut [f32],
    ) {
        let cols = t.cols;
        let (bpr, len) = (cols / BLOCK, BLOCK / UPB);
        let units = bpr * UPB;
        let (g, hf) = (half / 2, half % 2);
        // SAFETY: the caller's features and bounds.
        unsafe {
            let xq = p.q.as_ptr().add(g * cols * LANES + 32 * hf);
            let (xd, xs) = (p.d.as_ptr(), p.s.as_ptr());
            let w = t.u.as_ptr();
            let offset = _mm256_set1_epi8(t.offset as u8 as i8);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..bpr {
                let at = (g * bpr + b) * LANES + 8 * hf;
                for u in 0..UPB {
                    let mut sum = [_mm256_setzero_si256(); R];
                    let kq0 = (b * BLOCK + u * len) / 4;
                    for kq in kq0..kq0 + len / 4 {
                        let x = _mm256_loadu_si256(xq.add(kq * 64).cast());
                        for i in 0..R {
                            let wv = w
                                .add((r0 + i) * cols + 4 * kq)
                                .cast::<i32>()
                                .read_unaligned();
                            let v = _mm256_sub_epi8(_mm256_set1_epi32(wv), offset);
                            let pairs =
                                _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v));
                            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                    let d = _mm256_loadu_ps(xd.add(at));
                    for i in 0..R {
                        let scale = _mm256_set1_ps(t.scale[(r0 + i) * units + b * UPB + u]);
                        let s = _mm256_mul_ps(scale, d);
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), s, acc[i]);
                    }
                }
                if MINS {
                    let s = _mm256_loadu_ps(xs.add(at));
                    for i in 0..R {
                        let m = _mm256_set1_ps(t.min[(r0 + i) * bpr + b]);
                        acc[i] = _mm256_fmadd_ps(m, s, acc[i]);
                    }
                }
            }
            let j0 = 8 * half;
            let lanes = (n - j0).min(8);
            for i in 0..R {
                let o = out.as_mut_ptr().add((r0 + i) * n + j0);
                if lanes == 8 {
                    _mm256_storeu_ps(o, acc[i]);
                } else {
                    let mut v = [0.0f32; 8];
                    _mm256_storeu_ps(v.as_mut_ptr(), acc[i]);
                    std::ptr::copy_nonoverlapping(v.as_ptr(), o, lanes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector quantization gives the scalar loop's values, scales and sums, on
    /// random blocks and on values that land on halves of a step.
    #[test]
    fn vector_quantization_is_the_scalar_loop() {
        #[cfg(target_arch = "x86_64")]
        if crate::engine::cpu::kernels::available() {
            let mut state = 0x9E37_79B9_7F4A_7C15u64;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            for case in 0..2000 {
                let block: [f32; BLOCK] = std::array::from_fn(|i| match case % 4 {
                    // Steps of exactly 1 with values on halves: 127 sets the step.
                    0 if i == 0 => 127.0,
                    0 => (next() % 255) as f32 / 2.0 - 63.5,
                    1 => 0.0,
                    _ => ((next() % 2_000_001) as f32 / 1e6 - 1.0) * (1 + case % 97) as f32,
                });
                let (mut a, mut b) = ([0i8; BLOCK], [0i8; BLOCK]);
                let scalar = quantize_block(&block, &mut a);
                // SAFETY: AVX2 detected above.
                let vector = unsafe { quantize_block_avx2(&block, &mut b) };
                assert_eq!(a, b, "case {case}");
                assert_eq!(scalar.0.to_bits(), vector.0.to_bits(), "case {case}");
                assert_eq!(scalar.1, vector.1, "case {case}");
            }
        }
    }
}
