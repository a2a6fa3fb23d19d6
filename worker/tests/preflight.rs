//! Files the worker cannot run are refused before any weight is read, with one error that
//! names what is wrong: the key and its value, or the tensor. Each case rewrites the tiny
//! Qwen2 fixture of `tests/fixtures/arch` with one thing changed.

use std::path::{Path, PathBuf};

use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        gguf::{GgmlType, GgufFile, GgufWriter, MetaValue},
        llama::{load::load_llama, WeightDtype},
        Engine,
    },
};
use tempfile::TempDir;

fn source() -> PathBuf {
    fixture("qwen2.q8_0.gguf")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/arch")
        .join(name)
}

/// One change to the source file.
enum Edit<'a> {
    /// Sets (or adds) a metadata key.
    Set(&'a str, MetaValue),
    /// Stores `blk.0.attn_q.weight` as zero bytes of another type.
    Retype(GgmlType),
    /// Adds an F32 tensor of `n` values.
    AddTensor(&'a str, u64),
    /// Leaves a tensor out.
    Drop(&'a str),
    /// Stores a tensor with `n` F32 values of 1 in place of its own.
    Resize(&'a str, u64),
}

fn variant(dir: &TempDir, name: &str, edit: Edit<'_>) -> PathBuf {
    variant_of(&source(), dir, name, edit)
}

fn variant_of(source: &Path, dir: &TempDir, name: &str, edit: Edit<'_>) -> PathBuf {
    let src = GgufFile::open(source).expect("fixture opens");
    let mut w = GgufWriter::new();
    let mut set = match &edit {
        Edit::Set(k, v) => Some((*k, v.clone())),
        _ => None,
    };
    for (k, v) in src.metadata() {
        let v = match &set {
            Some((key, value)) if key == k => {
                let value = value.clone();
                set = None;
                value
            }
            _ => v.clone(),
        };
        w.add_metadata(k.clone(), v).expect("metadata");
    }
    if let Some((k, v)) = set {
        w.add_metadata(k, v).expect("new key");
    }
    for t in src.tensors() {
        match &edit {
            Edit::Drop(n) if *n == t.name => continue,
            Edit::Resize(n, len) if *n == t.name => {
                w.add_tensor(
                    t.name.clone(),
                    &[*len],
                    GgmlType::F32,
                    &vec![1.0; *len as usize],
                )
                .expect("tensor");
                continue;
            }
            _ => {}
        }
        if let (Edit::Retype(ty), "blk.0.attn_q.weight") = (&edit, t.name.as_str()) {
            let size = ty.bytes_for(t.dims.iter().product()).expect("known size") as usize;
            w.add_tensor_bytes(t.name.clone(), &t.dims, *ty, vec![0; size])
                .expect("tensor");
            continue;
        }
        w.add_tensor_bytes(
            t.name.clone(),
            &t.dims,
            t.ggml_type,
            src.tensor_bytes(t).to_vec(),
        )
        .expect("tensor");
    }
    if let Edit::AddTensor(name, n) = edit {
        w.add_tensor(name, &[n], GgmlType::F32, &vec![1.0; n as usize])
            .expect("tensor");
    }
    let path = dir.path().join(name);
    w.write_to(&path).expect("write");
    path
}

/// Loads `path` and returns the error's kind and text, checking that no tensor was read.
fn refused(path: &Path) -> (&'static str, String) {
    let gguf = GgufFile::open(path).expect("the file itself is well formed");
    let mut read = 0;
    let e = load_llama::<B>(
        &gguf,
        WeightDtype::NativeI16,
        &Default::default(),
        &mut |_, _| read += 1,
    )
    .expect_err("refused");
    assert_eq!(read, 0, "{e}: tensors were read before the refusal");
    (e.kind(), e.to_string())
}

#[test]
fn the_fixture_itself_loads() {
    let gguf = GgufFile::open(&source()).expect("opens");
    load_llama::<B>(
        &gguf,
        WeightDtype::NativeI16,
        &Default::default(),
        &mut |_, _| {},
    )
    .expect("loads");
}

#[test]
fn settings_the_forward_pass_does_not_implement_are_named() {
    let dir = TempDir::new().expect("tempdir");
    let s = |v: &str| MetaValue::String(v.into());
    let cases: Vec<(&str, Edit<'_>, &str, &[&str])> = vec![
        (
            "arch",
            Edit::Set("general.architecture", s("mamba")),
            "unsupported_architecture",
            &["general.architecture", "mamba"],
        ),
        (
            "yarn",
            Edit::Set("qwen2.rope.scaling.type", s("yarn")),
            "unsupported_key",
            &["qwen2.rope.scaling.type", "yarn"],
        ),
        (
            "window",
            Edit::Set("qwen2.attention.sliding_window", MetaValue::U32(4096)),
            "unsupported_key",
            &["qwen2.attention.sliding_window", "4096"],
        ),
        (
            "softcap",
            Edit::Set("qwen2.final_logit_softcapping", MetaValue::F32(30.0)),
            "unsupported_key",
            &["qwen2.final_logit_softcapping", "30"],
        ),
        (
            "experts",
            Edit::Set("qwen2.expert_count", MetaValue::U32(8)),
            "unsupported_key",
            &["qwen2.expert_count", "8"],
        ),
        (
            "partial",
            Edit::Set("qwen2.rope.dimension_count", MetaValue::U32(8)),
            "unsupported_key",
            &["qwen2.rope.dimension_count", "8", "partial"],
        ),
        (
            "attn-factor",
            Edit::Set("qwen2.rope.scaling.attn_factor", MetaValue::F32(1.25)),
            "unsupported_key",
            &["qwen2.rope.scaling.attn_factor", "1.25"],
        ),
        (
            "longrope-elsewhere",
            Edit::AddTensor("rope_factors_long.weight", 8),
            "unused_tensor",
            &["rope_factors_long.weight", "qwen2"],
        ),
        (
            "values",
            Edit::Set("qwen2.attention.value_length", MetaValue::U32(32)),
            "unsupported_key",
            &["qwen2.attention.value_length", "32"],
        ),
        (
            "split",
            Edit::Set("split.count", MetaValue::U16(3)),
            "unsupported_key",
            &["split.count", "3"],
        ),
        (
            "mxfp4",
            Edit::Retype(GgmlType::MXFP4),
            "unsupported_type",
            &["blk.0.attn_q.weight", "mxfp4"],
        ),
        (
            "extra",
            Edit::AddTensor("blk.0.post_attention_norm.weight", 64),
            "unused_tensor",
            &["blk.0.post_attention_norm.weight", "qwen2"],
        ),
    ];
    for (name, edit, kind, words) in cases {
        let path = variant(&dir, &format!("{name}.gguf"), edit);
        let (k, text) = refused(&path);
        assert_eq!(k, kind, "{name}: {text}");
        for w in words {
            assert!(text.contains(w), "{name}: {text:?} does not name {w:?}");
        }
    }
}

/// A Phi-3 file with LongRoPE over partial rotary embeddings that the forward pass
/// could not follow: each refused, naming the key or tensor.
#[test]
fn longrope_files_that_cannot_run_are_named() {
    let dir = TempDir::new().expect("tempdir");
    let source = fixture("phi3-longrope.q8_0.gguf");
    let cases: Vec<(&str, Edit<'_>, &str, &[&str])> = vec![
        (
            "odd-dims",
            Edit::Set("phi3.rope.dimension_count", MetaValue::U32(13)),
            "invalid_config",
            &["rope.dimension_count", "13"],
        ),
        (
            "wide-dims",
            Edit::Set("phi3.rope.dimension_count", MetaValue::U32(32)),
            "invalid_config",
            &["rope.dimension_count", "32", "16"],
        ),
        (
            "no-short",
            Edit::Drop("rope_factors_short.weight"),
            "missing_tensor",
            &["rope_factors_short.weight"],
        ),
        (
            "factors-for-all-dims",
            Edit::Resize("rope_factors_long.weight", 8),
            "tensor_shape",
            &["rope_factors_long.weight"],
        ),
        (
            "and-rope-freqs",
            Edit::AddTensor("rope_freqs.weight", 6),
            "invalid_config",
            &["rope_freqs.weight", "rope_factors_long"],
        ),
        (
            "zero-attn-factor",
            Edit::Set("phi3.rope.scaling.attn_factor", MetaValue::F32(0.0)),
            "invalid_config",
            &["rope.scaling.attn_factor", "0"],
        ),
    ];
    for (name, edit, kind, words) in cases {
        let path = variant_of(&source, &dir, &format!("{name}.gguf"), edit);
        let (k, text) = refused(&path);
        assert_eq!(k, kind, "{name}: {text}");
        for w in words {
            assert!(text.contains(w), "{name}: {text:?} does not name {w:?}");
        }
    }
}

#[test]
fn a_neutral_value_of_a_known_key_is_accepted() {
    let dir = TempDir::new().expect("tempdir");
    // A dense model may say it has no experts; a linear scaling factor of 1 is no scaling.
    for (name, edit) in [
        (
            "no-experts",
            Edit::Set("qwen2.expert_count", MetaValue::U32(0)),
        ),
        (
            "no-scaling",
            Edit::Set("qwen2.rope.scaling.type", MetaValue::String("none".into())),
        ),
    ] {
        let path = variant(&dir, &format!("{name}.gguf"), edit);
        let gguf = GgufFile::open(&path).expect("opens");
        load_llama::<B>(
            &gguf,
            WeightDtype::NativeI16,
            &Default::default(),
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

fn engine_error(path: &Path) -> baton_worker::engine::EngineError {
    match Engine::<B>::load(path, WeightDtype::NativeI16, &Default::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    }
}

#[test]
fn an_unsupported_tokenizer_is_named_with_its_key() {
    let dir = TempDir::new().expect("tempdir");
    let path = variant(
        &dir,
        "bert.gguf",
        Edit::Set("tokenizer.ggml.model", MetaValue::String("bert".into())),
    );
    let e = engine_error(&path);
    assert_eq!(e.kind(), "unsupported_model", "{e}");
    assert!(
        e.to_string().contains("tokenizer.ggml.model") && e.to_string().contains("bert"),
        "{e}"
    );
    let path = variant(
        &dir,
        "pre.gguf",
        Edit::Set("tokenizer.ggml.pre", MetaValue::String("tekken".into())),
    );
    let e = engine_error(&path);
    assert_eq!(e.kind(), "unsupported_pre", "{e}");
    assert!(
        e.to_string().contains("tokenizer.ggml.pre") && e.to_string().contains("tekken"),
        "{e}"
    );
}

#[test]
fn a_truncated_tensor_is_named_when_the_file_opens() {
    let dir = TempDir::new().expect("tempdir");
    let bytes = std::fs::read(source()).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).expect("write");
    let e = GgufFile::open(&cut).expect_err("refused");
    assert_eq!(e.kind(), "tensor_out_of_bounds", "{e}");
    assert!(
        e.to_string().contains("output_norm.weight") || e.to_string().contains("blk."),
        "{e}"
    );
}
