//! GGUF reader, dequantizer and writer, checked against files and values produced by an
//! independent implementation (the `gguf` Python package, see `scripts/gguf_fixtures.py`),
//! against damaged and hostile files, and against the default model when it is present.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use baton_worker::engine::cpu::qmatrix::QMatrix;
use baton_worker::engine::gguf::{
    dequant, writer, GgmlType, GgufError, GgufFile, GgufWriter, MetaValue,
};
use baton_worker::engine::llama::linear::DeviceBlocks;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("fixture JSON is readable");
    serde_json::from_str(&text).expect("fixture JSON parses")
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("expected values are readable");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn kind<T>(r: Result<T, GgufError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    }
}

#[test]
fn fixtures_dequantize_exactly_like_the_reference() {
    let manifest = read_json(&fixtures().join("manifest.json"));
    let entries = manifest.as_array().expect("manifest is a list");
    assert_eq!(entries.len(), 13);
    for entry in entries {
        let file = entry["file"].as_str().expect("file");
        let gguf = GgufFile::open(&fixtures().join(file)).expect("fixture opens");
        assert_eq!(gguf.version(), 3);
        assert_eq!(gguf.get_str("general.architecture").ok(), Some("fixture"));
        let info = gguf.tensor("weight").expect("tensor `weight`");
        let type_id = entry["type_id"].as_u64().expect("type_id");
        assert_eq!(u64::from(info.ggml_type.id()), type_id, "{file}");
        assert_eq!(
            info.ggml_type.name().to_uppercase(),
            entry["type"].as_str().expect("type")
        );
        let dims: Vec<u64> = entry["dims"]
            .as_array()
            .expect("dims")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(info.dims, dims, "{file}");

        let expected = read_f32(&fixtures().join(entry["expected"].as_str().expect("expected")));
        let got = gguf.dequantize("weight").expect("dequantizes");
        assert_eq!(got.len(), expected.len(), "{file}");
        assert_eq!(
            bits(&got),
            bits(&expected),
            "{file}: values differ from the reference"
        );

        // The device engine keeps Q8_0 and Q4_0 in their blocks: the integers and
        // scales it uploads give the reference's values bit for bit.
        if DeviceBlocks::supports(info.ggml_type) && info.dims.len() == 2 {
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let b = DeviceBlocks::from_gguf(info.ggml_type, rows, cols, gguf.tensor_bytes(info))
                .expect("blocks");
            assert_eq!(b.ggml_type(), info.ggml_type);
            let order: Vec<usize> = (0..rows).rev().collect();
            let reversed = b.select_rows(&order).into_dense();
            assert_eq!(bits(&b.clone().into_dense()), bits(&expected), "{file}");
            for (r, &src) in order.iter().enumerate() {
                assert_eq!(
                    bits(&reversed[r * cols..(r + 1) * cols]),
                    bits(&expected[src * cols..(src + 1) * cols]),
                    "{file}: row {r}"
                );
            }
            // Parts stacked in order, each with its own rows' scales.
            let both = DeviceBlocks::concat_rows(vec![b.clone(), b.select_rows(&order)])
                .expect("one type");
            assert_eq!(both.rows(), 2 * rows);
            let both = both.into_dense();
            assert_eq!(bits(&both[..rows * cols]), bits(&expected), "{file}");
            assert_eq!(bits(&both[rows * cols..]), bits(&reversed), "{file}");
            // Blocks shorter than the matrix are refused, not read past.
            let bytes = gguf.tensor_bytes(info);
            let short = &bytes[..bytes.len() - 1];
            assert!(DeviceBlocks::from_gguf(info.ggml_type, rows, cols, short).is_none());
        }

        // The host engine keeps these blocks as they are: their rows read back as the
        // reference's values (up to one fused multiply-add's rounding where a block has
        // a minimum).
        if QMatrix::supports(info.ggml_type) && info.dims.len() == 2 {
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let q = QMatrix::from_gguf(info.ggml_type, rows, cols, gguf.tensor_bytes(info))
                .expect("repacks");
            for r in 0..rows {
                for (a, b) in q.row(r).iter().zip(&expected[r * cols..(r + 1) * cols]) {
                    assert!(
                        (a - b).abs() <= b.abs() * 2e-7 + 1e-9,
                        "{file}: row {r}: {a} vs {b}"
                    );
                }
            }
        }

        // Where the reference also quantized real weights, our quantizer must agree byte
        // for byte.
        if let Some(quantized) = entry["quantized_source"].as_str() {
            let source = gguf.dequantize("source").expect("source is f32");
            let want = gguf.tensor(quantized).expect("quantized tensor");
            let ours = writer::quantize(want.ggml_type, &source).expect("quantizes");
            assert!(ours == gguf.tensor_bytes(want), "{file}: quantizer differs");
        }
    }
}

/// A metadata value from the tagged JSON form `{"type": "U8", "value": 200}`.
fn meta_from_json(v: &Value) -> MetaValue {
    let val = &v["value"];
    let int = || val.as_i64().expect("integer");
    match v["type"].as_str().expect("type tag") {
        "U8" => MetaValue::U8(int() as u8),
        "I8" => MetaValue::I8(int() as i8),
        "U16" => MetaValue::U16(int() as u16),
        "I16" => MetaValue::I16(int() as i16),
        "U32" => MetaValue::U32(int() as u32),
        "I32" => MetaValue::I32(int() as i32),
        "U64" => MetaValue::U64(val.as_u64().expect("u64")),
        "I64" => MetaValue::I64(int()),
        "F32" => MetaValue::F32(val.as_f64().expect("float") as f32),
        "F64" => MetaValue::F64(val.as_f64().expect("float")),
        "Bool" => MetaValue::Bool(val.as_bool().expect("bool")),
        "String" => MetaValue::String(val.as_str().expect("string").to_owned()),
        "Array" => MetaValue::Array(
            val.as_array()
                .expect("array")
                .iter()
                .map(meta_from_json)
                .collect(),
        ),
        other => panic!("unknown tag {other}"),
    }
}

#[test]
fn metadata_written_by_the_reference_reads_back() {
    let doc = read_json(&fixtures().join("metadata.json"));
    let gguf = GgufFile::open(&fixtures().join("metadata.gguf")).expect("fixture opens");
    let expected: BTreeMap<String, MetaValue> = doc["metadata"]
        .as_object()
        .expect("metadata object")
        .iter()
        .map(|(k, v)| (k.clone(), meta_from_json(v)))
        .collect();
    assert_eq!(gguf.metadata(), &expected);

    assert_eq!(gguf.alignment(), 64);
    assert_eq!(gguf.data_offset() % 64, 0);
    assert_eq!(
        gguf.get_u64("test.u64").ok(),
        Some(18_000_000_000_000_000_000)
    );
    assert_eq!(gguf.get_f64("test.f32").ok(), Some(f64::from(0.1f32)));
    assert_eq!(gguf.get_bool("test.bool_true").ok(), Some(true));
    assert_eq!(
        gguf.get_str_array("test.array_str").ok(),
        Some(vec!["a", "", "ü"])
    );
    assert_eq!(kind(gguf.get_u64("test.i8")), "wrong_type");
    assert_eq!(kind(gguf.get_str("test.u8")), "wrong_type");
    assert_eq!(kind(gguf.get_str_array("test.array_i32")), "wrong_type");
    assert_eq!(kind(gguf.get_bool("no.such.key")), "missing_key");

    for t in doc["tensors"].as_array().expect("tensors") {
        let name = t["name"].as_str().expect("name");
        let info = gguf.tensor(name).expect("tensor present");
        assert_eq!(info.offset % 64, 0);
        let want: Vec<f32> = t["values"]
            .as_array()
            .expect("values")
            .iter()
            .filter_map(Value::as_f64)
            .map(|v| v as f32)
            .collect();
        assert_eq!(gguf.dequantize(name).expect("f32"), want);
    }
    assert_eq!(kind(gguf.dequantize("missing")), "missing_tensor");
}

/// Metadata of every value type, for the writer round trip.
fn all_kinds_of_metadata() -> Vec<(&'static str, MetaValue)> {
    vec![
        ("general.architecture", MetaValue::String("test".into())),
        ("t.u8", MetaValue::U8(255)),
        ("t.i8", MetaValue::I8(-128)),
        ("t.u16", MetaValue::U16(65535)),
        ("t.i16", MetaValue::I16(-32768)),
        ("t.u32", MetaValue::U32(u32::MAX)),
        ("t.i32", MetaValue::I32(i32::MIN)),
        ("t.u64", MetaValue::U64(u64::MAX)),
        ("t.i64", MetaValue::I64(i64::MIN)),
        ("t.f32", MetaValue::F32(-1.5e-7)),
        ("t.f64", MetaValue::F64(std::f64::consts::PI)),
        ("t.bool", MetaValue::Bool(true)),
        ("t.string", MetaValue::String("ünïcode ✓\n".into())),
        ("t.empty_string", MetaValue::String(String::new())),
        ("t.empty_array", MetaValue::Array(vec![])),
        (
            "t.nested",
            MetaValue::Array(vec![
                MetaValue::Array(vec![MetaValue::I64(-1), MetaValue::I64(2)]),
                MetaValue::Array(vec![]),
            ]),
        ),
    ]
}

fn wave(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 + seed as f32) * 0.731).sin() * 0.05 + 0.001 * (i % 13) as f32)
        .collect()
}

#[test]
fn writer_round_trip() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in all_kinds_of_metadata() {
        w.add_metadata(k, v).expect("metadata");
    }
    let cases = [
        (GgmlType::F32, 0.0f32),
        (GgmlType::F16, 1e-4),
        (GgmlType::BF16, 1e-3),
        (GgmlType::Q8_0, 1e-3),
        (GgmlType::Q4_0, 2e-2),
        (GgmlType::Q4_1, 1e-2),
    ];
    let dims = [64u64, 3];
    for (i, (ty, _)) in cases.iter().enumerate() {
        w.add_tensor(format!("t.{}", ty.name()), &dims, *ty, &wave(192, i as u32))
            .expect("tensor");
    }
    w.add_tensor("scalar", &[], GgmlType::F32, &[7.0])
        .expect("0-d tensor");
    w.write_to(&path).expect("written");

    let gguf = GgufFile::open(&path).expect("reads back");
    assert_eq!(gguf.version(), 3);
    let expected: BTreeMap<String, MetaValue> = all_kinds_of_metadata()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    assert_eq!(gguf.metadata(), &expected);
    assert_eq!(gguf.tensors().len(), cases.len() + 1);
    for (i, (ty, tol)) in cases.iter().enumerate() {
        let name = format!("t.{}", ty.name());
        let info = gguf.tensor(&name).expect("tensor");
        assert_eq!((info.ggml_type, info.dims.as_slice()), (*ty, &dims[..]));
        assert_eq!(info.offset % 32, 0);
        let x = wave(192, i as u32);
        let y = gguf.dequantize(&name).expect("dequantizes");
        let err = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= *tol, "{name}: max error {err} > {tol}");
        if *ty == GgmlType::F32 {
            assert_eq!(bits(&x), bits(&y));
        }
    }
    assert_eq!(gguf.dequantize("scalar").expect("f32"), vec![7.0]);
}

/// A hand-built GGUF image, for damaged and hostile files.
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend(s.as_bytes());
        self
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self) -> &mut Self {
        while !self.0.len().is_multiple_of(32) {
            self.0.push(0);
        }
        self
    }
    fn data(&mut self, n: usize) -> &mut Self {
        self.0.extend((0..n).map(|i| i as u8));
        self
    }
    fn open(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.0.clone())
    }
}

#[test]
fn hand_built_file_reads() {
    let mut r = Raw::new(3, 1, 1);
    r.str("general.architecture").u32(8).str("llama");
    r.tensor("w", &[4, 2], 0, 0).pad().data(32);
    let g = r.open().expect("valid");
    assert_eq!(g.get_str("general.architecture").ok(), Some("llama"));
    let t = g.tensor("w").expect("tensor");
    assert_eq!(
        (t.n_elements, t.n_bytes, t.offset),
        (8, 32, g.data_offset())
    );
    assert_eq!(g.tensor_bytes(t).len(), 32);
}

#[test]
fn missing_file_is_an_open_error() {
    let err = GgufFile::open(Path::new("no/such/file.gguf")).expect_err("missing");
    assert_eq!(err.kind(), "open");
    assert!(err.to_string().contains("no/such/file.gguf"));
}

#[test]
fn every_truncation_is_an_error() {
    for name in ["metadata.gguf", "q4_k.gguf", "q4_1.gguf"] {
        let bytes = std::fs::read(fixtures().join(name)).expect("fixture");
        let full = GgufFile::from_bytes(bytes.clone()).expect("fixture parses");
        // Cutting inside the trailing padding still leaves every tensor whole.
        let data_end = full
            .tensors()
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .expect("has tensors") as usize;
        for cut in 0..bytes.len() {
            let r = GgufFile::from_bytes(bytes[..cut].to_vec());
            if cut < data_end {
                assert!(r.is_err(), "{name} cut at {cut} parsed");
            } else {
                assert!(r.is_ok(), "{name} cut at {cut} in the padding failed");
            }
        }
    }
    // And through the file system, for a few cuts.
    let dir = tempfile::tempdir().expect("temp dir");
    let bytes = std::fs::read(fixtures().join("metadata.gguf")).expect("fixture");
    for cut in [0, 1, 3, 4, 8, 23, 24, 100, bytes.len() - 100] {
        let path = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).expect("write");
        let err = GgufFile::open(&path).expect_err("truncated");
        assert!(
            matches!(
                err.kind(),
                "truncated" | "too_large" | "tensor_out_of_bounds"
            ),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn corrupt_magic_and_versions() {
    let mut bytes = std::fs::read(fixtures().join("f32.gguf")).expect("fixture");
    bytes[0] = b'X';
    let err = GgufFile::from_bytes(bytes.clone()).expect_err("bad magic");
    assert_eq!(err.kind(), "not_gguf");
    bytes[0] = b'G';
    for (version, ok) in [
        (2u32, true),
        (3, true),
        (1, false),
        (4, false),
        (0x0300_0000, false),
    ] {
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        match GgufFile::from_bytes(bytes.clone()) {
            Ok(g) => {
                assert!(ok, "version {version} accepted");
                assert_eq!(g.version(), version);
                assert_eq!(g.dequantize("weight").expect("f32").len(), 2304);
            }
            Err(GgufError::UnsupportedVersion(v)) => assert!(!ok && v == version),
            Err(e) => panic!("version {version}: {e}"),
        }
    }
}

#[test]
fn tensor_past_the_end_is_rejected() {
    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[8], 0, 0).pad().data(31); // needs 32 bytes
    let err = r.open().expect_err("out of bounds");
    assert_eq!(err.kind(), "tensor_out_of_bounds");
    assert!(err.to_string().contains("`w`"));

    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[8], 0, u64::MAX - 31).pad().data(32);
    assert_eq!(kind(r.open()), "tensor_out_of_bounds");

    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[8], 0, 16).pad().data(64);
    assert_eq!(kind(r.open()), "misaligned_tensor");
}

#[test]
fn huge_counts_are_errors_not_allocations() {
    let huge = 1u64 << 60;
    assert_eq!(kind(Raw::new(3, huge, 0).open()), "too_large");
    assert_eq!(kind(Raw::new(3, 0, huge).open()), "too_large");
    assert_eq!(kind(Raw::new(3, u64::MAX, u64::MAX).open()), "too_large");

    // String length.
    let mut r = Raw::new(3, 0, 1);
    r.u64(huge).data(64);
    assert_eq!(kind(r.open()), "truncated");
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(8).u64(u64::MAX).data(64);
    assert_eq!(kind(r.open()), "truncated");

    // Array length, flat and nested.
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(9).u32(0).u64(huge).data(64);
    assert_eq!(kind(r.open()), "too_large");
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(9).u32(9).u64(1).u32(4).u64(huge).data(64);
    assert_eq!(kind(r.open()), "too_large");

    // Arrays nested without end.
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(9);
    for _ in 0..10_000 {
        r.u32(9).u64(1);
    }
    assert_eq!(kind(r.open()), "too_large");

    // Dimensions whose product overflows, and too many dimensions.
    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[1 << 40, 1 << 40], 0, 0).pad();
    assert_eq!(kind(r.open()), "too_large");
    let mut r = Raw::new(3, 1, 0);
    r.str("w").u32(u32::MAX).data(64);
    assert_eq!(kind(r.open()), "bad_shape");

    // A huge element count through the dequantizer's own API.
    assert!(dequant::dequantize(GgmlType::Q8_0, &[0; 34], usize::MAX).is_err());
}

#[test]
fn other_structural_errors() {
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert_eq!(kind(r.open()), "unknown_value_type");

    let mut r = Raw::new(3, 0, 2);
    r.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    assert_eq!(kind(r.open()), "duplicate_key");

    let mut r = Raw::new(3, 2, 0);
    r.tensor("w", &[8], 0, 0)
        .tensor("w", &[8], 0, 32)
        .pad()
        .data(64);
    assert_eq!(kind(r.open()), "duplicate_tensor");

    for alignment in [0u32, 3, 48] {
        let mut r = Raw::new(3, 0, 1);
        r.str("general.alignment").u32(4).u32(alignment);
        assert_eq!(kind(r.open()), "bad_alignment", "alignment {alignment}");
    }

    let mut r = Raw::new(3, 0, 1);
    r.u64(2).0.extend([0xff, 0xfe]);
    r.u32(4).u32(1);
    assert_eq!(kind(r.open()), "invalid_utf8");

    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[31], 8, 0).pad().data(64); // Q8_0 rows must be whole blocks
    assert_eq!(kind(r.open()), "bad_shape");
}

#[test]
fn unsupported_quant_types() {
    // An id GGUF does not (or no longer) define: the tensor cannot even be sized.
    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[32], 4, 0).pad().data(64);
    match r.open() {
        Err(GgufError::UnsupportedType { name, type_id, .. }) => {
            assert_eq!((name.as_str(), type_id), ("w", 4));
        }
        other => panic!("expected unsupported_type, got {other:?}"),
    }
    // A known type without a dequantizer: the file opens, dequantizing fails.
    let mut r = Raw::new(3, 1, 0);
    r.tensor("w", &[256], 10, 0).pad().data(84).pad();
    let g = r.open().expect("Q2_K sizes are known");
    assert_eq!(g.tensor("w").map(|t| t.n_bytes), Some(84));
    let err = g.dequantize("w").expect_err("no Q2_K dequantizer");
    assert_eq!(err.kind(), "unsupported_type");
    assert!(err.to_string().contains("`w`") && err.to_string().contains("q2_K"));
}

#[test]
fn byte_mutations_never_panic() {
    let base = std::fs::read(fixtures().join("metadata.gguf")).expect("fixture");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..20_000 {
        let mut bytes = base.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % bytes.len() as u64) as usize;
            bytes[i] = match next() % 3 {
                0 => next() as u8,
                1 => 0xff,
                _ => bytes[i] ^ (1 << (next() % 8)),
            };
        }
        if let Ok(g) = GgufFile::from_bytes(bytes) {
            for t in g.tensors() {
                let _ = g.dequantize_tensor(t);
            }
        }
    }
}

/// The default model, when the repository has it.
#[test]
fn default_model_when_present() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipping: {} is absent", path.display());
        return;
    }
    let g = GgufFile::open(&path).expect("default model opens");
    assert_eq!(g.version(), 3);
    assert_eq!(g.tensors().len(), 272);
    assert_eq!(g.metadata().len(), 33);
    assert_eq!(g.get_str("general.architecture").ok(), Some("llama"));
    for (key, want) in [
        ("llama.block_count", 30),
        ("llama.context_length", 8192),
        ("llama.embedding_length", 576),
        ("llama.feed_forward_length", 1536),
        ("llama.attention.head_count", 9),
        ("llama.attention.head_count_kv", 3),
        ("llama.rope.dimension_count", 64),
        ("llama.vocab_size", 49152),
        ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2),
    ] {
        assert_eq!(g.get_u64(key).ok(), Some(want), "{key}");
    }
    assert_eq!(g.get_f64("llama.rope.freq_base").ok(), Some(100000.0));
    assert_eq!(
        g.get_f64("llama.attention.layer_norm_rms_epsilon").ok(),
        Some(f64::from(1e-5f32))
    );
    assert_eq!(g.get_str("tokenizer.ggml.model").ok(), Some("gpt2"));
    assert_eq!(g.get_str("tokenizer.ggml.pre").ok(), Some("smollm"));
    assert_eq!(g.get_bool("tokenizer.ggml.add_bos_token").ok(), Some(false));
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens")
            .map(|t| t.len())
            .ok(),
        Some(49152)
    );
    assert_eq!(
        g.get_str_array("tokenizer.ggml.merges")
            .map(|t| t.len())
            .ok(),
        Some(48900)
    );

    let count = |ty| g.tensors().iter().filter(|t| t.ggml_type == ty).count();
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::F32),
            count(GgmlType::Q8_0)
        ),
        (210, 61, 1)
    );
    assert!(g.tensor("output.weight").is_none());

    // The fixtures hold the first rows of these tensors, dequantized by the reference.
    let embd = g.tensor("token_embd.weight").expect("embedding");
    assert_eq!(embd.dims, vec![576, 49152]);
    let all = g.dequantize("token_embd.weight").expect("dequantizes");
    assert_eq!(all.len(), 576 * 49152);
    let want = read_f32(&fixtures().join("q8_0.f32"));
    assert_eq!(bits(&all[..want.len()]), bits(&want));
    let q = g.dequantize("blk.0.attn_q.weight").expect("dequantizes");
    let want = read_f32(&fixtures().join("q4_1.f32"));
    assert_eq!(bits(&q[..want.len()]), bits(&want));
}
