//! What a GGUF file asks of the forward pass, checked before any weight is read.
//!
//! The preflight reads only the metadata and the tensor table (both already parsed when
//! the file is opened), so it answers in milliseconds whatever the file's size. It
//! refuses, with one error that names the key or tensor:
//! - an architecture other than those of [`Arch`];
//! - any `<arch>.*` metadata key the forward pass does not implement, with its value
//!   (sliding windows outside gemma3 and phi3, soft-caps, experts, RoPE scaling other
//!   than linear, llama3 and Phi-3's LongRoPE, partial rotary outside phi3, …): a key
//!   that changes the arithmetic and were ignored would run the model silently wrong,
//!   so keys are known or refused, never skipped;
//! - a tensor the forward pass would not use (`blk.0.attn_post_norm.weight`, an
//!   `attn_output.bias`, …), for the same reason;
//! - a tensor of a type that cannot be read, or of the wrong shape;
//! - a file split in parts (`split.count`).
//!
//! Which optional tensors a file has (biases, per-head norms, `rope_freqs`, an untied
//! output) is read from block 0 and then required of every block.

use super::config::{Arch, LlamaConfig};
use super::load::LoadError;
use crate::engine::gguf::{GgufFile, MetaValue, TensorInfo};

/// What the file holds beyond the tensors every Llama-family file has.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The hyper-parameters.
    pub config: LlamaConfig,
    /// `blk.N.attn_{q,k,v}.bias` are present (Qwen2 has them).
    pub qkv_bias: bool,
    /// `blk.N.attn_{q,k}_norm.weight` are present (Qwen3: RMSNorm of each head).
    pub qk_norm: bool,
    /// `blk.N.post_attention_norm.weight` and `blk.N.post_ffw_norm.weight` (Gemma 3):
    /// RMSNorms of the attention's and the feed-forward block's outputs before they are
    /// added to the residual stream.
    pub post_norms: bool,
    /// `rope_freqs.weight` is present: per-frequency divisors of the RoPE angles (Llama
    /// 3.1 and later write their "llama3" RoPE scaling this way).
    pub rope_freqs: bool,
    /// `rope_factors_long.weight` and `rope_factors_short.weight` are present (Phi-3's
    /// LongRoPE): per-frequency divisors, one set for contexts past the original
    /// ([`LlamaConfig::long_rope_factors`]) and one for those within it.
    pub long_rope: bool,
    /// No `output.weight`: the output projection is the token embedding.
    pub tied: bool,
}

/// `<arch>.*` keys the configuration reads, or that change nothing in the arithmetic.
const KNOWN_KEYS: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    // Informational: the context the model was trained with before scaling.
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "vocab_size",
    // How the original checkpoint was laid out; the GGUF's own layout is fixed.
    "tensor_data_layout",
];

/// Keys that only some architectures implement.
fn known_for(arch: Arch, key: &str) -> bool {
    match arch {
        Arch::Gemma3 => matches!(
            key,
            "attention.sliding_window" | "attention.sliding_window_pattern" | "rope.freq_base_swa"
        ),
        Arch::Phi3 => matches!(key, "attention.sliding_window" | "rope.scaling.attn_factor"),
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => false,
    }
}

/// Keys that are harmless at these values (a dense model's expert counts).
fn neutral(key: &str, value: &MetaValue) -> bool {
    match key {
        "expert_count" | "expert_used_count" => value.as_u64() == Some(0),
        "attention.sliding_window" | "attn_logit_softcapping" | "final_logit_softcapping" => {
            value.as_f64() == Some(0.0)
        }
        _ => false,
    }
}

/// A value for an error message: strings quoted, long arrays summarised.
fn show(value: &MetaValue) -> String {
    match value {
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::Array(a) => format!("an array of {} {}", a.len(), value.type_name()),
        MetaValue::Bool(b) => b.to_string(),
        other => match (other.as_i64(), other.as_f64()) {
            (Some(i), _) => i.to_string(),
            (None, Some(f)) => f.to_string(),
            _ => other.type_name().to_owned(),
        },
    }
}

fn unsupported_key(key: String, value: &MetaValue, why: &str) -> LoadError {
    LoadError::UnsupportedKey {
        key,
        value: show(value),
        why: why.to_owned(),
    }
}

/// The tensors of block `n` that the forward pass reads, with their dims (GGUF order).
fn block_tensors(c: &LlamaConfig, plan: &Plan, n: usize) -> Vec<(String, Vec<usize>)> {
    let (hd, d, qd, kvd, ffn) = (
        c.hidden,
        c.head_dim,
        c.n_heads * c.head_dim,
        c.kv_dim(),
        c.ffn,
    );
    let name = |t: &str| format!("blk.{n}.{t}");
    let mut out = vec![
        (name("attn_norm.weight"), vec![hd]),
        (name("attn_output.weight"), vec![qd, hd]),
        (name("ffn_norm.weight"), vec![hd]),
        (name("ffn_down.weight"), vec![ffn, hd]),
    ];
    if c.arch.fused() {
        // Phi-3: Q, K, V in one matrix; gate and up in one (`ffn_up`, gate first).
        out.push((name("attn_qkv.weight"), vec![hd, qd + 2 * kvd]));
        out.push((name("ffn_up.weight"), vec![hd, 2 * ffn]));
    } else {
        out.push((name("attn_q.weight"), vec![hd, qd]));
        out.push((name("attn_k.weight"), vec![hd, kvd]));
        out.push((name("attn_v.weight"), vec![hd, kvd]));
        out.push((name("ffn_gate.weight"), vec![hd, ffn]));
        out.push((name("ffn_up.weight"), vec![hd, ffn]));
    }
    if plan.qkv_bias {
        out.push((name("attn_q.bias"), vec![qd]));
        out.push((name("attn_k.bias"), vec![kvd]));
        out.push((name("attn_v.bias"), vec![kvd]));
    }
    if plan.qk_norm {
        out.push((name("attn_q_norm.weight"), vec![d]));
        out.push((name("attn_k_norm.weight"), vec![d]));
    }
    if plan.post_norms {
        out.push((name("post_attention_norm.weight"), vec![hd]));
        out.push((name("post_ffw_norm.weight"), vec![hd]));
    }
    out
}

/// Every tensor the forward pass reads, with its dims (GGUF order).
pub fn expected_tensors(plan: &Plan) -> Vec<(String, Vec<usize>)> {
    let c = &plan.config;
    let mut out = vec![
        ("token_embd.weight".to_owned(), vec![c.hidden, c.vocab]),
        ("output_norm.weight".to_owned(), vec![c.hidden]),
    ];
    if !plan.tied {
        out.push(("output.weight".to_owned(), vec![c.hidden, c.vocab]));
    }
    if plan.rope_freqs {
        out.push(("rope_freqs.weight".to_owned(), vec![c.rope_dims / 2]));
    }
    if plan.long_rope {
        for name in ["rope_factors_long.weight", "rope_factors_short.weight"] {
            out.push((name.to_owned(), vec![c.rope_dims / 2]));
        }
    }
    for n in 0..c.n_layers {
        out.extend(block_tensors(c, plan, n));
    }
    out
}

/// Checks everything the forward pass will ask of `gguf`, reading no tensor data.
pub fn preflight(gguf: &GgufFile) -> Result<Plan, LoadError> {
    let arch_name = gguf.get_str("general.architecture")?;
    let arch = Arch::from_gguf_name(arch_name)
        .ok_or_else(|| LoadError::UnsupportedArchitecture(arch_name.to_owned()))?;
    if let Some(parts) = gguf.get("split.count") {
        if parts.as_u64() != Some(1) {
            return Err(unsupported_key(
                "split.count".into(),
                parts,
                "the model is split over several files; merge them first \
                 (llama.cpp's gguf-split --merge)",
            ));
        }
    }
    let prefix = format!("{arch_name}.");
    for (key, value) in gguf.metadata() {
        let Some(short) = key.strip_prefix(&prefix) else {
            continue;
        };
        if !KNOWN_KEYS.contains(&short) && !known_for(arch, short) && !neutral(short, value) {
            return Err(unsupported_key(
                key.clone(),
                value,
                "this worker does not implement it",
            ));
        }
    }
    let config = LlamaConfig::from_gguf(gguf, arch)?;
    config.validate().map_err(LoadError::Config)?;
    let key = |k: &str| format!("{prefix}{k}");
    if let Some(v) = gguf.get(&key("rope.scaling.type")) {
        if !matches!(v.as_str(), Some("none" | "linear")) {
            return Err(unsupported_key(
                key("rope.scaling.type"),
                v,
                "RoPE scaling other than none and linear is not implemented",
            ));
        }
    }
    if let Some(v) = gguf.get(&key("attention.value_length")) {
        if v.as_u64() != Some(config.head_dim as u64) {
            return Err(unsupported_key(
                key("attention.value_length"),
                v,
                &format!("values as wide as keys ({}) are required", config.head_dim),
            ));
        }
    }
    if let Some(v) = gguf.get(&key("rope.dimension_count")) {
        // Partial rotary embeddings, as Phi-3.5 and Phi-4 rotate: the first dimensions
        // of each head in halves. Other families' files would need llama.cpp's row
        // permutation undone over part of a head, which no converter writes.
        if v.as_u64() != Some(config.head_dim as u64) && arch != Arch::Phi3 {
            return Err(unsupported_key(
                key("rope.dimension_count"),
                v,
                &format!(
                    "partial rotary embeddings are implemented for phi3 only (heads are {} wide)",
                    config.head_dim
                ),
            ));
        }
    }
    // A block count the tensor table cannot back is refused before anything is sized
    // by it (a damaged count would otherwise ask for terabytes).
    let tensors = gguf.tensors().len();
    let per_block = if arch.fused() { 6 } else { 9 };
    if config.n_layers > tensors / per_block {
        return Err(LoadError::Config(format!(
            "block_count is {} but the file holds only {tensors} tensors ({per_block} per block)",
            config.n_layers
        )));
    }
    let has = |name: &str| gguf.tensor(name).is_some();
    let plan = Plan {
        qkv_bias: has("blk.0.attn_q.bias"),
        // Gemma 3 is defined with both; for the others the file says.
        qk_norm: arch == Arch::Gemma3 || has("blk.0.attn_q_norm.weight"),
        post_norms: arch == Arch::Gemma3,
        rope_freqs: has("rope_freqs.weight"),
        long_rope: arch == Arch::Phi3
            && (has("rope_factors_long.weight") || has("rope_factors_short.weight")),
        tied: !has("output.weight"),
        config,
    };
    if plan.rope_freqs && plan.long_rope {
        return Err(LoadError::Config(
            "the file has both rope_freqs.weight and LongRoPE factors \
             (rope_factors_long/short.weight): which divides the frequencies is ambiguous"
                .to_owned(),
        ));
    }
    let expected = expected_tensors(&plan);
    for (name, dims) in &expected {
        let info = gguf
            .tensor(name)
            .ok_or_else(|| LoadError::MissingTensor(name.clone()))?;
        check_tensor(info, dims)?;
    }
    if gguf.tensors().len() != expected.len() {
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = gguf
            .tensors()
            .iter()
            .find(|t| !known.contains(t.name.as_str()))
        {
            return Err(LoadError::UnusedTensor {
                name: extra.name.clone(),
                arch: arch_name.to_owned(),
            });
        }
    }
    Ok(plan)
}

fn check_tensor(info: &TensorInfo, dims: &[usize]) -> Result<(), LoadError> {
    let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if info.dims != expected {
        return Err(LoadError::Shape {
            name: info.name.clone(),
            expected,
            found: info.dims.clone(),
        });
    }
    if !info.ggml_type.dequant_supported() {
        return Err(LoadError::UnsupportedType {
            name: info.name.clone(),
            ty: info.ggml_type.name().to_owned(),
        });
    }
    Ok(())
}
