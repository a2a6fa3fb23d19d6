//! A weight matrix as the host engine multiplies it: one or more runs of rows, each kept
//! in its own block format ([`Blocks`]).
//!
//! Matrices that one product serves are stacked (queries, keys and values; gate and
//! up), but a file may keep them in different formats: Q4_K_M files hold half their
//! layers' value matrices in Q6_K beside Q4_K queries and keys. Each run keeps its
//! file's blocks, and a product over a range of rows runs each run's kernel on its part
//! of the range; the inputs are prepared once for all of them.

use super::Blocks;
pub use super::{Prepared, QKind};
use crate::engine::gguf::GgmlType;
use rayon::prelude::*;

/// A `rows × cols` weight matrix in block form; row `o` holds output `o`'s weights.
#[derive(Debug, Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    /// Runs of rows in order, each in one format; never empty, never two neighbours
    /// that could be one.
    parts: Vec<Blocks>,
}

impl From<Blocks> for QMatrix {
    fn from(b: Blocks) -> Self {
        QMatrix {
            rows: b.rows(),
            cols: b.cols(),
            parts: vec![b],
        }
    }
}

impl QMatrix {
    /// Rows of input from which products dequantize tiles of weights and run a dense
    /// product ([`Blocks::DENSE_FROM`]).
    pub const DENSE_FROM: usize = Blocks::DENSE_FROM;

    /// Whether GGUF data of this type can be kept as is.
    pub fn supports(ty: GgmlType) -> bool {
        Blocks::supports(ty)
    }

    /// See [`Blocks::from_gguf`].
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        Blocks::from_gguf(ty, rows, cols, bytes).map(Self::from)
    }

    /// See [`Blocks::quantize_q8`].
    pub fn quantize_q8(values: &[f32], rows: usize, cols: usize) -> Option<Self> {
        Blocks::quantize_q8(values, rows, cols).map(Self::from)
    }

    /// The same matrix, taking 16-bit integer activations where asked
    /// ([`Blocks::with_int_inputs`]).
    pub fn with_int_inputs(self, on: bool) -> Self {
        QMatrix {
            parts: self
                .parts
                .into_iter()
                .map(|p| p.with_int_inputs(on))
                .collect(),
            ..self
        }
    }

    /// The same matrix, with 8-bit prompt rows where asked ([`Blocks::with_byte_prompts`]).
    pub fn with_byte_prompts(self, on: bool) -> Self {
        QMatrix {
            parts: self
                .parts
                .into_iter()
                .map(|p| p.with_byte_prompts(on))
                .collect(),
            ..self
        }
    }

    /// Whether prompt rows take 8-bit inputs ([`QMatrix::with_byte_prompts`]).
    pub fn byte_prompts(&self) -> bool {
        self.parts.iter().any(|p| p.byte_prompts)
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The formats of the runs of rows, in order.
    pub fn kinds(&self) -> Vec<QKind> {
        self.parts.iter().map(Blocks::kind).collect()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(Blocks::bytes).sum()
    }

    /// The run holding row `r`, and the row within it.
    fn locate(&self, mut r: usize) -> (&Blocks, usize) {
        for p in &self.parts {
            if r < p.rows() {
                return (p, r);
            }
            r -= p.rows();
        }
        panic!("row {r} past the matrix's {} rows", self.rows)
    }

    /// A matrix of the rows in `order` (row `i` of the result is row `order[i]`).
    pub fn select_rows(&self, order: &[usize]) -> Self {
        if let [only] = &self.parts[..] {
            return QMatrix::from(only.select_rows(order));
        }
        let picked = order.iter().map(|&r| {
            let (p, i) = self.locate(r);
            QMatrix::from(p.select_rows(&[i]))
        });
        Self::concat_rows(picked.collect()).expect("rows of one width")
    }

    /// Stacks matrices of one width (runs of one format next to each other merge);
    /// `None` if the widths differ or there is nothing to stack.
    pub fn concat_rows(parts: Vec<QMatrix>) -> Option<Self> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let mut runs: Vec<Blocks> = Vec::new();
        for b in parts.into_iter().flat_map(|p| p.parts) {
            match runs.last_mut() {
                Some(last) if last.same_form(&b) => last.append(b),
                _ => runs.push(b),
            }
        }
        Some(QMatrix {
            rows: runs.iter().map(Blocks::rows).sum(),
            cols,
            parts: runs,
        })
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row(&self, r: usize) -> Vec<f32> {
        let (p, i) = self.locate(r);
        p.row(i)
    }

    /// Prepares the input rows `x: [n, cols]` for [`QMatrix::product_rows`], once for
    /// every run ([`Blocks::prepare`]).
    pub fn prepare(&self, x: &[f32], int_rows: &[bool], out: &mut Prepared) {
        let sums = self.parts.iter().any(|p| p.kind().has_mins());
        let floats = self.parts.iter().any(|p| p.kind().is_float());
        self.parts[0].prepare_with(x, int_rows, sums, floats, out);
    }

    /// Products of weight rows `r0..r1` with every row of `x: [n, cols]`, into
    /// `out: [r1 − r0, n]` (weight-row-major), each run's rows by its own kernel
    /// ([`Blocks::product_rows`]).
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
            r0 <= r1 && r1 <= self.rows && out.len() == (r1 - r0) * n,
            "product shapes disagree"
        );
        let mut start = 0;
        for p in &self.parts {
            let end = start + p.rows();
            let (a, b) = (r0.max(start), r1.min(end));
            if a < b {
                let o = &mut out[(a - r0) * n..(b - r0) * n];
                p.product_rows(x, n, prep, a - start, b - start, tile, o);
            }
            start = end;
        }
    }

    /// `x: [n, cols]` (row-major) → `[n, rows]`: every row of `x` against every weight
    /// row, in parallel slices of weight rows.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "input is not [n, cols]");
        let mut prep = Prepared::default();
        self.prepare(x, &vec![true; n], &mut prep);
        let rows_per_task = if n >= Self::DENSE_FROM {
            Blocks::TILE
        } else {
            (4096 / n.max(1)).clamp(16, 256)
        };
        let mut yt = vec![0.0f32; self.rows * n];
        yt.par_chunks_mut(rows_per_task * n)
            .enumerate()
            .for_each_init(Vec::new, |tile, (task, out)| {
                let r0 = task * rows_per_task;
                let r1 = r0 + out.len() / n;
                self.product_rows(x, n, &prep, r0, r1, tile, out);
            });
        if n == 1 {
            return yt;
        }
        let mut y = vec![0.0f32; n * self.rows];
        for r in 0..self.rows {
            for j in 0..n {
                y[j * self.rows + r] = yt[r * n + j];
            }
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::super::blocks::tests::values;
    use super::*;
    use crate::engine::gguf::{dequant::dequantize, writer::quantize};

    /// Runs of different formats stacked keep their values, and a product over any
    /// range of rows is each run's own product, bit for bit.
    #[test]
    fn stacks_of_different_formats_keep_each_runs_blocks() {
        let cols = 64;
        let mut pieces = Vec::new();
        let mut deq = Vec::new();
        for (i, (ty, rows)) in [
            (GgmlType::Q4_1, 5),
            (GgmlType::Q8_0, 7),
            (GgmlType::Q4_1, 3),
        ]
        .into_iter()
        .enumerate()
        {
            let w = values(rows * cols, 3 + i as u32);
            let bytes = quantize(ty, &w).expect("quantize");
            deq.extend(dequantize(ty, &bytes, rows * cols).expect("dequantize"));
            let m = QMatrix::from_gguf(ty, rows, cols, &bytes).expect("repack");
            pieces.push(m.with_int_inputs(true));
        }
        let stack = QMatrix::concat_rows(pieces.clone()).expect("one width");
        assert_eq!(stack.rows(), 15);
        assert_eq!(
            stack.kinds(),
            vec![QKind::Nibble, QKind::Byte, QKind::Nibble],
            "runs of other formats are kept apart, not converted"
        );
        for r in 0..15 {
            let row = stack.row(r);
            for c in 0..cols {
                assert!((row[c] - deq[r * cols + c]).abs() < 1e-6, "row {r}");
            }
        }
        let n = 3;
        let x = values(n * cols, 99);
        let whole = stack.matmul(&x, n);
        let mut at = 0;
        for p in &pieces {
            let alone = p.matmul(&x, n);
            for j in 0..n {
                for r in 0..p.rows() {
                    assert_eq!(
                        whole[j * 15 + at + r].to_bits(),
                        alone[j * p.rows() + r].to_bits()
                    );
                }
            }
            at += p.rows();
        }
        // A range that starts and ends inside runs.
        let mut prep = Prepared::default();
        stack.prepare(&x, &[true; 3], &mut prep);
        let mut part = vec![0.0; (13 - 3) * n];
        stack.product_rows(&x, n, &prep, 3, 13, &mut Vec::new(), &mut part);
        for r in 3..13 {
            for j in 0..n {
                assert_eq!(part[(r - 3) * n + j].to_bits(), whole[j * 15 + r].to_bits());
            }
        }
        // Rows picked across runs.
        let picked = stack.select_rows(&[14, 0, 6, 5]);
        for (i, &r) in [14, 0, 6, 5].iter().enumerate() {
            assert_eq!(picked.row(i), stack.row(r));
        }
        let q8 = QMatrix::quantize_q8(&values(2 * 32, 1), 2, 32).expect("q8");
        assert!(
            QMatrix::concat_rows(vec![stack, q8]).is_none(),
            "widths differ"
        );
    }
}
