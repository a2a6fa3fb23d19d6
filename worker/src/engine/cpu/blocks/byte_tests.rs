//! Prompt rows in 8-bit blocks ([`Blocks::with_byte_prompts`], [`kernels::bytes`]).

use super::tests::{random_blocks, reference, values};
use super::*;
use crate::engine::gguf::{dequant::dequantize, writer::quantize};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A matrix of `ty` with random values, and its dequantized weights.
fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> (Blocks, Vec<f32>) {
    let bytes = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            quantize(ty, &values(rows * cols, seed)).expect("quantize")
        }
        _ => {
            let per = ty.block_size().expect("block size");
            random_blocks(ty, rows * cols / per, u64::from(seed))
        }
    };
    let deq = dequantize(ty, &bytes, rows * cols).expect("dequantize");
    let q = Blocks::from_gguf(ty, rows, cols, &bytes).expect("repack");
    (q, deq)
}

/// The product of prompt rows (no integer rows) through the matrix's own path.
fn prompt_product(q: &Blocks, x: &[f32], n: usize) -> (Vec<f32>, Prepared) {
    let mut prep = Prepared::default();
    q.prepare(x, &vec![false; n], &mut prep);
    let mut out = vec![0.0f32; q.rows * n];
    q.product_rows(x, n, &prep, 0, q.rows, &mut Vec::new(), &mut out);
    (out, prep)
}

/// Every block format with byte prompts: the product is the dequantized weights times
/// the inputs as their 8-bit blocks dequantized (to float rounding), so within those
/// blocks' rounding of the f32 product; every kernel (512-bit, 256-bit, portable)
/// gives the same bits; every row gives the bits it gets alone and beside generated (integer) rows;
/// and the 8-bit inputs are really used (the result is not the f32 path's).
#[test]
fn byte_prompt_products_are_the_8_bit_inputs_product() {
    for (ty, cols) in [
        (GgmlType::Q4_0, 96),
        (GgmlType::Q4_1, 160),
        (GgmlType::Q8_0, 96),
        (GgmlType::Q5_0, 160),
        (GgmlType::Q5_1, 160),
        (GgmlType::Q4K, 512),
        (GgmlType::Q5K, 256),
        (GgmlType::Q6K, 512),
        (GgmlType::IQ4NL, 160),
        (GgmlType::IQ4XS, 256),
    ] {
        // 4-row blocks and a remainder; two whole groups of 16 input rows and a part.
        let (rows, n) = (23, 37);
        let (q, deq) = matrix(ty, rows, cols, cols as u32 + ty.id());
        let q = q.with_int_inputs(true).with_byte_prompts(true);
        let x: Vec<f32> = values(n * cols, 23)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (0.25 + (i % 13) as f32))
            .collect();
        let (got, prep) = prompt_product(&q, &x, n);
        let bytes = &prep.bytes;

        // The inputs as the kernel sees them: q · d of each block.
        let bpr = cols / BLOCK;
        let lanes = kernels::bytes::LANES;
        let seen: Vec<f32> = (0..n * cols)
            .map(|i| {
                let (j, c) = (i / cols, i % cols);
                let (g, l) = (j / lanes, j % lanes);
                let v = bytes.q[g * cols * lanes + (c / 4) * 4 * lanes + 4 * l + c % 4];
                f32::from(v) * bytes.d[(g * bpr + c / BLOCK) * lanes + l]
            })
            .collect();
        let of_seen = reference(&deq, rows, cols, &seen, n);
        let of_x = reference(&deq, rows, cols, &x, n);
        let mut moved = false;
        for j in 0..n {
            for r in 0..rows {
                let a = f64::from(got[r * n + j]);
                let terms: f64 = (0..cols)
                    .map(|c| f64::from(deq[r * cols + c] * seen[j * cols + c]).abs())
                    .sum();
                let e = f64::from(of_seen[j * rows + r]);
                assert!(
                    (a - e).abs() <= 1e-5 * terms + 1e-6,
                    "{ty:?} ({r}, {j}): {a} vs {e} of the 8-bit inputs"
                );
                // Half a step of each block, times the weights it meets.
                let bound: f64 = (0..cols)
                    .map(|c| {
                        let d = bytes.d[(j / lanes * bpr + c / BLOCK) * lanes + j % lanes];
                        f64::from(deq[r * cols + c].abs() * d) / 2.0
                    })
                    .sum();
                let f = f64::from(of_x[j * rows + r]);
                assert!(
                    (a - f).abs() <= bound * 1.001 + 1e-4,
                    "{ty:?} ({r}, {j}): {a} vs {f}, bound {bound}"
                );
                moved |= a.to_bits() != f.to_bits() && (a - f).abs() > 1e-6 * terms;
            }
        }
        assert!(moved, "{ty:?}: the 8-bit inputs changed nothing");

        // Every kernel this CPU runs, bit for bit.
        let mut tile = kernels::bytes::ByteTile::default();
        q.byte_tile(0, rows, &mut tile);
        for &kernel in kernels::IntKernel::available() {
            let mut each = vec![0.0f32; rows * n];
            kernels::bytes::product_on(kernel, bytes, n, &tile, &mut each);
            assert_eq!(bits(&each), bits(&got), "{ty:?}: {kernel:?} differs");
        }

        // Each row alone, and a part of the weight rows.
        for j in [0, 15, 16, 36] {
            let (alone, _) = prompt_product(&q, &x[j * cols..(j + 1) * cols], 1);
            let column: Vec<f32> = (0..rows).map(|r| got[r * n + j]).collect();
            assert_eq!(bits(&alone), bits(&column), "{ty:?}: row {j} alone");
        }
        let mut part = vec![0.0f32; 9 * n];
        q.product_rows(&x, n, &prep, 5, 14, &mut Vec::new(), &mut part);
        assert_eq!(bits(&part), bits(&got[5 * n..14 * n]), "{ty:?}: rows 5..14");

        // Beside generated rows (integer inputs), prompt rows keep their bits.
        let int_rows: Vec<bool> = (0..n).map(|j| j % 3 == 1).collect();
        let mut mixed_prep = Prepared::default();
        q.prepare(&x, &int_rows, &mut mixed_prep);
        let mut mixed = vec![0.0f32; rows * n];
        q.product_rows(&x, n, &mixed_prep, 0, rows, &mut Vec::new(), &mut mixed);
        for j in (0..n).filter(|&j| !int_rows[j]) {
            for r in 0..rows {
                assert_eq!(
                    mixed[r * n + j].to_bits(),
                    got[r * n + j].to_bits(),
                    "{ty:?} ({r}, {j}) beside integer rows"
                );
            }
        }
    }
}

/// Inputs quantize to the nearest step, halves away from zero, with zeros for an
/// all-zero block and the padding rows of a group.
#[test]
fn byte_panels_hold_the_nearest_steps() {
    let cols = 64;
    let mut x = vec![0.0f32; 3 * cols];
    // Row 0, block 0: a maximum of 127 makes the step 1.
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.49;
    x[4] = -126.6;
    // Row 1 stays zero; row 2's second block has a maximum of 0.127 (step 0.001).
    x[2 * cols + 32] = -0.127;
    x[2 * cols + 33] = 0.0016;
    let mut p = kernels::bytes::BytePanels::default();
    p.fill(&x, cols);
    let lanes = kernels::bytes::LANES;
    let at = |j: usize, c: usize| p.q[(c / 4) * 4 * lanes + 4 * j + c % 4];
    assert_eq!(
        [at(0, 0), at(0, 1), at(0, 2), at(0, 3), at(0, 4)],
        [127, 3, -3, 0, -127]
    );
    assert_eq!(p.d[0], 1.0);
    assert_eq!(p.s[0], 0.0, "127 + 3 − 3 + 0 − 127");
    assert!((0..cols).all(|c| at(1, c) == 0));
    assert_eq!(p.d[1], 0.0, "a zero block's step is zero");
    assert_eq!((at(2, 32), at(2, 33)), (-127, 2));
    assert!((p.d[lanes + 2] - 0.001).abs() < 1e-9);
    // Padding rows of the group are zeros with zero steps.
    assert_eq!(p.q.len(), cols * lanes);
    assert!((3..lanes).all(|j| (0..cols).all(|c| at(j, c) == 0) && p.d[j] == 0.0));
}

/// 16-bit float matrices take f32 prompt rows even with byte prompts, alone and
/// stacked beside blocks.
#[test]
fn sixteen_bit_floats_keep_f32_prompts() {
    let (rows, cols, n) = (6, 64, 5);
    let w = values(rows * cols, 3);
    let raw: Vec<u8> = w
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let f = Blocks::from_gguf(GgmlType::F16, rows, cols, &raw).expect("f16");
    let x = values(n * cols, 9);
    let plain = prompt_product(&f.clone().with_int_inputs(true), &x, n).0;
    let bytes = f.clone().with_int_inputs(true).with_byte_prompts(true);
    assert_eq!(bits(&prompt_product(&bytes, &x, n).0), bits(&plain));

    let (q, _) = matrix(GgmlType::Q8_0, 4, cols, 7);
    let stack = super::super::qmatrix::QMatrix::concat_rows(vec![
        bytes.into(),
        q.with_int_inputs(true).with_byte_prompts(true).into(),
    ])
    .expect("one width");
    let mut prep = Prepared::default();
    stack.prepare(&x, &vec![false; n], &mut prep);
    let mut out = vec![0.0f32; (rows + 4) * n];
    stack.product_rows(&x, n, &prep, 0, rows + 4, &mut Vec::new(), &mut out);
    assert_eq!(
        bits(&out[..rows * n]),
        bits(&plain),
        "the f16 rows of a stack"
    );
}

/// The unsigned values the byte products unpack (vector and scalar) are each kind's
/// signed values plus its offset.
#[test]
fn unpacked_bytes_are_the_values_plus_the_offset() {
    for (ty, cols) in [
        (GgmlType::Q5_0, 256),
        (GgmlType::Q5_1, 256),
        (GgmlType::Q5K, 256),
        (GgmlType::Q6K, 256),
        (GgmlType::IQ4NL, 256),
        (GgmlType::IQ4XS, 256),
        (GgmlType::Q4_1, 256),
    ] {
        let rows = 3;
        let (q, _) = matrix(ty, rows, cols, 5);
        let mut tile = kernels::bytes::ByteTile::default();
        q.byte_tile(0, rows, &mut tile);
        let bb = q.qs_per_block();
        for (b, block) in q.qs.chunks_exact(bb).enumerate() {
            let want: Vec<i32> = if q.kind == QKind::Nibble {
                block
                    .iter()
                    .map(|&v| i32::from(v & 0x0F))
                    .chain(block.iter().map(|&v| i32::from(v >> 4)))
                    .collect()
            } else {
                packed::unpack(q.kind, block)
                    .iter()
                    .map(|&v| i32::from(v))
                    .collect()
            };
            let got: Vec<i32> = tile.u[b * BLOCK..(b + 1) * BLOCK]
                .iter()
                .map(|&u| i32::from(u) - tile.offset)
                .collect();
            assert_eq!(got, want, "{ty:?} block {b}");
            if q.kind.is_packed() && q.kind != QKind::Iq4 {
                let mut one = [0u8; BLOCK];
                packed::unpack_raw(q.kind, block, &mut one);
                assert_eq!(
                    &one[..],
                    &tile.u[b * BLOCK..(b + 1) * BLOCK],
                    "{ty:?} scalar"
                );
            }
        }
    }
}
