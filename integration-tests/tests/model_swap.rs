//! Hot model swap on a worker running the real model: four streams run through a swap
//! and end as uninterrupted runs; a swap to a bad file (missing, not a GGUF, truncated,
//! another architecture, a wrong or missing SHA-256) is refused with a reply naming the
//! problem while the old model serves on; a renamed model and a second one follow into
//! `/v1/models`, over HTTP and over NATS (the `baton` CLI).

use std::process::Command;
use std::time::{Duration, Instant};

use baton_integration_tests::cluster::default_model_path;
use baton_integration_tests::drill::{load_model, sha256_hex, swap_model, Sampling};
use baton_integration_tests::http::assert_error;
use baton_integration_tests::process::bin;
use baton_integration_tests::{workspace_root, Cluster, ClusterOptions};
use serde_json::{json, Value};

#[test]
fn four_streams_run_through_a_swap_and_bad_swaps_are_refused() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(1)) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(5)] {
        let verdict = swap_model(&mut cluster, sampling, 1, 64, &default_model_path());
        println!("{}", verdict.line());
        assert!(
            verdict.ok(),
            "{}\n{}\n{}",
            verdict.line(),
            verdict.failures.join("\n"),
            cluster.logs()
        );
    }
    cluster.assert_alive();
}

/// The names `/v1/models` lists.
fn listed(cluster: &Cluster) -> Vec<String> {
    let reply = cluster.api.get("/v1/models").expect("GET /v1/models");
    reply.body["data"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until `/v1/models` lists exactly `want` (in any order).
fn wait_listed(cluster: &Cluster, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut got = listed(cluster);
        got.sort();
        let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        want.sort();
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/v1/models lists {got:?}, not {want:?}\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn greedy(cluster: &Cluster, model: &str) -> String {
    let reply = cluster
        .api
        .post_json(
            "/v1/completions",
            &json!({"model": model, "prompt": "The lighthouse keeper", "max_tokens": 12, "temperature": 0}),
        )
        .expect("POST /v1/completions");
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.body["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `baton` over NATS; its stdout as JSON, or its stderr as the error.
fn baton_nats(cluster: &Cluster, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(bin("baton"))
        .arg("--nats")
        .arg(&cluster.nats.url)
        .args(args)
        .env_remove("BATON_NATS_URL")
        .env_remove("BATON_URL")
        .output()
        .expect("running baton");
    if out.status.success() {
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn model_orders_name_what_is_wrong_and_models_follow_the_registry() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(1)) else {
        return;
    };
    let worker = cluster.worker_id(0).expect("a worker id");
    let before = greedy(&cluster, &cluster.model);
    let dir = tempfile::tempdir().expect("tempdir");
    let with_sha = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).expect("write");
        (p.display().to_string(), sha256_hex(&p))
    };
    let model = std::fs::read(default_model_path()).expect("the model file");
    let (text, text_sha) = with_sha("notes.gguf", b"not a model\n");
    let (cut, cut_sha) = with_sha("cut.gguf", &model[..model.len() / 2]);
    // Another architecture: every "qwen2" of a fixture (its name, its keys' prefix)
    // renamed to one nobody runs.
    let qwen2 = std::fs::read(workspace_root().join("worker/tests/fixtures/arch/qwen2.q8_0.gguf"))
        .expect("the qwen2 fixture");
    let mut mamba = qwen2.clone();
    let mut at = 0;
    while let Some(j) = mamba[at..].windows(5).position(|w| w == b"qwen2") {
        mamba[at + j..at + j + 5].copy_from_slice(b"mamba");
        at += j + 5;
    }
    let (other, other_sha) = with_sha("other.gguf", &mamba);
    let (copy, copy_sha) = with_sha("copy.gguf", &model);
    let missing = dir.path().join("missing.gguf").display().to_string();
    let cases = [
        (
            json!({"path": missing, "sha256": "0".repeat(64)}),
            "no model file",
        ),
        (json!({"path": text, "sha256": text_sha}), "not a GGUF file"),
        (json!({"path": cut, "sha256": cut_sha}), "not a GGUF file"),
        (json!({"path": other, "sha256": other_sha}), "cannot run it"),
        (
            json!({"path": copy, "sha256": "0".repeat(64)}),
            "its SHA-256 is",
        ),
        (json!({"path": copy}), "no SHA-256 given"),
        (json!({"path": copy, "sha256": "xyz"}), "not 64 hex digits"),
    ];
    for (body, why) in &cases {
        let reply = load_model(&cluster, &worker, body.clone());
        let error = assert_error(&reply, 400);
        let message = error["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{body}: {message}");
        assert_eq!(error["param"], "path", "{body}: {error}");
    }
    // The architecture is named.
    let reply = load_model(
        &cluster,
        &worker,
        json!({"path": other, "sha256": other_sha}),
    );
    assert!(reply.body.to_string().contains("mamba"), "{}", reply.body);
    // Orders that never reach a worker.
    for (body, status) in [
        (json!({"sha256": copy_sha}), 400),
        (
            json!({"path": copy, "sha256": copy_sha, "colour": "blue"}),
            400,
        ),
    ] {
        assert_error(&load_model(&cluster, &worker, body), status);
    }
    let malformed = cluster
        .api
        .post_raw(&format!("/admin/workers/{worker}/models"), "{\"path\": ")
        .expect("POST");
    assert_error(&malformed, 400);
    let nobody = "0123456789abcdef0123456789abcdef";
    let reply = load_model(&cluster, nobody, json!({"path": copy, "sha256": copy_sha}));
    assert_error(&reply, 404);
    // Nothing changed.
    wait_listed(&cluster, &[&cluster.model]);
    assert_eq!(greedy(&cluster, &cluster.model), before);

    // A swap to a copy under another name: the registry follows, the text is the same.
    let reply = load_model(
        &cluster,
        &worker,
        json!({"path": copy, "sha256": copy_sha, "name": "renamed"}),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["loaded"]["id"], "renamed", "{}", reply.body);
    assert_eq!(reply.body["serving"].as_array().map(Vec::len), Some(1));
    wait_listed(&cluster, &["renamed"]);
    assert_eq!(greedy(&cluster, "renamed"), before);
    let gone = cluster
        .api
        .post_json(
            "/v1/completions",
            &json!({"model": cluster.model, "prompt": "x", "max_tokens": 2}),
        )
        .expect("POST");
    assert_error(&gone, 404);

    // Over NATS: a second model beside it, then unloaded; the last one stays.
    let fixture = workspace_root().join("worker/tests/fixtures/arch/qwen2.q8_0.gguf");
    let (tiny, tiny_sha) = with_sha("tiny.gguf", &std::fs::read(fixture).expect("fixture"));
    let add_tiny = [
        "load-model",
        &worker,
        &tiny,
        "--sha256",
        &tiny_sha,
        "--name",
        "tiny",
        "--add",
    ];
    let added =
        baton_nats(&cluster, &add_tiny).unwrap_or_else(|e| panic!("{e}\n{}", cluster.logs()));
    assert_eq!(
        added["serving"].as_array().map(Vec::len),
        Some(2),
        "{added}"
    );
    wait_listed(&cluster, &["renamed", "tiny"]);
    let reply = cluster
        .api
        .post_json(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
        )
        .expect("POST");
    assert_eq!(reply.status, 200, "{}", reply.body);
    let again = baton_nats(&cluster, &add_tiny).expect_err("already served");
    assert!(again.contains("already serves"), "{again}");
    let unloaded = baton_nats(&cluster, &["unload-model", &worker, "tiny"])
        .unwrap_or_else(|e| panic!("{e}\n{}", cluster.logs()));
    assert_eq!(unloaded["serving"][0]["id"], "renamed", "{unloaded}");
    wait_listed(&cluster, &["renamed"]);
    let last = baton_nats(&cluster, &["unload-model", &worker, "renamed"])
        .expect_err("the last model stays");
    assert!(last.contains("only model"), "{last}");
    let unknown = cluster
        .api
        .delete(&format!("/admin/workers/{worker}/models/nothing"))
        .expect("DELETE");
    let error = assert_error(&unknown, 404);
    assert_eq!(
        (error["code"].as_str(), error["param"].as_str()),
        (Some("model_not_found"), Some("model")),
        "{error}"
    );
    assert_eq!(greedy(&cluster, "renamed"), before);

    // The worker counted each order by outcome.
    let text = cluster.worker_metrics(0);
    for line in [
        r#"baton_worker_model_changes_total{op="load",outcome="ok"} 2"#,
        r#"baton_worker_model_changes_total{op="load",outcome="invalid_request"} 9"#,
        r#"baton_worker_model_changes_total{op="unload",outcome="ok"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    }
    cluster.assert_alive();
}

/// A worker watching its model file: a new version with its `.sha256` is loaded and
/// switched to; a version that does not match its `.sha256` is refused, the model
/// serving on.
#[test]
fn a_watched_model_file_is_reloaded_when_it_changes() {
    let source = default_model_path();
    if !source.exists() {
        eprintln!("skipping: the default model is absent");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("watched.gguf");
    std::fs::copy(&source, &path).expect("copy");
    let sha_file = dir.path().join("watched.gguf.sha256");
    std::fs::write(&sha_file, sha256_hex(&path)).expect("write");
    let mut options = ClusterOptions::real(1).models(vec![path.clone()]);
    options.extra.push((
        "worker",
        "watch_model = true\nwatch_interval_ms = 100".into(),
    ));
    let Some(mut cluster) = Cluster::start(options) else {
        return;
    };
    let before = greedy(&cluster, &cluster.model);
    // The value of one of the worker's model-change counters.
    let count = |cluster: &Cluster, outcome: &str| -> u64 {
        let key = format!(r#"baton_worker_model_changes_total{{op="load",outcome="{outcome}"}} "#);
        cluster
            .worker_metrics(0)
            .lines()
            .find_map(|l| l.strip_prefix(key.as_str()).and_then(|v| v.parse().ok()))
            .unwrap_or(0)
    };
    let wait_for = |cluster: &Cluster, outcome: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while count(cluster, outcome) == 0 {
            assert!(
                Instant::now() < deadline,
                "no load {outcome} in 30 s\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // A new version (the same bytes written again), its .sha256 first, the file moved
    // in whole: loaded.
    let tmp = dir.path().join("incoming");
    std::fs::copy(&source, &tmp).expect("copy");
    std::fs::write(&sha_file, format!("{}  watched.gguf\n", sha256_hex(&tmp))).expect("write");
    std::fs::rename(&tmp, &path).expect("rename");
    wait_for(&cluster, "ok");
    assert_eq!(count(&cluster, "invalid_request"), 0);
    assert_eq!(greedy(&cluster, &cluster.model), before);
    // A version its .sha256 does not match (cut short): refused, the model serves on.
    let bytes = std::fs::read(&source).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
    wait_for(&cluster, "invalid_request");
    assert!(
        cluster.workers[0].log().contains("not the one expected"),
        "{}",
        cluster.logs()
    );
    assert_eq!(greedy(&cluster, &cluster.model), before);
    cluster.assert_alive();
}
