//! The SwiGLU feed-forward block: `down(silu(gate(x)) ⊙ up(x))`.

use burn_tensor::{activation::silu, backend::Backend, Tensor};

use super::linear::Linear;

/// One layer's feed-forward weights.
#[derive(Debug, Clone)]
pub struct Mlp<B: Backend> {
    /// Gate and up projections fused in one `[2·ffn, hidden]` matrix.
    pub(crate) gate_up: Linear<B>,
    /// Down projection.
    pub(crate) down: Linear<B>,
    pub(crate) ffn: usize,
}

impl<B: Backend> Mlp<B> {
    /// `x: [rows, hidden]` → `[rows, hidden]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let gu = self.gate_up.forward(x);
        let gate = gu.clone().narrow(1, 0, self.ffn);
        let up = gu.narrow(1, self.ffn, self.ffn);
        self.down.forward(silu(gate) * up)
    }
}
