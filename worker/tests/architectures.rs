//! Every supported architecture against Hugging Face `transformers`: tiny random-weight
//! models (`llama3` with llama3 RoPE scaling and a wide head, `mistral`, `qwen2` with
//! Q/K/V biases, `qwen3` with per-head Q/K norms, `gemma3` with GeGLU, post norms and
//! sliding-window layers, `phi3` with fused matrices and a window on every layer, and two
//! Phi-4-mini-style `phi3` models with LongRoPE over partial rotary embeddings, one
//! serving past its original context and one within it), written to GGUF as F32 and as Q8_0 by
//! `scripts/arch_fixtures.py`, which also recorded what `transformers` computes for them:
//! the logits at the last prompt position and 24 greedy tokens.
//!
//! Each file runs on the burn engine (weights as f32 tensors) and the Q8_0 file on the
//! host engine too (the file's blocks, the CPU kernels), with an f32 KV cache where the
//! logits are compared at 1e-3, and with the defaults (16-bit integer activations for
//! generated tokens, an f16 cache) where the greedy tokens must still agree. The F32
//! files rewritten with F16 and BF16 matrices run on the host engine in their 16-bit
//! values, against the burn engine on the same values.

use std::path::{Path, PathBuf};

use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        gguf::{GgmlType, GgufFile, GgufWriter},
        llama::{
            load::load_llama, preflight::preflight, Arch, KvDtype, Llama, SeqInput, WeightDtype,
        },
        sampler::argmax,
    },
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    models: Vec<Model>,
}

#[derive(Deserialize)]
struct Model {
    name: String,
    arch: String,
    files: Files,
    prompt_ids: Vec<u32>,
    reference: References,
}

#[derive(Deserialize)]
struct Files {
    f32: String,
    q8_0: String,
}

#[derive(Deserialize)]
struct References {
    f32: Reference,
    q8_0: Reference,
}

#[derive(Deserialize)]
struct Reference {
    last_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    /// Best minus second-best logit at each greedy step.
    margins: Vec<f32>,
}

/// How far the defaults' logits may move from the reference's (the 16-bit rounding of
/// activations and of the cache), as a fraction of the logits' root mean square (the
/// rounding is relative, and deeper models carry it further): a greedy step closer to a
/// tie than this may go either way.
const ROUNDED: f32 = 1.5e-2;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arch")
}

fn fixture() -> Fixture {
    let text = std::fs::read_to_string(dir().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

fn load(file: &str, dtype: WeightDtype, kv: KvDtype) -> Llama<B> {
    let gguf = GgufFile::open(&dir().join(file)).expect("fixture opens");
    let mut model =
        load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {}).expect("loads");
    model.set_kv_dtype(kv);
    model
}

/// The logits after the prompt and after each of `forced` in turn (all of them when
/// given), else the logits of `n` greedy tokens decoded one at a time from our own
/// choices; returns the logits of every step and the tokens chosen.
fn run(
    model: &Llama<B>,
    prompt: &[u32],
    n: usize,
    forced: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = model.new_cache();
    let mut step = |tokens: &[u32]| {
        let (logits, _) = model
            .forward_greedy(
                &mut [SeqInput {
                    tokens,
                    cache: &mut cache,
                }],
                true,
            )
            .expect("forward");
        logits
    };
    let mut all = vec![step(prompt)];
    let mut tokens = vec![argmax(&all[0])];
    while tokens.len() < n {
        let next = match forced {
            Some(f) => f[tokens.len() - 1],
            None => *tokens.last().expect("one token"),
        };
        let logits = step(&[next]);
        tokens.push(argmax(&logits));
        all.push(logits);
    }
    (all, tokens)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs `file` as `dtype` with a `kv` cache against `reference`: logits within `tol` and
/// every greedy token equal, decoding from its own choices; or, without `tol`, decoding
/// the reference's tokens, the same choice at every step that is not a close call (see
/// [`ROUNDED`]).
fn check(
    m: &Model,
    file: &str,
    dtype: WeightDtype,
    kv: KvDtype,
    reference: &Reference,
    tol: Option<f32>,
) {
    let model = load(file, dtype, kv);
    assert_eq!(
        model.host_path(),
        dtype.is_native(),
        "{file} as {dtype}: the engine"
    );
    let n = reference.greedy_ids.len();
    let what = format!("{} ({file} as {dtype}, kv {kv})", m.name);
    match tol {
        Some(tol) => {
            let (logits, greedy) = run(&model, &m.prompt_ids, n, None);
            let d = max_diff(&logits[0], &reference.last_logits);
            eprintln!("{what}: logits within {d:.2e}");
            assert!(d <= tol, "{what}: logits differ by {d} (> {tol})");
            assert_eq!(greedy, reference.greedy_ids, "{what}: greedy tokens differ");
        }
        None => {
            let (logits, greedy) = run(&model, &m.prompt_ids, n, Some(&reference.greedy_ids));
            let d = max_diff(&logits[0], &reference.last_logits);
            let l = &reference.last_logits;
            let rms = (l.iter().map(|x| x * x).sum::<f32>() / l.len() as f32).sqrt();
            let margin = ROUNDED * rms;
            assert!(d <= margin, "{what}: logits differ by {d} (> {margin})");
            let clear: Vec<usize> = (0..n).filter(|&i| reference.margins[i] >= margin).collect();
            eprintln!(
                "{what}: logits within {d:.2e}, {} of {n} steps clear of ties",
                clear.len()
            );
            assert!(
                clear.len() >= n * 2 / 3,
                "{what}: too few steps clear of ties"
            );
            for i in clear {
                assert_eq!(
                    greedy[i], reference.greedy_ids[i],
                    "{what}: greedy step {i} differs"
                );
            }
        }
    }
}

#[test]
fn every_architecture_matches_transformers() {
    let fixture = fixture();
    let names: Vec<&str> = fixture.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "llama3",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma3",
            "phi3",
            "phi3-longrope",
            "phi3-longrope-short"
        ]
    );
    for m in &fixture.models {
        let r = &m.reference;
        // The burn engine on exact f32 weights, and on the Q8_0 file's values.
        check(
            m,
            &m.files.f32,
            WeightDtype::F32,
            KvDtype::F32,
            &r.f32,
            Some(1e-3),
        );
        check(
            m,
            &m.files.q8_0,
            WeightDtype::F32,
            KvDtype::F32,
            &r.q8_0,
            Some(1e-3),
        );
        // The host engine on the file's blocks: f32 activations, then the defaults.
        check(
            m,
            &m.files.q8_0,
            WeightDtype::Native,
            KvDtype::F32,
            &r.q8_0,
            Some(1e-3),
        );
        check(
            m,
            &m.files.q8_0,
            WeightDtype::NativeI16,
            KvDtype::F16,
            &r.q8_0,
            None,
        );
    }
}

/// The F32 fixture rewritten with every matrix in `ty` (F16 or BF16), norms in F32.
fn sixteen_bit_copy(file: &str, ty: GgmlType, out: &Path) {
    let gguf = GgufFile::open(&dir().join(file)).expect("fixture opens");
    let mut w = GgufWriter::new();
    for (key, value) in gguf.metadata() {
        w.add_metadata(key.clone(), value.clone())
            .expect("metadata");
    }
    for info in gguf.tensors() {
        if info.dims.len() == 2 {
            let values = gguf.dequantize_tensor(info).expect("f32 values");
            w.add_tensor(info.name.clone(), &info.dims, ty, &values)
                .expect("16-bit tensor");
        } else {
            let bytes = gguf.tensor_bytes(info).to_vec();
            w.add_tensor_bytes(info.name.clone(), &info.dims, info.ggml_type, bytes)
                .expect("tensor");
        }
    }
    w.write_to(out).expect("written");
}

/// F16 and BF16 files on the host engine keep their 16-bit values: every family's
/// logits within 1e-3 of the burn engine's on the same file's exact f32 values, and the
/// same greedy tokens, with the default 16-bit activations (the 16-bit matrices take
/// generated rows' f32 inputs as they are).
#[test]
fn sixteen_bit_float_files_run_as_their_values() {
    let fixture = fixture();
    let tmp = tempfile::tempdir().expect("temporary directory");
    for m in &fixture.models {
        for ty in [GgmlType::F16, GgmlType::BF16] {
            let path = tmp.path().join(format!("{}.{ty:?}.gguf", m.name));
            sixteen_bit_copy(&m.files.f32, ty, &path);
            let open = |dtype| {
                let gguf = GgufFile::open(&path).expect("copy opens");
                let mut model = load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {})
                    .expect("loads");
                model.set_kv_dtype(KvDtype::F32);
                model
            };
            let host = open(WeightDtype::NativeI16);
            assert!(host.host_path(), "{} {ty:?}: the host engine", m.name);
            let held = host.held_formats();
            let kind = if ty == GgmlType::F16 { "F16" } else { "Bf16" };
            assert!(
                held.contains(kind) && !held.contains("Byte"),
                "{} {ty:?}: held {held}",
                m.name
            );
            let dense = open(WeightDtype::F32);
            let n = 12;
            let (want, greedy) = run(&dense, &m.prompt_ids, n, None);
            let (got, tokens) = run(&host, &m.prompt_ids, n, None);
            let d = max_diff(&got[0], &want[0]);
            assert!(d <= 1e-3, "{} {ty:?}: logits differ by {d}", m.name);
            assert_eq!(tokens, greedy, "{} {ty:?}: greedy tokens differ", m.name);
        }
    }
}

#[test]
fn the_preflight_reads_each_family_from_its_metadata() {
    for m in &fixture().models {
        let gguf = GgufFile::open(&dir().join(&m.files.q8_0)).expect("opens");
        let plan = preflight(&gguf).expect("preflight");
        let c = &plan.config;
        assert_eq!(
            c.arch,
            Arch::from_gguf_name(&m.arch).expect("known"),
            "{}",
            m.name
        );
        let (head_dim, bias, qk_norm, freqs, tied) = match m.name.as_str() {
            "llama3" => (32, false, false, true, false),
            "mistral" => (16, false, false, false, true),
            "qwen2" => (16, true, false, false, true),
            "qwen3" => (32, false, true, false, true),
            "gemma3" => (32, false, true, false, true),
            "phi3" => (16, false, false, false, false),
            "phi3-longrope" => (16, false, false, false, true),
            "phi3-longrope-short" => (16, false, false, false, false),
            other => panic!("unexpected model {other}"),
        };
        // LongRoPE over 12 of 16 dimensions; the long factors (and the attention
        // factor √(1 + ln 32 / ln 8)) where the context served passes the original.
        let (rope_dims, long_rope, long_factors, attn_factor) = match m.name.as_str() {
            "phi3-longrope" => (12, true, true, (1.0 + 32f32.ln() / 8f32.ln()).sqrt()),
            "phi3-longrope-short" => (12, true, false, 1.0),
            _ => (head_dim, false, false, 1.0),
        };
        assert_eq!(c.rope_dims, rope_dims, "{}: rotary dims", m.name);
        assert_eq!(plan.long_rope, long_rope, "{}: LongRoPE", m.name);
        if long_rope {
            assert_eq!(
                c.long_rope_factors(),
                long_factors,
                "{}: long factors",
                m.name
            );
        }
        assert!(
            (c.rope_attn_factor - attn_factor).abs() < 1e-6,
            "{}: attention factor {}",
            m.name,
            c.rope_attn_factor
        );
        assert_eq!(c.head_dim, head_dim, "{}: head size", m.name);
        assert_eq!(plan.qkv_bias, bias, "{}: biases", m.name);
        assert_eq!(plan.qk_norm, qk_norm, "{}: q/k norms", m.name);
        assert_eq!(plan.rope_freqs, freqs, "{}: rope_freqs", m.name);
        assert_eq!(plan.tied, tied, "{}: tied output", m.name);
    }
}
