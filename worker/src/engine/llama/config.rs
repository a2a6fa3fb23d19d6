//! Hyper-parameters of a Llama-family network, read from a GGUF file's `<arch>.*` metadata.

use crate::engine::gguf::{GgufError, GgufFile};

/// The `general.architecture` values this worker runs. They share one forward pass and
/// differ in what the file holds (biases, per-head norms) and in the RoPE layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `llama`: Llama 1–3, Mistral, SmolLM2 and the many models converted as Llama.
    Llama,
    /// `qwen2`: Qwen2 and Qwen2.5, with Q/K/V biases.
    Qwen2,
    /// `qwen3`: Qwen3 dense, with a per-head RMSNorm on queries and keys.
    Qwen3,
    /// `gemma3`: Gemma 3 (text), with GeGLU, embeddings scaled by √hidden, norms after
    /// attention and after the feed-forward block, Q/K norms, and sliding-window layers
    /// with their own RoPE base.
    Gemma3,
    /// `phi3`: Phi-3, Phi-3.5 and Phi-4-mini, with fused Q/K/V and gate/up matrices, a
    /// sliding window on every layer (when the file gives one), partial rotary
    /// embeddings and LongRoPE.
    Phi3,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: [Arch; 5] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Phi3,
    ];

    /// The architecture named `name` in `general.architecture`.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.gguf_name() == name)
    }

    /// The `general.architecture` value, also the prefix of the file's model keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Phi3 => "phi3",
        }
    }

    /// Whether llama.cpp's converter permuted the rows of `attn_q` / `attn_k` so that
    /// RoPE rotates adjacent pairs (llama.cpp's "normal" RoPE): only for `llama`. The
    /// others keep the Hugging Face order and rotate halves ("neox" RoPE), which is the
    /// order this forward pass uses.
    pub fn rope_rows_permuted(self) -> bool {
        matches!(self, Arch::Llama)
    }

    /// Whether the file fuses Q/K/V into `attn_qkv` and gate/up into `ffn_up` (Phi-3).
    pub fn fused(self) -> bool {
        matches!(self, Arch::Phi3)
    }
}

/// The feed-forward block's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) · up` (SwiGLU): Llama, Qwen.
    Silu,
    /// `gelu_tanh(gate) · up` (GeGLU with GELU's tanh approximation): Gemma.
    GeluTanh,
}

/// Sliding-window attention on some layers (Gemma 3: five local layers, then a global one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// A local layer's query sees itself and the `window − 1` positions before it.
    pub window: usize,
    /// Layers `l` with `l % pattern < pattern − 1` are local, the others global.
    pub pattern: usize,
    /// RoPE base of the local layers when they rotate with one of their own, unscaled
    /// (Gemma 3); `None`: as the global layers (Phi-3).
    pub rope_theta: Option<f32>,
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.gguf_name())
    }
}

/// The shape of a Llama-family network.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which member of the family (`general.architecture`).
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub ffn: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Longest sequence the model was trained for.
    pub context_length: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Positions are multiplied by this before rotation: `1 / rope.scaling.factor` for
    /// linear RoPE scaling, else 1. Local (sliding-window) layers are never scaled.
    pub rope_scale: f32,
    /// Dimensions of each head that rotate (`rope.dimension_count`): the head size,
    /// or fewer with partial rotary embeddings (Phi-3.5, Phi-4).
    pub rope_dims: usize,
    /// Cosines and sines are multiplied by this (`rope.scaling.attn_factor`: LongRoPE's
    /// `√(1 + ln s / ln original)` for a context stretched `s` times), else 1.
    pub rope_attn_factor: f32,
    /// The context the model was trained with before its RoPE was stretched
    /// (`rope.scaling.original_context_length`, else `context_length`): a LongRoPE
    /// model serving more than this rotates with its long factors, else its short ones.
    pub rope_original_context: usize,
    /// The feed-forward gate's activation.
    pub activation: Activation,
    /// The token embedding is multiplied by this (Gemma: √hidden), else 1.
    pub embed_scale: f32,
    /// Attention scores are `q·k` times this: `1/√head_dim`, except where a model says
    /// otherwise.
    pub attn_scale: f32,
    /// The local layers, when the model has any.
    pub sliding: Option<SlidingWindow>,
}

impl LlamaConfig {
    /// Reads the configuration of a GGUF file of architecture `arch`. Only the keys it
    /// reads are checked here; [`super::preflight`] refuses the ones it does not know.
    pub fn from_gguf(gguf: &GgufFile, arch: Arch) -> Result<Self, GgufError> {
        let arch_name = arch.gguf_name();
        let key = |k: &str| format!("{arch_name}.{k}");
        let get = |k: &str| -> Result<usize, GgufError> {
            let v = gguf.get_u64(&key(k))?;
            usize::try_from(v).map_err(|_| GgufError::WrongType {
                key: key(k),
                expected: "an integer that fits in usize",
            })
        };
        let n_heads = get("attention.head_count")?;
        let hidden = get("embedding_length")?;
        let n_kv_heads = match gguf.get(&key("attention.head_count_kv")) {
            Some(_) => get("attention.head_count_kv")?,
            None => n_heads,
        };
        let vocab = match gguf.get(&key("vocab_size")) {
            Some(_) => get("vocab_size")?,
            None => gguf.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_theta = match gguf.get(&key("rope.freq_base")) {
            Some(_) => gguf.get_f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        // Qwen3 and Mistral Nemo have heads that are not hidden / heads wide: the file
        // says so in `attention.key_length`.
        let head_dim = match gguf.get(&key("attention.key_length")) {
            Some(_) => get("attention.key_length")?,
            None => hidden.checked_div(n_heads).unwrap_or(0),
        };
        let rope_scale = match gguf.get(&key("rope.scaling.type")) {
            Some(_) if gguf.get_str(&key("rope.scaling.type"))? == "linear" => {
                (1.0 / gguf.get_f64(&key("rope.scaling.factor"))?) as f32
            }
            _ => 1.0,
        };
        let gemma = arch == Arch::Gemma3;
        let sliding = match gguf.get(&key("attention.sliding_window")) {
            // Phi-3's window covers every layer, which rotate alike (as transformers runs
            // it; llama.cpp leaves Phi's window off).
            Some(_) if arch == Arch::Phi3 && get("attention.sliding_window")? > 0 => {
                Some(SlidingWindow {
                    window: get("attention.sliding_window")?,
                    pattern: 0,
                    rope_theta: None,
                })
            }
            Some(_) if gemma && get("attention.sliding_window")? > 0 => Some(SlidingWindow {
                window: get("attention.sliding_window")?,
                pattern: match gguf.get(&key("attention.sliding_window_pattern")) {
                    Some(_) => get("attention.sliding_window_pattern")?,
                    // Gemma 3's: five local layers, then a global one.
                    None => 6,
                },
                rope_theta: Some(match gguf.get(&key("rope.freq_base_swa")) {
                    Some(_) => gguf.get_f64(&key("rope.freq_base_swa"))? as f32,
                    None => 10_000.0,
                }),
            }),
            _ => None,
        };
        let n_layers = get("block_count")?;
        let context_length = get("context_length")?;
        let rope_dims = match gguf.get(&key("rope.dimension_count")) {
            Some(_) => get("rope.dimension_count")?,
            None => head_dim,
        };
        let rope_attn_factor = match gguf.get(&key("rope.scaling.attn_factor")) {
            Some(_) => gguf.get_f64(&key("rope.scaling.attn_factor"))? as f32,
            None => 1.0,
        };
        let rope_original_context = match gguf.get(&key("rope.scaling.original_context_length")) {
            Some(_) => get("rope.scaling.original_context_length")?,
            None => context_length,
        };
        // Gemma 3 27B scales queries by hidden / heads instead of the head size (llama.cpp
        // and gemma_pytorch tell it by its 62 layers; the file has no key for it).
        let scale_dim = if gemma && n_layers == 62 {
            hidden.checked_div(n_heads).unwrap_or(0)
        } else {
            head_dim
        };
        Ok(Self {
            arch,
            rope_scale,
            rope_dims,
            rope_attn_factor,
            rope_original_context,
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            attn_scale: 1.0 / (scale_dim as f32).sqrt(),
            sliding,
            n_layers,
            hidden,
            ffn: get("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_length,
            rope_theta,
            rms_eps: gguf.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
        })
    }

    /// Checks the relations between the numbers that the forward pass relies on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_count", self.n_layers),
            ("embedding_length", self.hidden),
            ("feed_forward_length", self.ffn),
            ("attention.head_count", self.n_heads),
            ("attention.head_count_kv", self.n_kv_heads),
            ("vocab_size", self.vocab),
            ("context_length", self.context_length),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} is 0"));
            }
        }
        if self.head_dim == 0 {
            return Err(format!(
                "the head size is 0 (embedding_length {} over head_count {}, or \
                 attention.key_length)",
                self.hidden, self.n_heads
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head dimension {} is odd", self.head_dim));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(format!("rms epsilon {} is not positive", self.rms_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!("rope base {} is not positive", self.rope_theta));
        }
        if let Some(theta) = self.sliding.and_then(|s| s.rope_theta) {
            if !(theta.is_finite() && theta > 0.0) {
                return Err(format!("rope.freq_base_swa {theta} is not positive"));
            }
        }
        if !(self.rope_scale.is_finite() && self.rope_scale > 0.0) {
            return Err(format!(
                "rope.scaling.factor {} is not positive",
                1.0 / self.rope_scale
            ));
        }
        if self.rope_dims == 0
            || !self.rope_dims.is_multiple_of(2)
            || self.rope_dims > self.head_dim
        {
            return Err(format!(
                "rope.dimension_count {} is not an even count of at most the head size {}",
                self.rope_dims, self.head_dim
            ));
        }
        if !(self.rope_attn_factor.is_finite() && self.rope_attn_factor > 0.0) {
            return Err(format!(
                "rope.scaling.attn_factor {} is not positive",
                self.rope_attn_factor
            ));
        }
        Ok(())
    }

    /// Longest sequence (prompt and output) the engine runs: the model's context, at
    /// most [`super::load::MAX_CONTEXT`].
    pub fn served_context(&self) -> usize {
        self.context_length.min(super::load::MAX_CONTEXT)
    }

    /// Whether a LongRoPE model rotates with its long factors: when the context served
    /// is longer than the one it was trained with before stretching (llama.cpp's rule,
    /// for the whole of a sequence, so that cached keys never mix the two).
    pub fn long_rope_factors(&self) -> bool {
        self.served_context() > self.rope_original_context
    }

    /// Whether layer `layer` attends over a sliding window.
    pub fn is_local(&self, layer: usize) -> bool {
        self.sliding
            .is_some_and(|s| s.pattern == 0 || layer % s.pattern < s.pattern - 1)
    }

    /// The rotations layer `layer` takes of an engine's two (`local`: those of
    /// sliding-window layers, when they have a base of their own), and its window when
    /// it is a sliding-window layer.
    pub(crate) fn layer_rope<'r, R>(
        &self,
        layer: usize,
        global: &'r R,
        local: &'r Option<R>,
    ) -> (&'r R, Option<usize>) {
        match self.sliding {
            Some(s) if self.is_local(layer) => (local.as_ref().unwrap_or(global), Some(s.window)),
            _ => (global, None),
        }
    }

    /// Query heads that share one key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Width of the key (and value) projection.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
