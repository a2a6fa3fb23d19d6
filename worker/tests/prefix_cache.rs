//! The prefix cache: a sequence started from cached keys and values, whole blocks or
//! the leading positions of one, produces the tokens of a cold start, fresh or resumed,
//! greedy or sampled. On a tiny random-weight model,
//! and on the default model when it is in `models/`.

use std::path::PathBuf;

use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        chat::ChatMessage,
        gguf::GgmlType,
        llama::{
            synthetic::{write_synthetic_llama, SyntheticSpec},
            WeightDtype,
        },
        prefix::BLOCK_TOKENS,
        Engine, GenerateParams, Prompt,
    },
};
use tempfile::TempDir;

/// A tiny model in block form (so the host forward path runs), with room for long
/// prompts.
fn engine(dir: &TempDir) -> Engine<B> {
    engine_with(dir, WeightDtype::Native)
}

/// The same tiny model with weights kept as `dtype`.
fn engine_with(dir: &TempDir, dtype: WeightDtype) -> Engine<B> {
    let path: PathBuf = dir.path().join("tiny.gguf");
    if !path.exists() {
        let mut spec = SyntheticSpec::tiny(21);
        spec.weight_type = GgmlType::Q8_0;
        spec.config.context_length = 256;
        write_synthetic_llama(&path, &spec).expect("write tiny model");
    }
    let engine = Engine::<B>::load(&path, dtype, &Default::default()).expect("load");
    assert_eq!(engine.model().host_path(), dtype == WeightDtype::Native);
    engine
}

/// A shared prefix of 2.5 blocks, then a tail of its own per prompt.
fn prompts() -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..40).map(|i| (i * 37 % 290) as u32 + 3).collect();
    let tails: [&[u32]; 4] = [
        &[11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        &[200, 201, 202],
        // Ends on a block boundary (48 tokens): its last block is run, not reused.
        &[5, 6, 7, 8, 9, 10, 11, 12],
        // Shorter than the shared prefix: only its first block can be reused.
        &[],
    ];
    let mut out: Vec<Vec<u32>> = tails
        .iter()
        .map(|t| shared.iter().chain(t.iter()).copied().collect())
        .collect();
    out[3].truncate(20);
    out
}

fn params(temperature: f32, seed: u64) -> GenerateParams {
    let mut p = GenerateParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    p.sampling.temperature = temperature;
    p.sampling.seed = seed;
    p
}

fn run(engine: &Engine<B>, prompt: &[u32], params: &GenerateParams) -> Vec<u32> {
    engine
        .generate(prompt.to_vec(), params.clone(), &mut |_| {})
        .expect("generate")
        .ids
}

/// Starts every prompt at once and steps them together to their ends; their tokens.
fn run_together(
    engine: &Engine<B>,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> Vec<Vec<u32>> {
    let mut seqs: Vec<_> = prompts
        .iter()
        .map(|x| engine.start(x.clone(), params.clone()).expect("start"))
        .collect();
    while seqs.iter().any(|s| s.finish_reason().is_none()) {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        engine.step(&mut refs).expect("step");
    }
    seqs.iter().map(|s| s.generated().to_vec()).collect()
}

#[test]
fn cached_prefixes_give_the_tokens_of_a_cold_start() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine(&dir);
    let prompts = prompts();
    for (temperature, seed) in [(0.0, 0), (1.0, 7)] {
        let p = params(temperature, seed);
        engine.set_prefix_cache(0);
        let disabled = engine.prefix_stats();
        let cold: Vec<Vec<u32>> = prompts.iter().map(|x| run(&engine, x, &p)).collect();
        assert_eq!(
            engine.prefix_stats(),
            disabled,
            "a disabled cache does nothing"
        );

        engine.set_prefix_cache(1 << 20);
        let before = engine.prefix_stats();
        // Prompt tokens reused, per pass and prompt. Pass 0: nothing for the first; the
        // second reuses the two shared blocks and the shared half of the third (a
        // partial block: the first prompt's third block begins with the same 8 tokens),
        // the third likewise, the fourth its first block and 3 tokens of the second.
        // Pass 1: every prompt token but the last (the last always runs), from the
        // blocks of each prompt's own first run (the first prompt's 49th token from
        // the block its first run stored at its end, prompt and output).
        let want_reused = [[0, 40, 40, 19], [49, 42, 47, 19]];
        // Twice over: the first pass fills the cache, the second finds whole prompts.
        for (pass, reused) in want_reused.iter().enumerate() {
            for ((x, want), &reused) in prompts.iter().zip(&cold).zip(reused) {
                let at = engine.prefix_stats().reused_tokens;
                assert_eq!(
                    &run(&engine, x, &p),
                    want,
                    "temperature {temperature}, pass {pass}, prompt of {} tokens",
                    x.len()
                );
                assert_eq!(
                    engine.prefix_stats().reused_tokens - at,
                    reused,
                    "temperature {temperature}, pass {pass}, prompt of {} tokens",
                    x.len()
                );
            }
        }
        let s = engine.prefix_stats();
        assert_eq!(s.misses - before.misses, 1);
        assert_eq!(s.hits - before.hits, 7);
        assert!(s.blocks > 0 && s.bytes > 0);
    }
}

#[test]
fn a_batch_mixing_cached_and_cold_prefills_matches_cold_starts() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine(&dir);
    let prompts = prompts();
    let p = params(0.0, 0);
    let cold: Vec<Vec<u32>> = prompts.iter().map(|x| run(&engine, x, &p)).collect();

    engine.set_prefix_cache(1 << 20);
    run(&engine, &prompts[0], &p);
    // All four start in one step, each from the blocks the first run stored.
    assert_eq!(run_together(&engine, &prompts, &p), cold);
    assert_eq!(engine.prefix_stats().hits, 4);
}

#[test]
fn a_resumed_stream_reuses_its_blocks_and_goes_on_as_before() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine(&dir);
    let prompt = &prompts()[0];
    for (temperature, seed) in [(0.0, 0), (1.0, 3)] {
        let p = params(temperature, seed);
        engine.set_prefix_cache(0);
        let cold = run(&engine, prompt, &p);

        engine.set_prefix_cache(1 << 20);
        // A first run stores the blocks of its prompt and, once finished, of its output.
        assert_eq!(run(&engine, prompt, &p), cold);
        let before = engine.prefix_stats();
        for cut in [5, 20] {
            let mut seq = engine
                .resume(prompt.clone(), &cold[..cut], p.clone())
                .expect("resume");
            engine.run(&mut seq, &mut |_| {}).expect("run");
            assert_eq!(
                seq.generated(),
                &cold[..],
                "temperature {temperature}, cut {cut}"
            );
        }
        // 50 prompt + 5 tokens: three blocks and 6 positions of the fourth (the first
        // run's fourth block: 2 prompt tokens, then its output); 50 + 20: four blocks
        // (the first run's 73 positions hold no fifth).
        let s = engine.prefix_stats();
        assert_eq!(s.hits - before.hits, 2);
        assert_eq!(
            s.reused_tokens - before.reused_tokens,
            (3 * BLOCK_TOKENS + 6 + 4 * BLOCK_TOKENS) as u64
        );
        engine.set_prefix_cache(0);
    }
}

/// The default model, when `scripts/setup` has put it in `models/`: a long shared
/// system prompt, cold and cached, greedy and sampled.
#[test]
fn the_default_model_gives_the_same_tokens_from_cached_blocks() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipping: {} is absent (run scripts/setup)", path.display());
        return;
    }
    let engine = Engine::<B>::load(&path, WeightDtype::Native, &Default::default()).expect("load");
    let system = baton_worker::bench::system_prompt(&engine, 300).expect("system prompt");
    let prompts: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            engine
                .encode_prompt(&Prompt::Chat(vec![
                    ChatMessage::new("system", system.clone()),
                    ChatMessage::new("user", baton_worker::bench::serving_prompt(i)),
                ]))
                .expect("encode")
        })
        .collect();
    for (temperature, seed) in [(0.0, 0), (0.8, 5)] {
        let mut p = params(temperature, seed);
        p.max_tokens = 16;
        engine.set_prefix_cache(0);
        let cold: Vec<Vec<u32>> = prompts.iter().map(|x| run(&engine, x, &p)).collect();
        engine.set_prefix_cache(256 << 20);
        let before = engine.prefix_stats();
        let mut reused = Vec::new();
        for (x, want) in prompts.iter().zip(&cold) {
            let at = engine.prefix_stats().reused_tokens;
            assert_eq!(&run(&engine, x, &p), want, "temperature {temperature}");
            reused.push(engine.prefix_stats().reused_tokens - at);
        }
        // The second prompt reuses all it shares with the first: the system prompt's
        // blocks and, from the first prompt's block that holds where they part, the
        // positions before it.
        let common = prompts[0]
            .iter()
            .zip(&prompts[1])
            .take_while(|(a, b)| a == b)
            .count();
        assert!(common % BLOCK_TOKENS != 0 && common + BLOCK_TOKENS <= prompts[0].len());
        assert_eq!(reused, [0, common as u64]);
        assert_eq!(engine.prefix_stats().hits - before.hits, 1);
    }
}

/// Chunked prefill: under a step budget, prompts run in chunks over several steps give
/// the tokens of whole prompts, greedy and sampled, with the prefix cache on and off; a
/// sequence that is generating gets its token every step while prompts join; no step
/// runs more than the budget (or, when generating sequences fill it, a block's worth of
/// prompt beside them), and every prompt advances.
#[test]
fn chunked_prompts_give_the_tokens_of_whole_ones() {
    let dir = TempDir::new().expect("tempdir");
    chunked_prompts_match(&engine(&dir));
}

/// The same with dense weights: the burn forward path, where no prefix cache runs.
#[test]
fn chunked_prompts_give_the_tokens_of_whole_ones_on_the_burn_path() {
    let dir = TempDir::new().expect("tempdir");
    chunked_prompts_match(&engine_with(&dir, WeightDtype::F32));
}

fn chunked_prompts_match(engine: &Engine<B>) {
    let prompts = prompts();
    for (temperature, seed) in [(0.0, 0), (1.0, 9)] {
        let p = params(temperature, seed);
        engine.set_step_tokens(0);
        engine.set_prefix_cache(0);
        let whole: Vec<Vec<u32>> = prompts.iter().map(|x| run(engine, x, &p)).collect();
        for (budget, cache) in [(7, 0), (16, 0), (1, 0), (5, 1 << 20), (40, 1 << 20)] {
            let case = format!("temperature {temperature}, budget {budget}, cache {cache}");
            engine.set_prefix_cache(cache);
            engine.set_step_tokens(budget);
            // The first prompt starts alone: ⌈50 / budget⌉ steps to its first token.
            let mut seqs = vec![engine.start(prompts[0].clone(), p.clone()).expect("start")];
            let mut steps = 0;
            while seqs[0].generated().is_empty() {
                engine.step(&mut [&mut seqs[0]]).expect("step");
                steps += 1;
                if seqs[0].generated().is_empty() {
                    // A chunk ran and gave no token: the worker reports how far it got.
                    let at = seqs[0].cache().len() as u32;
                    assert_eq!(seqs[0].progress(), Some(at), "{case}");
                    assert_eq!(seqs[0].progress(), None, "{case}: reported once");
                }
            }
            if cache == 0 {
                assert_eq!(steps, prompts[0].len().div_ceil(budget), "{case}");
            }
            // The others join while it generates.
            for x in &prompts[1..] {
                seqs.push(engine.start(x.clone(), p.clone()).expect("start"));
            }
            while seqs.iter().any(|s| s.finish_reason().is_none()) {
                let before: Vec<(usize, usize, bool)> = seqs
                    .iter()
                    .map(|s| {
                        let done = s.finish_reason().is_some();
                        (s.cache().len(), s.generated().len(), done)
                    })
                    .collect();
                let generating = seqs
                    .iter()
                    .filter(|s| s.finish_reason().is_none() && !s.generated().is_empty())
                    .count();
                let mut refs: Vec<_> = seqs.iter_mut().collect();
                engine.step(&mut refs).expect("step");
                let ran: usize = seqs
                    .iter()
                    .zip(&before)
                    .map(|(s, (len, _, _))| s.cache().len() - len)
                    .sum();
                if cache == 0 {
                    assert!(ran > 0, "{case}: every step advances");
                    assert!(
                        ran <= budget.max(generating + BLOCK_TOKENS),
                        "{case}: {ran} tokens in a step"
                    );
                }
                // A generating sequence gets its token every step.
                for (s, (_, made, done)) in seqs.iter().zip(&before) {
                    if *made > 0 && !done {
                        assert_eq!(s.generated().len(), made + 1, "{case}");
                    }
                }
            }
            for (s, want) in seqs.iter().zip(&whole) {
                assert_eq!(s.generated(), &want[..], "{case}");
            }
        }
    }
    engine.set_step_tokens(0);
}

/// Under a step budget, prompts that arrive together and wait their turn find what the
/// prompts that ran before them stored, and each sequence is counted once, a hit or a
/// miss.
#[test]
fn prompts_waiting_under_the_budget_reuse_what_ran_before_them() {
    let dir = TempDir::new().expect("tempdir");
    let engine = engine(&dir);
    let prompts = prompts();
    let p = params(0.0, 0);
    engine.set_prefix_cache(0);
    let whole: Vec<Vec<u32>> = prompts.iter().map(|x| run(&engine, x, &p)).collect();
    engine.set_prefix_cache(1 << 20);
    // The first prompt (50 tokens) fills the first step alone; the others wait a step.
    engine.set_step_tokens(prompts[0].len());
    let before = engine.prefix_stats();
    assert_eq!(run_together(&engine, &prompts, &p), whole);
    let s = engine.prefix_stats();
    assert_eq!(s.misses - before.misses, 1, "only the first prompt missed");
    assert_eq!(s.hits - before.hits, 3);
    // 40 shared tokens for the second and third, 19 (all but the last) for the fourth.
    assert_eq!(s.reused_tokens - before.reused_tokens, 40 + 40 + 19);
    engine.set_step_tokens(0);
}
