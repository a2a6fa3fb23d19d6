use super::*;
use crate::engine::gguf::{dequant::dequantize, writer::quantize};

pub(in crate::engine::cpu) fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0
                - 1.0
        })
        .collect()
}

pub(super) fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
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
                QKind::Byte => kernels::dot_byte(false, qs, sc, xs),
                QKind::Nibble => {
                    let xsum: Vec<f32> = xs.chunks(32).map(|c| c.iter().sum()).collect();
                    kernels::dot_nibble(false, qs, sc, mins, xs, &xsum)
                }
                _ => unreachable!("not made here"),
            };
            assert!((portable - want[r]).abs() < 1e-4);
        }
    }
}

/// `n` valid blocks of `ty` (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS) from a seed:
/// random bytes with sane f16 scales.
pub(super) fn random_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
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
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
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

/// The same matrix with 5-bit blocks or IQ4's indices as the bytes of their values:
/// the form Q5_0 was kept in before being packed.
fn unpacked(q: &Blocks) -> Blocks {
    let mut out = q.clone();
    if matches!(q.kind, QKind::Five | QKind::Iq4) {
        out.kind = QKind::Byte;
        out.qs =
            q.qs.chunks_exact(packed::block_bytes(q.kind))
                .flat_map(|b| packed::unpack(q.kind, b).map(|v| v as u8))
                .collect();
    }
    out
}

/// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS kept in their blocks, with integer
/// inputs: within the inputs' rounding of the dequantized product; the vector kernels
/// bitwise alike and the portable loop within float rounding; every row as it is
/// alone; K-quant (and IQ4_XS) scales formed in the kernels bitwise the expanded ones';
/// and Q5_0 and IQ4_NL bitwise what their values give as bytes.
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
        (GgmlType::IQ4NL, 160),
        (GgmlType::IQ4NL, 576),
        (GgmlType::IQ4XS, 512),
        (GgmlType::IQ4XS, 768),
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
        // super-block); IQ4_NL 5 for 4.5 (an f32 scale a block) and IQ4_XS 4.375 for
        // 4.25 (a byte a block's scale, an f32 `d` a super-block).
        let per_weight = q.bytes() as f64 * 8.0 / (rows * cols) as f64;
        let want = match ty {
            GgmlType::Q5_0 => 6.0,
            GgmlType::IQ4NL => 5.0,
            GgmlType::IQ4XS => 4.375,
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
        let kernels = kernels::IntKernel::available();
        let runs: Vec<Vec<f32>> = kernels
            .iter()
            .map(|&kernel| {
                let mut out = vec![0.0f32; rows * n];
                let x = prep.int_inputs(&prep.sums);
                let scales = q.scales_of(0, rows);
                match q.kind {
                    k if k.is_packed() => {
                        packed::dot_int_rows(kernel, q.kind, bpr, &q.qs, scales, x, 0..n, &mut out)
                    }
                    _ => {
                        kernels::dot_int_rows(kernel, q.kind, bpr, &q.qs, scales, x, 0..n, &mut out)
                    }
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
        if matches!(ty, GgmlType::Q5_0 | GgmlType::IQ4NL) {
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
                !prep.qz.is_empty() || kernels::IntKernel::best() == kernels::IntKernel::Portable,
                "inputs laid out for the vector kernels"
            );
            let outs: Vec<(kernels::IntKernel, Vec<f32>)> = kernels::IntKernel::available()
                .iter()
                .map(|&kernel| {
                    let mut out = vec![0.0f32; rows * n];
                    kernels::dot_int_rows(
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
        kernels::panels(&x, cols, &mut panels);
        let mut wl = vec![0.0f32; m * cols];
        for (row, out) in w.chunks_exact(cols).zip(wl.chunks_exact_mut(cols)) {
            kernels::interleave_halves(row, out);
            for k in 0..cols / 2 {
                assert_eq!((out[2 * k], out[2 * k + 1]), (row[k], row[cols / 2 + k]));
            }
        }
        let run = |avx2: bool| {
            let mut out = vec![0.0f32; m * n];
            kernels::panel_product(avx2, &panels, n, &wl, m, cols, &mut out);
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
        if kernels::available() {
            assert_eq!(bits(&run(true)), bits(&portable), "n={n} m={m} cols={cols}");
            #[cfg(target_arch = "x86_64")]
            {
                let mut narrow = vec![0.0f32; m * n];
                // SAFETY: AVX2 and FMA are available (checked above); the shapes
                // match.
                unsafe { kernels::avx2::panel_product(&panels, n, &wl, m, cols, &mut narrow) };
                assert_eq!(bits(&narrow), bits(&portable), "AVX2 n={n} m={m}");
            }
        }
        // Row j alone gives column j.
        for j in [0, n / 2, n - 1] {
            let mut one = Vec::new();
            kernels::panels(&x[j * cols..(j + 1) * cols], cols, &mut one);
            let mut out = vec![0.0f32; m];
            kernels::panel_product(kernels::available(), &one, 1, &wl, m, cols, &mut out);
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
        kernels::quantize_blocks(avx2, &x, &mut q, &mut d);
        (q, d.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    let portable = run(false);
    if kernels::available() {
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
