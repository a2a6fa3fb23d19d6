//! NATS authorization and TLS, with the shipped `docs/nats-accounts.conf`: a cluster
//! whose coordinator and worker connect with their own credentials serves completions;
//! clients without credentials, or with a wrong password, are refused at connect; a
//! client with the public credentials uses the public API but cannot publish on worker
//! subjects nor read worker tokens; over TLS, a client that does not know the CA is
//! refused, and a server that verifies clients refuses one without a certificate.

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::Event;
use baton_common::config::NatsConfig;
use baton_common::ids::{CoordinatorId, WorkerId};
use baton_common::nats::{connect, connect_options, NatsConnectError};
use baton_common::subjects::Subjects;
use baton_integration_tests::cluster::field;
use baton_integration_tests::process::bin;
use baton_integration_tests::secure::{NatsSecurity, Role};
use baton_integration_tests::{Api, Cluster, ClusterOptions};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// How long a refused message has to show up where it must not, had it been delivered.
const QUIET: Duration = Duration::from_millis(700);

/// `baton` with `env` (and none of the caller's `BATON_*` settings).
fn baton(env: &[(&str, String)], args: &[&str]) -> Output {
    let mut cmd = Command::new(bin("baton"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("BATON_") {
            cmd.env_remove(key);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(args)
        .output()
        .expect("running baton")
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The stderr of a `baton` run that must fail without a panic.
fn refused(out: Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{what} succeeded:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{what} panicked:\n{stderr}");
    stderr
}

/// Streams a greedy 8-token completion through the `baton` CLI with `env`.
fn complete(nats: &str, model: &str, env: &[(&str, String)]) -> String {
    let out = baton(
        env,
        &[
            "--nats",
            nats,
            "complete",
            "--verbose",
            "--model",
            model,
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "Count to eight",
        ],
    );
    ok(out, "baton complete")
}

/// Connects with `config`, sending every event of the connection to the returned
/// receiver (the server's permission errors among them).
async fn connect_watched(
    config: &NatsConfig,
) -> (async_nats::Client, mpsc::UnboundedReceiver<Event>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let client = connect_options(config, "nats-security-test")
        .expect("valid settings")
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(event);
            }
        })
        .connect(config.url.as_str())
        .await
        .expect("connect");
    (client, rx)
}

/// Waits for the server's permissions violation naming `subject`.
async fn expect_violation(events: &mut mpsc::UnboundedReceiver<Event>, subject: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no permissions violation for {subject}"))
            .expect("the event channel is open");
        if let Event::ServerError(e) = &event {
            let text = e.to_string().to_lowercase();
            if text.contains("permissions violation") && text.contains(&subject.to_lowercase()) {
                return;
            }
        }
    }
}

/// Asserts that nothing arrives on `sub` for a while.
async fn assert_silent(sub: &mut async_nats::Subscriber, what: &str) {
    if let Ok(Some(msg)) = tokio::time::timeout(QUIET, sub.next()).await {
        panic!("{what}: a message was delivered on {}", msg.subject);
    }
}

/// The refusal of a connection as `config`.
async fn refusal(config: &NatsConfig) -> NatsConnectError {
    match connect(config, "nats-security-test").await {
        Ok(_) => panic!("a connection as {config:?} was accepted"),
        Err(e) => e,
    }
}

/// Prometheus text as `name → value`.
fn scrape(api: &Api) -> Vec<(String, f64)> {
    let reply = api.get("/metrics").expect("GET /metrics");
    let text = reply.body.as_str().unwrap_or_default().to_string();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn permissions_keep_every_role_to_its_subjects() {
    let security = Arc::new(NatsSecurity::new());
    let Some(mut cluster) = Cluster::start(
        ClusterOptions::simulated(1)
            .step_ms(5)
            .secured(security.clone()),
    ) else {
        return;
    };
    let url = cluster.nats.url.clone();
    let model = cluster.model.clone();
    let subjects = Subjects::default();

    // (a) Completions end to end: HTTP, and the public NATS API as a client and as the
    // tenant with its own inbox prefix.
    let reply = cluster
        .api
        .post_json(
            "/v1/completions",
            &json!({"model": model, "prompt": "Count", "max_tokens": 8, "temperature": 0}),
        )
        .expect("POST /v1/completions");
    assert_eq!(reply.status, 200, "{}", reply.body);
    for role in [Role::Client, Role::Tenant] {
        let out = complete(&url, &model, &security.client_env(role));
        assert!(out.contains("8 generated tokens"), "{role:?}: {out}");
    }
    let status: Value = serde_json::from_str(&ok(
        baton(
            &security.client_env(Role::Client),
            &["--nats", &url, "status"],
        ),
        "baton status",
    ))
    .expect("status JSON");
    assert_eq!(status["health"], "ok", "{status}");
    let coordinator: CoordinatorId = status["coordinator"]["id"]
        .as_str()
        .expect("a coordinator id")
        .parse()
        .expect("a coordinator id");
    let worker: WorkerId = cluster
        .worker_id(0)
        .expect("worker id in its log")
        .parse()
        .expect("a worker id");

    // A client that goes away: the coordinator cancels on the worker's cancel subject.
    let mut events = cluster.api.stream(
        "/v1/completions",
        &json!({"model": model, "prompt": "Count", "max_tokens": 4000, "ignore_eos": true,
                "stream": true}),
    );
    assert!(events.next_event().is_some(), "a first event");
    drop(events);
    let metrics_addr = cluster.workers[0]
        .log()
        .lines()
        .find(|l| l.contains("metrics listening"))
        .and_then(|l| field(l, "addr"))
        .expect("the worker logs its metrics address");
    let worker_metrics = Api::new(&format!("http://{metrics_addr}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let cancels = scrape(&worker_metrics)
            .into_iter()
            .find(|(name, _)| name == "baton_worker_cancels_total")
            .map(|(_, v)| v)
            .unwrap_or(0.0);
        if cancels >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no cancel reached the worker\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // (b) No credentials, a wrong password, an unknown NKey: refused at connect, with an
    // error that says so (the CLI exits with it, no panic).
    let stderr = refused(
        baton(&[], &["--nats", &url, "status"]),
        "baton status without credentials",
    );
    assert!(stderr.contains("NATS authorization failed"), "{stderr}");
    assert!(stderr.contains("none were given"), "{stderr}");
    let mut wrong = security.client_env(Role::Client);
    wrong.retain(|(k, _)| *k != baton_common::env::NATS_PASSWORD);
    wrong.push((baton_common::env::NATS_PASSWORD, "not-the-password".into()));
    let stderr = refused(
        baton(&wrong, &["--nats", &url, "status"]),
        "baton status with a wrong password",
    );
    assert!(stderr.contains("NATS authorization failed"), "{stderr}");
    assert!(stderr.contains("user \"client\""), "{stderr}");
    assert!(!stderr.contains("not-the-password"), "{stderr}");

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let open = NatsConfig {
            url: url.clone(),
            ..NatsConfig::default()
        };
        assert_eq!(refusal(&open).await.kind(), "authorization");
        let mut config = security.nats_config(Role::Client, &url);
        config.password = Some("not-the-password".into());
        assert_eq!(refusal(&config).await.kind(), "authorization");
        let stranger = nkeys::KeyPair::new_user();
        let config = NatsConfig {
            url: url.clone(),
            nkey: Some(stranger.seed().expect("seed").into()),
            ..NatsConfig::default()
        };
        let e = refusal(&config).await;
        assert_eq!(e.kind(), "authorization");
        assert!(e.to_string().contains(&stranger.public_key()), "{e}");
    });

    // A worker with an unknown NKey, or with contradictory settings, stops at start.
    for (env, expected) in [
        (
            vec![(
                baton_common::env::NATS_NKEY,
                nkeys::KeyPair::new_user().seed().expect("seed"),
            )],
            "NATS authorization failed",
        ),
        (
            {
                let mut env = security.env(Role::Worker);
                env.push((baton_common::env::NATS_USER, "worker".into()));
                env
            },
            "contradictory NATS settings",
        ),
    ] {
        let mut cmd = Command::new(bin("baton-worker"));
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("BATON_") {
                cmd.env_remove(key);
            }
        }
        let out = cmd
            .args(["serve", "--simulated", "--config"])
            .arg(&cluster.config)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .expect("running baton-worker");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the worker started:\n{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    // (c) The public credentials reach only the public subjects.
    runtime.block_on(async {
        let nobody = WorkerId(0x0bad);
        let (as_worker, _) = connect_watched(&security.nats_config(Role::Worker, &url)).await;
        let mut submits = as_worker
            .subscribe(subjects.submit(nobody))
            .await
            .expect("subscribe");
        let (as_coordinator, mut coordinator_events) =
            connect_watched(&security.nats_config(Role::Coordinator, &url)).await;
        let mut heartbeats = as_coordinator
            .subscribe(subjects.heartbeat())
            .await
            .expect("subscribe");
        as_worker.flush().await.expect("flush");
        as_coordinator.flush().await.expect("flush");
        let real = worker.to_string();

        let (intruder, mut events) =
            connect_watched(&security.nats_config(Role::Client, &url)).await;
        intruder
            .publish(subjects.submit(nobody), "forged submit".into())
            .await
            .expect("publish");
        expect_violation(&mut events, &subjects.submit(nobody)).await;
        assert_silent(&mut submits, "a client's submit").await;
        intruder
            .publish(subjects.heartbeat(), "forged heartbeat".into())
            .await
            .expect("publish");
        expect_violation(&mut events, &subjects.heartbeat()).await;
        // The real worker's heartbeats arrive too; only a forged one would be news.
        let forged = tokio::time::timeout(QUIET, async {
            while let Some(msg) = heartbeats.next().await {
                if msg.payload.as_ref() == b"forged heartbeat" {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        assert!(!forged, "a client's heartbeat was delivered");
        intruder
            .publish(
                subjects.admin_drain(),
                json!({"worker": real}).to_string().into(),
            )
            .await
            .expect("publish");
        expect_violation(&mut events, &subjects.admin_drain()).await;

        // Reading a coordinator's tokens: refused, and nothing arrives while a
        // completion streams.
        let tokens = subjects.tokens(coordinator);
        let mut stolen = intruder.subscribe(tokens.clone()).await.expect("subscribe");
        expect_violation(&mut events, &tokens).await;
        let streamed = tokio::task::spawn_blocking({
            let (url, model, env) = (
                url.clone(),
                model.clone(),
                security.client_env(Role::Client),
            );
            move || complete(&url, &model, &env)
        });
        if let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(3), stolen.next()).await {
            panic!("a client read worker tokens on {}", msg.subject);
        }
        let out = streamed.await.expect("the completion ran");
        assert!(out.contains("8 generated tokens"), "{out}");
        // Reading the cluster's own inbox (the workers' answers to submits): refused.
        let inbox = format!(
            "{}.>",
            baton_integration_tests::secure::CLUSTER_INBOX_PREFIX
        );
        let _peek = intruder.subscribe(inbox.clone()).await.expect("subscribe");
        expect_violation(&mut events, &inbox).await;

        // The control: what a coordinator publishes on a submit subject is delivered.
        as_coordinator
            .publish(subjects.submit(nobody), "a real submit".into())
            .await
            .expect("publish");
        let msg = tokio::time::timeout(Duration::from_secs(5), submits.next())
            .await
            .expect("the coordinator's submit arrives")
            .expect("a message");
        assert_eq!(msg.payload.as_ref(), b"a real submit");
        while let Ok(event) = coordinator_events.try_recv() {
            assert!(
                !matches!(event, Event::ServerError(_)),
                "the coordinator's connection got {event}"
            );
        }
    });

    // An operator may drain (the last step: the worker then leaves).
    let drained: Value = serde_json::from_str(&ok(
        baton(
            &security.client_env(Role::Operator),
            &["--nats", &url, "drain", &worker.to_string()],
        ),
        "baton drain",
    ))
    .expect("drain JSON");
    assert_eq!(drained["draining"], true, "{drained}");
    assert!(
        cluster.workers[0]
            .wait_timeout(Duration::from_secs(30))
            .is_some(),
        "the drained worker did not leave"
    );

    // No process of the cluster was refused anything along the way.
    for (name, log) in [
        ("coordinator", cluster.coordinator.log()),
        ("worker", cluster.workers[0].log()),
    ] {
        assert!(
            !log.contains("NATS server error"),
            "the {name} was refused something:\n{log}"
        );
    }
}

#[test]
fn tls_with_a_private_ca() {
    let security = Arc::new(NatsSecurity::new().with_tls(false));
    let Some(cluster) = Cluster::start(
        ClusterOptions::simulated(1)
            .step_ms(5)
            .secured(security.clone()),
    ) else {
        return;
    };
    let url = cluster.nats.url.clone();
    let out = complete(&url, &cluster.model, &security.client_env(Role::Client));
    assert!(out.contains("8 generated tokens"), "{out}");

    // A client that does not know the CA: refused, and told it is TLS.
    let mut env = security.client_env(Role::Client);
    env.retain(|(k, _)| *k != baton_common::env::NATS_TLS_CA);
    let stderr = refused(
        baton(&env, &["--nats", &url, "status"]),
        "baton status without the CA",
    );
    assert!(stderr.contains("TLS with NATS"), "{stderr}");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let mut config = security.nats_config(Role::Client, &url);
        config.tls_ca = None;
        assert_eq!(refusal(&config).await.kind(), "tls");
        // Another CA is no better.
        let other = NatsSecurity::new().with_tls(false);
        config.tls_ca = other.tls().map(|t| t.ca.clone());
        assert_eq!(refusal(&config).await.kind(), "tls");
    });
}

#[test]
fn mutual_tls_asks_for_a_client_certificate() {
    let security = NatsSecurity::new().with_tls(true);
    let Some(nats) = security.start_nats() else {
        return;
    };
    let url = nats.url.clone();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let config = security.nats_config(Role::Client, &url);
        let client = connect(&config, "nats-security-test")
            .await
            .expect("a client with a certificate connects");
        client.flush().await.expect("flush");

        let mut anonymous = config.clone();
        anonymous.tls_cert = None;
        anonymous.tls_key = None;
        let e = refusal(&anonymous).await;
        assert_eq!(e.kind(), "tls", "{e}");

        // A certificate is not a password: the accounts still apply.
        let mut no_password = config.clone();
        no_password.user = None;
        no_password.password = None;
        assert_eq!(refusal(&no_password).await.kind(), "authorization");
    });
}
