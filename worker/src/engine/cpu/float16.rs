//! Matrices of 16-bit floats (GGUF F16 and BF16) kept as the file has them.
//!
//! Both convert to f32 exactly, so a product is the f32 product of the file's values,
//! with no second rounding (they were converted to 8-bit blocks before). A row's dot
//! product adds in one fixed order — eight lanes, four accumulators over each 32
//! values, then a fixed reduction — on every CPU and whatever rows run beside it, so a
//! generated token's bits do not depend on its batch or on the machine. On x86-64 with
//! AVX2, FMA and F16C (checked at run time) the conversions and fused multiply-adds run
//! on 256-bit vectors; elsewhere a portable loop does the same operations in the same
//! order (`f32::mul_add` is the fused multiply-add).

use half::{bf16, f16};

/// Values a row's length is a multiple of.
pub const CHUNK: usize = 32;

/// Whether the vector kernels run on this CPU.
fn vector() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Value `i` of `w` (little-endian 16-bit floats, BF16 when `brain`) as f32.
#[inline]
fn at(brain: bool, w: &[u8], i: usize) -> f32 {
    let b = [w[2 * i], w[2 * i + 1]];
    if brain {
        bf16::from_le_bytes(b).to_f32()
    } else {
        f16::from_le_bytes(b).to_f32()
    }
}

/// `w` (2 bytes a value) as f32 into `out`, exactly.
pub fn to_f32(brain: bool, w: &[u8], out: &mut [f32]) {
    assert_eq!(w.len(), 2 * out.len(), "16-bit row and output disagree");
    #[cfg(target_arch = "x86_64")]
    if vector() && out.len().is_multiple_of(8) {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the lengths are checked
        // above (eight values at a time).
        unsafe {
            if brain {
                x86::to_f32::<true>(w, out)
            } else {
                x86::to_f32::<false>(w, out)
            }
        }
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = at(brain, w, i);
    }
}

/// `Σ w_i · x_i` in the fixed order the module describes; `x.len()` a multiple of
/// [`CHUNK`].
pub fn dot(brain: bool, w: &[u8], x: &[f32]) -> f32 {
    assert!(
        w.len() == 2 * x.len() && x.len().is_multiple_of(CHUNK),
        "16-bit row and input disagree"
    );
    #[cfg(target_arch = "x86_64")]
    if vector() {
        // SAFETY: AVX2, FMA and F16C were detected at run time; the lengths are checked
        // above.
        return unsafe {
            if brain {
                x86::dot::<true>(w, x)
            } else {
                x86::dot::<false>(w, x)
            }
        };
    }
    portable(brain, w, x)
}

/// [`dot`] without vectors: the same operations in the same order.
fn portable(brain: bool, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [[0.0f32; 8]; 4];
    for c in 0..x.len() / CHUNK {
        for (k, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                let i = CHUNK * c + 8 * k + l;
                *a = at(brain, w, i).mul_add(x[i], *a);
            }
        }
    }
    // (a0 + a1) + (a2 + a3), then lanes as the vector reduction adds them.
    let v: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let s: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::hsum;

    /// Eight values from `p` as f32.
    ///
    /// # Safety
    /// Needs AVX2 and F16C; sixteen bytes at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const BRAIN: bool>(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees sixteen readable bytes.
        unsafe {
            let v = _mm_loadu_si128(p.cast());
            if BRAIN {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
            } else {
                _mm256_cvtph_ps(v)
            }
        }
    }

    /// [`super::to_f32`] on 256-bit vectors (exact conversions: the same bits).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `w` two bytes for each value of `out`, whose length is
    /// a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn to_f32<const BRAIN: bool>(w: &[u8], out: &mut [f32]) {
        // SAFETY: every group of eight values is inside `w` and `out` (checked by the
        // caller).
        unsafe {
            for c in 0..out.len() / 8 {
                let v = load8::<BRAIN>(w.as_ptr().add(16 * c));
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), v);
            }
        }
    }

    /// [`super::dot`] on 256-bit vectors.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `w` two bytes for each value of `x`, whose length is a
    /// multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<const BRAIN: bool>(w: &[u8], x: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        // SAFETY: every chunk of 32 values is inside `x` and `w` (checked by the caller).
        unsafe {
            for c in 0..x.len() / super::CHUNK {
                let (wp, xp) = (w.as_ptr().add(64 * c), x.as_ptr().add(32 * c));
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(4096).cast());
                for (k, a) in acc.iter_mut().enumerate() {
                    let wv = load8::<BRAIN>(wp.add(16 * k));
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(8 * k)), *a);
                }
            }
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            hsum(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector kernel gives the portable loop's bits, and both are within f32
    /// rounding of an f64 dot product of the exact values.
    #[test]
    fn dot_products_are_the_same_bits_everywhere() {
        for brain in [false, true] {
            for n in [32, 96, 2048] {
                let w: Vec<u8> = (0..n)
                    .flat_map(|i| {
                        let v = ((i * 37 % 101) as f32 - 50.0) * 0.013;
                        if brain {
                            bf16::from_f32(v).to_le_bytes()
                        } else {
                            f16::from_f32(v).to_le_bytes()
                        }
                    })
                    .collect();
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) * 0.021)
                    .collect();
                let got = dot(brain, &w, &x);
                let mut vals = vec![0.0f32; n];
                to_f32(brain, &w, &mut vals);
                // The vector conversion gives the scalar one's bits.
                let scalar: Vec<f32> = (0..n).map(|i| at(brain, &w, i)).collect();
                assert_eq!(
                    vals.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    scalar.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                let exact: f64 = vals
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let mag: f64 = vals
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from((a * b).abs()))
                    .sum();
                assert!(
                    (f64::from(got) - exact).abs() <= 1e-6 * mag + 1e-6,
                    "{brain} {n}"
                );
                let slow = portable(brain, &w, &x);
                assert_eq!(got.to_bits(), slow.to_bits(), "{brain} {n}");
                // Exact conversions.
                for (i, v) in vals.iter().enumerate() {
                    let b = [w[2 * i], w[2 * i + 1]];
                    let want = if brain {
                        f64::from(bf16::from_le_bytes(b))
                    } else {
                        f64::from(f16::from_le_bytes(b))
                    };
                    assert_eq!(f64::from(*v), want);
                }
            }
        }
    }
}
