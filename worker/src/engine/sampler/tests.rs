use super::*;

/// One scan, keeping the first strictly larger value.
fn argmax_by_scan(logits: &[f32]) -> u32 {
    let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            (best, best_v) = (i, v);
        }
    }
    best as u32
}

#[test]
fn argmax_is_the_first_largest_value() {
    let mut state = 0x2545_f491_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    for len in [0, 1, 5, 15, 16, 17, 33, 100, 49_152] {
        for round in 0..20 {
            // Few distinct values, so that ties are common; some NaNs and −∞.
            let logits: Vec<f32> = (0..len)
                .map(|_| match next() % 23 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    r if round % 4 == 0 => -(r as f32) - 1.0,
                    r => (r % 7) as f32 - 3.0,
                })
                .collect();
            let want = argmax_by_scan(&logits);
            // The dispatched version (AVX-512 where the CPU has it), the baseline
            // build of the same lanes, and the row in parts of every size merged.
            assert_eq!(argmax(&logits), want, "{len}, {round}");
            assert_eq!(
                first_max_lanes(&logits).map_or(0, |m| m.1),
                want,
                "{len}, {round}"
            );
            for part in [1, 3, 16, 17, 1000] {
                let maxima = logits
                    .chunks(part)
                    .enumerate()
                    .map(|(k, c)| first_max(c).map(|(v, i)| (v, i + (k * part) as u32)));
                assert_eq!(
                    merge_first_max(maxima),
                    want,
                    "{len}, {round}, parts of {part}"
                );
            }
        }
    }
    assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NAN]), 0);
    let mut late = vec![0.0f32; 40];
    late[39] = 1.0;
    assert_eq!(argmax(&late), 39);
    late[21] = 1.0;
    assert_eq!(argmax(&late), 21);
}

fn params(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed,
        ..Default::default()
    }
}

#[test]
fn greedy_picks_max_and_lowest_on_ties() {
    let p = params(0.0, 1);
    assert_eq!(p.sample(&mut [0.1, 3.0, -1.0, 2.0], &[], &[], 0), 1);
    assert_eq!(p.sample(&mut [1.0, 5.0, 5.0], &[], &[], 0), 1);
    assert_eq!(p.sample(&mut [f32::NAN, 1.0], &[], &[], 0), 1);
}

#[test]
fn draw_depends_only_on_seed_and_position() {
    let a = params(1.0, 42);
    let b = params(1.0, 42);
    let seq_a: Vec<f64> = (0..50).map(|p| a.draw(p)).collect();
    // Another "worker" that starts at position 25 draws the same values there.
    let seq_b: Vec<f64> = (25..50).map(|p| b.draw(p)).collect();
    assert_eq!(&seq_a[25..], &seq_b[..]);
    assert_ne!(params(1.0, 43).draw(7), a.draw(7));
    assert_ne!(a.draw(7), a.draw(8));
    assert!(seq_a.iter().all(|u| (0.0..1.0).contains(u)));
}

#[test]
fn sampling_is_reproducible_and_follows_probabilities() {
    let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
    let p = params(1.0, 9);
    let mut counts = [0usize; 3];
    for pos in 0..4000 {
        let t = p.sample(&mut logits.clone(), &[], &[], pos);
        assert_eq!(t, p.sample(&mut logits.clone(), &[], &[], pos));
        counts[t as usize] += 1;
    }
    assert_eq!(counts[2], 0);
    let share = counts[1] as f64 / 4000.0;
    assert!((share - 0.75).abs() < 0.03, "share of token 1 was {share}");
}

/// Sampling as it was before the keyed ranking: every candidate sorted by comparison,
/// every probability summed.
fn sample_by_full_sort(p: &SamplingParams, logits: &[f32], position: u64) -> u32 {
    let mut cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l / p.temperature))
        .collect();
    if cands.is_empty() {
        return 0;
    }
    cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < cands.len() {
        cands.truncate(p.top_k);
    }
    let max = cands[0].1;
    let mut probs: Vec<f64> = cands.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
    let mut keep = probs.len();
    if p.min_p > 0.0 {
        // Ratios to the likeliest, before normalizing.
        keep = probs
            .iter()
            .take_while(|&&q| q >= f64::from(p.min_p))
            .count()
            .max(1);
    }
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p.top_p as f64 {
                keep = keep.min(i + 1);
                break;
            }
        }
    }
    let total: f64 = probs[..keep].iter().sum();
    let target = p.draw(position) * total;
    let mut acc = 0.0;
    for (c, q) in cands[..keep].iter().zip(&probs[..keep]) {
        acc += q;
        if target < acc {
            return c.0;
        }
    }
    cands[keep - 1].0
}

#[test]
fn sampling_matches_the_full_sort_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for case in 0..40 {
        let n = [1, 2, 7, 300, 5000][case % 5];
        // A wide spread (a long negligible tail), ties, both zeros, infinities, NaNs
        // and subnormals.
        let logits: Vec<f32> = (0..n)
            .map(|_| match rng.random_range(0..14) {
                0 => 0.0,
                1 => -0.0,
                2 if case % 3 == 0 => f32::NEG_INFINITY,
                3 if case % 7 == 0 => f32::INFINITY,
                4 => f32::NAN,
                5 => 1.0e-40,
                6 => (rng.random_range(0..4) as f32) * 0.5,
                7 | 8 => rng.random_range(-200.0f32..-40.0),
                _ => rng.random_range(-30.0f32..30.0),
            })
            .collect();
        for (temperature, top_k, top_p, min_p) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.3, 40, 1.0, 0.0),
            (1.0, 1, 1.0, 0.0),
            (0.5, n + 3, 0.999_999, 0.0),
            (3.0, 0, 0.5, 0.0),
            (0.05, 0, 1.0, 0.0),
            (1.0, 0, 1.0, 0.05),
            (2.0, 0, 0.8, 0.3),
            (0.9, 50, 1.0, 0.01),
        ] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: case as u64,
                ..Default::default()
            };
            for pos in 0..50 {
                assert_eq!(
                    p.sample(&mut logits.clone(), &[], &[], pos),
                    sample_by_full_sort(&p, &logits, pos),
                    "case {case}, T {temperature}, top_k {top_k}, top_p {top_p}, pos {pos}"
                );
            }
        }
    }
}

/// The `k` largest logits of `row` as a device's top-k gives them: ties at the edge
/// parted at random, the order shuffled.
fn device_top(row: &[f32], k: usize, rng: &mut ChaCha8Rng) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32, u32)> = row
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l, rng.random::<u32>()))
        .collect();
    // Numeric order (−0 and +0 equal), random among equals.
    all.sort_by(|a, b| b.1.partial_cmp(&a.1).expect("finite").then(a.2.cmp(&b.2)));
    all.truncate(k);
    let mut top: Vec<(u32, f32)> = all.into_iter().map(|(i, l, _)| (i, l)).collect();
    for i in (1..top.len()).rev() {
        top.swap(i, rng.random_range(0..=i));
    }
    top
}

#[test]
fn a_draw_from_the_top_logits_is_the_full_rows_draw_or_none() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (mut decided, mut total) = (0usize, 0usize);
    for case in 0..60 {
        let n = [5, 64, 300, 2000][case % 4];
        // Wide rows (a short head), narrow ones (a head of the whole row), and
        // rows of few distinct values (ties everywhere, both zeros).
        let spread = [200.0f32, 20.0, 0.0][case % 3];
        let row: Vec<f32> = (0..n)
            .map(|_| {
                if spread == 0.0 {
                    [0.0, -0.0, 1.0, -3.0, 7.5][rng.random_range(0..5)]
                } else {
                    rng.random_range(-spread..spread)
                }
            })
            .collect();
        for (temperature, top_k, top_p, min_p) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.0, 40, 1.0, 0.0),
            (0.3, 20, 0.95, 0.0),
            (1.0, 1, 1.0, 0.0),
            (2.0, 0, 0.8, 0.3),
            (0.9, 63, 1.0, 0.01),
            (1.0, n, 1.0, 0.0),
        ] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: case as u64,
                ..Default::default()
            };
            for k in [1, 16, 64] {
                let top = device_top(&row, k.min(n), &mut rng);
                for pos in 0..20 {
                    total += 1;
                    if let Some(id) = p.pick_from_top(&top, n, None, pos) {
                        decided += 1;
                        assert_eq!(
                            id,
                            p.pick(&row, pos),
                            "case {case}, T {temperature}, top_k {top_k}, k {k}, pos {pos}"
                        );
                    }
                }
            }
            // A top_k below the selection, on distinct values, is always decided.
            if spread > 0.0 && top_k > 0 && top_k < 64 && n > 64 {
                let top = device_top(&row, 64, &mut rng);
                assert!((0..20).all(|pos| p.pick_from_top(&top, n, None, pos).is_some()));
            }
        }
    }
    // Neither always nor never: both answers are exercised.
    assert!(
        decided > total / 5 && decided < total,
        "{decided} of {total}"
    );
}

/// What a device sums of `row` beyond `top` at temperature `t` ([`Rest`]), in f32 in
/// a shuffled order, then moved by up to `skew` of itself (a device's rounding).
fn device_rest(row: &[f32], top: &[(u32, f32)], t: f32, skew: f64, rng: &mut ChaCha8Rng) -> Rest {
    let least = top.iter().map(|x| x.1).fold(f32::INFINITY, f32::min);
    let max = top.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
    let inv = 1.0 / t;
    let mut terms: Vec<f32> = row
        .iter()
        .filter(|&&l| l < least)
        .map(|&l| ((l - max) * inv).exp())
        .collect();
    for i in (1..terms.len()).rev() {
        terms.swap(i, rng.random_range(0..=i));
    }
    let below = terms.iter().sum::<f32>();
    Rest {
        ties: row.iter().filter(|&&l| l == least).count(),
        below: (f64::from(below) * (1.0 + rng.random_range(-skew..=skew))) as f32,
    }
}

/// Rows shaped like a language model's: noise, a few tokens far above it.
fn peaked_row(n: usize, peaks: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut row: Vec<f32> = (0..n)
        .map(|_| (0..4).map(|_| rng.random_range(-1.5f32..1.5)).sum())
        .collect();
    for _ in 0..peaks {
        row[rng.random_range(0..n)] += rng.random_range(6.0f32..14.0);
    }
    row
}

#[test]
fn a_draw_from_the_top_logits_and_the_rests_sum_is_the_full_rows_draw_or_none() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (mut decided, mut total) = (0usize, 0usize);
    for case in 0..24 {
        let n = [3000, 20000][case % 2];
        let row = peaked_row(n, [1, 3, 12, 0][case % 4], &mut rng);
        for (temperature, top_p, min_p) in [
            (0.7, 1.0, 0.0),
            (1.0, 1.0, 0.0),
            (0.8, 0.95, 0.0),
            (1.3, 0.9, 0.05),
            (0.2, 1.0, 0.0),
            (1.0, 0.95, 0.0),
            (1.0, 0.5, 0.0),
        ] {
            let p = SamplingParams {
                temperature,
                top_p,
                min_p,
                seed: case as u64,
                ..Default::default()
            };
            let top = device_top(&row, 64, &mut rng);
            // The largest error the bound allows for the sum alone.
            let skew = n as f64 * f64::from(f32::EPSILON) / 2.0;
            let rest = device_rest(&row, &top, temperature, skew, &mut rng);
            for pos in 0..30 {
                total += 1;
                if let Some(id) = p.pick_from_top(&top, n, Some(&rest), pos) {
                    decided += 1;
                    assert_eq!(
                        id,
                        p.pick(&row, pos),
                        "case {case}, T {temperature}, top_p {top_p}, pos {pos}"
                    );
                }
            }
        }
    }
    // Most draws from rows like a model's are decided, not all (some land in the rest).
    eprintln!("{decided} of {total}");
    assert!(
        decided > total * 3 / 5 && decided < total,
        "{decided} of {total}"
    );
}

#[test]
fn a_rest_summed_wrong_gives_other_draws() {
    // The check above can fail: a sum of the rest three times too large moves draws.
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let mut wrong = 0;
    for case in 0..8 {
        let row = peaked_row(3000, 2, &mut rng);
        let p = SamplingParams {
            temperature: 1.0,
            seed: case,
            ..Default::default()
        };
        let top = device_top(&row, 64, &mut rng);
        let mut rest = device_rest(&row, &top, 1.0, 0.0, &mut rng);
        rest.below *= 3.0;
        wrong += (0..40)
            .filter(|&pos| {
                p.pick_from_top(&top, row.len(), Some(&rest), pos)
                    .is_some_and(|id| id != p.pick(&row, pos))
            })
            .count();
    }
    assert!(wrong > 0);
}

#[test]
fn a_top_p_cut_past_the_top_logits_still_decides_draws_well_inside_them() {
    // Rows without peaks: the 64 largest hold far less than half the total, so a
    // top_p of 0.5 cuts in the rest, and draws landing inside the 64 are decided.
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let (mut decided, mut total) = (0usize, 0usize);
    for case in 0..6 {
        let row = peaked_row(3000, 0, &mut rng);
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: case,
            ..Default::default()
        };
        let top = device_top(&row, 64, &mut rng);
        let skew = row.len() as f64 * f64::from(f32::EPSILON) / 2.0;
        let rest = device_rest(&row, &top, 1.0, skew, &mut rng);
        for pos in 0..50 {
            total += 1;
            if let Some(id) = p.pick_from_top(&top, row.len(), Some(&rest), pos) {
                assert_eq!(id, p.pick(&row, pos), "case {case}, pos {pos}");
                decided += 1;
            }
        }
    }
    assert!(
        decided > total / 10 && decided < total,
        "{decided} of {total}"
    );
}

#[test]
fn a_tiny_temperature_on_large_logits_leaves_the_rest_undecided() {
    // At T 1e-4 a logit of 30 scales to 3e5, where the device's exponent may be off
    // by enough to move each term of the rest by several percent: nothing is decided
    // from the sum. The same row moved down to 0 is decided as usual.
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let shape: Vec<f32> = (0..3000)
        .map(|i| if i < 200 { -(i as f32) * 4e-6 } else { -1.0 })
        .collect();
    let p = SamplingParams {
        temperature: 1e-4,
        seed: 3,
        ..Default::default()
    };
    let decided = |row: &[f32], rng: &mut ChaCha8Rng| {
        let top = device_top(row, 64, rng);
        let rest = device_rest(row, &top, p.temperature, 0.0, rng);
        (0..40)
            .filter_map(|pos| {
                let id = p.pick_from_top(&top, row.len(), Some(&rest), pos)?;
                assert_eq!(id, p.pick(row, pos), "pos {pos}");
                Some(id)
            })
            .count()
    };
    let high: Vec<f32> = shape.iter().map(|l| l + 30.0).collect();
    assert_eq!(decided(&high, &mut rng), 0);
    assert!(decided(&shape, &mut rng) > 20);
}

#[test]
fn the_negligible_tail_is_counted_but_not_summed() {
    // Only the head is sorted and summed; the tail's size and its last candidate in
    // the full order (chosen if a draw ever ran past the head) are kept.
    let logits = [0.0f32, -100.0, -100.0, -300.0];
    let p = SamplingParams {
        temperature: 1.0,
        seed: 1,
        ..Default::default()
    };
    let ranked = p.ranked(&logits).expect("candidates");
    assert_eq!(ranked.head.len(), 1);
    assert_eq!((ranked.len, ranked.last), (4, Some(3)));
    for pos in 0..2000 {
        assert_eq!(
            p.sample(&mut logits.clone(), &[], &[], pos),
            sample_by_full_sort(&p, &logits, pos)
        );
    }
}

#[test]
fn top_k_and_top_p_restrict_candidates() {
    let logits = [1.0f32, 2.0, 3.0, 4.0];
    let k1 = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..Default::default()
    };
    let p_small = SamplingParams {
        temperature: 1.0,
        top_p: 0.1,
        ..Default::default()
    };
    for pos in 0..100 {
        assert_eq!(k1.sample(&mut logits.clone(), &[], &[], pos), 3);
        assert_eq!(p_small.sample(&mut logits.clone(), &[], &[], pos), 3);
    }
    let k2 = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        ..Default::default()
    };
    let seen: std::collections::BTreeSet<u32> = (0..200)
        .map(|pos| k2.sample(&mut logits.clone(), &[], &[], pos))
        .collect();
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![2, 3]);
}

#[test]
fn repetition_penalty_discourages_seen_tokens() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..Default::default()
    };
    // Token 0 leads but was already used: 3.0 / 2 < 2.0.
    assert_eq!(p.sample(&mut [3.0, 2.0], &[0], &[0], 0), 1);
    let mut neg = [-1.0f32, -1.5];
    p.sample(&mut neg, &[0], &[], 0);
    assert_eq!(neg, [-2.0, -1.5]);
}

#[test]
fn presence_and_frequency_penalties_follow_openais_definition() {
    let p = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    // logit −= presence × [count > 0] + frequency × count, over the output only.
    let mut l = [1.0f32, 1.0, 1.0, 1.0];
    p.adjust(&mut l, &[3, 3, 3], &[0, 1, 1, 1]);
    assert_eq!(l, [1.0 - 0.75, 1.0 - 1.25, 1.0, 1.0]);
    // Greedy: token 0 leads, but the output already holds it three times.
    assert_eq!(p.sample(&mut [2.0, 1.5], &[], &[0, 0, 0], 0), 1);
    assert_eq!(p.sample(&mut [2.0, 1.5], &[0, 0, 0], &[], 0), 0);
    // A negative presence penalty encourages repeats.
    let encourage = SamplingParams {
        presence_penalty: -2.0,
        ..Default::default()
    };
    assert_eq!(encourage.sample(&mut [2.0, 1.5], &[], &[1], 0), 1);
}

#[test]
fn logit_bias_moves_the_draw() {
    let p = SamplingParams {
        logit_bias: vec![(2, 100.0), (0, -100.0), (99, 5.0)],
        temperature: 1.0,
        ..Default::default()
    };
    for pos in 0..200 {
        assert_eq!(p.sample(&mut [5.0, 4.0, -3.0], &[], &[], pos), 2);
    }
    let ban = SamplingParams {
        logit_bias: vec![(0, -100.0)],
        ..Default::default()
    };
    assert_eq!(ban.sample(&mut [5.0, 4.0], &[], &[], 0), 1);
}

#[test]
fn min_p_drops_tokens_far_below_the_most_likely() {
    // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
    let logits = [0.0f32, -(2.0f32).ln(), -(4.0f32).ln(), -(4.0f32).ln()];
    let seen = |min_p: f32| {
        let p = SamplingParams {
            temperature: 1.0,
            min_p,
            seed: 3,
            ..Default::default()
        };
        (0..2000)
            .map(|pos| p.sample(&mut logits.clone(), &[], &[], pos))
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect::<Vec<_>>()
    };
    assert_eq!(seen(0.0), vec![0, 1, 2, 3]);
    assert_eq!(seen(0.2), vec![0, 1, 2, 3]);
    assert_eq!(seen(0.3), vec![0, 1]);
    assert_eq!(seen(0.45), vec![0, 1]);
    assert_eq!(seen(0.6), vec![0]);
    assert_eq!(seen(1.0), vec![0]);
    // Only ratios to the largest count: the far tail goes with any min_p.
    let mut wide = vec![-300.0f32; 100];
    wide[7] = 0.0;
    let p = SamplingParams {
        temperature: 1.0,
        min_p: 1e-30,
        ..Default::default()
    };
    for pos in 0..200 {
        assert_eq!(p.sample(&mut wide.clone(), &[], &[], pos), 7);
    }
}

#[test]
fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
    let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, f32::NAN, 2.0];
    let (chosen, top) = logprobs(&logits, 5, 3);
    let z: f64 = [1.0f64, 3.0, 3.0, 2.0].iter().map(|l| l.exp()).sum();
    let lp = |l: f64| (l - z.ln()) as f32;
    assert!((chosen - lp(2.0)).abs() < 1e-6, "{chosen}");
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 5]);
    assert!((top[0].1 - lp(3.0)).abs() < 1e-6);
    let total: f64 = [0u32, 1, 3, 5]
        .iter()
        .map(|&i| f64::from(logprobs(&logits, i, 0).0).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    // Forbidden tokens are never listed, even when fewer are left than asked for.
    let (none, top) = logprobs(&logits, 2, 20);
    assert_eq!(none, f32::NEG_INFINITY);
    assert_eq!(top.len(), 4);
}

#[test]
fn validation_rejects_out_of_domain_values() {
    assert!(params(-0.1, 0).validate().is_err());
    assert!(params(f32::NAN, 0).validate().is_err());
    let mut p = params(1.0, 0);
    p.top_p = 0.0;
    assert!(p.validate().is_err());
    p.top_p = 1.0;
    p.repetition_penalty = 0.0;
    assert!(p.validate().is_err());
    p.repetition_penalty = 1.1;
    assert!(p.validate().is_ok());
    p.min_p = 1.5;
    assert!(p.validate().is_err());
    p.min_p = 0.1;
    p.presence_penalty = 2.5;
    assert!(p.validate().is_err());
    p.presence_penalty = -2.0;
    p.frequency_penalty = f32::NAN;
    assert!(p.validate().is_err());
    p.frequency_penalty = 2.0;
    p.logit_bias = vec![(1, 101.0)];
    assert!(p.validate().is_err());
    p.logit_bias = vec![(1, -100.0)];
    assert!(p.validate().is_ok());
}
