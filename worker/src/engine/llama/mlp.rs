//! The gated feed-forward block: `down(act(gate(x)) ⊙ up(x))`, with SiLU (SwiGLU) or
//! GELU's tanh approximation (GeGLU).

use burn_tensor::{activation::silu, backend::Backend, Tensor};

use super::{config::Activation, linear::Linear};

/// One layer's feed-forward weights.
#[derive(Debug, Clone)]
pub struct Mlp<B: Backend> {
    /// Gate and up projections fused in one `[2·ffn, hidden]` matrix.
    pub(crate) gate_up: Linear<B>,
    /// Down projection.
    pub(crate) down: Linear<B>,
    pub(crate) ffn: usize,
    /// The gate's activation.
    pub(crate) activation: Activation,
}

impl<B: Backend> Mlp<B> {
    /// `x: [rows, hidden]` → `[rows, hidden]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let gu = self.gate_up.forward(x);
        let gate = gu.clone().narrow(1, 0, self.ffn);
        let up = gu.narrow(1, self.ffn, self.ffn);
        let gate = match self.activation {
            Activation::Silu => silu(gate),
            Activation::GeluTanh => gelu_tanh(gate),
        };
        self.down.forward(gate * up)
    }
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, PyTorch's `gelu(approximate="tanh")`.
fn gelu_tanh<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let inner = (x.clone() + x.clone().powi_scalar(3).mul_scalar(0.044_715))
        .mul_scalar((2.0f64 / std::f64::consts::PI).sqrt());
    x.mul_scalar(0.5) * (inner.tanh().add_scalar(1.0))
}
