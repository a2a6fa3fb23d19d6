use super::super::{
    cache::KvCache,
    load::load_llama,
    model::{ForwardError, Llama, SeqInput},
    synthetic::{write_synthetic_llama, SyntheticSpec},
    WeightDtype,
};
use super::*;
use crate::{
    backend::CpuBackend as B,
    engine::gguf::{GgmlType, GgufFile},
};

fn native(ty: GgmlType, seed: u64) -> (tempfile::TempDir, Llama<B>) {
    load(ty, seed, WeightDtype::Native)
}

fn load(ty: GgmlType, seed: u64, dtype: WeightDtype) -> (tempfile::TempDir, Llama<B>) {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    let mut spec = SyntheticSpec::tiny(seed);
    spec.weight_type = ty;
    write_synthetic_llama(&path, &spec).expect("write");
    let gguf = GgufFile::open(&path).expect("open");
    let model = load_llama::<B>(&gguf, dtype, &Default::default(), &mut |_, _| {}).expect("load");
    (dir, model)
}

/// One generated token for each cache.
fn one_each<'a>(tokens: &'a [[u32; 1]], caches: &'a mut [KvCache<B>]) -> Vec<SeqInput<'a, B>> {
    tokens
        .iter()
        .zip(caches.iter_mut())
        .map(|(t, c)| SeqInput {
            tokens: t,
            cache: c,
        })
        .collect()
}

fn run(model: &Llama<B>, seqs: &mut [SeqInput<'_, B>]) -> Vec<Vec<f32>> {
    Llama::<B>::logits_to_host(model.forward(seqs).expect("forward"))
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The host engine (the file's blocks) and the device engine (the same file as f32
/// tensors, here on flex) agree on prefill, cached decode, batches of sequences at
/// different positions, and after a truncation: to rounding with an f32 cache, within
/// what rounding keys and values to f16 moves with an f16 one.
#[test]
fn the_host_engine_matches_the_device_engine() {
    for (ty, kv) in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::IQ4NL,
    ]
    .into_iter()
    .flat_map(|ty| [(ty, KvDtype::F32), (ty, KvDtype::F16)])
    {
        let (_dir, mut host) = native(ty, 11);
        host.set_kv_dtype(kv);
        let (_dense, mut burn) = load(ty, 11, WeightDtype::F32);
        burn.set_kv_dtype(kv);
        assert!(host.host_path() && !burn.host_path());
        let prompts: [&[u32]; 3] = [&[5, 70, 200, 3, 9, 41, 7], &[1, 2], &[300, 17, 17, 17, 99]];
        let mut results = Vec::new();
        for (m, model) in [&host, &burn].into_iter().enumerate() {
            let mut caches: Vec<_> = (0..3).map(|_| model.new_cache()).collect();
            let mut out = Vec::new();
            // Prefill of all three at once, then decode steps of all three.
            {
                let mut seqs: Vec<_> = caches
                    .iter_mut()
                    .zip(prompts)
                    .map(|(cache, tokens)| SeqInput { tokens, cache })
                    .collect();
                out.push(run(model, &mut seqs));
            }
            for step in 0..4u32 {
                let toks: Vec<[u32; 1]> = (0..3).map(|i| [10 + step * 3 + i]).collect();
                let mut seqs: Vec<_> = caches
                    .iter_mut()
                    .zip(&toks)
                    .map(|(cache, tokens)| SeqInput { tokens, cache })
                    .collect();
                out.push(run(model, &mut seqs));
            }
            // A truncation, then a mixed batch: one prompt chunk, one token.
            caches[0].truncate(4);
            assert_eq!(caches[0].len(), 4);
            let (a, rest) = caches.split_at_mut(1);
            out.push(run(
                model,
                &mut [
                    SeqInput {
                        tokens: &[8, 9, 10],
                        cache: &mut a[0],
                    },
                    SeqInput {
                        tokens: &[77],
                        cache: &mut rest[0],
                    },
                ],
            ));
            assert_eq!(caches[0].len(), 7);
            // 7 positions × (keys + values) × 32 values × bytes × 2 layers; the burn
            // path's device store counts its whole room, at least the 7 positions.
            let position = 2 * 32 * kv.bytes() * 2;
            if m == 0 {
                assert_eq!(caches[0].bytes(), 7 * position);
            } else {
                assert!(caches[0].bytes() >= 7 * position);
                assert_eq!(caches[0].bytes() % position, 0);
            }
            results.push(out);
        }
        for (step, (a, b)) in results[0].iter().zip(&results[1]).enumerate() {
            let diff = max_diff(a, b);
            let tolerance = match kv {
                KvDtype::F32 => 1e-4,
                // 0.8–2.0e-3 on these models.
                KvDtype::F16 => 5e-3,
            };
            assert!(
                diff < tolerance,
                "{ty:?} KV {kv} step {step}: host and burn differ by {diff}"
            );
        }
    }
}

/// Each engine makes caches of its own store and refuses the other's, before any work:
/// the refused caches and the batch's other caches are left as they were.
#[test]
fn an_engine_refuses_the_other_engines_caches() {
    let (_dir, host) = native(GgmlType::Q8_0, 5);
    let (_dense, device) = load(GgmlType::Q8_0, 5, WeightDtype::F32);
    let mut host_cache = host.new_cache();
    let mut device_cache = device.new_cache();
    assert!(matches!(host_cache, KvCache::Host(_)));
    assert!(matches!(device_cache, KvCache::Device(_)));
    for (model, own, other) in [
        (&host, host.new_cache(), &mut device_cache),
        (&device, device.new_cache(), &mut host_cache),
    ] {
        let mut own = own;
        model
            .forward(&mut [SeqInput {
                tokens: &[3, 4],
                cache: &mut own,
            }])
            .expect("its own cache");
        let err = model
            .forward(&mut [
                SeqInput {
                    tokens: &[5],
                    cache: &mut own,
                },
                SeqInput {
                    tokens: &[1, 2],
                    cache: other,
                },
            ])
            .expect_err("the other engine's cache");
        assert_eq!(err, ForwardError::ForeignCache(1));
        assert_eq!((own.len(), other.len()), (2, 0), "nothing ran");
        assert_eq!(other.bytes(), 0);
    }
    // A prefix-cache block of one engine does not go into the other's cache.
    let (mut a, mut b) = (host.new_cache(), device.new_cache());
    for (model, cache) in [(&host, &mut a), (&device, &mut b)] {
        model
            .forward(&mut [SeqInput {
                tokens: &[7, 8, 9, 10],
                cache,
            }])
            .expect("forward");
    }
    let (from_host, from_device) = (a.span(0, 4).expect("host"), b.span(0, 4).expect("device"));
    let (mut c, mut d) = (host.new_cache(), device.new_cache());
    assert!(!c.push_span(4, 4, &from_device) && c.is_empty());
    assert!(!d.push_span(4, 4, &from_host) && d.is_empty());
    assert!(c.push_span(4, 4, &from_host) && c.len() == 4);
    assert!(d.push_span(4, 4, &from_device) && d.len() == 4);
}

#[test]
fn steps_split_by_sequence_only_when_every_thread_gets_enough() {
    let spans = |lens: &[usize]| {
        let mut row = 0;
        lens.iter()
            .map(|&len| {
                row += len;
                SeqSpan {
                    row: row - len,
                    len,
                    pos: 7,
                }
            })
            .collect::<Vec<_>>()
    };
    let ones = |n: usize| spans(&vec![1; n]);
    assert!(split_by_sequence(&ones(16), 1).is_none());
    assert!(split_by_sequence(&ones(2 * SPLIT_ROWS - 1), 2).is_none());
    let mut lens = vec![1; 16];
    lens[5] = 2;
    assert!(split_by_sequence(&spans(&lens), 2).is_none());
    for (n, threads) in [(8, 2), (16, 2), (13, 3), (64, 4)] {
        let groups = split_by_sequence(&ones(n), threads).expect("split");
        assert_eq!(groups.len(), threads);
        assert_eq!(groups[0].start, 0);
        assert_eq!(groups[threads - 1].end, n);
        for pair in groups.windows(2) {
            assert_eq!(pair[0].end, pair[1].start);
        }
        let sizes: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        let lo = sizes.iter().min().expect("groups");
        let hi = sizes.iter().max().expect("groups");
        assert!(
            hi - lo <= 1 && *lo >= SPLIT_ROWS,
            "{n} over {threads}: {sizes:?}"
        );
    }
}

/// A step of many generated tokens, split by sequence over two or three threads,
/// gives every sequence bitwise the logits it gets decoding alone.
#[test]
fn a_step_split_by_sequence_gives_each_sequence_its_logits_alone() {
    let (_dir, model) = load(GgmlType::Q4_1, 5, WeightDtype::NativeI16);
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| {
            let n = threads * SPLIT_ROWS + 1;
            let prompts: Vec<Vec<u32>> = (0..n as u32)
                .map(|i| (0..3 + i % 5).map(|k| 11 + 7 * i + k).collect())
                .collect();
            let step = |i: usize, s: usize| [(31 * i + 5 * s) as u32 % 250 + 1];
            let start = |p: &[u32]| {
                let mut c = model.new_cache();
                c.set_decode_from(p.len());
                run(
                    &model,
                    &mut [SeqInput {
                        tokens: p,
                        cache: &mut c,
                    }],
                );
                c
            };
            let alone: Vec<Vec<Vec<f32>>> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let mut c = start(p);
                    (0..3)
                        .map(|s| {
                            let t = step(i, s);
                            run(
                                &model,
                                &mut [SeqInput {
                                    tokens: &t,
                                    cache: &mut c,
                                }],
                            )
                            .remove(0)
                        })
                        .collect()
                })
                .collect();
            let mut caches: Vec<_> = prompts.iter().map(|p| start(p)).collect();
            #[allow(clippy::needless_range_loop)] // `s` also makes the tokens
            for s in 0..3 {
                let tokens: Vec<[u32; 1]> = (0..n).map(|i| step(i, s)).collect();
                let mut seqs = one_each(&tokens, &mut caches);
                let together = run(&model, &mut seqs);
                for (i, logits) in together.iter().enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(logits) == bits(&alone[i][s]),
                        "{threads} threads, sequence {i}, step {s}"
                    );
                }
            }
        });
    }
}

/// The argmax the forward pass finds chunk by chunk as it writes the logits is the
/// sampler's argmax of each whole row: in a step split by sequence (two and three
/// threads), in a step with prompts (one region), and for a single sequence.
#[test]
fn the_forward_pass_argmax_is_the_samplers() {
    use crate::engine::sampler::argmax;
    let (_dir, model) = load(GgmlType::Q4_1, 9, WeightDtype::NativeI16);
    let vocab = model.config().vocab;
    let check = |seqs: &mut [SeqInput<'_, B>], what: &str| {
        let (logits, greedy) = model.forward_greedy(seqs, true).expect("forward");
        let greedy = greedy.expect("the host path finds the argmax");
        assert_eq!(greedy.len(), seqs.len(), "{what}");
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            assert_eq!(greedy[r], argmax(row), "{what}, row {r}");
        }
    };
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| {
            let n = 3 * SPLIT_ROWS + 2;
            let prompts: Vec<Vec<u32>> = (0..n as u32)
                .map(|i| (0..2 + i % 4).map(|k| 3 + 13 * i + k).collect())
                .collect();
            let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
            // Prompts of several lengths together: one region.
            let mut seqs: Vec<SeqInput<'_, B>> = prompts
                .iter()
                .zip(caches.iter_mut())
                .map(|(p, c)| {
                    c.set_decode_from(p.len());
                    SeqInput {
                        tokens: p,
                        cache: c,
                    }
                })
                .collect();
            check(&mut seqs, &format!("{threads} threads, prompts"));
            // Then generated tokens only: split by sequence from two threads on.
            for s in 0..2u32 {
                let tokens: Vec<[u32; 1]> = (0..n as u32)
                    .map(|i| [(17 * i + 5 * s) % 200 + 1])
                    .collect();
                let mut seqs = one_each(&tokens, &mut caches);
                check(&mut seqs, &format!("{threads} threads, step {s}"));
            }
            let mut one = model.new_cache();
            check(
                &mut [SeqInput {
                    tokens: &[7, 8, 9],
                    cache: &mut one,
                }],
                &format!("{threads} threads, one sequence"),
            );
        });
    }
}

/// A cache told how far its sequence will go takes room for it at the first step and
/// never moves while it fills (no doubling, no copies mid-stream); one told nothing
/// still grows.
#[test]
fn an_expected_length_is_allocated_once() {
    let (_dir, model) = load(GgmlType::Q4_1, 3, WeightDtype::NativeI16);
    let width = model.config().n_kv_heads * model.config().head_dim;
    let mut told = model.new_cache();
    told.expect_positions(40);
    let mut untold = model.new_cache();
    let prompt: &[u32] = &[5, 6, 7, 8, 9];
    for c in [&mut told, &mut untold] {
        c.set_decode_from(prompt.len());
        run(
            &model,
            &mut [SeqInput {
                tokens: prompt,
                cache: c,
            }],
        );
    }
    let first = told.host_allocation();
    assert_eq!(first.1, 40 * width);
    let mut moved = false;
    for t in 0..35u32 {
        run(
            &model,
            &mut [SeqInput {
                tokens: &[t + 1],
                cache: &mut told,
            }],
        );
        run(
            &model,
            &mut [SeqInput {
                tokens: &[t + 1],
                cache: &mut untold,
            }],
        );
        assert_eq!(told.host_allocation(), first, "step {t}");
        moved |= untold.host_allocation().1 > prompt.len() * width;
    }
    assert!(moved, "a cache told nothing grows as it goes");
}

/// With 16-bit generated rows, and with 8-bit prompts beside them: a generated
/// token's logits and a prompt's are the same bits alone, beside other sequences, in
/// parts, or moved.
#[test]
fn generated_rows_do_not_depend_on_their_batch() {
    let kinds = [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::IQ4NL];
    let dtypes = [WeightDtype::NativeI16, WeightDtype::NativeI8];
    for (ty, dtype) in kinds.into_iter().flat_map(|t| dtypes.map(|d| (t, d))) {
        let (_dir, model) = load(ty, 5, dtype);
        let prompt: &[u32] = &[5, 70, 200, 3, 9, 41, 7];
        let steps: [u32; 4] = [12, 250, 31, 8];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let cache = || {
            let mut c = model.new_cache();
            c.set_decode_from(prompt.len());
            c
        };

        // Alone: the prompt, then one token a step.
        let mut a = cache();
        run(
            &model,
            &mut [SeqInput {
                tokens: prompt,
                cache: &mut a,
            }],
        );
        let alone: Vec<Vec<f32>> = steps
            .iter()
            .map(|t| {
                run(
                    &model,
                    &mut [SeqInput {
                        tokens: std::slice::from_ref(t),
                        cache: &mut a,
                    }],
                )
                .remove(0)
            })
            .collect();

        // Beside others: the same prompt, then each step beside a second sequence
        // decoding, with a third sequence's prompt joining at the second step.
        let (mut a, mut b, mut c) = (cache(), cache(), model.new_cache());
        run(
            &model,
            &mut [SeqInput {
                tokens: prompt,
                cache: &mut a,
            }],
        );
        run(
            &model,
            &mut [SeqInput {
                tokens: &[1, 2, 3, 4, 5, 6, 7, 8, 9],
                cache: &mut b,
            }],
        );
        let third: [u32; 10] = [300, 17, 17, 17, 99, 4, 4, 4, 4, 61];
        let mut batched = Vec::new();
        for (i, t) in steps.iter().enumerate() {
            let other = [40 + i as u32];
            let next = [140 + i as u32];
            let joining: &[u32] = if i == 1 { &third } else { &next };
            let mut seqs = vec![
                SeqInput {
                    tokens: &other,
                    cache: &mut b,
                },
                SeqInput {
                    tokens: joining,
                    cache: &mut c,
                },
                SeqInput {
                    tokens: std::slice::from_ref(t),
                    cache: &mut a,
                },
            ];
            if i == 0 {
                // The third sequence has not arrived yet.
                seqs.remove(1);
            }
            batched.push(run(&model, &mut seqs).pop().expect("a's logits"));
        }

        // Moved: prompt and every token but the last in one pass, then the last.
        let mut moved_cache = cache();
        let mut replay: Vec<u32> = prompt.to_vec();
        replay.extend_from_slice(&steps[..steps.len() - 1]);
        run(
            &model,
            &mut [SeqInput {
                tokens: &replay,
                cache: &mut moved_cache,
            }],
        );
        let last = &steps[steps.len() - 1..];
        let moved = run(
            &model,
            &mut [SeqInput {
                tokens: last,
                cache: &mut moved_cache,
            }],
        );

        // The prompt itself: alone, beside another prompt, or after a prefix-cache
        // hit (its first rows loaded, the rest run) gives the same logits.
        let mut p1 = cache();
        let first = run(
            &model,
            &mut [SeqInput {
                tokens: prompt,
                cache: &mut p1,
            }],
        )
        .remove(0);
        let (mut p2, mut other) = (cache(), model.new_cache());
        let beside = run(
            &model,
            &mut [
                SeqInput {
                    tokens: &third,
                    cache: &mut other,
                },
                SeqInput {
                    tokens: prompt,
                    cache: &mut p2,
                },
            ],
        )
        .remove(1);
        let mut p3 = cache();
        run(
            &model,
            &mut [SeqInput {
                tokens: &prompt[..5],
                cache: &mut p3,
            }],
        );
        let rest = run(
            &model,
            &mut [SeqInput {
                tokens: &prompt[5..],
                cache: &mut p3,
            }],
        )
        .remove(0);
        assert_eq!(
            bits(&beside),
            bits(&first),
            "{ty:?} {dtype}: a prompt beside another differs"
        );
        assert_eq!(
            bits(&rest),
            bits(&first),
            "{ty:?} {dtype}: a prompt run in two parts differs"
        );

        for (step, (x, y)) in alone.iter().zip(&batched).enumerate() {
            assert_eq!(
                bits(x),
                bits(y),
                "{ty:?} {dtype} step {step}: batched logits differ from alone"
            );
        }
        let want = bits(alone.last().expect("steps"));
        assert_eq!(
            bits(&moved[0]),
            want,
            "{ty:?} {dtype}: a moved sequence's logits differ"
        );
    }
}

/// `native-i8` runs prompts on 8-bit inputs: its prompt logits are not `native-i16`'s
/// (which runs them in f32) but lie within that rounding of them, and its generated
/// rows then run as `native-i16`'s do (the same kernels, on slightly different keys
/// and values).
#[test]
fn byte_prompts_round_the_prompt_only() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let prompt: &[u32] = &[5, 70, 200, 3, 9, 41, 7, 300, 12];
        let logits = |dtype| {
            let (_dir, model) = load(ty, 11, dtype);
            let mut c = model.new_cache();
            c.set_decode_from(prompt.len());
            let first = run(
                &model,
                &mut [SeqInput {
                    tokens: prompt,
                    cache: &mut c,
                }],
            );
            let next = run(
                &model,
                &mut [SeqInput {
                    tokens: &[17],
                    cache: &mut c,
                }],
            );
            (first, next)
        };
        let (wide, wide_next) = logits(WeightDtype::NativeI16);
        let (bytes, bytes_next) = logits(WeightDtype::NativeI8);
        let (d, d_next) = (max_diff(&wide, &bytes), max_diff(&wide_next, &bytes_next));
        let scale = wide[0].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert!(d > 0.0, "{ty:?}: 8-bit prompts changed nothing");
        assert!(
            d < 0.05 * scale && d_next < 0.05 * scale,
            "{ty:?}: 8-bit prompts moved the logits by {d} and {d_next} (largest {scale})"
        );
    }
}
