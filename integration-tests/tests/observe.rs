//! What an operator sees: Prometheus metrics that move by exactly the traffic sent, one
//! request id in the coordinator's and the worker's logs, and the status page rendered
//! by a headless Chromium.

use std::collections::HashMap;
use std::process::Command;

use baton_integration_tests::{cluster::field, Api, Cluster, ClusterOptions};
use serde_json::json;

/// `name{labels}` → value, from a Prometheus text exposition.
fn scrape(api: &Api) -> HashMap<String, f64> {
    let reply = api.get("/metrics").expect("GET /metrics");
    assert_eq!(reply.status, 200);
    parse(reply.body.as_str().expect("text"))
}

fn parse(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, key: &str) -> f64 {
    after.get(key).copied().unwrap_or(0.0) - before.get(key).copied().unwrap_or(0.0)
}

#[test]
fn metrics_move_by_the_traffic_and_one_id_follows_a_request() {
    let Some(cluster) = Cluster::start(ClusterOptions::simulated(1).step_ms(5)) else {
        return;
    };
    let before = scrape(&cluster.api);
    let chat = json!({"model": cluster.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = cluster
            .api
            .post_json("/v1/chat/completions", &chat)
            .expect("POST");
        assert_eq!(r.status, 200, "{}", r.body);
        ids.push(r.request_id.clone().expect("an X-Request-Id"));
    }
    for _ in 0..2 {
        let body =
            json!({"model": cluster.model, "prompt": "count", "max_tokens": 4, "stream": true});
        let events = cluster.api.stream("/v1/completions", &body).collect_all();
        assert!(events.last().is_some_and(|e| e.is_done()));
    }
    let bad = json!({"model": cluster.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1});
    assert_eq!(
        cluster
            .api
            .post_json("/v1/chat/completions", &bad)
            .expect("POST")
            .status,
        400
    );

    let after = scrape(&cluster.api);
    let d = |k: &str| delta(&before, &after, k);
    assert_eq!(
        d(r#"baton_requests_total{endpoint="chat",outcome="finished"}"#),
        3.0
    );
    assert_eq!(
        d(r#"baton_requests_total{endpoint="completion",outcome="finished"}"#),
        2.0
    );
    assert_eq!(
        d(r#"baton_requests_total{endpoint="chat",outcome="invalid_value"}"#),
        1.0,
        "{after:?}"
    );
    assert_eq!(d("baton_generation_tokens_total"), 20.0);
    assert_eq!(d("baton_time_to_first_token_seconds_count"), 5.0);
    assert_eq!(d("baton_inter_token_latency_seconds_count"), 15.0);
    assert_eq!(d("baton_e2e_request_latency_seconds_count"), 5.0);
    assert!(d("baton_time_to_first_token_seconds_sum") > 0.0);
    assert_eq!(after.get("baton_workers_live"), Some(&1.0));
    assert_eq!(after.get("baton_streams_in_flight"), Some(&0.0));
    assert!(
        d("baton_checkpoint_flush_seconds_count") >= 1.0,
        "sync checkpoints flush: {:?}",
        after.get("baton_checkpoint_flush_seconds_count")
    );

    // The worker's own metrics, on the port its log names.
    let log = cluster.workers[0].log();
    let addr = log
        .lines()
        .find(|l| l.contains("metrics listening"))
        .and_then(|l| field(l, "addr"))
        .expect("the worker logs its metrics address");
    let worker = Api::new(&format!("http://{addr}"));
    let w = scrape(&worker);
    assert_eq!(
        w.get(r#"baton_worker_sequences_submitted_total{outcome="accepted"}"#),
        Some(&5.0)
    );
    assert_eq!(w.get("baton_worker_generation_tokens_total"), Some(&20.0));

    // One id, both processes: the coordinator's and the worker's lines about it.
    let id = &ids[0];
    let coordinator = cluster.coordinator.log();
    let in_coordinator: Vec<&str> = coordinator
        .lines()
        .filter(|l| l.contains(id.as_str()))
        .collect();
    let in_worker: Vec<&str> = log.lines().filter(|l| l.contains(id.as_str())).collect();
    assert!(
        in_coordinator.iter().any(|l| l.contains("stream accepted")),
        "{in_coordinator:?}"
    );
    assert!(
        in_worker.iter().any(|l| l.contains("request_id=")),
        "the NATS header reached the worker: {in_worker:?}"
    );
    assert!(
        in_worker.iter().any(|l| l.contains("sequence accepted")),
        "{in_worker:?}"
    );
}

/// The headless browser, if installed (`scripts/setup` installs Debian's `chromium`).
fn chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(str::to_string)
}

#[test]
fn the_status_page_shows_the_workers_in_chromium() {
    let Some(browser) = chromium() else {
        eprintln!("note: skipped: no chromium (scripts/setup installs it)");
        return;
    };
    let Some(cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(5)) else {
        return;
    };
    let body = json!({"model": cluster.model, "prompt": "warm up", "max_tokens": 8});
    assert_eq!(
        cluster
            .api
            .post_json("/v1/completions", &body)
            .expect("POST")
            .status,
        200
    );
    let profile = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(&browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=3000",
        "--dump-dom",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()));
    if let Ok(shot) = std::env::var("BATON_STATUS_SCREENSHOT") {
        cmd.arg(format!("--screenshot={shot}"))
            .arg("--window-size=1100,760");
    }
    let out = cmd
        .arg(format!("{}/", cluster.api.base))
        .output()
        .expect("running chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The page rendered what /v1/status says: both workers, their model, serving.
    for i in 0..2 {
        let id = cluster.worker_id(i).expect("worker id");
        assert!(dom.contains(&id), "worker {id} not on the page:\n{dom}");
    }
    assert!(dom.contains(&cluster.model), "{dom}");
    assert_eq!(dom.matches("class=\"worker\"").count(), 2, "{dom}");
    assert!(dom.contains(">serving<"), "{dom}");
    assert!(dom.contains(">synced<"), "{dom}");
}
