//! Llama hyper-parameters, read from a GGUF file's `llama.*` metadata.

use crate::engine::gguf::{GgufError, GgufFile};

/// The shape of a Llama-family network.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
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
}

impl LlamaConfig {
    /// Reads the configuration of a `general.architecture = "llama"` GGUF file.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, GgufError> {
        let arch = gguf.get_str("general.architecture")?.to_owned();
        let key = |k: &str| format!("{arch}.{k}");
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
        let head_dim = hidden.checked_div(n_heads).unwrap_or(0);
        Ok(Self {
            n_layers: get("block_count")?,
            hidden,
            ffn: get("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_length: get("context_length")?,
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
        if !self.hidden.is_multiple_of(self.n_heads) {
            return Err(format!(
                "embedding_length {} is not a multiple of head_count {}",
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
        Ok(())
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
