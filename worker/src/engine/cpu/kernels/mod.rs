//! Block dot products, vectorised where the CPU allows.

use super::scales::{ScaleRows, SUPER_BLOCKS};

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
        unsafe { avx2::dot4(nibble, qs, scales, mins, xs, sums) }
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
        unsafe { avx2::interleave_halves(row, out) };
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
                avx512::panel_product_wide(panels, n, w, m, cols, out);
            } else {
                avx2::panel_product(panels, n, w, m, cols, out);
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
pub fn dequant_row(kind: super::QKind, qs: &[u8], scales: &[f32], mins: &[f32], out: &mut [f32]) {
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
        unsafe { avx2::dequant_row(nibble, qs, scales, mins, out) }
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
        unsafe { avx2::quantize_blocks(x, q, d) };
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
        (IntKernel::Avx512, ScaleRows::Flat(f)) => {
            // SAFETY: AVX-512 F/BW/VNNI, AVX2 and FMA were detected at run time (the
            // assertion above); the lengths checked above put every block of every
            // row asked for in bounds.
            unsafe { avx512::dot_int_rows_of(kind, nb, qs, f, x, rows, out) };
            return;
        }
        (IntKernel::Avx512, ScaleRows::Super(k)) => {
            // SAFETY: as above, and rows hold whole super-blocks.
            unsafe { avx512::dot_int_rows_of(kind, nb, qs, k, x, rows, out) };
            return;
        }
        (IntKernel::Avx2, ScaleRows::Flat(f)) => {
            // SAFETY: AVX2 and FMA were detected at run time; the lengths checked
            // above put every block of every row asked for in bounds.
            unsafe { avx2::dot_int_rows_of(nibble, nb, qs, f, x, rows, out) };
            return;
        }
        (IntKernel::Avx2, ScaleRows::Super(k)) => {
            // SAFETY: AVX2 and FMA were detected at run time; the lengths checked
            // above put every block of every row asked for in bounds, and rows hold
            // whole super-blocks.
            unsafe { avx2::dot_int_rows_of(nibble, nb, qs, k, x, rows, out) };
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
                            i32::from(q & 0x0F) * i32::from(l) + i32::from(q >> 4) * i32::from(h)
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
        return unsafe { avx2::dot_byte(qs, scales, x) };
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
        return unsafe { avx2::dot_nibble(qs, scales, mins, x, xsum) };
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
pub(super) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;
pub mod bytes;
