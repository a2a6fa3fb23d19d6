//! A cluster whose coordinator takes API keys from its environment: authorised
//! requests stream, the others are refused in OpenAI's shape, streams stay with their
//! key, the `baton` command line sends its key, and no key ever reaches a log.

use std::process::Command;

use baton_integration_tests::cluster::field;
use baton_integration_tests::process::bin;
use baton_integration_tests::{assert_error, summarize, Cluster, ClusterOptions};
use serde_json::json;

const USER: &str = "sk-it-user-5f2c9a41d7";
const OTHER: &str = "sk-it-other-0b8e3d62aa";
const ADMIN: &str = "sk-it-admin-93c1f07e4b";
const WRONG: &str = "sk-it-wrong-7d4a1c9e22";

#[test]
fn keys_guard_the_api_and_never_reach_the_logs() {
    let options = ClusterOptions::simulated(1)
        .step_ms(5)
        .keys(&[USER, OTHER], &[ADMIN]);
    let Some(cluster) = Cluster::start(options) else {
        return;
    };
    let path = "/v1/chat/completions";
    let body = json!({"model": cluster.model, "max_tokens": 6, "stream": true,
                      "messages": [{"role": "user", "content": "Count to six"}]});

    // Authorised: a whole stream.
    let user = cluster.api.with_key(USER);
    let events = user.stream(path, &body).collect_all();
    let summary = summarize(&events);
    assert!(summary.done && summary.errors.is_empty(), "{events:?}");
    assert_eq!(
        summary.text.split_whitespace().count(),
        6,
        "{:?}",
        summary.text
    );
    let stream = summary.stream_id.expect("a stream id");

    // Unauthorised: no key, a wrong key.
    for api in [cluster.api.without_key(), cluster.api.with_key(WRONG)] {
        let r = api.post_json(path, &body).expect("POST");
        let error = assert_error(&r, 401);
        assert_eq!(error["code"], "invalid_api_key");
        assert_eq!(error["type"], "invalid_request_error");
    }
    // An API key on an admin route; the admin key there.
    let r = user.get("/metrics").expect("GET");
    assert_eq!(assert_error(&r, 403)["code"], "insufficient_permissions");
    let r = cluster.api.with_key(ADMIN).get("/metrics").expect("GET");
    assert_eq!(r.status, 200);
    // The stream is its key's (and the admin's) only.
    let replay = format!("/v1/streams/{stream}");
    let r = cluster.api.with_key(OTHER).get(&replay).expect("GET");
    assert_eq!(assert_error(&r, 404)["code"], "stream_not_found");
    assert_eq!(user.get(&replay).expect("GET").status, 200);
    // /health stays open for load balancers.
    assert_eq!(
        cluster
            .api
            .without_key()
            .get("/health")
            .expect("GET")
            .status,
        200
    );

    // The command line sends its key, from the flag or the environment.
    let baton = |key_flag: Option<&str>, key_env: Option<&str>| {
        let mut cmd = Command::new(bin("baton"));
        cmd.env_remove("BATON_NATS_URL")
            .env_remove("BATON_URL")
            .env_remove("BATON_API_KEY")
            .args(["--url", &cluster.api.base]);
        if let Some(key) = key_flag {
            cmd.args(["--api-key", key]);
        }
        if let Some(key) = key_env {
            cmd.env("BATON_API_KEY", key);
        }
        cmd.args(["complete", "--no-stream", "--model", &cluster.model])
            .args(["--max-tokens", "3", "--temperature", "0", "Count"]);
        cmd.output().expect("running baton")
    };
    for (flag, env) in [(Some(USER), None), (None, Some(USER))] {
        let out = baton(flag, env);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.split_whitespace().count(), 3, "{text:?}");
    }
    let out = baton(None, None);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid_api_key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Draining over HTTP is an admin route: an API key is refused, the admin key drains.
    let worker = cluster.worker_id(0).expect("worker id");
    let drain = |key: &str| {
        Command::new(bin("baton"))
            .env_remove("BATON_NATS_URL")
            .env_remove("BATON_URL")
            .env("BATON_API_KEY", key)
            .args(["--url", &cluster.api.base, "drain", &worker])
            .output()
            .expect("running baton")
    };
    let out = drain(USER);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("insufficient_permissions"));
    let out = drain(ADMIN);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let drained: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(drained["draining"], true);

    // Logs name keys by id only.
    let log = cluster.coordinator.log();
    let configured: Vec<String> = log
        .lines()
        .filter(|l| l.contains("API key configured"))
        .filter_map(|l| field(l, "key"))
        .collect();
    assert_eq!(configured.len(), 3, "{log}");
    assert!(configured
        .iter()
        .all(|id| id.len() == 8 && id.chars().all(|c| c.is_ascii_hexdigit())));
    assert!(
        log.contains("request with an unknown API key refused"),
        "{log}"
    );
    assert!(log.contains("stream accepted"), "{log}");
    for process in std::iter::once(&cluster.coordinator).chain(&cluster.workers) {
        let log = process.log();
        for key in [USER, OTHER, ADMIN, WRONG] {
            assert!(!log.contains(key), "{} logged a key:\n{log}", process.name);
        }
    }
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
fn the_status_page_asks_for_an_admin_key() {
    let Some(browser) = chromium() else {
        eprintln!("note: skipped: no chromium (scripts/setup installs it)");
        return;
    };
    let options = ClusterOptions::simulated(1).keys(&[USER], &[ADMIN]);
    let Some(cluster) = Cluster::start(options) else {
        return;
    };
    let profile = tempfile::tempdir().expect("tempdir");
    let out = Command::new(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=3000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("{}/", cluster.api.base))
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    // The HTML is served to anyone; its data is not: the key form is shown instead.
    assert!(dom.contains("<form id=\"keyform\">"), "{dom}");
    assert!(dom.contains("needs an admin key"), "{dom}");
    let worker = cluster.worker_id(0).expect("worker id");
    assert!(!dom.contains(&worker), "{dom}");
}
