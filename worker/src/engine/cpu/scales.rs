//! The scales of a weight matrix's blocks (and the minimums of 4-bit blocks), as the
//! products read them.
//!
//! A scale unit is a block of 32 values, or half a block for 6-bit blocks. Most formats
//! give each unit an f16 scale, kept as f32 ([`Scales::Flat`]). K-quant files (Q4_K,
//! Q5_K, Q6_K) give each unit a small integer multiplier of one f16 scale per
//! super-block of 256 values (and Q4_K, Q5_K each block a multiplier of one f16
//! minimum); they are kept that way ([`Scales::Super`]): a byte a unit and four bytes a
//! super-block instead of four bytes a unit — Q4_K at 4.75 bits a weight instead of 6.
//! The kernels form `d · mul` as they go: an f16 times an integer below 2⁷ is exact in
//! f32, so every product is bitwise the one the expanded scales give.

/// Blocks (and so units of 4-bit blocks, and their minimums) in a K-quant super-block.
pub const SUPER_BLOCKS: usize = 8;

/// A matrix's scales, row after row.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    /// One f32 a unit; for 4-bit blocks one f32 minimum a block (empty otherwise).
    Flat { scales: Vec<f32>, mins: Vec<f32> },
    /// K-quant super-blocks: a unit's scale is `d[u >> shift] · mul[u]` and a block's
    /// minimum `dmin[b / 8] · mmul[b]` (`dmin` negated as stored; both empty without
    /// minimums); `1 << shift` units a super-block.
    Super {
        mul: Vec<i8>,
        d: Vec<f32>,
        mmul: Vec<i8>,
        dmin: Vec<f32>,
        shift: u32,
    },
}

impl Scales {
    /// Empty flat scales.
    pub fn flat() -> Self {
        Scales::Flat {
            scales: Vec::new(),
            mins: Vec::new(),
        }
    }

    /// Empty super-block scales with `units` units a super-block (a power of two).
    pub fn super_blocks(units: usize) -> Self {
        assert!(units.is_power_of_two(), "units a super-block: {units}");
        Scales::Super {
            mul: Vec::new(),
            d: Vec::new(),
            mmul: Vec::new(),
            dmin: Vec::new(),
            shift: units.trailing_zeros(),
        }
    }

    /// Super-block scales made empty with `units` units a super-block, and their parts
    /// to fill: `mul`, `d`, `mmul`, `dmin` (see [`Scales::Super`]).
    pub fn fill_super(
        &mut self,
        units: usize,
    ) -> (&mut Vec<i8>, &mut Vec<f32>, &mut Vec<i8>, &mut Vec<f32>) {
        *self = Scales::super_blocks(units);
        match self {
            Scales::Super {
                mul, d, mmul, dmin, ..
            } => (mul, d, mmul, dmin),
            Scales::Flat { .. } => unreachable!("made above"),
        }
    }

    /// Whether 4-bit minimums are kept.
    pub fn has_mins(&self) -> bool {
        match self {
            Scales::Flat { mins, .. } => !mins.is_empty(),
            Scales::Super { mmul, .. } => !mmul.is_empty(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Scales::Flat { scales, mins } => 4 * (scales.len() + mins.len()),
            Scales::Super {
                mul, d, mmul, dmin, ..
            } => mul.len() + mmul.len() + 4 * (d.len() + dmin.len()),
        }
    }

    /// Whether `other` is kept the same way (and so can follow this one's rows).
    pub fn same_form(&self, other: &Scales) -> bool {
        match (self, other) {
            (Scales::Flat { .. }, Scales::Flat { .. }) => self.has_mins() == other.has_mins(),
            (Scales::Super { shift: a, .. }, Scales::Super { shift: b, .. }) => {
                a == b && self.has_mins() == other.has_mins()
            }
            _ => false,
        }
    }

    /// Appends `other`'s rows (the same form).
    pub fn append(&mut self, other: &Scales) {
        assert!(self.same_form(other), "scales of different forms stacked");
        match (self, other) {
            (Scales::Flat { scales, mins }, Scales::Flat { scales: s, mins: m }) => {
                scales.extend_from_slice(s);
                mins.extend_from_slice(m);
            }
            (
                Scales::Super {
                    mul, d, mmul, dmin, ..
                },
                Scales::Super {
                    mul: mu,
                    d: dd,
                    mmul: mm,
                    dmin: dm,
                    ..
                },
            ) => {
                mul.extend_from_slice(mu);
                d.extend_from_slice(dd);
                mmul.extend_from_slice(mm);
                dmin.extend_from_slice(dm);
            }
            _ => unreachable!("forms checked above"),
        }
    }

    /// An empty set of scales of this form.
    pub fn empty_like(&self) -> Self {
        match self {
            Scales::Flat { .. } => Scales::flat(),
            Scales::Super { shift, .. } => Scales::super_blocks(1 << shift),
        }
    }

    /// Rows `r0..r1` of a matrix with `upr` units and `bpr` blocks a row.
    pub fn rows(&self, r0: usize, r1: usize, upr: usize, bpr: usize) -> ScaleRows<'_> {
        match self {
            Scales::Flat { scales, mins } => ScaleRows::Flat(FlatRows {
                scales: &scales[r0 * upr..r1 * upr],
                mins: if mins.is_empty() {
                    &[]
                } else {
                    &mins[r0 * bpr..r1 * bpr]
                },
            }),
            Scales::Super {
                mul,
                d,
                mmul,
                dmin,
                shift,
            } => {
                let (spr, mpr) = (upr >> shift, bpr / SUPER_BLOCKS);
                let has_mins = !mmul.is_empty();
                ScaleRows::Super(SuperRows {
                    mul: &mul[r0 * upr..r1 * upr],
                    d: &d[r0 * spr..r1 * spr],
                    mmul: if has_mins {
                        &mmul[r0 * bpr..r1 * bpr]
                    } else {
                        &[]
                    },
                    dmin: if has_mins {
                        &dmin[r0 * mpr..r1 * mpr]
                    } else {
                        &[]
                    },
                    shift: *shift,
                })
            }
        }
    }

    /// Appends the units of rows `rows` (of `upr` units and `bpr` blocks) to `to`, which
    /// has this form.
    pub fn pick_rows(&self, to: &mut Scales, rows: &[usize], upr: usize, bpr: usize) {
        for &r in rows {
            let one = self.rows(r, r + 1, upr, bpr);
            match (&mut *to, one) {
                (Scales::Flat { scales, mins }, ScaleRows::Flat(f)) => {
                    scales.extend_from_slice(f.scales);
                    mins.extend_from_slice(f.mins);
                }
                (
                    Scales::Super {
                        mul, d, mmul, dmin, ..
                    },
                    ScaleRows::Super(s),
                ) => {
                    mul.extend_from_slice(s.mul);
                    d.extend_from_slice(s.d);
                    mmul.extend_from_slice(s.mmul);
                    dmin.extend_from_slice(s.dmin);
                }
                _ => panic!("scales of different forms"),
            }
        }
    }
}

/// Some rows' scales, flat.
#[derive(Debug, Clone, Copy)]
pub struct FlatRows<'a> {
    pub scales: &'a [f32],
    pub mins: &'a [f32],
}

/// Some rows' scales, as K-quant super-blocks ([`Scales::Super`]).
#[derive(Debug, Clone, Copy)]
pub struct SuperRows<'a> {
    pub mul: &'a [i8],
    pub d: &'a [f32],
    pub mmul: &'a [i8],
    pub dmin: &'a [f32],
    pub shift: u32,
}

/// Some rows' scales, in either form.
#[derive(Debug, Clone, Copy)]
pub enum ScaleRows<'a> {
    Flat(FlatRows<'a>),
    Super(SuperRows<'a>),
}

/// Reading scales from either form; the kernels are generic over it, so each form gets
/// its own code with the scales formed in registers.
pub trait UnitScales: Copy {
    /// Units held.
    fn units(self) -> usize;
    /// Whether 4-bit minimums are held.
    fn has_mins(self) -> bool;
    /// The scale of unit `u`.
    ///
    /// # Safety
    /// `u < self.units()`.
    unsafe fn unit(self, u: usize) -> f32;
    /// The minimum of block `b`.
    ///
    /// # Safety
    /// Minimums held and `b` one of their blocks.
    unsafe fn min(self, b: usize) -> f32;
    /// Units `u0..u1` (and blocks `b0..b1` of minimums), where a row starts at `u0`
    /// and `b0`.
    fn slice(self, u0: usize, u1: usize, b0: usize, b1: usize) -> Self;
    /// Whether scales and minimums are f32 ([`FlatRows`]): worth prefetching.
    const FLAT: bool;
    /// Addresses of unit `u`'s scale and minimum data, to prefetch (may be past the
    /// end: never read).
    fn ahead(self, u: usize) -> [*const u8; 2];
}

impl UnitScales for FlatRows<'_> {
    const FLAT: bool = true;
    #[inline(always)]
    fn ahead(self, u: usize) -> [*const u8; 2] {
        [
            self.scales.as_ptr().wrapping_add(u).cast(),
            self.mins.as_ptr().wrapping_add(u).cast(),
        ]
    }
    #[inline(always)]
    fn units(self) -> usize {
        self.scales.len()
    }
    #[inline(always)]
    fn has_mins(self) -> bool {
        !self.mins.is_empty()
    }
    #[inline(always)]
    unsafe fn unit(self, u: usize) -> f32 {
        // SAFETY: in bounds by the caller's contract.
        unsafe { *self.scales.get_unchecked(u) }
    }
    #[inline(always)]
    unsafe fn min(self, b: usize) -> f32 {
        // SAFETY: in bounds by the caller's contract.
        unsafe { *self.mins.get_unchecked(b) }
    }
    #[inline(always)]
    fn slice(self, u0: usize, u1: usize, b0: usize, b1: usize) -> Self {
        FlatRows {
            scales: &self.scales[u0..u1],
            mins: if self.mins.is_empty() {
                self.mins
            } else {
                &self.mins[b0..b1]
            },
        }
    }
}

impl UnitScales for SuperRows<'_> {
    const FLAT: bool = false;
    #[inline(always)]
    fn ahead(self, u: usize) -> [*const u8; 2] {
        [
            self.mul.as_ptr().wrapping_add(u).cast(),
            self.mmul.as_ptr().wrapping_add(u).cast(),
        ]
    }
    #[inline(always)]
    fn units(self) -> usize {
        self.mul.len()
    }
    #[inline(always)]
    fn has_mins(self) -> bool {
        !self.mmul.is_empty()
    }
    #[inline(always)]
    unsafe fn unit(self, u: usize) -> f32 {
        // SAFETY: `u` is a unit held, and so its super-block's `d` too.
        unsafe { *self.d.get_unchecked(u >> self.shift) * f32::from(*self.mul.get_unchecked(u)) }
    }
    #[inline(always)]
    unsafe fn min(self, b: usize) -> f32 {
        // SAFETY: `b` is a block held, and so its super-block's `dmin` too.
        unsafe {
            *self.dmin.get_unchecked(b / SUPER_BLOCKS) * f32::from(*self.mmul.get_unchecked(b))
        }
    }
    #[inline(always)]
    fn slice(self, u0: usize, u1: usize, b0: usize, b1: usize) -> Self {
        // Rows start on super-block boundaries.
        debug_assert!(u0 & ((1 << self.shift) - 1) == 0 && b0.is_multiple_of(SUPER_BLOCKS));
        let has_mins = self.has_mins();
        SuperRows {
            mul: &self.mul[u0..u1],
            d: &self.d[u0 >> self.shift..u1.div_ceil(1 << self.shift)],
            mmul: if has_mins { &self.mmul[b0..b1] } else { &[] },
            dmin: if has_mins {
                &self.dmin[b0 / SUPER_BLOCKS..b1.div_ceil(SUPER_BLOCKS)]
            } else {
                &[]
            },
            shift: self.shift,
        }
    }
}

impl ScaleRows<'_> {
    /// Units held.
    pub fn units(self) -> usize {
        match self {
            ScaleRows::Flat(f) => f.units(),
            ScaleRows::Super(s) => s.units(),
        }
    }

    /// Whether 4-bit minimums are held.
    pub fn has_mins(self) -> bool {
        match self {
            ScaleRows::Flat(f) => f.has_mins(),
            ScaleRows::Super(s) => s.has_mins(),
        }
    }

    /// Blocks of minimums held (0 without).
    pub fn min_blocks(self) -> usize {
        match self {
            ScaleRows::Flat(f) => f.mins.len(),
            ScaleRows::Super(s) => s.mmul.len(),
        }
    }

    /// The scale of unit `u` (panics out of bounds).
    pub fn unit(self, u: usize) -> f32 {
        assert!(u < self.units(), "unit {u} out of bounds");
        // SAFETY: checked above.
        unsafe {
            match self {
                ScaleRows::Flat(f) => f.unit(u),
                ScaleRows::Super(s) => s.unit(u),
            }
        }
    }

    /// The minimum of block `b` (panics out of bounds).
    pub fn min(self, b: usize) -> f32 {
        assert!(b < self.min_blocks(), "block {b} has no minimum");
        // SAFETY: checked above.
        unsafe {
            match self {
                ScaleRows::Flat(f) => f.min(b),
                ScaleRows::Super(s) => s.min(b),
            }
        }
    }

    /// The scales and minimums as f32 (borrowed when flat, formed into `buf` when not).
    pub fn flat<'b>(self, buf: &'b mut (Vec<f32>, Vec<f32>)) -> FlatRows<'b>
    where
        Self: 'b,
    {
        match self {
            ScaleRows::Flat(f) => f,
            ScaleRows::Super(s) => {
                buf.0.clear();
                buf.1.clear();
                // SAFETY: every index is below the units or blocks held.
                unsafe {
                    buf.0.extend((0..s.units()).map(|u| s.unit(u)));
                    if s.has_mins() {
                        buf.1.extend((0..s.mmul.len()).map(|b| s.min(b)));
                    }
                }
                FlatRows {
                    scales: &buf.0,
                    mins: &buf.1,
                }
            }
        }
    }
}

/// The scales of a quad of blocks (four blocks, as the integer kernels take them) in
/// the lanes the kernels multiply them in, formed with 256-bit vectors.
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::arch::x86_64::*;

    use super::super::load_tail;
    use super::{FlatRows, SuperRows, UnitScales};

    /// Lanes of block scales for the AVX2 kernels.
    pub trait QuadScales: UnitScales {
        /// One unit a block: `[d₀ ×4, d₁ ×4]` and `[d₂ ×4, d₃ ×4]` for the blocks
        /// `4q..4q + 4`, zeros for blocks at `nb` or past it.
        ///
        /// # Safety
        /// Needs AVX2; block `4q` below `nb`, the units held.
        unsafe fn quad(self, q: usize, nb: usize) -> [__m256; 2];
        /// Two units a block (halves): for each half `h` of the quad (blocks
        /// `b = 4q + 2h` and `b + 1`), the first halves' scales `[u₂ᵦ ×4, u₂₍ᵦ₊₁₎ ×4]`
        /// and the second halves' `[u₂ᵦ₊₁ ×4, u₂₍ᵦ₊₁₎₊₁ ×4]`, zeros past `nb`.
        ///
        /// # Safety
        /// As [`QuadScales::quad`], with units `2b` and `2b + 1` for each block.
        unsafe fn quad_halves(self, q: usize, nb: usize) -> [[__m256; 2]; 2];
        /// The minimums of blocks `at..at + 8`, zeros at `nb` or past it.
        ///
        /// # Safety
        /// Needs AVX2; minimums held for the blocks below `nb`.
        unsafe fn mins8(self, at: usize, nb: usize) -> __m256;
    }

    /// `[s[a] ×4, s[b] ×4]` (`s[b]` zero when not `two`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pair<S: UnitScales>(s: S, a: usize, b: usize, two: bool) -> __m256 {
        // SAFETY: the caller guarantees the units read are held.
        unsafe {
            let d1 = if two { s.unit(b) } else { 0.0 };
            _mm256_setr_m128(_mm_set1_ps(s.unit(a)), _mm_set1_ps(d1))
        }
    }

    impl QuadScales for FlatRows<'_> {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn quad(self, q: usize, nb: usize) -> [__m256; 2] {
            let b = 4 * q;
            // SAFETY: blocks below `nb` are held.
            unsafe {
                [
                    pair(self, b, b + 1, b + 1 < nb),
                    if b + 2 < nb {
                        pair(self, b + 2, b + 3, b + 3 < nb)
                    } else {
                        _mm256_setzero_ps()
                    },
                ]
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn quad_halves(self, q: usize, nb: usize) -> [[__m256; 2]; 2] {
            // SAFETY: blocks below `nb` (two units each) are held.
            unsafe {
                std::array::from_fn(|h| {
                    let b = 4 * q + 2 * h;
                    if b >= nb {
                        return [_mm256_setzero_ps(); 2];
                    }
                    let two = b + 1 < nb;
                    [
                        pair(self, 2 * b, 2 * b + 2, two),
                        pair(self, 2 * b + 1, 2 * b + 3, two),
                    ]
                })
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn mins8(self, at: usize, nb: usize) -> __m256 {
            // SAFETY: the minimums of the `nb` blocks are held.
            unsafe { load_tail(self.mins.as_ptr(), at, nb) }
        }
    }

    /// Eight multipliers from `p` times `d`: the exact scales, as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn times8(p: *const i8, d: f32) -> __m256 {
        // SAFETY: the caller guarantees eight bytes at `p`.
        unsafe {
            let m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()));
            _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(d))
        }
    }

    /// Lanes `[v[i] ×4, v[j] ×4]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn spread(v: __m256, i: i32, j: i32) -> __m256 {
        _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, j, j, j, j))
    }

    // Rows of super-blocks hold whole super-blocks (eight blocks, so two whole quads),
    // so no quad is partial here.
    impl QuadScales for SuperRows<'_> {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn quad(self, q: usize, _nb: usize) -> [__m256; 2] {
            // SAFETY: units `4q..4q + 4` are held (whole super-blocks).
            unsafe {
                let d = *self.d.get_unchecked((4 * q) >> self.shift);
                let p = self.mul.as_ptr().add(4 * q);
                let m =
                    _mm_cvtepi8_epi32(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.cast::<i32>())));
                let v = _mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(d));
                let v = _mm256_castps128_ps256(v);
                [spread(v, 0, 1), spread(v, 2, 3)]
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn quad_halves(self, q: usize, _nb: usize) -> [[__m256; 2]; 2] {
            // SAFETY: units `8q..8q + 8` are held (whole super-blocks).
            unsafe {
                let d = *self.d.get_unchecked((8 * q) >> self.shift);
                let v = times8(self.mul.as_ptr().add(8 * q), d);
                [
                    [spread(v, 0, 2), spread(v, 1, 3)],
                    [spread(v, 4, 6), spread(v, 5, 7)],
                ]
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn mins8(self, at: usize, nb: usize) -> __m256 {
            if at >= nb {
                return _mm256_setzero_ps();
            }
            // SAFETY: `at` starts a super-block held (eight blocks).
            unsafe {
                let dmin = *self.dmin.get_unchecked(at / super::SUPER_BLOCKS);
                times8(self.mmul.as_ptr().add(at), dmin)
            }
        }
    }
}

/// The scales of blocks as the AVX-512 integer kernels take them: four blocks' to a
/// 128-bit vector, sixteen minimums to a 512-bit one.
#[cfg(target_arch = "x86_64")]
pub mod x86_wide {
    use std::arch::x86_64::*;

    use super::{FlatRows, SuperRows, UnitScales, SUPER_BLOCKS};

    /// Lanes of block scales for the AVX-512 kernels. Super-block scales are formed
    /// as the exact products `d · mul`, so both forms give the same lanes.
    pub trait WideScales: UnitScales {
        /// The scales of blocks `at..at + blocks` (`1..=4`) in lanes 0..4, zeros past.
        ///
        /// # Safety
        /// Needs AVX-512 F/BW; the units read are held.
        unsafe fn four(self, at: usize, blocks: usize) -> __m128;
        /// The minimums of blocks `at..at + count` (`1..=16`) in lanes 0..16, zeros
        /// past.
        ///
        /// # Safety
        /// Needs AVX-512 F/BW; the minimums read are held.
        unsafe fn sixteen_mins(self, at: usize, count: usize) -> __m512;
    }

    impl WideScales for FlatRows<'_> {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
        unsafe fn four(self, at: usize, blocks: usize) -> __m128 {
            // SAFETY: the caller guarantees the units read are held; masked lanes
            // are not read.
            unsafe {
                if blocks == 4 {
                    _mm_loadu_ps(self.scales.as_ptr().add(at))
                } else {
                    _mm512_castps512_ps128(_mm512_maskz_loadu_ps(
                        (1u16 << blocks) - 1,
                        self.scales.as_ptr().add(at),
                    ))
                }
            }
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
        unsafe fn sixteen_mins(self, at: usize, count: usize) -> __m512 {
            let mask = if count >= 16 {
                u16::MAX
            } else {
                (1u16 << count) - 1
            };
            // SAFETY: the caller guarantees the minimums read are held; masked
            // lanes are not read.
            unsafe { _mm512_maskz_loadu_ps(mask, self.mins.as_ptr().add(at)) }
        }
    }

    // Rows of super-blocks hold whole super-blocks (eight blocks), so four blocks
    // from a multiple of four are always there, and minimums come eight or sixteen at
    // a time from the start of a super-block.
    impl WideScales for SuperRows<'_> {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
        unsafe fn four(self, at: usize, _blocks: usize) -> __m128 {
            // SAFETY: units `at..at + 4` are held (whole super-blocks).
            unsafe {
                let d = *self.d.get_unchecked(at >> self.shift);
                let p = self.mul.as_ptr().add(at);
                let m =
                    _mm_cvtepi8_epi32(_mm_cvtsi32_si128(std::ptr::read_unaligned(p.cast::<i32>())));
                _mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(d))
            }
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
        unsafe fn sixteen_mins(self, at: usize, count: usize) -> __m512 {
            debug_assert!(at.is_multiple_of(SUPER_BLOCKS) && count.is_multiple_of(SUPER_BLOCKS));
            // SAFETY: blocks `at..at + count` are whole super-blocks held.
            unsafe {
                let p = self.mmul.as_ptr().add(at);
                let s = at / SUPER_BLOCKS;
                let (m, d) = if count >= 16 {
                    (
                        _mm_loadu_si128(p.cast()),
                        _mm_castpd_ps(_mm_load_sd(self.dmin.as_ptr().add(s).cast())),
                    )
                } else {
                    (
                        _mm_loadl_epi64(p.cast()),
                        _mm_load_ss(self.dmin.as_ptr().add(s)),
                    )
                };
                let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
                let d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d));
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m)), d)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn super_scales(rows: usize, bpr: usize, units_per_block: usize, mins: bool) -> Scales {
        let upr = bpr * units_per_block;
        let mut s = Scales::super_blocks(SUPER_BLOCKS * units_per_block);
        if let Scales::Super {
            mul, d, mmul, dmin, ..
        } = &mut s
        {
            for r in 0..rows {
                for u in 0..upr {
                    mul.push(((r * 31 + u * 7) % 64) as i8 - 20);
                }
                for k in 0..bpr / SUPER_BLOCKS {
                    d.push(half::f16::from_f32(1e-3 * (1 + r + k) as f32).to_f32());
                    if mins {
                        dmin.push(-half::f16::from_f32(3e-4 * (2 + r + k) as f32).to_f32());
                    }
                }
                if mins {
                    for b in 0..bpr {
                        mmul.push(((r * 13 + b * 5) % 64) as i8);
                    }
                }
            }
        }
        s
    }

    /// Formed scales are the exact products, rows slice where they start, and picked
    /// and appended rows keep their values.
    #[test]
    fn super_block_scales_form_exact_products() {
        for (upb, mins) in [(1, true), (2, false)] {
            let (rows, bpr) = (5, 16);
            let upr = bpr * upb;
            let s = super_scales(rows, bpr, upb, mins);
            let all = s.rows(0, rows, upr, bpr);
            let Scales::Super { mul, d, .. } = &s else {
                unreachable!()
            };
            for u in 0..rows * upr {
                let want = f64::from(d[u / (SUPER_BLOCKS * upb)]) * f64::from(mul[u]);
                assert_eq!(f64::from(all.unit(u)), want, "unit {u}");
            }
            for r in 0..rows {
                let one = s.rows(r, r + 1, upr, bpr);
                for u in 0..upr {
                    assert_eq!(one.unit(u).to_bits(), all.unit(r * upr + u).to_bits());
                }
                if mins {
                    for b in 0..bpr {
                        assert_eq!(one.min(b).to_bits(), all.min(r * bpr + b).to_bits());
                        assert!(one.min(b) <= 0.0);
                    }
                }
            }
            let mut picked = s.empty_like();
            s.pick_rows(&mut picked, &[3, 1], upr, bpr);
            let mut stacked = s.clone();
            stacked.append(&picked);
            let p = stacked.rows(rows, rows + 2, upr, bpr);
            for u in 0..upr {
                assert_eq!(p.unit(u), all.unit(3 * upr + u));
                assert_eq!(p.unit(upr + u), all.unit(upr + u));
            }
            if mins {
                assert_eq!(p.min(bpr + 2), all.min(bpr + 2));
            }
            let mut buf = Default::default();
            let f = all.flat(&mut buf);
            assert_eq!(f.scales.len(), rows * upr);
            assert_eq!(f.mins.len(), if mins { rows * bpr } else { 0 });
            let supers = rows * bpr / SUPER_BLOCKS;
            let want = if mins {
                rows * upr + rows * bpr + 8 * supers
            } else {
                rows * upr + 4 * supers
            };
            assert_eq!(s.bytes(), want);
            assert!(!s.same_form(&Scales::flat()));
        }
    }
}
