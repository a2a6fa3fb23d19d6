//! The forward pass, KV cache, batching and load errors on tiny random-weight models
//! written for the test: no real model needed.

use std::path::{Path, PathBuf};

use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        gguf::{GgmlType, GgufFile, GgufWriter, MetaValue},
        llama::{
            load::load_llama,
            synthetic::{write_synthetic_llama, SyntheticSpec},
            KvDtype, Llama, SeqInput, WeightDtype,
        },
        Engine, EngineError, FinishReason, GenerateParams, Prompt, TokenEvent,
    },
};
use tempfile::TempDir;

fn tiny(dir: &TempDir, spec: &SyntheticSpec) -> PathBuf {
    let path = dir.path().join("tiny.gguf");
    write_synthetic_llama(&path, spec).expect("write tiny model");
    path
}

fn load(path: &Path, dtype: WeightDtype) -> Llama<B> {
    let gguf = GgufFile::open(path).expect("open");
    load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {}).expect("load")
}

fn logits(model: &Llama<B>, seqs: &mut [SeqInput<'_, B>]) -> Vec<Vec<f32>> {
    Llama::<B>::logits_to_host(model.forward(seqs).expect("forward"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn cached_decode_equals_full_prefill() {
    let dir = TempDir::new().expect("tempdir");
    let model = load(&tiny(&dir, &SyntheticSpec::tiny(1)), WeightDtype::F32);
    let tokens: Vec<u32> = (0..20).map(|i| (i * 37 % 300) as u32 + 3).collect();
    for split in [1, 5, 19] {
        let mut full_cache = model.new_cache();
        let full = logits(
            &model,
            &mut [SeqInput {
                tokens: &tokens,
                cache: &mut full_cache,
            }],
        );
        // Prefill part of the sequence, then one token at a time.
        let mut cache = model.new_cache();
        let mut last = logits(
            &model,
            &mut [SeqInput {
                tokens: &tokens[..split],
                cache: &mut cache,
            }],
        );
        for t in &tokens[split..] {
            last = logits(
                &model,
                &mut [SeqInput {
                    tokens: std::slice::from_ref(t),
                    cache: &mut cache,
                }],
            );
        }
        assert_eq!(cache.len(), tokens.len());
        let d = max_diff(&full[0], &last[0]);
        assert!(
            d < 1e-4,
            "split {split}: cached and full logits differ by {d}"
        );
    }
}

#[test]
fn a_batch_equals_its_sequences_run_alone() {
    let dir = TempDir::new().expect("tempdir");
    let model = load(&tiny(&dir, &SyntheticSpec::tiny(2)), WeightDtype::F32);
    let a: Vec<u32> = vec![10, 20, 30, 40, 50, 60, 70];
    let b: Vec<u32> = vec![5, 6];
    let c: Vec<u32> = vec![100];
    let alone: Vec<Vec<f32>> = [&a, &b, &c]
        .iter()
        .map(|t| {
            let mut cache = model.new_cache();
            logits(
                &model,
                &mut [SeqInput {
                    tokens: t,
                    cache: &mut cache,
                }],
            )
            .remove(0)
        })
        .collect();
    let (mut ca, mut cb, mut cc) = (model.new_cache(), model.new_cache(), model.new_cache());
    let together = logits(
        &model,
        &mut [
            SeqInput {
                tokens: &a,
                cache: &mut ca,
            },
            SeqInput {
                tokens: &b,
                cache: &mut cb,
            },
            SeqInput {
                tokens: &c,
                cache: &mut cc,
            },
        ],
    );
    for (x, y) in alone.iter().zip(&together) {
        assert!(max_diff(x, y) < 1e-4);
    }
    // A decode step mixing sequences at different positions.
    let step = logits(
        &model,
        &mut [
            SeqInput {
                tokens: &[7],
                cache: &mut ca,
            },
            SeqInput {
                tokens: &[8, 9],
                cache: &mut cb,
            },
        ],
    );
    let mut solo = model.new_cache();
    let mut seq_a = a.clone();
    seq_a.push(7);
    let ref_a = logits(
        &model,
        &mut [SeqInput {
            tokens: &seq_a,
            cache: &mut solo,
        }],
    );
    assert!(max_diff(&step[0], &ref_a[0]) < 1e-4);
}

#[test]
fn f16_weights_stay_close_to_f32() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(3));
    let tokens: Vec<u32> = (3..40).collect();
    let run = |dtype| {
        let model = load(&path, dtype);
        let mut cache = model.new_cache();
        logits(
            &model,
            &mut [SeqInput {
                tokens: &tokens,
                cache: &mut cache,
            }],
        )
        .remove(0)
    };
    let d = max_diff(&run(WeightDtype::F32), &run(WeightDtype::F16));
    assert!(d < 2e-2, "f16 logits differ from f32 by {d}");
}

#[test]
fn untied_and_quantized_models_load_and_run() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::F16] {
        let dir = TempDir::new().expect("tempdir");
        let mut spec = SyntheticSpec::tiny(4);
        spec.weight_type = ty;
        spec.untied_output = true;
        let model = load(&tiny(&dir, &spec), WeightDtype::F32);
        let mut cache = model.new_cache();
        let out = logits(
            &model,
            &mut [SeqInput {
                tokens: &[3, 4, 5],
                cache: &mut cache,
            }],
        );
        assert_eq!(out[0].len(), 320);
        assert!(out[0].iter().all(|v| v.is_finite()), "{ty:?}");
    }
}

/// The fingerprint, root of every stream's hash chain, names the arithmetic too: the
/// same file and settings give the same one, another weight format or (on the host path)
/// another KV cache type another one, so that a worker never takes over a stream it
/// would continue differently.
#[test]
fn fingerprints_name_the_weights_and_their_arithmetic() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(5));
    let load = |dtype: WeightDtype, kv: KvDtype| {
        let mut engine = Engine::<B>::load(&path, dtype, &Default::default()).expect("load");
        engine.set_kv_dtype(kv);
        engine.fingerprint()
    };
    let base = load(WeightDtype::NativeI16, KvDtype::F16);
    assert_eq!(base, load(WeightDtype::NativeI16, KvDtype::F16));
    assert_ne!(base, load(WeightDtype::NativeI16, KvDtype::F32));
    assert_ne!(base, load(WeightDtype::Native, KvDtype::F16));
    assert_ne!(base, load(WeightDtype::F32, KvDtype::F16));
    // The device engine's store keeps the KV dtype too, so its fingerprint names it.
    assert_ne!(
        load(WeightDtype::F32, KvDtype::F16),
        load(WeightDtype::F32, KvDtype::F32)
    );
    // Setting the type back gives the first fingerprint again.
    let mut engine =
        Engine::<B>::load(&path, WeightDtype::NativeI16, &Default::default()).expect("load");
    engine.set_kv_dtype(KvDtype::F32);
    engine.set_kv_dtype(KvDtype::F16);
    assert_eq!(engine.fingerprint(), base);
}

#[test]
fn engine_generates_and_honours_limits() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(5));
    let engine = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("load");
    let ids = engine
        .encode_prompt(&Prompt::Text("hello world".into()))
        .expect("encode");
    assert!(!ids.is_empty());

    // max_tokens
    let params = GenerateParams {
        max_tokens: 5,
        ignore_eos: true,
        ..Default::default()
    };
    let mut streamed = Vec::new();
    let out = engine
        .generate(ids.clone(), params.clone(), &mut |ev| {
            streamed.push(ev.clone())
        })
        .expect("generate");
    assert_eq!(out.ids.len(), 5);
    assert_eq!(out.finish, FinishReason::MaxTokens);
    assert_eq!(streamed.iter().map(|e| e.id).collect::<Vec<_>>(), out.ids);
    let streamed_text: String = streamed.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(streamed_text, out.text);
    // Greedy is deterministic.
    let again = engine
        .generate(ids.clone(), params, &mut |_| {})
        .expect("generate");
    assert_eq!(again.ids, out.ids);

    // Context length: the tiny model holds 64 positions.
    let long = GenerateParams {
        max_tokens: 1000,
        ignore_eos: true,
        ..Default::default()
    };
    let out = engine
        .generate(ids.clone(), long, &mut |_| {})
        .expect("generate");
    assert_eq!(out.finish, FinishReason::ContextFull);
    assert_eq!(ids.len() + out.ids.len(), 64);

    // A prompt longer than the context is refused before any work.
    let too_long: Vec<u32> = vec![5; 80];
    match engine.start(too_long, GenerateParams::default()) {
        Err(EngineError::PromptTooLong {
            prompt: 80,
            context: 64,
        }) => {}
        other => panic!("expected PromptTooLong, got {:?}", other.err()),
    }
    assert!(matches!(
        engine.start(vec![], GenerateParams::default()),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        engine.start(vec![1_000_000], GenerateParams::default()),
        Err(EngineError::Forward(_))
    ));

    // Seeded sampling is reproducible and depends on the seed.
    let sampled = |seed| {
        let mut p = GenerateParams {
            max_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        };
        p.sampling.temperature = 1.5;
        p.sampling.seed = seed;
        engine
            .generate(ids.clone(), p, &mut |_| {})
            .expect("generate")
            .ids
    };
    assert_eq!(sampled(7), sampled(7));
    assert_ne!(sampled(7), sampled(8));
}

#[test]
fn stop_strings_cut_the_text() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(6));
    let engine = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("load");
    let ids = engine
        .encode_prompt(&Prompt::Text("abc".into()))
        .expect("encode");
    let free = GenerateParams {
        max_tokens: 30,
        ignore_eos: true,
        ..Default::default()
    };
    let full = engine
        .generate(ids.clone(), free.clone(), &mut |_| {})
        .expect("generate");
    // Stop on a piece of the text the model produces anyway, past its first character.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(
        chars.len() > 4,
        "tiny model produced too little text: {:?}",
        full.text
    );
    let stop: String = chars[2..4].iter().collect();
    let cut = full.text.find(&stop).expect("stop string is in the text");
    let mut params = free;
    params.stop = vec![stop];
    let mut streamed = String::new();
    let out = engine
        .generate(ids, params, &mut |ev| streamed.push_str(&ev.text))
        .expect("generate");
    assert_eq!(out.finish, FinishReason::StopString);
    assert_eq!(out.text, full.text[..cut]);
    assert_eq!(streamed, out.text);
}

#[test]
fn bad_model_files_give_clear_errors() {
    let dir = TempDir::new().expect("tempdir");
    let good = tiny(&dir, &SyntheticSpec::tiny(7));
    let device = Default::default();
    let err = |path: &Path| match Engine::<B>::load(path, WeightDtype::F32, &device) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    };

    // Missing file.
    let e = err(&dir.path().join("absent.gguf"));
    assert!(
        e.to_string().contains("absent.gguf") || e.kind() == "io",
        "{e}"
    );

    // Truncated file.
    let bytes = std::fs::read(&good).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).expect("write");
    err(&cut);

    // Corrupt magic.
    let mut bad = bytes.clone();
    bad[0] = b'X';
    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, &bad).expect("write");
    err(&corrupt);

    // Another architecture, a missing tensor and a damaged block count, built by
    // rewriting the metadata.
    let src = GgufFile::open(&good).expect("open");
    let rewrite =
        |name: &str, meta: (&str, MetaValue), skip: Option<&str>, retype: Option<GgmlType>| {
            let mut w = GgufWriter::new();
            for (k, v) in src.metadata() {
                let v = if k == meta.0 {
                    meta.1.clone()
                } else {
                    v.clone()
                };
                w.add_metadata(k.clone(), v).expect("metadata");
            }
            for t in src.tensors() {
                if Some(t.name.as_str()) == skip {
                    continue;
                }
                if t.name == "blk.0.attn_q.weight" {
                    if let Some(ty) = retype {
                        let n = t.dims.iter().product::<u64>();
                        let size = ty.bytes_for(n).expect("known size") as usize;
                        w.add_tensor_bytes(t.name.clone(), &t.dims, ty, vec![0; size])
                            .expect("tensor");
                        continue;
                    }
                }
                let values = src.dequantize(&t.name).expect("dequantize");
                w.add_tensor(t.name.clone(), &t.dims, t.ggml_type, &values)
                    .expect("tensor");
            }
            let path = dir.path().join(name);
            w.write_to(&path).expect("write");
            path
        };
    let arch = |a: &str| ("general.architecture", MetaValue::String(a.into()));
    let e = err(&rewrite("arch.gguf", arch("mamba"), None, None));
    assert!(e.to_string().contains("mamba"), "{e}");
    let e = err(&rewrite(
        "missing.gguf",
        arch("llama"),
        Some("blk.1.ffn_up.weight"),
        None,
    ));
    assert!(e.to_string().contains("blk.1.ffn_up.weight"), "{e}");
    // A block count no tensor table backs is refused before anything is sized by it.
    let blocks = ("llama.block_count", MetaValue::U32(u32::MAX));
    let e = err(&rewrite("blocks.gguf", blocks, None, None));
    assert_eq!(e.kind(), "invalid_config", "{e}");
}

/// Runs `ids` to completion and returns every token event.
fn events(engine: &Engine<B>, ids: &[u32], params: &GenerateParams) -> Vec<TokenEvent> {
    let mut out = Vec::new();
    engine
        .generate(ids.to_vec(), params.clone(), &mut |ev| out.push(ev.clone()))
        .expect("generate");
    out
}

#[test]
fn a_stream_resumed_at_any_position_goes_on_exactly_as_the_original() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(8));
    let engine = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("load");
    let ids = engine
        .encode_prompt(&Prompt::Text("once upon".into()))
        .expect("encode");
    let greedy = GenerateParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let mut sampled = greedy.clone();
    sampled.sampling.temperature = 1.2;
    sampled.sampling.top_p = 0.9;
    sampled.sampling.seed = 1234;
    sampled.sampling.repetition_penalty = 1.1;
    // A stop string from the sampled text itself, so the stop matcher holds text back
    // across the cut points.
    let text: String = events(&engine, &ids, &sampled)
        .iter()
        .map(|e| e.text.as_str())
        .collect();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "tiny model produced too little text");
    let mut stopped = sampled.clone();
    stopped.stop = vec![chars[8..11].iter().collect()];

    for params in [&greedy, &sampled, &stopped] {
        let original = events(&engine, &ids, params);
        for cut in 0..=original.len() {
            let done: Vec<u32> = original[..cut].iter().map(|e| e.id).collect();
            let mut seq = match engine.resume(ids.clone(), &done, params.clone()) {
                Ok(seq) => seq,
                Err(e) => panic!("resume at {cut}: {e}"),
            };
            let mut rest = Vec::new();
            engine
                .run(&mut seq, &mut |ev| rest.push(ev.clone()))
                .expect("run");
            assert_eq!(
                rest,
                original[cut..],
                "resumed at {cut} of {}",
                original.len()
            );
            assert_eq!(seq.generated().len(), original.len());
        }
        // Tokens past the end are refused.
        let mut past: Vec<u32> = original.iter().map(|e| e.id).collect();
        past.push(past[0]);
        assert!(matches!(
            engine.resume(ids.clone(), &past, params.clone()),
            Err(EngineError::ResumePastEnd { .. })
        ));
    }
}

#[test]
fn sampled_sequences_stepped_together_draw_what_each_draws_alone() {
    // Several sequences at temperature > 0 in one step take their draws in parallel;
    // each must still get exactly the tokens it gets alone.
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(11));
    let engine =
        Engine::<B>::load(&path, WeightDtype::NativeI16, &Default::default()).expect("load");
    let prompts = ["once upon", "hello world", "a b c d", "the end"];
    let params = |i: usize| {
        let mut p = GenerateParams {
            max_tokens: 20,
            ignore_eos: true,
            ..Default::default()
        };
        p.sampling.temperature = 0.6 + 0.3 * i as f32;
        p.sampling.top_p = if i.is_multiple_of(2) { 1.0 } else { 0.85 };
        p.sampling.repetition_penalty = if i == 3 { 1.2 } else { 1.0 };
        p.sampling.seed = 100 + i as u64;
        p
    };
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            engine
                .encode_prompt(&Prompt::Text((*p).into()))
                .expect("encode")
        })
        .collect();
    let alone: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| {
            engine
                .generate(ids[i].clone(), params(i), &mut |_| {})
                .expect("generate")
                .ids
        })
        .collect();
    let mut seqs: Vec<_> = (0..prompts.len())
        .map(|i| engine.start(ids[i].clone(), params(i)).expect("start"))
        .collect();
    let mut together = vec![Vec::new(); prompts.len()];
    loop {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let events = engine.step(&mut refs).expect("step");
        for (i, ev) in events.into_iter().enumerate() {
            if let Some(ev) = ev {
                together[i].push(ev.id);
            }
        }
        if seqs.iter().all(|s| s.finish_reason().is_some()) {
            break;
        }
    }
    assert_eq!(together, alone);
    // The draws are not all the greedy choice: sampling was exercised.
    let greedy = engine
        .generate(
            ids[0].clone(),
            GenerateParams {
                max_tokens: 20,
                ignore_eos: true,
                ..Default::default()
            },
            &mut |_| {},
        )
        .expect("generate")
        .ids;
    assert_ne!(alone[0], greedy);
}

/// A scored prompt (a completion's `echo`) gets each of its tokens' log-probability
/// given the tokens before it, equal to what a forward pass over that prefix gives; it
/// runs one token a step, which changes nothing it generates after; with `max_tokens` 0
/// it generates nothing. On the host path and the burn path.
#[test]
fn a_scored_prompt_gets_each_tokens_logprob() {
    let dir = TempDir::new().expect("tempdir");
    let path = tiny(&dir, &SyntheticSpec::tiny(8));
    for dtype in [WeightDtype::Native, WeightDtype::F32] {
        let engine = Engine::<B>::load(&path, dtype, &Default::default()).expect("load");
        let model = load(&path, dtype);
        let ids = engine
            .encode_prompt(&Prompt::Text("the quick brown fox jumps".into()))
            .expect("encode");
        assert!(ids.len() > 4, "{ids:?}");
        let scoring = GenerateParams {
            max_tokens: 0,
            prompt_logprobs: Some(3),
            ..Default::default()
        };
        let out = engine
            .generate(ids.clone(), scoring.clone(), &mut |_| {})
            .expect("score");
        assert!(out.ids.is_empty(), "{:?}", out.ids);
        assert_eq!(out.finish, FinishReason::MaxTokens);
        assert_eq!(out.prompt_logprobs.len(), ids.len() - 1);
        for (i, entry) in out.prompt_logprobs.iter().enumerate() {
            let mut cache = model.new_cache();
            let row = logits(
                &model,
                &mut [SeqInput {
                    tokens: &ids[..=i],
                    cache: &mut cache,
                }],
            )
            .remove(0);
            let (want, top) = baton_worker::engine::sampler::logprobs(&row, ids[i + 1], 3);
            assert!(
                (entry.logprob - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{dtype:?} token {}: {} against {want}",
                i + 1,
                entry.logprob
            );
            assert_eq!(entry.top.len(), 3);
            assert_eq!(
                entry.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                top.iter().map(|t| t.0).collect::<Vec<_>>()
            );
        }
        // Scoring first changes nothing generated after.
        let plain = GenerateParams {
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        };
        let scored_then = GenerateParams {
            prompt_logprobs: Some(0),
            ..plain.clone()
        };
        let a = engine
            .generate(ids.clone(), plain, &mut |_| {})
            .expect("plain");
        let b = engine
            .generate(ids.clone(), scored_then, &mut |_| {})
            .expect("scored");
        assert_eq!(a.ids, b.ids, "{dtype:?}");
        assert_eq!(b.prompt_logprobs.len(), ids.len() - 1);
        // Without scoring, max_tokens 0 is refused.
        let zero = GenerateParams {
            max_tokens: 0,
            ..Default::default()
        };
        assert!(matches!(
            engine.start(ids.clone(), zero),
            Err(EngineError::ZeroMaxTokens)
        ));
    }
}
