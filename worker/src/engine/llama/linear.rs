//! A weight matrix kept in the dtype the worker chose for weights.

use burn_tensor::{backend::Backend, DType, Tensor, TensorData};
use half::f16;

/// The dtype weights are kept in on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// 32-bit floats: exact dequantized values (used to check against the reference).
    #[default]
    F32,
    /// 16-bit floats: half the memory traffic per decoded token.
    F16,
}

impl WeightDtype {
    /// The burn dtype of tensors holding such weights.
    pub fn dtype(self) -> DType {
        match self {
            WeightDtype::F32 => DType::F32,
            WeightDtype::F16 => DType::F16,
        }
    }

    /// Bytes per weight.
    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for WeightDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(WeightDtype::F32),
            "f16" => Ok(WeightDtype::F16),
            other => Err(format!("unknown weight dtype {other:?} (expected f32 or f16)")),
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
        WeightDtype::F32 => {
            Tensor::from_data(TensorData::new(values, [rows, cols]), (device, DType::F32))
        }
        WeightDtype::F16 => {
            let half: Vec<f16> = values.into_iter().map(f16::from_f32).collect();
            Tensor::from_data(TensorData::new(half, [rows, cols]), (device, DType::F16))
        }
    }
}

/// `y = x · Wᵀ` for a weight stored as `[out, in]` rows, as GGUF stores it.
///
/// Activations stay f32; when the weight is kept in another dtype the input is cast to
/// it for the product and the result cast back.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    /// `[in, out]`: a transposed view of the `[out, in]` rows, so no copy is made and
    /// a one-row product reads each output's weights contiguously.
    weight_t: Tensor<B, 2>,
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
        Self {
            weight_t: rows.transpose(),
            dtype,
        }
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight_t.dims()[1]
    }

    /// `x: [n, in]` → `[n, out]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self.dtype {
            WeightDtype::F32 => x.matmul(self.weight_t.clone()),
            WeightDtype::F16 => x
                .cast(DType::F16)
                .matmul(self.weight_t.clone())
                .cast(DType::F32),
        }
    }
}
