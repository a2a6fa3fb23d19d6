//! The elementwise steps of the host forward pass: RMSNorm and the gated activations
//! (SwiGLU, GeGLU) with a vector `e^x` where the CPU has AVX2.

use super::attention::dot;

/// RMSNorm of every `hidden`-wide row of `x` into `out`, scaled by `w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = w.len();
    for (xr, or) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let mean = dot(xr, xr) / hidden as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// `g ← gelu_tanh(g) · u`, elementwise (GeGLU). GELU's tanh approximation,
/// `0.5·x·(1 + tanh(z))` with `z = √(2/π)·(x + 0.044715·x³)`, is `x / (1 + e^(−2z))`:
/// the sigmoid form, computed as [`swiglu`] computes its own.
pub(crate) fn geglu(g: &mut [f32], u: &[f32]) {
    gated::<true>(g, u);
}

/// `g ← silu(g) · u = g / (1 + e^−g) · u`, elementwise.
pub(crate) fn swiglu(g: &mut [f32], u: &[f32]) {
    gated::<false>(g, u);
}

/// √(2/π), GELU's tanh approximation's scale.
const GELU_K: f32 = 0.797_884_6;
/// GELU's tanh approximation's cubic coefficient.
const GELU_C: f32 = 0.044_715;

/// `g ← g / (1 + e^(−a)) · u` with `a = g` (SiLU) or `a = 2z` (GELU, `GELU`). With AVX2
/// and FMA (checked at run time) `e^x` is [`exp_avx2`] on eight values at a time
/// (within 2 ulp of the library's); elsewhere the library's.
fn gated<const GELU: bool>(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "gated halves disagree");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        /// # Safety
        /// Needs AVX2 and FMA; `g` and `u` of one length.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide<const GELU: bool>(g: &mut [f32], u: &[f32]) {
            use std::arch::x86_64::*;
            /// Eight values in place.
            ///
            /// # Safety
            /// Needs AVX2 and FMA; `g` and `u` at least eight long.
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn eight<const GELU: bool>(g: &mut [f32], u: &[f32]) {
                // SAFETY: eight values each, by the contract.
                unsafe {
                    let gv = _mm256_loadu_ps(g.as_ptr());
                    let a = if GELU {
                        // 2z = 2k·(x + c·x³) = x·(2k + 2kc·x²)
                        let x2 = _mm256_mul_ps(gv, gv);
                        let s = _mm256_fmadd_ps(
                            x2,
                            _mm256_set1_ps(2.0 * GELU_K * GELU_C),
                            _mm256_set1_ps(2.0 * GELU_K),
                        );
                        _mm256_mul_ps(gv, s)
                    } else {
                        gv
                    };
                    let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), a));
                    let y = _mm256_mul_ps(
                        _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e)),
                        _mm256_loadu_ps(u.as_ptr()),
                    );
                    _mm256_storeu_ps(g.as_mut_ptr(), y);
                }
            }
            let mut gc = g.chunks_exact_mut(8);
            for (g, u) in (&mut gc).zip(u.chunks_exact(8)) {
                // SAFETY: AVX2 and FMA by this function's contract; eight values each.
                unsafe { eight::<GELU>(g, u) };
            }
            let g = gc.into_remainder();
            if !g.is_empty() {
                // The tail through a padded copy.
                let n = g.len();
                let (mut gl, mut ul) = ([0.0f32; 8], [0.0f32; 8]);
                gl[..n].copy_from_slice(g);
                ul[..n].copy_from_slice(&u[u.len() - n..]);
                // SAFETY: as above.
                unsafe { eight::<GELU>(&mut gl, &ul) };
                g.copy_from_slice(&gl[..n]);
            }
        }
        // SAFETY: AVX2 and FMA were detected just above; lengths checked above.
        unsafe { wide::<GELU>(g, u) };
        return;
    }
    for (g, u) in g.iter_mut().zip(u) {
        let x = *g;
        let a = if GELU {
            x * (2.0 * GELU_K + 2.0 * GELU_K * GELU_C * x * x)
        } else {
            x
        };
        *g = x / (1.0 + (-a).exp()) * u;
    }
}

/// `e^x` in each lane: `2^n · p(r)` with `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, and a
/// degree-6 polynomial `p` (Cephes' `expf`), within 2 ulp of the exact value. Inputs
/// are clamped to `[−87.3, 88]`, where the result is a normal float: below, the result
/// is ~1.2e−38 instead of smaller (or 0); above, ~1.65e38 instead of larger (or ∞).
/// NaN stays NaN.
///
/// # Safety
/// Needs AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.0),
    );
    // n = round(x · log2 e), by floor(x · log2 e + 1/2).
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    // r = x − n · ln 2, with ln 2 in two parts for the precision.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    // 2^n from the exponent bits (n in −126..=127 after the clamp).
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(p, two_n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector `e^x` stays within 2 ulp of the library's over the range that
    /// matters, and SwiGLU through it within rounding of the plain formula.
    #[test]
    fn vector_exp_swiglu_and_geglu_match_the_library() {
        let xs: Vec<f32> = (0..=20_000)
            .map(|i| -87.0 + 175.0 * i as f32 / 20_000.0)
            .chain([0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 88.0, -87.3])
            .collect();
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            use std::arch::x86_64::*;
            for c in xs.chunks(8) {
                let mut lanes = [0.0f32; 8];
                lanes[..c.len()].copy_from_slice(c);
                // SAFETY: AVX2 and FMA detected above.
                unsafe {
                    let e = exp_avx2(_mm256_loadu_ps(lanes.as_ptr()));
                    _mm256_storeu_ps(lanes.as_mut_ptr(), e);
                }
                for (&x, &got) in c.iter().zip(&lanes) {
                    let want = x.exp();
                    let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                    assert!(ulps <= 2, "exp({x}) = {got}, library {want} ({ulps} ulp)");
                }
            }
        }
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let u: Vec<f32> = (0..1003).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut y = g.clone();
        swiglu(&mut y, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&y) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (y - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "swiglu({g}, {u}) = {y}, want {want}"
            );
        }
        // GeGLU against GELU's tanh form, in f64.
        let mut y = g.clone();
        geglu(&mut y, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&y) {
            let x = f64::from(g);
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let want = 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()) * f64::from(u);
            assert!(
                (f64::from(y) - want).abs() <= 2e-6 * (1.0 + want.abs()),
                "geglu({g}, {u}) = {y}, want {want}"
            );
        }
    }
}
