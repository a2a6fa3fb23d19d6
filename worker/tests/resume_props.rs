//! Property: a stream cut anywhere and resumed with [`Engine::resume`] goes on exactly as
//! the stream that was never cut — same token events (ids, text pieces, logprobs), same
//! text, same end — whatever the prompt and the sampling parameters (temperature, top-p,
//! top-k, min-p, seed, repetition, presence and frequency penalties, logit bias, stop
//! strings, stop tokens, min_tokens, max_tokens up to the context length). On a tiny
//! random-weight model.

use baton_worker::{
    backend::CpuBackend as B,
    engine::{
        llama::{
            synthetic::{write_synthetic_llama, SyntheticSpec},
            WeightDtype,
        },
        sampler::SamplingParams,
        Completion, Engine, GenerateParams, TokenEvent,
    },
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tempfile::TempDir;

/// Sampling parameters over their whole domain, greedy included.
fn sampling() -> impl Strategy<Value = SamplingParams> {
    (
        (
            prop_oneof![Just(0.0f32), 0.05f32..2.5],
            prop_oneof![Just(1.0f32), 0.05f32..1.0],
            prop_oneof![Just(0usize), 1usize..40],
            prop_oneof![Just(0.0f32), 0.0f32..0.5],
        ),
        (
            prop_oneof![Just(1.0f32), 0.5f32..2.0],
            prop_oneof![Just(0.0f32), -2.0f32..2.0],
            prop_oneof![Just(0.0f32), -2.0f32..2.0],
            prop::collection::vec((0u32..320, -100.0f32..100.0), 0..4),
        ),
        any::<u64>(),
    )
        .prop_map(
            |(
                (temperature, top_p, top_k, min_p),
                (repetition_penalty, presence_penalty, frequency_penalty, logit_bias),
                seed,
            )| SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                logit_bias,
                seed,
            },
        )
}

/// A case: prompt ids, generation parameters without stops, where to take a stop string
/// from the uncut text (start and length as fractions; `None`: no stop string), and the
/// cut point.
type Case = (
    Vec<u32>,
    GenerateParams,
    Option<(f64, f64)>,
    prop::sample::Index,
);

fn cases() -> impl Strategy<Value = Case> {
    (
        // Ids of the tiny vocabulary (320), short enough to leave room in its 64 positions.
        prop::collection::vec(0u32..320, 1..16),
        sampling(),
        // Up to past the context, so that some streams end there.
        1usize..64,
        any::<bool>(),
        prop::option::of((0.0f64..1.0, 0.0f64..1.0)),
        any::<prop::sample::Index>(),
        (
            0usize..8,
            prop::collection::vec(0u32..320, 0..3),
            prop::option::of(0usize..6),
            prop::option::of(0usize..3),
        ),
    )
        .prop_map(
            |(prompt, sampling, max_tokens, ignore_eos, stop, cut, extra)| {
                let (min_tokens, stop_token_ids, logprobs, prompt_logprobs) = extra;
                let params = GenerateParams {
                    max_tokens,
                    sampling,
                    stop: Vec::new(),
                    ignore_eos,
                    grammar: None,
                    min_tokens: min_tokens.min(max_tokens),
                    stop_token_ids,
                    logprobs,
                    prompt_logprobs,
                    tools: None,
                };
                (prompt, params, stop, cut)
            },
        )
}

/// Runs a stream uncut: its events and its completion.
fn run(
    engine: &Engine<B>,
    prompt: &[u32],
    params: &GenerateParams,
) -> (Vec<TokenEvent>, Completion) {
    let mut events = Vec::new();
    let done = engine
        .generate(prompt.to_vec(), params.clone(), &mut |ev| {
            events.push(ev.clone())
        })
        .expect("generate");
    (events, done)
}

#[test]
fn a_stream_resumed_at_any_cut_ends_as_the_uncut_one() {
    let dir = TempDir::new().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_synthetic_llama(&path, &SyntheticSpec::tiny(9)).expect("write tiny model");
    let engine = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("load");

    let mut runner = TestRunner::new(Config::with_cases(64));
    runner
        .run(&cases(), |(prompt, mut params, stop, cut)| {
            if let Some((start, len)) = stop {
                // A stop string from the text itself, so that it fires (or is held back
                // across the cut) rather than never matching.
                let chars: Vec<char> = run(&engine, &prompt, &params).1.text.chars().collect();
                if !chars.is_empty() {
                    let from = ((start * chars.len() as f64) as usize).min(chars.len() - 1);
                    let n = 1 + (len * 3.0) as usize;
                    let to = (from + n).min(chars.len());
                    params.stop = vec![chars[from..to].iter().collect()];
                }
            }
            let (original, uncut) = run(&engine, &prompt, &params);
            let cut = cut.index(original.len() + 1);
            let done: Vec<u32> = original[..cut].iter().map(|e| e.id).collect();
            let mut seq = engine
                .resume(prompt.clone(), &done, params.clone())
                .map_err(|e| TestCaseError::fail(format!("resume at {cut}: {e}")))?;
            let mut rest = Vec::new();
            engine
                .run(&mut seq, &mut |ev| rest.push(ev.clone()))
                .expect("run");
            prop_assert_eq!(&rest[..], &original[cut..], "resumed at {}", cut);
            // A scored prompt is scored again only by a resume that runs (one already
            // at its end has nothing to run: its first scores were kept by the client);
            // then its scores are the first run's.
            let (mut resumed, mut uncut) = (seq.into_completion(), uncut);
            if !resumed.prompt_logprobs.is_empty() {
                prop_assert_eq!(&resumed.prompt_logprobs, &uncut.prompt_logprobs);
            }
            resumed.prompt_logprobs.clear();
            uncut.prompt_logprobs.clear();
            prop_assert_eq!(resumed, uncut);
            Ok(())
        })
        .expect("every resumed stream ends as the uncut one");
}

/// A case the property once failed on the device engine: a resume replayed its
/// generated tokens as prompt rows, which round otherwise than the decode rows they
/// first ran as, and at top-p 0.12 the last draw flipped.
#[test]
fn a_resume_replays_generated_tokens_as_decode_rows() {
    let dir = TempDir::new().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_synthetic_llama(&path, &SyntheticSpec::tiny(9)).expect("write tiny model");
    let engine = Engine::<B>::load(&path, WeightDtype::F32, &Default::default()).expect("load");
    let prompt = vec![212, 122, 196];
    let mut params = GenerateParams {
        max_tokens: 25,
        ignore_eos: true,
        ..Default::default()
    };
    params.sampling.temperature = 1.712_064_6;
    params.sampling.top_p = 0.120_181_87;
    params.sampling.seed = 9_540_409_419_794_001_067;
    let (original, uncut) = run(&engine, &prompt, &params);
    for cut in [1, 4, 13, 24] {
        let done: Vec<u32> = original[..cut].iter().map(|e| e.id).collect();
        let mut seq = engine
            .resume(prompt.clone(), &done, params.clone())
            .expect("resume");
        let mut rest = Vec::new();
        engine
            .run(&mut seq, &mut |ev| rest.push(ev.clone()))
            .expect("run");
        assert_eq!(rest, original[cut..], "resumed at {cut}");
        assert_eq!(seq.into_completion(), uncut);
    }
}
