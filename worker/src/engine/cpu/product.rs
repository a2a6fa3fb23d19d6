//! The products of a [`Blocks`] matrix with prepared input rows: integer rows through the
//! block kernels, f32 rows through dequantized tiles and panels.

use std::cell::RefCell;

use super::blocks::{Blocks, Prepared, QKind, BLOCK};
use super::kernels::bytes::{BytePanels, ByteTile};
use super::scales::FlatRows;
use super::{float16, kernels, packed};
use crate::engine::gguf::dequant::IQ4_VALUES;

/// IQ4's sixteen values plus 128, as the byte products take them.
const IQ4_UNSIGNED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (IQ4_VALUES[i] as u8) ^ 0x80;
        i += 1;
    }
    t
};

thread_local! {
    /// Each thread's weight tile for byte products, kept between them.
    static BYTE_TILE: RefCell<ByteTile> = RefCell::default();
}

impl Blocks {
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
                self.product_rows_f32(
                    fx,
                    n - n_int,
                    fsums,
                    panels,
                    &prep.bytes,
                    r0,
                    r1,
                    tile,
                    &mut part,
                );
                scatter(&part, &prep.f_rows, n, out);
            }
        } else if n_int == 0 {
            let (sums, panels) = (&prep.sums, &prep.panels);
            self.product_rows_f32(x, n, sums, panels, &prep.bytes, r0, r1, tile, out);
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
            self.product_rows_f32(
                fx,
                n_f,
                fsums,
                &prep.panels,
                &prep.bytes,
                r0,
                r1,
                tile,
                part,
            );
            scatter(part, &prep.f_rows, n, out);
        }
    }

    /// [`Blocks::product_rows`] with f32 inputs `x: [n, cols]`, their block sums and
    /// (for a matrix with integer inputs) their panels, f32 or bytes.
    #[allow(clippy::too_many_arguments)]
    fn product_rows_f32(
        &self,
        x: &[f32],
        n: usize,
        xsum: &[f32],
        panels: &[f32],
        bytes: &BytePanels,
        r0: usize,
        r1: usize,
        tile: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let bpr = self.cols / BLOCK;
        let qpb = self.qs_per_block();
        if self.int_inputs && self.byte_prompts && !self.kind.is_float() {
            // Prompt rows in 8-bit blocks: the weight rows as their integers, then one
            // integer product, each output's chain fixed as the f32 panels' are.
            BYTE_TILE.with_borrow_mut(|t| {
                self.byte_tile(r0, r1, t);
                kernels::bytes::product(bytes, n, t, out);
            });
            return;
        }
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
                kernels::interleave_halves(&row[..cols], &mut rows[i * cols..(i + 1) * cols]);
            }
            kernels::panel_product(
                kernels::available(),
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
        let avx2 = kernels::available();
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
                o[j0..j0 + 4]
                    .copy_from_slice(&kernels::dot4(self.kind, qs, scales, mins, xs, sums));
                j0 += 4;
            }
            for (j, y) in o.iter_mut().enumerate().skip(j0) {
                let xr = &x[j * self.cols..(j + 1) * self.cols];
                *y = if self.kind == QKind::Nibble {
                    let xs = &xsum[j * bpr..(j + 1) * bpr];
                    kernels::dot_nibble(avx2, qs, scales, mins, xr, xs)
                } else {
                    kernels::dot_byte(avx2, qs, scales, xr)
                };
            }
        }
    }

    /// Weight rows `r0..r1` as their file's unsigned integers with their scales and
    /// minimums (`w = (u − offset) · scale + min`, as [`Blocks::dequant_into`]
    /// computes them).
    pub(super) fn byte_tile(&self, r0: usize, r1: usize, t: &mut ByteTile) {
        let (cols, qpb) = (self.cols, self.qs_per_block());
        let bpr = cols / BLOCK;
        let upb = if self.kind == QKind::Six { 2 } else { 1 };
        let offset = match self.kind {
            QKind::Byte => 128,
            kind => packed::raw_offset(kind),
        };
        t.reset(r1 - r0, cols, upb, offset);
        let qs = &self.qs[r0 * bpr * qpb..r1 * bpr * qpb];
        match self.kind {
            QKind::Nibble => kernels::bytes::split_nibbles(qs, None, &mut t.u),
            QKind::Iq4 => kernels::bytes::split_nibbles(qs, Some(&IQ4_UNSIGNED), &mut t.u),
            QKind::Byte => {
                // The same length: 32 bytes a block either side.
                for (o, &b) in t.u.iter_mut().zip(qs) {
                    *o = b ^ 0x80;
                }
            }
            kind => packed::unpack_raw_blocks(kind, qs, &mut t.u),
        }
        let mut buf = Default::default();
        let FlatRows { scales, mins } = self.scales_of(r0, r1).flat(&mut buf);
        t.scale.extend_from_slice(scales);
        t.min.extend_from_slice(mins);
    }

    /// [`Blocks::product_rows`] with integer inputs: four input rows at a time share
    /// each widened weight block, the rest go one by one, and every row's result is
    /// bitwise the one it gets alone ([`kernels::dot_int_rows`], [`packed::dot_int_rows`]),
    /// so a sequence's numbers do not depend on what shares its step. Input rows run in
    /// groups small enough to stay in cache while the weight rows pass over them.
    fn product_rows_int(&self, n: usize, x: kernels::IntRows<'_>, r0: usize, out: &mut [f32]) {
        const GROUP: usize = 16;
        let (bpr, qpb) = (self.cols / BLOCK, self.qs_per_block());
        let r1 = r0 + out.len() / n.max(1);
        let kernel = kernels::IntKernel::best();
        let qs = &self.qs[r0 * bpr * qpb..r1 * bpr * qpb];
        let scales = self.scales_of(r0, r1);
        for g0 in (0..n).step_by(GROUP) {
            let rows = g0..(g0 + GROUP).min(n);
            if self.kind.is_packed() {
                packed::dot_int_rows(kernel, self.kind, bpr, qs, scales, x, rows, out);
            } else {
                kernels::dot_int_rows(kernel, self.kind, bpr, qs, scales, x, rows, out);
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
