//! The device engine (weights as burn tensors, keys and values in the device store) on
//! every backend this build has: `flex` on the host always, and with the `wgpu` feature
//! the same checks on a wgpu adapter (in CI Mesa's software Vulkan driver, chosen with
//! `CUBECL_WGPU_DEFAULT_DEVICE=Cpu`). Tiny random-weight models written for the test.

use std::path::{Path, PathBuf};

use baton_worker::engine::{
    gguf::GgmlType,
    llama::{
        synthetic::{write_synthetic_llama, SyntheticSpec},
        Fetch, KvCache, Llama, SeqInput, WeightDtype, HEAD,
    },
    sampler::{argmax, logprobs, logprobs_from_top, SamplingParams},
    Engine, GenerateParams, Prompt, TokenEvent,
};
use burn_tensor::backend::Backend;
use tempfile::TempDir;

/// A tiny model with room for the longer runs here.
fn tiny(dir: &TempDir, seed: u64) -> PathBuf {
    let path = dir.path().join("tiny.gguf");
    let mut spec = SyntheticSpec::tiny(seed);
    spec.config.context_length = 256;
    write_synthetic_llama(&path, &spec).expect("write tiny model");
    path
}

fn engine<B: Backend>(path: &Path) -> Engine<B> {
    let engine = Engine::<B>::load(path, WeightDtype::F32, &Default::default()).expect("load");
    assert!(
        !engine.model().host_path(),
        "f32 weights run on the device engine"
    );
    engine
}

/// One input a sequence: `tokens[i]` against `caches[i]`.
fn seqs<'a, B: Backend>(
    tokens: &'a [Vec<u32>],
    caches: &'a mut [KvCache<B>],
) -> Vec<SeqInput<'a, B>> {
    tokens
        .iter()
        .zip(caches.iter_mut())
        .map(|(tokens, cache)| SeqInput { tokens, cache })
        .collect()
}

fn logits<B: Backend>(model: &Llama<B>, seqs: &mut [SeqInput<'_, B>]) -> Vec<Vec<f32>> {
    Llama::<B>::logits_to_host(model.forward(seqs).expect("forward"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn prompt(i: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|j| (i * 53 + j * 37) % 300 + 3)
        .collect()
}

/// A prompt run in chunks (each chunk's queries fewer than the keys they see: the
/// causal mask must line up with the cached positions) gives the logits and the tokens
/// of the whole prompt run at once.
fn chunked_prefill_equals_whole<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 11));
    let model = engine.model();
    let tokens = prompt(1, 40);
    let mut whole_cache = model.new_cache();
    let whole = logits(
        model,
        &mut [SeqInput {
            tokens: &tokens,
            cache: &mut whole_cache,
        }],
    );
    for chunk in [7, 16, 39] {
        let mut cache = model.new_cache();
        let mut last = Vec::new();
        for part in tokens.chunks(chunk) {
            last = logits(
                model,
                &mut [SeqInput {
                    tokens: part,
                    cache: &mut cache,
                }],
            );
        }
        let d = max_diff(&whole[0], &last[0]);
        assert!(d < 1e-3, "chunks of {chunk}: logits differ by {d}");
    }
    let params = GenerateParams {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let run = |step_tokens: usize| {
        engine.set_step_tokens(step_tokens);
        let mut out = Vec::new();
        engine
            .generate(tokens.clone(), params.clone(), &mut |ev| out.push(ev.id))
            .expect("generate");
        out
    };
    let at_once = run(0);
    for step_tokens in [5, 16] {
        assert_eq!(run(step_tokens), at_once, "steps of {step_tokens} tokens");
    }
}

/// The tokens each prompt generates alone, prompt `i` with `params(i)`.
fn each_alone<B: Backend>(
    engine: &Engine<B>,
    prompts: &[Vec<u32>],
    params: impl Fn(u64) -> GenerateParams,
) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut out = Vec::new();
            engine
                .generate(p.clone(), params(i as u64), &mut |ev| out.push(ev.id))
                .expect("generate");
            out
        })
        .collect()
}

/// Eight sequences of different lengths decoding together (one attention call for all
/// their decode rows) each get the tokens they get alone.
fn a_batch_of_eight_decodes_what_each_decodes_alone<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 12));
    let params = |i: u64| {
        let mut p = GenerateParams {
            max_tokens: 12 + i as usize,
            ignore_eos: true,
            ..Default::default()
        };
        if i % 2 == 1 {
            p.sampling.temperature = 0.8;
            p.sampling.seed = 100 + i;
        }
        if i % 4 == 3 {
            // Drawn from the rows' heads on the device.
            p.sampling.top_k = 20;
        }
        p
    };
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(i, 3 + 5 * i as usize)).collect();
    let alone = each_alone(&engine, &prompts, params);
    let mut seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| engine.start(p.clone(), params(i as u64)).expect("start"))
        .collect();
    while seqs.iter().any(|s| s.finish_reason().is_none()) {
        let mut live: Vec<_> = seqs
            .iter_mut()
            .filter(|s| s.finish_reason().is_none())
            .collect();
        engine.step(&mut live).expect("step");
    }
    for (i, (seq, want)) in seqs.iter().zip(&alone).enumerate() {
        assert_eq!(seq.generated(), &want[..], "sequence {i}");
    }
}

/// A step whose rows mostly draw greedily from the logits as they are, beside one whose
/// draw a penalty changes (so it needs its whole row), downloads that row alone: the
/// others' argmaxes come down as ids. Every sequence still gets the tokens it gets alone.
fn a_mixed_step_downloads_only_the_rows_it_needs<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 21));
    let max_tokens = 7;
    let params = |i: u64| {
        let mut p = GenerateParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        if i == 2 {
            p.sampling.presence_penalty = 0.7;
        }
        p
    };
    assert!(params(2).sampling.adjusts() && !params(0).sampling.adjusts());
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 4 + 3 * i as usize)).collect();
    let alone = each_alone(&engine, &prompts, params);
    let before = engine.downloaded_rows();
    let mut seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| engine.start(p.clone(), params(i as u64)).expect("start"))
        .collect();
    let mut steps = 0;
    while seqs.iter().any(|s| s.finish_reason().is_none()) {
        let mut live: Vec<_> = seqs.iter_mut().collect();
        engine.step(&mut live).expect("step");
        steps += 1;
    }
    assert_eq!(steps, max_tokens, "every sequence drew at every step");
    for (i, (seq, want)) in seqs.iter().zip(&alone).enumerate() {
        assert_eq!(seq.generated(), &want[..], "sequence {i}");
    }
    assert_eq!(
        engine.downloaded_rows() - before,
        max_tokens,
        "one row a step: the penalized sequence's"
    );
}

/// A sequence's keys and values are written in place: the device store is allocated
/// once, with room for the positions the sequence is expected to reach, and 100 decode
/// steps later it is still that one allocation; past the expected room it grows (and
/// what it held is kept).
fn kv_is_written_in_place<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 13));
    let model = engine.model();
    let tokens = prompt(2, 8);
    let mut cache = model.new_cache();
    cache.expect_positions(120);
    let mut last = logits(
        model,
        &mut [SeqInput {
            tokens: &tokens,
            cache: &mut cache,
        }],
    );
    let bytes = cache.bytes();
    let mut all = tokens.clone();
    for _ in 0..100 {
        let t = argmax(&last[0]);
        all.push(t);
        last = logits(
            model,
            &mut [SeqInput {
                tokens: &[t],
                cache: &mut cache,
            }],
        );
    }
    assert_eq!(cache.len(), 108);
    assert_eq!(cache.device_allocations(), 1, "the store was reallocated");
    assert_eq!(cache.bytes(), bytes, "the store's room changed");
    // Past the room: one more allocation, and the positions before it are intact.
    for _ in 0..16 {
        let t = argmax(&last[0]);
        all.push(t);
        last = logits(
            model,
            &mut [SeqInput {
                tokens: &[t],
                cache: &mut cache,
            }],
        );
    }
    assert_eq!(cache.device_allocations(), 2);
    all.pop();
    let mut fresh = model.new_cache();
    let whole = logits(
        model,
        &mut [SeqInput {
            tokens: &all,
            cache: &mut fresh,
        }],
    );
    let mut again = cache.clone();
    again.truncate(all.len() - 1);
    let step = logits(
        model,
        &mut [SeqInput {
            tokens: &all[all.len() - 1..],
            cache: &mut again,
        }],
    );
    let d = max_diff(&whole[0], &step[0]);
    assert!(d < 1e-3, "after growing, logits differ by {d}");
}

/// Greedy steps find each row's largest logit on the device and download the ids
/// alone: the same ids the host finds in the downloaded logits.
fn device_argmax_is_the_host_argmax<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 14));
    let model = engine.model();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 4 + i as usize)).collect();
    let mut with: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut without: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut next: Vec<Vec<u32>> = prompts.clone();
    for _ in 0..12 {
        let mut inputs = seqs(&next, &mut with);
        let (rows, _) = model.forward_greedy(&mut inputs, true).expect("forward");
        let mut inputs = seqs(&next, &mut without);
        let (none, ids) = model.forward_greedy(&mut inputs, false).expect("forward");
        assert!(none.is_empty(), "logits were downloaded");
        let ids = ids.expect("ids found on the device");
        let vocab = model.config().vocab;
        let host: Vec<u32> = rows.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(ids, host);
        next = ids.iter().map(|&t| vec![t]).collect();
    }
}

/// Sampled steps download each row's head (its `HEAD` largest logits and their ids)
/// and the sum of the rest at the row's temperature instead of the row; where those
/// decide a draw, it is the draw the whole row gives for the same (seed, position), and
/// a `top_k` below the head is always decided.
fn device_heads_draw_what_the_rows_draw<B: Backend>(heads: bool) {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 16));
    let model = engine.model();
    let vocab = model.config().vocab;
    assert!(vocab > HEAD, "the head is a part of the row");
    assert_eq!(model.fetches_heads(), heads);
    if !heads {
        // flex: the rows are host memory already, and it has no top-k.
        let mut cache = model.new_cache();
        let mut inputs = [SeqInput {
            tokens: &prompt(0, 3),
            cache: &mut cache,
        }];
        let out = model
            .forward_fetch(&mut inputs, Fetch::Heads(&[1.0]))
            .expect("forward");
        assert!(out.heads.is_none() && out.logits.len() == vocab);
        return;
    }
    // Cut to a top_k, decided by the head alone (any temperature).
    let cuts = [(0.8, 20, 1.0), (1.0, 40, 0.9), (0.6, 63, 1.0)];
    // Each row's own temperature, whose rest the device sums.
    let temperatures = [1.0f32, 0.5, 0.25, 0.1];
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 3 + 2 * i as usize)).collect();
    let mut with: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut without: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut next: Vec<Vec<u32>> = prompts.clone();
    let (mut decided, mut cut, mut free, mut scored) = (0, 0, 0, 0);
    for step in 0..10u64 {
        let mut inputs = seqs(&next, &mut with);
        let mut out = model
            .forward_fetch(&mut inputs, Fetch::Heads(&temperatures))
            .expect("forward");
        assert!(out.logits.is_empty(), "the rows were downloaded");
        let heads = out.heads.take().expect("heads found on the device");
        let mut inputs = seqs(&next, &mut without);
        let (rows, _) = model.forward_greedy(&mut inputs, true).expect("forward");
        for ((head, row), &t) in heads
            .iter()
            .zip(rows.chunks_exact(vocab))
            .zip(&temperatures)
        {
            assert!(head.finite);
            assert_eq!(head.top.len(), HEAD);
            // The head holds the row's largest logits, at their ids.
            let least = head.top.iter().map(|t| t.1).fold(f32::INFINITY, f32::min);
            let max = head
                .top
                .iter()
                .map(|t| t.1)
                .fold(f32::NEG_INFINITY, f32::max);
            let held: std::collections::HashSet<u32> = head.top.iter().map(|t| t.0).collect();
            assert_eq!(held.len(), HEAD);
            for &(id, v) in &head.top {
                assert_eq!(v, row[id as usize], "the value at {id}");
            }
            for (id, &v) in row.iter().enumerate() {
                assert!(held.contains(&(id as u32)) || v <= least, "{id} left out");
            }
            // The rest: the ties at the least counted, the logits below it summed.
            assert_eq!(head.rest.ties, row.iter().filter(|&&l| l == least).count());
            let below: f64 = row
                .iter()
                .filter(|&&l| l < least)
                .map(|&l| f64::from((l - max) / t).exp())
                .sum();
            let off = (f64::from(head.rest.below) - below).abs();
            assert!(
                off <= 1e-4 * below,
                "rest {} against {below}",
                head.rest.below
            );
            // Log-probabilities from the head and the rest at temperature 1: those of
            // the whole row, up to the device sum's rounding.
            for (chosen, n) in [(argmax(row), 0), (argmax(row), 5), (head.top[7].0, 20)] {
                let Some((lp, best)) =
                    logprobs_from_top(&head.top, head.rest.ties, head.below_at_one, chosen, n)
                else {
                    continue;
                };
                let (want, want_best) = logprobs(row, chosen, n);
                assert!((lp - want).abs() <= 1e-5, "logprob {lp} against {want}");
                assert_eq!(best.len(), want_best.len());
                for (a, b) in best.iter().zip(&want_best) {
                    assert_eq!(a.0, b.0);
                    assert!((a.1 - b.1).abs() <= 1e-5, "{a:?} against {b:?}");
                }
                scored += 1;
            }
            let draws = cuts
                .iter()
                .map(|&d| (d, false))
                .chain([((t, 0, 1.0), true), ((t, 0, 0.9), true)]);
            for (d, ((temperature, top_k, top_p), summed)) in draws.enumerate() {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: 40 + d as u64,
                    ..Default::default()
                };
                let rest = summed.then_some(&head.rest);
                for pos in step * 16..step * 16 + 16 {
                    if let Some(id) = p.pick_from_top(&head.top, vocab, rest, pos) {
                        assert_eq!(id, p.pick(row, pos), "T {temperature}, top_k {top_k}");
                        decided += 1;
                        free += usize::from(top_k == 0);
                    } else {
                        assert!(top_k == 0, "top_k {top_k} not decided by the head");
                    }
                    cut += usize::from(top_k > 0);
                }
            }
        }
        // The rows asked for (those whose draws the heads left undecided) come down,
        // each the row it is, and no others.
        let wanted: Vec<bool> = (0..prompts.len())
            .map(|r| match step % 4 {
                0 => true,
                1 => false,
                _ => (r + step as usize).is_multiple_of(3),
            })
            .collect();
        out.fetch_rows(&wanted);
        let fetched = out.rows_mut();
        assert_eq!(fetched.len(), prompts.len());
        for ((got, &w), row) in fetched.iter().zip(&wanted).zip(rows.chunks_exact(vocab)) {
            if w {
                assert_eq!(&**got, row, "step {step}");
            } else {
                assert!(got.is_empty(), "step {step}: a row not asked for came down");
            }
        }
        next = rows.chunks_exact(vocab).map(|r| vec![argmax(r)]).collect();
    }
    assert!(
        decided >= cut && cut > 0 && free > 0 && scored > 0,
        "{decided} draws decided, {cut} cut to top_k, {free} not cut; {scored} scored"
    );
}

fn events<B: Backend>(engine: &Engine<B>, ids: &[u32], params: &GenerateParams) -> Vec<TokenEvent> {
    let mut out = Vec::new();
    engine
        .generate(ids.to_vec(), params.clone(), &mut |ev| out.push(ev.clone()))
        .expect("generate");
    out
}

/// A stream resumed mid-way on the device engine (its prompt and the tokens so far
/// replayed into a new cache) goes on as the original did, greedy and sampled.
fn a_resumed_stream_goes_on_identically<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 15));
    let ids = engine
        .encode_prompt(&Prompt::Text("once upon".into()))
        .expect("encode");
    let greedy = GenerateParams {
        max_tokens: 20,
        ignore_eos: true,
        ..Default::default()
    };
    let mut sampled = greedy.clone();
    sampled.sampling.temperature = 1.1;
    sampled.sampling.top_p = 0.9;
    sampled.sampling.seed = 77;
    // Drawn from the rows' heads on the device.
    let mut cut = sampled.clone();
    cut.sampling.top_k = 30;
    // With logprobs: the same tokens, and the log-probabilities the same on resuming.
    let mut scored = sampled.clone();
    scored.logprobs = Some(3);
    let mut scored_greedy = greedy.clone();
    scored_greedy.logprobs = Some(0);
    let tokens = |events: &[TokenEvent]| events.iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(
        tokens(&events(&engine, &ids, &scored)),
        tokens(&events(&engine, &ids, &sampled))
    );
    for params in [&greedy, &sampled, &cut, &scored, &scored_greedy] {
        let original = events(&engine, &ids, params);
        assert_eq!(
            original.iter().all(|e| e.logprobs.is_some()),
            params.logprobs.is_some()
        );
        for cut in [1, 7, 19] {
            let done: Vec<u32> = original[..cut].iter().map(|e| e.id).collect();
            let mut seq = engine
                .resume(ids.clone(), &done, params.clone())
                .expect("resume");
            let mut rest = Vec::new();
            engine
                .run(&mut seq, &mut |ev| rest.push(ev.clone()))
                .expect("run");
            assert_eq!(rest, original[cut..], "resumed at {cut}");
        }
    }
}

/// The prefix cache serves the device engine too, its blocks copied on the device:
/// prompts sharing a long start reuse its keys and values, and every stream gets the
/// tokens it gets from a cold start, greedy and sampled, fresh and resumed.
fn the_prefix_cache_serves_the_device_engine<B: Backend>() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine::<B>(&tiny(&dir, 16));
    let shared = prompt(5, 40);
    let prompts: Vec<Vec<u32>> = [vec![7, 8, 9], vec![10, 11], vec![12]]
        .into_iter()
        .map(|tail| shared.iter().copied().chain(tail).collect())
        .collect();
    let mut sampled = GenerateParams {
        max_tokens: 10,
        ignore_eos: true,
        ..Default::default()
    };
    sampled.sampling.temperature = 0.9;
    sampled.sampling.seed = 5;
    let greedy = GenerateParams {
        max_tokens: 10,
        ignore_eos: true,
        ..Default::default()
    };
    let run = |p: &[u32], params: &GenerateParams| -> Vec<u32> {
        events(&engine, p, params).iter().map(|e| e.id).collect()
    };
    let cold: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| [run(p, &greedy), run(p, &sampled)])
        .collect();
    assert_eq!(
        engine.prefix_stats().stored_blocks,
        0,
        "disabled by default"
    );
    engine.set_prefix_cache(64 << 20);
    let warm: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| [run(p, &greedy), run(p, &sampled)])
        .collect();
    assert_eq!(warm, cold);
    let stats = engine.prefix_stats();
    assert!(stats.stored_blocks >= 2, "{stats:?}");
    assert!(stats.reused_tokens >= 5 * 32, "{stats:?}");
    assert!(stats.bytes > 0, "{stats:?}");
    // A resume replays the prompt and the tokens so far: the cached blocks serve it.
    let done = &cold[1][..4];
    let mut seq = engine
        .resume(prompts[0].clone(), done, sampled.clone())
        .expect("resume");
    let mut rest = Vec::new();
    engine
        .run(&mut seq, &mut |ev| rest.push(ev.id))
        .expect("run");
    assert_eq!(rest, cold[1][4..]);
}

/// The fingerprint of the device engine names the hardware cubecl chooses its kernels
/// for (what tilings and reductions, so what bits, a device computes); flex's kernels
/// depend on nothing of the host, and its fingerprint names none.
fn the_fingerprint_names_the_hardware<B: Backend>(cubecl: bool) {
    let hardware = baton_worker::backend::device_identity::<B>(&Default::default());
    if cubecl {
        for field in ["plane_size_min", "max_shared_memory_size", "max_cube_dim"] {
            assert!(hardware.contains(field), "{field} in {hardware}");
        }
    } else {
        assert_eq!(hardware, "");
    }
}

/// Q8_0 and Q4_0 matrices stay in their blocks on cubecl's backends (burn's block-32
/// quantized tensors: the file's integers, a half or a quarter of f16's bytes); flex,
/// whose block products quantize their inputs too, holds them as f16. Either way the logits stay within f16 rounding of the exact
/// f32 weights', and greedy text follows theirs.
fn q8_0_and_q4_0_stay_in_their_blocks<B: Backend>(cubecl: bool) {
    for (ty, held, bits) in [(GgmlType::Q8_0, "q8_0", 8), (GgmlType::Q4_0, "q4_0", 4)] {
        let dir = TempDir::new().expect("tempdir");
        let path = dir.path().join("blocks.gguf");
        let mut spec = SyntheticSpec::tiny(21);
        spec.weight_type = ty;
        spec.untied_output = true;
        write_synthetic_llama(&path, &spec).expect("write model");
        let exact = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("f32");
        let half = Engine::<B>::load(&path, WeightDtype::F16, &Default::default()).expect("f16");
        let c = &spec.config;
        let (hd, qd, kvd) = (c.hidden, c.n_heads * c.head_dim, c.kv_dim());
        let weights = c.vocab * hd + c.n_layers * (hd * (qd + 2 * kvd) + qd * hd + 3 * hd * c.ffn);
        assert_eq!(exact.model().held_formats(), "f32");
        assert_eq!(exact.model().decode_weight_bytes(), 4 * weights);
        if cubecl {
            assert_eq!(half.model().held_formats(), held, "{ty:?}");
            // The values, and an f32 scale for each 32 of them.
            assert_eq!(
                half.model().decode_weight_bytes(),
                weights * bits / 8 + weights / 32 * 4,
                "{ty:?}"
            );
        } else {
            assert_eq!(half.model().held_formats(), "f16", "{ty:?}");
            assert_eq!(half.model().decode_weight_bytes(), 2 * weights);
        }
        let tokens = prompt(3, 24);
        let run = |e: &Engine<B>| {
            let mut cache = e.model().new_cache();
            logits(
                e.model(),
                &mut [SeqInput {
                    tokens: &tokens,
                    cache: &mut cache,
                }],
            )
            .remove(0)
        };
        let d = max_diff(&run(&exact), &run(&half));
        assert!(
            d < 2e-2,
            "{ty:?}: logits differ from the f32 weights' by {d}"
        );
        let params = GenerateParams {
            max_tokens: 16,
            ignore_eos: true,
            ..Default::default()
        };
        let text = |e: &Engine<B>| {
            let mut out = Vec::new();
            e.generate(tokens.clone(), params.clone(), &mut |ev| out.push(ev.id))
                .expect("generate");
            out
        };
        assert_eq!(text(&half), text(&exact), "{ty:?}");
        eprintln!(
            "{ty:?} held {}: logits within {d}",
            half.model().held_formats()
        );
    }
}

/// `baton-worker bench` runs on the backend: prefill, decode and batched decode, greedy
/// and sampled, in the device engine's default formats (f16 weights, f16 cache). Its
/// figures on llvmpipe or flex say nothing of a GPU's; this checks that the command works.
fn bench_runs<B: Backend>(backend: &str) {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: baton_worker::bench::BenchArgs,
    }
    let dir = TempDir::new().expect("tempdir");
    let model = tiny(&dir, 17);
    for temperature in ["0", "0.8"] {
        let args = Cli::try_parse_from([
            "bench",
            "--model",
            model.to_str().expect("utf-8 path"),
            "--backend",
            backend,
            "--dtype",
            "f16",
            "--prompt-tokens",
            "12",
            "--gen-tokens",
            "4",
            "--reps",
            "1",
            "--batch",
            "3",
            "--temperature",
            temperature,
        ])
        .expect("bench arguments")
        .bench;
        baton_worker::bench::run::<B>(&args, &Default::default()).expect("bench runs");
    }
}

/// The suite, for one backend (`$cubecl`: whether it is one of cubecl's, which find rows'
/// heads on the device and choose kernels by the hardware).
macro_rules! device_suite {
    ($name:ident, $backend:ty, $cubecl:expr) => {
        mod $name {
            #[test]
            fn chunked_prefill_equals_whole() {
                super::chunked_prefill_equals_whole::<$backend>();
            }
            #[test]
            fn a_batch_of_eight_decodes_what_each_decodes_alone() {
                super::a_batch_of_eight_decodes_what_each_decodes_alone::<$backend>();
            }
            #[test]
            fn kv_is_written_in_place() {
                super::kv_is_written_in_place::<$backend>();
            }
            #[test]
            fn device_argmax_is_the_host_argmax() {
                super::device_argmax_is_the_host_argmax::<$backend>();
            }
            #[test]
            fn device_heads_draw_what_the_rows_draw() {
                super::device_heads_draw_what_the_rows_draw::<$backend>($cubecl);
            }
            #[test]
            fn q8_0_and_q4_0_stay_in_their_blocks() {
                super::q8_0_and_q4_0_stay_in_their_blocks::<$backend>($cubecl);
            }
            #[test]
            fn the_fingerprint_names_the_hardware() {
                super::the_fingerprint_names_the_hardware::<$backend>($cubecl);
            }
            #[test]
            fn a_mixed_step_downloads_only_the_rows_it_needs() {
                super::a_mixed_step_downloads_only_the_rows_it_needs::<$backend>();
            }
            #[test]
            fn bench_runs() {
                super::bench_runs::<$backend>(if $cubecl { "wgpu" } else { "cpu" });
            }
            #[test]
            fn the_prefix_cache_serves_the_device_engine() {
                super::the_prefix_cache_serves_the_device_engine::<$backend>();
            }
            #[test]
            fn a_resumed_stream_goes_on_identically() {
                super::a_resumed_stream_goes_on_identically::<$backend>();
            }
        }
    };
}

device_suite!(flex, baton_worker::backend::CpuBackend, false);
#[cfg(feature = "wgpu")]
device_suite!(wgpu, baton_worker::backend::WgpuBackend, true);
