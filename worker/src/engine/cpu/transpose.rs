//! Row-major transposes between the products' layout (a row per weight row) and the
//! forward pass's (a row per input row).

/// `dst: [n, r]` from `src: [r, n]` (resized to fit). The products leave one row per
/// weight row; the rest of the step wants one row per input row. With AVX (checked at
/// run time) eight by eight values at a time, through registers.
pub(crate) fn transpose(src: &[f32], r: usize, n: usize, dst: &mut Vec<f32>) {
    assert_eq!(src.len(), r * n, "transposed shapes disagree");
    dst.resize(r * n, 0.0);
    if n == 1 || r == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let (mut i0, mut j0) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") && r >= 8 && n >= 8 {
        // SAFETY: AVX was detected just above; the blocks stay inside both buffers.
        unsafe { transpose_avx(src, r, n, dst) };
        (i0, j0) = (r / 8 * 8, n / 8 * 8);
    }
    // What the blocks of eight left: the last rows of `src` for every column, and the
    // last columns for the rows the blocks took.
    for i in 0..r {
        let from = if i < i0 { j0 } else { 0 };
        for j in from..n {
            dst[j * r + i] = src[i * n + j];
        }
    }
}

/// [`transpose`] of the whole 8 × 8 blocks.
///
/// # Safety
/// Needs AVX; `src` and `dst` at least `r · n` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_avx(src: &[f32], r: usize, n: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY: rows i..i + 8 < r and columns j..j + 8 < n of `src`, and the same
    // transposed in `dst`, are inside both buffers.
    unsafe {
        for i in (0..r / 8 * 8).step_by(8) {
            for j in (0..n / 8 * 8).step_by(8) {
                let v: [__m256; 8] =
                    std::array::from_fn(|k| _mm256_loadu_ps(src.as_ptr().add((i + k) * n + j)));
                let t0 = _mm256_unpacklo_ps(v[0], v[1]);
                let t1 = _mm256_unpackhi_ps(v[0], v[1]);
                let t2 = _mm256_unpacklo_ps(v[2], v[3]);
                let t3 = _mm256_unpackhi_ps(v[2], v[3]);
                let t4 = _mm256_unpacklo_ps(v[4], v[5]);
                let t5 = _mm256_unpackhi_ps(v[4], v[5]);
                let t6 = _mm256_unpacklo_ps(v[6], v[7]);
                let t7 = _mm256_unpackhi_ps(v[6], v[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let out = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (k, o) in out.iter().enumerate() {
                    _mm256_storeu_ps(dst.as_mut_ptr().add((j + k) * r + i), *o);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With integer inputs a generated token's logits are bitwise the same whatever
    /// shares its step (other sequences decoding, another's prompt joining) and however
    /// the cache before it was filled: one token a step, or replayed in one pass with the
    /// prompt after a move to another worker.
    /// The sequences of a split step: one contiguous run a thread, sizes within one of
    /// each other; no split for one thread, too few rows or any prompt of two tokens.
    #[test]
    fn transposes_match_the_plain_loop() {
        let mut dst = Vec::new();
        for (r, n) in [
            (1, 5),
            (5, 1),
            (7, 3),
            (8, 8),
            (64, 16),
            (66, 13),
            (17, 9),
            (96, 7),
        ] {
            let src: Vec<f32> = (0..r * n).map(|v| v as f32 * 0.5 - 3.0).collect();
            transpose(&src, r, n, &mut dst);
            assert_eq!(dst.len(), r * n);
            for i in 0..r {
                for j in 0..n {
                    assert_eq!(dst[j * r + i], src[i * n + j], "{r} x {n} at ({i}, {j})");
                }
            }
        }
    }
}
