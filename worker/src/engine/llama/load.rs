//! Builds a [`Llama`] from a GGUF file.
//!
//! GGUF tensor names (llama.cpp's): `token_embd.weight`, `output_norm.weight`, optional
//! `output.weight`, and per block `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
//! ffn_norm, ffn_gate, ffn_up, ffn_down}.weight`. GGUF lists dimensions fastest-first, so
//! a matrix with dims `[in, out]` is `out` rows of `in` values: exactly the `[out, in]`
//! layout of a PyTorch linear weight.

pub use super::linear::WeightDtype;
use super::{
    attention::Attention,
    config::LlamaConfig,
    linear::{weight_tensor, Linear},
    mlp::Mlp,
    model::{Block, Llama, RmsNorm},
    rope::Rope,
};
use crate::engine::gguf::{GgufError, GgufFile};
use burn_tensor::{backend::Backend, Tensor, TensorData};

/// Why a model could not be built from a file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file itself is unreadable or malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The file describes another architecture.
    #[error("unsupported architecture {0:?}: this worker runs \"llama\" models")]
    UnsupportedArchitecture(String),
    /// The hyper-parameters contradict each other.
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// A tensor the architecture needs is absent.
    #[error("tensor {0:?} is missing from the model file")]
    MissingTensor(String),
    /// A tensor has the wrong shape for the configuration.
    #[error("tensor {name:?} has dims {found:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Dims the configuration implies (GGUF order).
        expected: Vec<u64>,
        /// Dims in the file.
        found: Vec<u64>,
    },
}

impl LoadError {
    /// A stable identifier for metrics and error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            LoadError::Gguf(e) => e.kind(),
            LoadError::UnsupportedArchitecture(_) => "unsupported_architecture",
            LoadError::Config(_) => "invalid_config",
            LoadError::MissingTensor(_) => "missing_tensor",
            LoadError::Shape { .. } => "tensor_shape",
        }
    }
}

/// Longest context the RoPE tables are built for, whatever the file claims: bounds the
/// tables' memory for models that advertise huge contexts.
pub const MAX_CONTEXT: usize = 32_768;

struct Loader<'a, B: Backend> {
    gguf: &'a GgufFile,
    device: &'a B::Device,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl<B: Backend> Loader<'_, B> {
    /// Dequantizes `name` after checking its dims (GGUF order).
    fn read(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>, LoadError> {
        let info = self
            .gguf
            .tensor(name)
            .ok_or_else(|| LoadError::MissingTensor(name.to_owned()))?;
        let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if info.dims != expected {
            return Err(LoadError::Shape {
                name: name.to_owned(),
                expected,
                found: info.dims.clone(),
            });
        }
        let values = self.gguf.dequantize(name)?;
        self.done += 1;
        (self.progress)(self.done, self.total);
        Ok(values)
    }

    fn norm(&mut self, name: &str, hidden: usize, eps: f32) -> Result<RmsNorm<B>, LoadError> {
        let w = self.read(name, &[hidden])?;
        Ok(RmsNorm {
            weight: Tensor::from_data(TensorData::new(w, [1, hidden]), self.device),
            eps,
        })
    }
}

/// Reorders the rows of a GGUF `attn_q`/`attn_k` matrix back to the Hugging Face order.
///
/// llama.cpp's converter permutes each head's rows so that its RoPE rotates adjacent
/// pairs: GGUF row `2i + j` of a head is row `j·(d/2) + i` of the original. Undoing it
/// lets the forward pass rotate the halves `(x[i], x[i + d/2])`.
pub fn unpermute_rope_rows(values: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * head_dim + 2 * i + j) * cols;
                let dst = (h * head_dim + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&values[src..src + cols]);
            }
        }
    }
    out
}

/// Builds the model, dequantizing each tensor to `dtype` on `device`.
///
/// `progress(done, total)` is called after each tensor.
pub fn load_llama<B: Backend>(
    gguf: &GgufFile,
    dtype: WeightDtype,
    device: &B::Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Llama<B>, LoadError> {
    let arch = gguf.get_str("general.architecture")?;
    if arch != "llama" {
        return Err(LoadError::UnsupportedArchitecture(arch.to_owned()));
    }
    let config = LlamaConfig::from_gguf(gguf)?;
    config.validate().map_err(LoadError::Config)?;
    let tied = gguf.tensor("output.weight").is_none();
    let total = 2 + config.n_layers * 9 + usize::from(!tied);
    let mut l = Loader::<B> {
        gguf,
        device,
        done: 0,
        total,
        progress,
    };
    let (hd, d, kvd, ffn, vocab) = (
        config.hidden,
        config.head_dim,
        config.kv_dim(),
        config.ffn,
        config.vocab,
    );
    let qd = config.n_heads * d;

    let embed_values = l.read("token_embd.weight", &[hd, vocab])?;
    let embed = weight_tensor::<B>(embed_values, vocab, hd, dtype, device);
    let lm_head = if tied {
        // Tied embeddings: the output projection is the embedding matrix itself.
        Linear::from_rows(embed.clone(), dtype)
    } else {
        let w = l.read("output.weight", &[hd, vocab])?;
        Linear::new(w, vocab, hd, dtype, device)
    };

    let mut blocks = Vec::with_capacity(config.n_layers);
    for n in 0..config.n_layers {
        let name = |t: &str| format!("blk.{n}.{t}.weight");
        let attn_norm = l.norm(&name("attn_norm"), hd, config.rms_eps)?;
        let q = l.read(&name("attn_q"), &[hd, qd])?;
        let k = l.read(&name("attn_k"), &[hd, kvd])?;
        let v = l.read(&name("attn_v"), &[hd, kvd])?;
        let mut qkv = unpermute_rope_rows(&q, config.n_heads, d, hd);
        drop(q);
        qkv.extend_from_slice(&unpermute_rope_rows(&k, config.n_kv_heads, d, hd));
        drop(k);
        qkv.extend_from_slice(&v);
        drop(v);
        let qkv = Linear::new(qkv, qd + 2 * kvd, hd, dtype, device);
        let out = Linear::new(l.read(&name("attn_output"), &[qd, hd])?, hd, qd, dtype, device);
        let ffn_norm = l.norm(&name("ffn_norm"), hd, config.rms_eps)?;
        let mut gate_up = l.read(&name("ffn_gate"), &[hd, ffn])?;
        gate_up.extend_from_slice(&l.read(&name("ffn_up"), &[hd, ffn])?);
        let gate_up = Linear::new(gate_up, 2 * ffn, hd, dtype, device);
        let down = Linear::new(l.read(&name("ffn_down"), &[ffn, hd])?, hd, ffn, dtype, device);
        blocks.push(Block {
            attn_norm,
            attn: Attention {
                qkv,
                out,
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: d,
            },
            ffn_norm,
            mlp: Mlp { gate_up, down, ffn },
        });
    }
    let norm = l.norm("output_norm.weight", hd, config.rms_eps)?;
    let positions = config.context_length.min(MAX_CONTEXT);
    let rope = Rope::new(d, positions, config.rope_theta, device);
    Ok(Llama {
        config,
        embed,
        lm_head,
        blocks,
        norm,
        rope,
        device: device.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_restores_halves() {
        // One head of dim 4, one column: HF rows [a0, a1, b0, b1] are stored by the
        // converter as [a0, b0, a1, b1].
        let gguf = [10.0, 20.0, 11.0, 21.0];
        assert_eq!(unpermute_rope_rows(&gguf, 1, 4, 1), vec![10.0, 11.0, 20.0, 21.0]);
    }

    #[test]
    fn unpermute_keeps_columns_and_heads_apart() {
        // Two heads of dim 2 with two columns: a head of dim 2 has one pair and is
        // unchanged.
        let v: Vec<f32> = (0..8).map(|x| x as f32).collect();
        assert_eq!(unpermute_rope_rows(&v, 2, 2, 2), v);
    }
}
