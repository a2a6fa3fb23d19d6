//! Llama GGUF files with random weights: tiny ones for tests that need no real model,
//! and big ones (e.g. a 1B shape) for speed measurements, where values do not matter.
//!
//! The tokenizer is a byte-level BPE over the 256 byte symbols, three special tokens
//! (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and merges that build lowercase
//! letter runs, padded to the vocabulary size; the chat template is ChatML.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::{Activation, Arch, LlamaConfig};
use crate::engine::gguf::{GgmlType, GgufError, GgufWriter, MetaValue};

/// What to write.
#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    /// Shape of the network; `vocab` must be at least 259 + 26.
    pub config: LlamaConfig,
    /// Storage type of the matrices (norms are always F32).
    pub weight_type: GgmlType,
    /// Seed of the weights.
    pub seed: u64,
    /// Write `output.weight` instead of tying the output to the embedding.
    pub untied_output: bool,
}

impl SyntheticSpec {
    /// A tiny model that runs in milliseconds: 2 layers, hidden 64, 4 heads over 2 KV
    /// heads, vocab 320, context 64.
    pub fn tiny(seed: u64) -> Self {
        Self {
            config: LlamaConfig {
                arch: Arch::Llama,
                n_layers: 2,
                hidden: 64,
                ffn: 128,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 16,
                vocab: 320,
                context_length: 64,
                rope_theta: 10_000.0,
                rms_eps: 1e-5,
                rope_scale: 1.0,
                rope_dims: 16,
                rope_attn_factor: 1.0,
                rope_original_context: 64,
                activation: Activation::Silu,
                embed_scale: 1.0,
                attn_scale: 0.25,
                sliding: None,
            },
            weight_type: GgmlType::F32,
            seed,
            untied_output: false,
        }
    }

    /// The shape of the default model, SmolLM2-135M (30 layers, hidden 576, 9 heads over
    /// 3 KV heads, a 49k vocabulary, tied output), in Q4_1 as its file is.
    pub fn smollm2_135m(seed: u64) -> Self {
        let base = Self::llama_1b(seed);
        Self {
            config: LlamaConfig {
                n_layers: 30,
                hidden: 576,
                ffn: 1536,
                n_heads: 9,
                n_kv_heads: 3,
                vocab: 49_152,
                rope_theta: 100_000.0,
                ..base.config
            },
            ..base
        }
    }

    /// The shape of a 1B Llama (Llama 3.2 1B's layers and widths, with a 32k vocab).
    pub fn llama_1b(seed: u64) -> Self {
        Self {
            config: LlamaConfig {
                arch: Arch::Llama,
                n_layers: 16,
                hidden: 2048,
                ffn: 8192,
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 64,
                vocab: 32_000,
                context_length: 8192,
                rope_theta: 500_000.0,
                rms_eps: 1e-5,
                rope_scale: 1.0,
                rope_dims: 64,
                rope_attn_factor: 1.0,
                rope_original_context: 8192,
                activation: Activation::Silu,
                embed_scale: 1.0,
                attn_scale: 0.125,
                sliding: None,
            },
            weight_type: GgmlType::Q4_1,
            seed,
            untied_output: false,
        }
    }
}

/// GPT-2's byte ↔ printable-character table: bytes that are printable map to themselves,
/// the others to code points from 256 up.
pub fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).expect("code points below 0x200 are chars")
        })
        .collect()
}

/// The vocabulary and merges of the synthetic tokenizer.
fn vocabulary(size: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![3i32; 3];
    tokens.extend(byte_symbols().into_iter().map(String::from));
    types.extend(std::iter::repeat_n(1, 256));
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut merges = Vec::new();
    // Runs of letters: every existing run extended by one letter, shortest first.
    let mut frontier = letters.clone();
    'outer: while tokens.len() < size {
        let mut next = Vec::new();
        for run in &frontier {
            for l in &letters {
                if tokens.len() >= size {
                    break 'outer;
                }
                merges.push(format!("{run} {l}"));
                let t = format!("{run}{l}");
                tokens.push(t.clone());
                types.push(1);
                next.push(t);
            }
        }
        frontier = next;
    }
    (tokens, types, merges)
}

fn strings(v: Vec<String>) -> MetaValue {
    MetaValue::Array(v.into_iter().map(MetaValue::String).collect())
}

/// ChatML, as SmolLM2 and many others use.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Writes a random-weight Llama GGUF file.
pub fn write_synthetic_llama(path: &Path, spec: &SyntheticSpec) -> Result<(), GgufError> {
    let c = &spec.config;
    let mut w = GgufWriter::new();
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.add_metadata("general.architecture", MetaValue::String("llama".into()))?;
    w.add_metadata("general.name", MetaValue::String("synthetic-llama".into()))?;
    w.add_metadata("llama.block_count", u32v(c.n_layers))?;
    w.add_metadata("llama.context_length", u32v(c.context_length))?;
    w.add_metadata("llama.embedding_length", u32v(c.hidden))?;
    w.add_metadata("llama.feed_forward_length", u32v(c.ffn))?;
    w.add_metadata("llama.attention.head_count", u32v(c.n_heads))?;
    w.add_metadata("llama.attention.head_count_kv", u32v(c.n_kv_heads))?;
    w.add_metadata("llama.rope.freq_base", MetaValue::F32(c.rope_theta))?;
    w.add_metadata("llama.rope.dimension_count", u32v(c.head_dim))?;
    w.add_metadata("llama.attention.key_length", u32v(c.head_dim))?;
    w.add_metadata("llama.attention.value_length", u32v(c.head_dim))?;
    w.add_metadata(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(c.rms_eps),
    )?;
    w.add_metadata("llama.vocab_size", u32v(c.vocab))?;
    let (tokens, types, merges) = vocabulary(c.vocab);
    w.add_metadata("tokenizer.ggml.model", MetaValue::String("gpt2".into()))?;
    w.add_metadata("tokenizer.ggml.pre", MetaValue::String("smollm".into()))?;
    w.add_metadata("tokenizer.ggml.tokens", strings(tokens))?;
    w.add_metadata(
        "tokenizer.ggml.token_type",
        MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
    )?;
    w.add_metadata("tokenizer.ggml.merges", strings(merges))?;
    w.add_metadata("tokenizer.ggml.bos_token_id", MetaValue::U32(1))?;
    w.add_metadata("tokenizer.ggml.eos_token_id", MetaValue::U32(2))?;
    w.add_metadata("tokenizer.ggml.unknown_token_id", MetaValue::U32(0))?;
    w.add_metadata("tokenizer.ggml.padding_token_id", MetaValue::U32(2))?;
    w.add_metadata("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))?;
    w.add_metadata("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false))?;
    w.add_metadata(
        "tokenizer.chat_template",
        MetaValue::String(CHATML_TEMPLATE.into()),
    )?;

    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let matrix = |rows: usize, cols: usize, rng: &mut ChaCha8Rng| -> Vec<f32> {
        // Uniform with the variance of N(0, 1/cols): activations keep their scale.
        let bound = (3.0 / cols as f32).sqrt();
        (0..rows * cols)
            .map(|_| rng.random_range(-bound..bound))
            .collect()
    };
    let norm = |n: usize, rng: &mut ChaCha8Rng| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(0.8..1.2)).collect()
    };
    let ty = spec.weight_type;
    let (h, d, kv) = (c.hidden, c.head_dim, c.kv_dim());
    let q = c.n_heads * d;
    // GGUF dims are fastest-first: [in, out] for a matrix of `out` rows.
    let embed = matrix(c.vocab, h, &mut rng);
    w.add_tensor("token_embd.weight", &[h as u64, c.vocab as u64], ty, &embed)?;
    drop(embed);
    for n in 0..c.n_layers {
        let name = |t: &str| format!("blk.{n}.{t}.weight");
        let mut add = |w: &mut GgufWriter, t: &str, inp: usize, out: usize| {
            let m = matrix(out, inp, &mut rng);
            w.add_tensor(name(t), &[inp as u64, out as u64], ty, &m)
        };
        add(&mut w, "attn_q", h, q)?;
        add(&mut w, "attn_k", h, kv)?;
        add(&mut w, "attn_v", h, kv)?;
        add(&mut w, "attn_output", q, h)?;
        add(&mut w, "ffn_gate", h, c.ffn)?;
        add(&mut w, "ffn_up", h, c.ffn)?;
        add(&mut w, "ffn_down", c.ffn, h)?;
        let an = norm(h, &mut rng);
        w.add_tensor(name("attn_norm"), &[h as u64], GgmlType::F32, &an)?;
        let fnm = norm(h, &mut rng);
        w.add_tensor(name("ffn_norm"), &[h as u64], GgmlType::F32, &fnm)?;
    }
    let on = norm(h, &mut rng);
    w.add_tensor("output_norm.weight", &[h as u64], GgmlType::F32, &on)?;
    if spec.untied_output {
        let out = matrix(c.vocab, h, &mut rng);
        w.add_tensor("output.weight", &[h as u64, c.vocab as u64], ty, &out)?;
    }
    w.write_to(path)
}
