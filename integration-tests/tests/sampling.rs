//! Logprobs and the sampling fields through the official `openai` Python client against
//! a cluster running the real model, each compared with the engine's own answer
//! (`baton-worker generate --json` with the same options): chat `logprobs` and
//! `top_logprobs` (whole and streamed alike), text completions' `logprobs` N with their
//! offsets, `logit_bias`, `stop_token_ids`, `min_tokens`, and the presence and frequency
//! penalties with `min_p` on a seeded draw; a bias on a token past the vocabulary is a
//! 400 naming `logit_bias`; `usage.prompt_tokens_details.cached_tokens` counts the prompt
//! tokens a repeated prompt found in the worker's prefix cache; `/tokenize` gives the
//! engine's prompt ids for text and chat messages, and `/detokenize` their text back;
//! `echo` with `max_tokens: 0` scores a prompt with the engine's own prompt logprobs
//! (lm-eval's log-likelihood request), and `echo` puts the prompt and its tokens before
//! the completion, whole and streamed alike.

use baton_integration_tests::{
    generate_json, generate_with, python_has, python_json, Cluster, ClusterOptions,
};
use serde_json::{json, Value};

const PROMPT: &str = "Name three colors.";
const COMPLETION_PROMPT: &str = "The three primary colors are";
const SHORT_PROMPT: &str = "What is 2+2? Reply with just the number.";
const MAX_TOKENS: u32 = 24;
const MIN_TOKENS: u32 = 12;
const TOP: usize = 3;

fn ids(v: &Value) -> Vec<u64> {
    v["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| i.as_u64().expect("id"))
        .collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// Logprobs as JSON carries them (f32 printed shortest, read back as f64) against the
/// engine's: equal to an f32's precision.
fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
        "{what}: {a} against the engine's {b}"
    );
}

#[test]
fn logprobs_and_sampling_fields_match_the_engine() {
    if !python_has("openai", "openai") {
        return;
    }
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(1)) else {
        return;
    };
    let top = TOP.to_string();
    let reference = generate_json(PROMPT, true, MAX_TOKENS, &["--logprobs", &top]);
    let out = ids(&reference);
    assert!(out.len() > 4, "{reference}");
    // A stop token that first appears at position k ≥ 2.
    let k = (2..out.len())
        .find(|&k| !out[..k].contains(&out[k]))
        .expect("a token new at some position");
    let short = generate_json(SHORT_PROMPT, true, MAX_TOKENS, &[]);
    let sampled = json!({"temperature": 0.8, "seed": 11, "presence_penalty": 0.6,
                         "frequency_penalty": 0.9, "min_p": 0.05});
    let cases = json!({
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "top": TOP,
        "completion_prompt": COMPLETION_PROMPT,
        "bias": {out[0].to_string(): -100},
        "stop_ids": [out[k]],
        "min_tokens_prompt": SHORT_PROMPT, "min_tokens": MIN_TOKENS,
        "sampled": sampled,
        "outside": {"99999999": 5},
    });
    let r = python_json(
        "sampling.py",
        &[&cluster.api.base, &cluster.model, &cases.to_string()],
        &cluster,
    );

    // Chat logprobs: one entry per generated token, equal to the engine's; greedy picks
    // the likeliest; streamed entries are the whole answer's.
    let chat = &r["chat"];
    assert_eq!(chat["text"], reference["text"], "{chat}");
    let entries = chat["logprobs"].as_array().expect("chat logprobs");
    let engine = reference["logprobs"].as_array().expect("engine logprobs");
    assert_eq!(entries.len(), out.len(), "{chat}");
    assert_eq!(chat["completion_tokens"], out.len());
    for (i, (e, want)) in entries.iter().zip(engine).enumerate() {
        close(f(&e["logprob"]), f(&want["logprob"]), &format!("token {i}"));
        let tops = e["top"].as_array().expect("top");
        assert_eq!(tops.len(), TOP, "{e}");
        for (j, (t, w)) in tops
            .iter()
            .zip(want["top"].as_array().expect("top"))
            .enumerate()
        {
            close(
                f(&t["logprob"]),
                f(&w[1]),
                &format!("token {i}, alternative {j}"),
            );
        }
        assert_eq!(
            e["logprob"], tops[0]["logprob"],
            "greedy draws the likeliest: {e}"
        );
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .map(|b| b.as_u64().expect("byte") as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().expect("token")
        );
    }
    assert_eq!(r["chat_stream"]["logprobs"], chat["logprobs"]);
    assert_eq!(r["chat_stream"]["text"], chat["text"]);
    assert_eq!(r["chat_plain_logprobs"], Value::Null, "not asked, not sent");

    // The first request with this prompt ran all of it; later ones found most of it in
    // the prefix cache (all but the last token, which always runs).
    assert_eq!(chat["cached_tokens"], 0, "{chat}");
    let again = &r["bias"];
    let (cached, prompt) = (f(&again["cached_tokens"]), f(&again["prompt_tokens"]));
    assert!(cached > 0.0 && cached < prompt, "{again}");

    // Text completions: the legacy shape, with offsets into the text.
    let completion_ref = generate_json(COMPLETION_PROMPT, false, MAX_TOKENS, &["--logprobs", &top]);
    let c = &r["completion"];
    assert_eq!(c["text"], completion_ref["text"]);
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_str().expect("token"))
        .collect();
    assert_eq!(tokens.len(), ids(&completion_ref).len(), "{lp}");
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset, "{lp}");
        offset += token.chars().count();
        let want = &completion_ref["logprobs"][i];
        close(
            f(&lp["token_logprobs"][i]),
            f(&want["logprob"]),
            &format!("completion token {i}"),
        );
        let alternatives = lp["top_logprobs"][i].as_object().expect("top");
        assert!(
            !alternatives.is_empty() && alternatives.len() <= TOP,
            "{lp}"
        );
    }
    assert!(
        tokens
            .concat()
            .starts_with(c["text"].as_str().expect("text")),
        "{c}"
    );
    assert_eq!(r["completion_stream"]["logprobs"], *lp);
    assert_eq!(r["completion_stream"]["text"], c["text"]);

    // echo + max_tokens 0: the prompt's log-likelihood, token by token the engine's own.
    let scored = generate_json(COMPLETION_PROMPT, false, 0, &["--prompt-logprobs", "1"]);
    let prompt_ids = scored["prompt_ids"].as_array().expect("prompt ids").len();
    let score = &r["echo_score"];
    assert_eq!(score["text"], COMPLETION_PROMPT, "{score}");
    assert_eq!(score["completion_tokens"], 0, "{score}");
    assert_eq!(score["finish_reason"], "length", "{score}");
    let lp = &score["logprobs"]["token_logprobs"];
    assert_eq!(lp.as_array().map(Vec::len), Some(prompt_ids), "{score}");
    assert_eq!(lp[0], Value::Null, "nothing scores the first token");
    let engine_scores = scored["prompt_logprobs"].as_array().expect("engine scores");
    assert_eq!(engine_scores.len(), prompt_ids - 1);
    let (mut got, mut want) = (0.0, 0.0);
    for (i, e) in engine_scores.iter().enumerate() {
        close(
            f(&lp[i + 1]),
            f(&e["logprob"]),
            &format!("prompt token {}", i + 1),
        );
        got += f(&lp[i + 1]);
        want += f(&e["logprob"]);
    }
    close(got, want, "the prompt's log-likelihood");
    assert!(got < 0.0);
    // echo before a completion: the prompt's tokens, then the completion's, with the
    // completion's offsets counted after the prompt's text.
    let echoed = &r["echo"];
    let completion_text = c["text"].as_str().expect("text");
    assert_eq!(
        echoed["text"].as_str(),
        Some(format!("{COMPLETION_PROMPT}{completion_text}").as_str())
    );
    let lp = &echoed["logprobs"];
    let n = lp["tokens"].as_array().map(Vec::len).unwrap_or(0);
    assert_eq!(n, prompt_ids + tokens.len(), "{lp}");
    assert_eq!(
        lp["token_logprobs"].as_array().expect("logprobs")[prompt_ids..],
        c["logprobs"]["token_logprobs"]
            .as_array()
            .expect("logprobs")[..],
        "generating after an echo changes nothing"
    );
    assert_eq!(
        lp["text_offset"][prompt_ids],
        COMPLETION_PROMPT.chars().count()
    );
    assert_eq!(r["echo_stream"]["logprobs"], *lp);
    assert_eq!(r["echo_stream"]["text"], echoed["text"]);

    // logit_bias: the first token is banned, and the answer is the engine's with the
    // same bias.
    let banned = format!("{}=-100", out[0]);
    let biased = generate_with(PROMPT, true, MAX_TOKENS, &["--logit-bias", &banned]);
    assert_eq!(r["bias"]["text"], biased.as_str());
    assert_ne!(r["bias"]["text"], reference["text"]);

    // stop_token_ids: the output ends with that token, which has no text.
    let stopped = &r["stop_ids"];
    assert_eq!(stopped["finish_reason"], "stop", "{stopped}");
    assert_eq!(stopped["completion_tokens"], k + 1, "{stopped}");
    let stop_id = out[k].to_string();
    assert_eq!(
        stopped["text"],
        generate_with(PROMPT, true, MAX_TOKENS, &["--stop-token-id", &stop_id]).as_str()
    );

    // min_tokens: a short answer runs on to at least that many tokens.
    assert!(ids(&short).len() < MIN_TOKENS as usize, "{short}");
    assert_eq!(r["min_tokens_off"]["completion_tokens"], ids(&short).len());
    let long = &r["min_tokens"];
    assert!(
        f(&long["completion_tokens"]) >= f64::from(MIN_TOKENS),
        "{long}"
    );
    let min = MIN_TOKENS.to_string();
    assert_eq!(
        long["text"],
        generate_with(SHORT_PROMPT, true, MAX_TOKENS, &["--min-tokens", &min]).as_str()
    );

    // Penalties and min_p on a seeded draw: the engine's answer with the same options.
    let same = generate_with(
        PROMPT,
        true,
        MAX_TOKENS,
        &[
            "--temperature",
            "0.8",
            "--seed",
            "11",
            "--presence-penalty",
            "0.6",
            "--frequency-penalty",
            "0.9",
            "--min-p",
            "0.05",
        ],
    );
    assert_eq!(r["sampled"]["text"], same.as_str());

    // /tokenize: the prompt ids the engine ran, for messages and for text; /detokenize
    // gives text back.
    let tokenized = cluster
        .api
        .post_json(
            "/tokenize",
            &json!({"model": cluster.model,
                    "messages": [{"role": "user", "content": PROMPT}]}),
        )
        .expect("POST /tokenize");
    assert_eq!(tokenized.status, 200, "{}", tokenized.body);
    assert_eq!(tokenized.body["tokens"], reference["prompt_ids"]);
    assert_eq!(
        tokenized.body["count"],
        reference["prompt_ids"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0)
    );
    assert!(tokenized.body["max_model_len"].as_u64().unwrap_or(0) > 0);
    let text = cluster
        .api
        .post_json(
            "/tokenize",
            &json!({"model": cluster.model, "prompt": COMPLETION_PROMPT}),
        )
        .expect("POST /tokenize");
    assert_eq!(
        text.body["tokens"], completion_ref["prompt_ids"],
        "{}",
        text.body
    );
    let back = cluster
        .api
        .post_json(
            "/detokenize",
            &json!({"model": cluster.model, "tokens": text.body["tokens"]}),
        )
        .expect("POST /detokenize");
    assert_eq!(back.status, 200, "{}", back.body);
    assert_eq!(back.body["prompt"], COMPLETION_PROMPT);
    let past = cluster
        .api
        .post_json(
            "/detokenize",
            &json!({"model": cluster.model, "tokens": [99_999_999]}),
        )
        .expect("POST /detokenize");
    assert_eq!(past.status, 400, "{}", past.body);
    let unknown = cluster
        .api
        .post_json(
            "/tokenize",
            &json!({"model": "no-such-model", "prompt": "x"}),
        )
        .expect("POST /tokenize");
    assert_eq!(unknown.status, 404, "{}", unknown.body);

    let outside = &r["outside"];
    assert_eq!(outside["status"], 400, "{outside}");
    let message = outside["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("logit_bias") && message.contains("vocabulary"),
        "{message}"
    );
    cluster.assert_alive();
}
