//! A weight matrix kept in the format the worker chose for weights.

use burn_tensor::{backend::Backend, DType, Tensor, TensorData};
use half::f16;

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
}

impl WeightDtype {
    /// Whether weights stay in the file's blocks (the CPU kernels of
    /// [`crate::engine::cpu::blocks`]).
    pub fn is_native(self) -> bool {
        matches!(self, WeightDtype::Native | WeightDtype::NativeI16)
    }
}

impl WeightDtype {
    /// The burn dtype of tensors holding such weights.
    pub fn dtype(self) -> DType {
        match self {
            WeightDtype::F32 | WeightDtype::Native | WeightDtype::NativeI16 => DType::F32,
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
            other => Err(format!(
                "unknown weight format {other:?} (expected native, native-i16, f32 or f16)"
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
        WeightDtype::F32 | WeightDtype::Native | WeightDtype::NativeI16 => {
            Tensor::from_data(TensorData::new(values, [rows, cols]), (device, DType::F32))
        }
        WeightDtype::F16 => {
            let half: Vec<f16> = values.into_iter().map(f16::from_f32).collect();
            Tensor::from_data(TensorData::new(half, [rows, cols]), (device, DType::F16))
        }
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

    /// Bytes of weights one product reads.
    pub fn weight_bytes(&self) -> usize {
        self.weight_t.shape().num_elements() * if self.dtype == WeightDtype::F16 { 2 } else { 4 }
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
