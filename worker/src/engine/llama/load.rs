//! Builds a [`Llama`] from a GGUF file.
//!
//! GGUF tensor names (llama.cpp's): `token_embd.weight`, `output_norm.weight`, optional
//! `output.weight`, and per block `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
//! ffn_norm, ffn_gate, ffn_up, ffn_down}.weight`. GGUF lists dimensions fastest-first, so
//! a matrix with dims `[in, out]` is `out` rows of `in` values: exactly the `[out, in]`
//! layout of a PyTorch linear weight.

pub use super::linear::WeightDtype;
use super::{
    attention::{Attention, Bias},
    config::LlamaConfig,
    host::{HostBlock, HostLlama, HostWeights},
    linear::{weight_tensor, DeviceBlocks, Linear},
    mlp::Mlp,
    model::{Block, BurnLlama, Llama, Net, RmsNorm},
    preflight::{expected_tensors, preflight, Plan},
    rope::{Rope, RopeSpec, RopeTables},
};
use crate::engine::cpu::qmatrix::QMatrix;
use crate::engine::gguf::{GgufError, GgufFile, TensorInfo};
use burn_tensor::{backend::Backend, Tensor};
use std::sync::Arc;

/// Why a model could not be built from a file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file itself is unreadable or malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The file describes another architecture.
    #[error(
        "unsupported architecture general.architecture = {0:?} (supported: llama, qwen2, qwen3, gemma3, phi3)"
    )]
    UnsupportedArchitecture(String),
    /// A metadata key whose arithmetic the forward pass does not implement.
    #[error("unsupported model setting {key} = {value}: {why}")]
    UnsupportedKey {
        /// The metadata key.
        key: String,
        /// Its value, as the error shows it.
        value: String,
        /// What is missing.
        why: String,
    },
    /// A tensor the forward pass would not use: running without it would be wrong.
    #[error("tensor {name:?} is not part of the {arch} forward pass this worker runs")]
    UnusedTensor {
        /// Tensor name.
        name: String,
        /// The file's architecture.
        arch: String,
    },
    /// A tensor stored in a type that cannot be read.
    #[error("tensor {name:?} is stored as {ty}, which this worker cannot read")]
    UnsupportedType {
        /// Tensor name.
        name: String,
        /// The ggml type's name.
        ty: String,
    },
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
            LoadError::UnsupportedKey { .. } => "unsupported_key",
            LoadError::UnusedTensor { .. } => "unused_tensor",
            LoadError::UnsupportedType { .. } => "unsupported_type",
            LoadError::Config(_) => "invalid_config",
            LoadError::MissingTensor(_) => "missing_tensor",
            LoadError::Shape { .. } => "tensor_shape",
        }
    }
}

/// Longest context the RoPE tables are built for, whatever the file claims: bounds the
/// tables' memory for models that advertise huge contexts.
pub const MAX_CONTEXT: usize = 32_768;

/// A weight matrix between reading and placing: dense values (the device engine's
/// formats) or GGUF blocks (the host engine's).
enum Matrix {
    Dense(Vec<f32>),
    Quant(QMatrix),
    /// Q8_0 or Q4_0 blocks for the device engine ([`DeviceBlocks`]).
    Device(DeviceBlocks),
}

impl Matrix {
    /// The values, row-major (blocks only come from native formats, which the host
    /// engine takes; they are dequantized here for completeness).
    fn into_dense(self) -> Vec<f32> {
        match self {
            Matrix::Dense(v) => v,
            Matrix::Quant(q) => (0..q.rows()).flat_map(|r| q.row(r)).collect(),
            Matrix::Device(b) => b.into_dense(),
        }
    }

    /// The device engine's product of `out × inp` weights: blocks where they were
    /// kept, else a tensor in `dtype`.
    fn into_linear<B: Backend>(
        self,
        out: usize,
        inp: usize,
        dtype: WeightDtype,
        device: &B::Device,
    ) -> Linear<B> {
        match self {
            Matrix::Device(b) => Linear::from_rows(b.into_tensor::<B>(device), dtype),
            m => Linear::new(m.into_dense(), out, inp, dtype, device),
        }
    }

    /// The blocks for the host engine, with the inputs `dtype` asks for (integer for
    /// generated rows, 8-bit for prompts); native formats always read as blocks; dense
    /// rows of `cols` values, which they never are, would become 8-bit blocks.
    fn into_quant(self, cols: usize, dtype: WeightDtype) -> Arc<QMatrix> {
        let q = match self {
            Matrix::Quant(q) => q,
            m => {
                let v = m.into_dense();
                QMatrix::quantize_q8(&v, v.len() / cols, cols).expect("width checked when read")
            }
        };
        Arc::new(
            q.with_int_inputs(dtype.int_inputs())
                .with_byte_prompts(dtype.byte_prompts()),
        )
    }
}

/// One block's weights between reading and placing.
struct BlockParts {
    attn_norm: Vec<f32>,
    qkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    out: Matrix,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate_up: Matrix,
    down: Matrix,
    post_ffn_norm: Option<Vec<f32>>,
}

struct Loader<'a> {
    gguf: &'a GgufFile,
    dtype: WeightDtype,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
    /// Whether the device engine keeps Q8_0 and Q4_0 matrices in their blocks.
    device_blocks: bool,
}

impl Loader<'_> {
    /// The tensor `name` after checking its dims (GGUF order).
    fn info(&self, name: &str, dims: &[usize]) -> Result<&TensorInfo, LoadError> {
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
        Ok(info)
    }

    fn tick(&mut self) {
        self.done += 1;
        (self.progress)(self.done, self.total);
    }

    /// Dequantizes `name` after checking its dims.
    fn read(&mut self, name: &str, dims: &[usize]) -> Result<Vec<f32>, LoadError> {
        let info = self.info(name, dims)?;
        let values = self.gguf.dequantize_tensor(info)?;
        self.tick();
        Ok(values)
    }

    /// Reads the `out × inp` matrix `name` (GGUF dims `[inp, out]`) in the weight format.
    fn matrix(&mut self, name: &str, inp: usize, out: usize) -> Result<Matrix, LoadError> {
        if !self.dtype.is_native() {
            let info = self.info(name, &[inp, out])?;
            if self.device_blocks && DeviceBlocks::supports(info.ggml_type) {
                let bytes = self.gguf.tensor_bytes(info);
                let b =
                    DeviceBlocks::from_gguf(info.ggml_type, out, inp, bytes).ok_or_else(|| {
                        LoadError::Config(format!("tensor {name:?}: its blocks do not fill it"))
                    })?;
                self.tick();
                return Ok(Matrix::Device(b));
            }
            return Ok(Matrix::Dense(self.read(name, &[inp, out])?));
        }
        let info = self.info(name, &[inp, out])?;
        let q = if QMatrix::supports(info.ggml_type) {
            QMatrix::from_gguf(info.ggml_type, out, inp, self.gguf.tensor_bytes(info))
        } else {
            // No kernel for this type: convert to 8-bit blocks.
            QMatrix::quantize_q8(&self.gguf.dequantize_tensor(info)?, out, inp)
        };
        let q = q
            .ok_or_else(|| {
                LoadError::Config(format!(
                    "tensor {name:?}: rows of {inp} values cannot be kept in 32-value blocks"
                ))
            })?
            .with_int_inputs(self.dtype.int_inputs())
            .with_byte_prompts(self.dtype.byte_prompts());
        self.tick();
        Ok(Matrix::Quant(q))
    }

    /// The scale of a norm over `width` values.
    fn norm(&mut self, name: &str, width: usize) -> Result<Vec<f32>, LoadError> {
        self.read(name, &[width])
    }

    /// Reads block `n`'s weights.
    fn block(&mut self, plan: &Plan, n: usize) -> Result<BlockParts, LoadError> {
        let config = &plan.config;
        let (hd, d, kvd, ffn) = (config.hidden, config.head_dim, config.kv_dim(), config.ffn);
        let qd = config.n_heads * d;
        let permuted = config.arch.rope_rows_permuted();
        let name = |t: &str| format!("blk.{n}.{t}.weight");
        let bias = |t: &str| format!("blk.{n}.{t}.bias");
        let attn_norm = self.norm(&name("attn_norm"), hd)?;
        let qkv = if config.arch.fused() {
            self.matrix(&name("attn_qkv"), hd, qd + 2 * kvd)?
        } else {
            let mut q = self.matrix(&name("attn_q"), hd, qd)?;
            let mut k = self.matrix(&name("attn_k"), hd, kvd)?;
            if permuted {
                q = unpermute(q, config.n_heads, d, hd);
                k = unpermute(k, config.n_kv_heads, d, hd);
            }
            let v = self.matrix(&name("attn_v"), hd, kvd)?;
            stack(vec![q, k, v], hd)
        };
        let qkv_bias = if plan.qkv_bias {
            let (mut bq, mut bk) = (
                self.read(&bias("attn_q"), &[qd])?,
                self.read(&bias("attn_k"), &[kvd])?,
            );
            if permuted {
                bq = unpermute_rope_rows(&bq, config.n_heads, d, 1);
                bk = unpermute_rope_rows(&bk, config.n_kv_heads, d, 1);
            }
            let mut all = bq;
            all.extend(bk);
            all.extend(self.read(&bias("attn_v"), &[kvd])?);
            Some(all)
        } else {
            None
        };
        let (q_norm, k_norm) = if plan.qk_norm {
            // Norms of whole heads, before RoPE. The converter leaves them in the Hugging
            // Face order, which is the order of the rows after `unpermute`.
            (
                Some(self.norm(&name("attn_q_norm"), d)?),
                Some(self.norm(&name("attn_k_norm"), d)?),
            )
        } else {
            (None, None)
        };
        let out = self.matrix(&name("attn_output"), qd, hd)?;
        let post_attn_norm = if plan.post_norms {
            Some(self.norm(&name("post_attention_norm"), hd)?)
        } else {
            None
        };
        let ffn_norm = self.norm(&name("ffn_norm"), hd)?;
        let gate_up = if config.arch.fused() {
            self.matrix(&name("ffn_up"), hd, 2 * ffn)?
        } else {
            let gate = self.matrix(&name("ffn_gate"), hd, ffn)?;
            let up = self.matrix(&name("ffn_up"), hd, ffn)?;
            stack(vec![gate, up], hd)
        };
        let down = self.matrix(&name("ffn_down"), ffn, hd)?;
        let post_ffn_norm = if plan.post_norms {
            Some(self.norm(&name("post_ffw_norm"), hd)?)
        } else {
            None
        };
        Ok(BlockParts {
            attn_norm,
            qkv,
            qkv_bias,
            q_norm,
            k_norm,
            out,
            post_attn_norm,
            ffn_norm,
            gate_up,
            down,
            post_ffn_norm,
        })
    }
}

impl BlockParts {
    /// The host engine's block: blocks and host vectors.
    fn host(self, config: &LlamaConfig, dtype: WeightDtype) -> HostBlock {
        let (hd, qd, ffn) = (config.hidden, config.n_heads * config.head_dim, config.ffn);
        HostBlock {
            attn_norm: self.attn_norm,
            qkv: self.qkv.into_quant(hd, dtype),
            qkv_bias: self.qkv_bias,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
            post_attn_norm: self.post_attn_norm,
            post_ffn_norm: self.post_ffn_norm,
            out: self.out.into_quant(qd, dtype),
            ffn_norm: self.ffn_norm,
            gate_up: self.gate_up.into_quant(hd, dtype),
            down: self.down.into_quant(ffn, dtype),
        }
    }

    /// The device engine's block: tensors in `dtype` on `device`.
    fn device<B: Backend>(
        self,
        config: &LlamaConfig,
        dtype: WeightDtype,
        device: &B::Device,
    ) -> Block<B> {
        let (hd, d, kvd, ffn) = (config.hidden, config.head_dim, config.kv_dim(), config.ffn);
        let qd = config.n_heads * d;
        let norm = |w: Vec<f32>| RmsNorm::new(w, config.rms_eps, device);
        let linear =
            |m: Matrix, out: usize, inp: usize| m.into_linear::<B>(out, inp, dtype, device);
        Block {
            attn_norm: norm(self.attn_norm),
            attn: Attention {
                qkv: linear(self.qkv, qd + 2 * kvd, hd),
                qkv_bias: self.qkv_bias.map(|b| Bias::new(b, device)),
                q_norm: self.q_norm.map(norm),
                k_norm: self.k_norm.map(norm),
                out: linear(self.out, hd, qd),
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: d,
            },
            post_attn_norm: self.post_attn_norm.map(norm),
            ffn_norm: norm(self.ffn_norm),
            mlp: Mlp {
                gate_up: linear(self.gate_up, 2 * ffn, hd),
                down: linear(self.down, hd, ffn),
                ffn,
                activation: config.activation,
            },
            post_ffn_norm: self.post_ffn_norm.map(norm),
        }
    }
}

/// Row order that undoes llama.cpp's RoPE permutation (see [`unpermute_rope_rows`]):
/// row `i` of the result is row `order[i]` of the file.
fn rope_row_order(heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut order = vec![0; heads * head_dim];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                order[h * head_dim + j * half + i] = h * head_dim + 2 * i + j;
            }
        }
    }
    order
}

fn unpermute(m: Matrix, heads: usize, head_dim: usize, cols: usize) -> Matrix {
    match m {
        Matrix::Dense(v) => Matrix::Dense(unpermute_rope_rows(&v, heads, head_dim, cols)),
        Matrix::Quant(q) => Matrix::Quant(q.select_rows(&rope_row_order(heads, head_dim))),
        Matrix::Device(b) => Matrix::Device(b.select_rows(&rope_row_order(heads, head_dim))),
    }
}

/// Stacks matrices of equal width: one product instead of several.
fn stack(parts: Vec<Matrix>, cols: usize) -> Matrix {
    if parts.iter().all(|p| matches!(p, Matrix::Device(_))) {
        let blocks = parts
            .into_iter()
            .filter_map(|p| match p {
                Matrix::Device(b) => Some(b),
                _ => None,
            })
            .collect();
        // Parts of one type stay blocks; mixed ones (Q4_0 beside Q8_0) go dense.
        return match DeviceBlocks::concat_rows(blocks) {
            Ok(b) => Matrix::Device(b),
            Err(parts) => Matrix::Dense(parts.into_iter().flat_map(|b| b.into_dense()).collect()),
        };
    }
    let parts: Vec<Matrix> = if parts.iter().any(|p| matches!(p, Matrix::Quant(_))) {
        parts
    } else {
        // The device engine's blocks beside dense parts: all dense.
        parts
            .into_iter()
            .map(|p| Matrix::Dense(p.into_dense()))
            .collect()
    };
    if parts.iter().all(|p| matches!(p, Matrix::Dense(_))) {
        let mut all = Vec::new();
        for p in parts {
            if let Matrix::Dense(v) = p {
                all.extend_from_slice(&v);
            }
        }
        return Matrix::Dense(all);
    }
    let quants: Vec<QMatrix> = parts
        .into_iter()
        .map(|p| match p {
            Matrix::Quant(q) => q,
            m => {
                let v = m.into_dense();
                let rows = v.len() / cols;
                QMatrix::quantize_q8(&v, rows, cols).expect("width checked when read")
            }
        })
        .collect();
    // Each part keeps its own blocks (runs of different formats side by side).
    Matrix::Quant(QMatrix::concat_rows(quants).expect("parts of one width"))
}

/// Reorders the rows of a GGUF `attn_q`/`attn_k` matrix back to the Hugging Face order.
///
/// llama.cpp's converter permutes each head's rows so that its RoPE rotates adjacent
/// pairs: GGUF row `2i + j` of a head is row `j·(d/2) + i` of the original. Undoing it
/// lets the forward pass rotate the halves `(x[i], x[i + d/2])`.
pub fn unpermute_rope_rows(values: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(values.len());
    for src in rope_row_order(heads, head_dim) {
        out.extend_from_slice(&values[src * cols..(src + 1) * cols]);
    }
    out
}

/// Builds the model, keeping weights in `dtype` on `device`, after [`preflight`] has
/// checked everything the forward pass asks of the file.
///
/// `progress(done, total)` is called after each tensor.
pub fn load_llama<B: Backend>(
    gguf: &GgufFile,
    dtype: WeightDtype,
    device: &B::Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Llama<B>, LoadError> {
    load_planned(gguf, &preflight(gguf)?, dtype, device, progress)
}

/// [`load_llama`] for a file whose [`Plan`] [`preflight`] has already made.
pub fn load_planned<B: Backend>(
    gguf: &GgufFile,
    plan: &Plan,
    dtype: WeightDtype,
    device: &B::Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Llama<B>, LoadError> {
    let config = plan.config.clone();
    let total = expected_tensors(plan).len();
    let mut l = Loader {
        gguf,
        dtype,
        // burn's block-32 products on cubecl's backends dequantize the blocks in the
        // kernel; flex's quantizes the inputs to 8 bits too, so it takes f16 tensors.
        device_blocks: dtype == WeightDtype::F16 && B::name(device).contains("cubecl<"),
        done: 0,
        total,
        progress,
    };
    let (hd, d, vocab) = (config.hidden, config.head_dim, config.vocab);

    // Each part goes to its engine's form as soon as it is read, so the dense values of
    // one matrix at a time are held on the host.
    let embed = l.matrix("token_embd.weight", hd, vocab)?;
    let head = match plan.tied {
        // Tied embeddings: the output projection is the embedding matrix itself.
        true => None,
        false => Some(l.matrix("output.weight", hd, vocab)?),
    };
    let mut placed = if dtype.is_native() {
        let embed = embed.into_quant(hd, dtype);
        Placed::Host {
            lm_head: head.map_or_else(|| embed.clone(), |m| m.into_quant(hd, dtype)),
            embed,
            blocks: Vec::with_capacity(config.n_layers),
        }
    } else {
        let table = weight_tensor::<B>(embed.into_dense(), vocab, hd, dtype, device);
        Placed::Device {
            lm_head: match head {
                None => Linear::from_rows(table.clone(), dtype),
                Some(m) => m.into_linear::<B>(vocab, hd, dtype, device),
            },
            embed: table,
            blocks: Vec::with_capacity(config.n_layers),
        }
    };
    for n in 0..config.n_layers {
        let parts = l.block(plan, n)?;
        match &mut placed {
            Placed::Host { blocks, .. } => blocks.push(parts.host(&config, dtype)),
            Placed::Device { blocks, .. } => blocks.push(parts.device(&config, dtype, device)),
        }
    }
    let norm = l.norm("output_norm.weight", hd)?;
    let rope_dims = config.rope_dims;
    let freqs = if plan.rope_freqs {
        Some(l.read("rope_freqs.weight", &[rope_dims / 2])?)
    } else if plan.long_rope {
        let name = if config.long_rope_factors() {
            "rope_factors_long.weight"
        } else {
            "rope_factors_short.weight"
        };
        Some(l.read(name, &[rope_dims / 2])?)
    } else {
        None
    };
    let positions = config.served_context();
    let rope = RopeTables::new(
        RopeSpec {
            head_dim: d,
            dims: rope_dims,
            base: config.rope_theta,
            scale: config.rope_scale,
            freq_factors: freqs.as_deref(),
            mscale: config.rope_attn_factor,
        },
        positions,
    );
    // Sliding-window layers with a base of their own rotate with it, never scaled.
    let rope_local = config
        .sliding
        .and_then(|s| s.rope_theta)
        .map(|theta| RopeTables::new(RopeSpec::plain(d, theta), positions));
    let net = match placed {
        Placed::Host {
            embed,
            lm_head,
            blocks,
        } => Net::Host(HostLlama {
            weights: HostWeights {
                embed,
                lm_head,
                blocks,
                norm,
            },
            config,
            rope,
            rope_local,
        }),
        Placed::Device {
            embed,
            lm_head,
            blocks,
        } => Net::Device(BurnLlama {
            norm: RmsNorm::new(norm, config.rms_eps, device),
            config,
            embed,
            lm_head,
            blocks,
            rope: Rope::new(rope, device),
            rope_local: rope_local.map(|t| Rope::new(t, device)),
            device: device.clone(),
            heads: false,
        }),
    };
    Ok(Llama {
        net,
        device: device.clone(),
        kv_dtype: Default::default(),
    })
}

/// The weights read so far, in the form of the engine that will run them.
enum Placed<B: Backend> {
    Host {
        embed: Arc<QMatrix>,
        lm_head: Arc<QMatrix>,
        blocks: Vec<HostBlock>,
    },
    Device {
        embed: Tensor<B, 2>,
        lm_head: Linear<B>,
        blocks: Vec<Block<B>>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_restores_halves() {
        // One head of dim 4, one column: HF rows [a0, a1, b0, b1] are stored by the
        // converter as [a0, b0, a1, b1].
        let gguf = [10.0, 20.0, 11.0, 21.0];
        assert_eq!(
            unpermute_rope_rows(&gguf, 1, 4, 1),
            vec![10.0, 11.0, 20.0, 21.0]
        );
    }

    #[test]
    fn unpermute_keeps_columns_and_heads_apart() {
        // Two heads of dim 2 with two columns: a head of dim 2 has one pair and is
        // unchanged.
        let v: Vec<f32> = (0..8).map(|x| x as f32).collect();
        assert_eq!(unpermute_rope_rows(&v, 2, 2, 2), v);
    }
}
