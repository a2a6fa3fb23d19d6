//! A weight matrix kept in the format the worker chose for weights.

use burn_tensor::quantization::{QuantLevel, QuantScheme, QuantStore, QuantValue};
use burn_tensor::{backend::Backend, DType, Tensor, TensorData};
use half::f16;

use crate::engine::gguf::GgmlType;

/// The format weights are kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// 32-bit floats: exact dequantized values, as burn tensors on the device.
    F32,
    /// 16-bit floats, as burn tensors on the device: half the traffic of f32.
    F16,
    /// The file's own 32-element blocks (Q4_0, Q4_1, Q8_0; other types converted to
    /// Q8_0), multiplied by the CPU kernels of [`crate::engine::cpu::blocks`]: the least memory
    /// traffic per token. CPU only.
    Native,
    /// The file's blocks as [`WeightDtype::Native`], with the inputs of generated
    /// tokens' rows quantized to 16-bit blocks and multiplied in integers (prompts stay
    /// f32): faster decode, and a generated token's numbers never depend on what shares
    /// its step; logits move by the 16-bit rounding of the activations (within the
    /// reference test's 5e-3 on the default model). The default. CPU only.
    #[default]
    NativeI16,
    /// [`WeightDtype::NativeI16`] with the prompt's rows quantized to 8-bit blocks too
    /// (`cpu/kernels/bytes.rs`), as llama.cpp multiplies every row:
    /// prompts about twice as fast where the CPU has AVX-512 VNNI, at the cost of that
    /// rounding (on the default model the last logits move by up to ~1; greedy text
    /// can part from f32 after a few tokens; docs/benchmarks.md). Opt-in. CPU only.
    NativeI8,
}

impl WeightDtype {
    /// Whether weights stay in the file's blocks (the CPU kernels of
    /// [`crate::engine::cpu::blocks`]).
    pub fn is_native(self) -> bool {
        matches!(
            self,
            WeightDtype::Native | WeightDtype::NativeI16 | WeightDtype::NativeI8
        )
    }
}

impl WeightDtype {
    /// Whether generated tokens' rows take 16-bit integer inputs.
    pub fn int_inputs(self) -> bool {
        matches!(self, WeightDtype::NativeI16 | WeightDtype::NativeI8)
    }

    /// Whether prompt rows take 8-bit integer inputs.
    pub fn byte_prompts(self) -> bool {
        self == WeightDtype::NativeI8
    }

    /// The burn dtype of tensors holding such weights.
    pub fn dtype(self) -> DType {
        match self {
            WeightDtype::F32
            | WeightDtype::Native
            | WeightDtype::NativeI16
            | WeightDtype::NativeI8 => DType::F32,
            WeightDtype::F16 => DType::F16,
        }
    }
}

impl std::fmt::Display for WeightDtype {
    /// The name [`std::str::FromStr`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::Native => "native",
            WeightDtype::NativeI16 => "native-i16",
            WeightDtype::NativeI8 => "native-i8",
        })
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(WeightDtype::F32),
            "f16" => Ok(WeightDtype::F16),
            "native" | "q" => Ok(WeightDtype::Native),
            "native-i16" => Ok(WeightDtype::NativeI16),
            "native-i8" => Ok(WeightDtype::NativeI8),
            other => Err(format!(
                "unknown weight format {other:?} (expected native, native-i16, native-i8, f32 or f16)"
            )),
        }
    }
}

/// Builds a 2-D tensor of `rows × cols` row-major values in the given dtype.
pub fn weight_tensor<B: Backend>(
    values: Vec<f32>,
    rows: usize,
    cols: usize,
    dtype: WeightDtype,
    device: &B::Device,
) -> Tensor<B, 2> {
    debug_assert_eq!(values.len(), rows * cols);
    match dtype {
        WeightDtype::F32 | WeightDtype::Native | WeightDtype::NativeI16 | WeightDtype::NativeI8 => {
            Tensor::from_data(TensorData::new(values, [rows, cols]), (device, DType::F32))
        }
        WeightDtype::F16 => {
            let half: Vec<f16> = values.into_iter().map(f16::from_f32).collect();
            Tensor::from_data(TensorData::new(half, [rows, cols]), (device, DType::F16))
        }
    }
}

/// A matrix of GGUF Q8_0 or Q4_0 blocks on its way to the device engine, which keeps it
/// as burn's block-32 quantized tensor (8- or 4-bit symmetric values, an f32 scale a
/// block): about a half (Q8_0) or a quarter (Q4_0) of the f16 tensor's bytes, the file's
/// integers as they are. The product dequantizes them in the input's dtype (f16 for
/// `f16` weights), so it rounds as an f16 tensor's product does.
#[derive(Debug, Clone)]
pub struct DeviceBlocks {
    /// `Q8S` for Q8_0, `Q4S` for Q4_0.
    value: QuantValue,
    rows: usize,
    cols: usize,
    /// Each weight's integer, row-major (`q − 8` for Q4_0).
    q: Vec<i8>,
    /// Each block's scale, row-major (`rows × cols/32`).
    d: Vec<f32>,
}

impl DeviceBlocks {
    /// Whether the device engine keeps matrices of type `ty` in blocks.
    pub fn supports(ty: GgmlType) -> bool {
        matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
    }

    /// The `rows × cols` matrix in `bytes`, as the file stores blocks of type `ty`
    /// (`None` for another type, or bytes that do not hold the matrix).
    pub fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let value = match ty {
            GgmlType::Q8_0 => QuantValue::Q8S,
            GgmlType::Q4_0 => QuantValue::Q4S,
            _ => return None,
        };
        let size = ty.block_bytes()?;
        let blocks = (rows * cols) / 32;
        if !cols.is_multiple_of(32) || bytes.len() != blocks * size {
            return None;
        }
        let mut q = Vec::with_capacity(rows * cols);
        let mut d = Vec::with_capacity(blocks);
        for b in bytes.chunks_exact(size) {
            d.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            let v = &b[2..];
            if value == QuantValue::Q8S {
                q.extend(v.iter().map(|&x| x as i8));
            } else {
                // Low nibbles are elements 0..16, high nibbles 16..32.
                q.extend(v.iter().map(|&x| (x & 0x0F) as i8 - 8));
                q.extend(v.iter().map(|&x| (x >> 4) as i8 - 8));
            }
        }
        Some(Self {
            value,
            rows,
            cols,
            q,
            d,
        })
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The GGUF type the blocks came from.
    pub fn ggml_type(&self) -> GgmlType {
        match self.value {
            QuantValue::Q4S => GgmlType::Q4_0,
            _ => GgmlType::Q8_0,
        }
    }

    /// The values, row-major.
    pub fn into_dense(self) -> Vec<f32> {
        self.q
            .chunks_exact(32)
            .zip(&self.d)
            .flat_map(|(q, &d)| q.iter().map(move |&v| f32::from(v) * d))
            .collect()
    }

    /// The rows in the order `order` gives (each an index of a row here).
    pub fn select_rows(&self, order: &[usize]) -> Self {
        let (c, bc) = (self.cols, self.cols / 32);
        let mut q = Vec::with_capacity(order.len() * c);
        let mut d = Vec::with_capacity(order.len() * bc);
        for &r in order {
            q.extend_from_slice(&self.q[r * c..(r + 1) * c]);
            d.extend_from_slice(&self.d[r * bc..(r + 1) * bc]);
        }
        Self {
            rows: order.len(),
            q,
            d,
            ..*self
        }
    }

    /// The rows of every part, in order, where all are of one type and width.
    pub fn concat_rows(parts: Vec<Self>) -> Result<Self, Vec<Self>> {
        let same = parts
            .windows(2)
            .all(|w| w[0].value == w[1].value && w[0].cols == w[1].cols);
        if parts.is_empty() || !same {
            return Err(parts);
        }
        let mut all = parts.into_iter();
        let mut first = all.next().expect("not empty");
        for p in all {
            first.rows += p.rows;
            first.q.extend(p.q);
            first.d.extend(p.d);
        }
        Ok(first)
    }

    /// The matrix as a quantized `[rows, cols]` tensor on `device`: values packed eight
    /// (Q4) or four (Q8) to a `u32` along the rows, blocks of 32 along them.
    pub fn into_tensor<B: Backend>(self, device: &B::Device) -> Tensor<B, 2> {
        let scheme = QuantScheme::default()
            .with_value(self.value)
            .with_level(QuantLevel::block([1, 32]))
            .with_store(QuantStore::PackedU32(0));
        let data = if self.value == QuantValue::Q4S {
            // Element i of each eight in bits 4i..4i + 4, two's complement.
            let mut bytes: Vec<u8> = self
                .q
                .chunks_exact(8)
                .map(|c| {
                    c.iter().enumerate().fold(0u32, |a, (i, &v)| {
                        a | (u32::from(v as u8 & 0x0F) << (4 * i))
                    })
                })
                .flat_map(u32::to_le_bytes)
                .collect();
            bytes.extend(self.d.iter().flat_map(|v| v.to_le_bytes()));
            TensorData::from_bytes_vec(bytes, [self.rows, self.cols], DType::QFloat(scheme))
        } else {
            TensorData::quantized(self.q, [self.rows, self.cols], scheme, &self.d)
        };
        Tensor::from_data(data, device)
    }
}

/// `y = x · Wᵀ` for a weight stored as `[out, in]` rows, as GGUF stores it, as a burn
/// tensor on the device (the device engine's; the host engine keeps its matrices in
/// block form, `QMatrix`).
///
/// Activations stay f32. A weight kept in f16 gets its input cast to f16 for the product
/// and the result cast back.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    /// `[in, out]`: a transposed view of the `[out, in]` rows, so no copy is made and a
    /// one-row product reads each output's weights contiguously.
    weight_t: Tensor<B, 2>,
    /// The tensor's dtype.
    dtype: WeightDtype,
}

impl<B: Backend> Linear<B> {
    /// Wraps `out × in` row-major values.
    pub fn new(
        values: Vec<f32>,
        out: usize,
        inp: usize,
        dtype: WeightDtype,
        device: &B::Device,
    ) -> Self {
        let w = weight_tensor::<B>(values, out, inp, dtype, device);
        Self::from_rows(w, dtype)
    }

    /// Wraps an existing `[out, in]` tensor of the given dtype.
    pub fn from_rows(rows: Tensor<B, 2>, dtype: WeightDtype) -> Self {
        Linear {
            weight_t: rows.transpose(),
            dtype,
        }
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight_t.dims()[1]
    }

    /// Bytes of weights one product reads (a block's scale counted in).
    pub fn weight_bytes(&self) -> usize {
        let n = self.weight_t.shape().num_elements();
        match self.weight_t.dtype() {
            DType::QFloat(s) => n * s.value.size_bits() / 8 + n / 32 * 4,
            DType::F16 => 2 * n,
            _ => 4 * n,
        }
    }

    /// How the weights are held: `f32`, `f16`, or `q8_0`/`q4_0` blocks.
    pub fn held(&self) -> &'static str {
        match self.weight_t.dtype() {
            DType::QFloat(s) if s.value == QuantValue::Q4S => "q4_0",
            DType::QFloat(_) => "q8_0",
            DType::F16 => "f16",
            _ => "f32",
        }
    }

    /// `x: [n, in]` → `[n, out]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if self.dtype == WeightDtype::F16 {
            x.cast(DType::F16)
                .matmul(self.weight_t.clone())
                .cast(DType::F32)
        } else {
            x.matmul(self.weight_t.clone())
        }
    }
}

/// Copies an f32 tensor's values to the host.
pub fn to_host<B: Backend, const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
    let data = x.into_data();
    match data.to_vec::<f32>() {
        Ok(v) => v,
        Err(_) => data.convert::<f32>().to_vec::<f32>().unwrap_or_default(),
    }
}
