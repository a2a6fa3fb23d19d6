//! Checkpoints in NATS JetStream: a coordinator killed with its disk deleted loses no
//! stream. Clients reconnect to another coordinator with `Last-Event-ID`; a live
//! coordinator takes the dead one's streams over once its lease runs out (claimed exactly
//! once), and the text is that of an uninterrupted run.

use baton_integration_tests::cluster::Coordinator;
use baton_integration_tests::drill::{self, Sampling, Verdict};
use baton_integration_tests::{Cluster, ClusterOptions};

fn check(v: &Verdict, cluster: &Cluster, other: &Coordinator) {
    println!("{} (at {:?})", v.line(), std::time::SystemTime::now());
    assert!(
        v.ok(),
        "{}\n{}\n{}\nthe second coordinator:\n{}",
        v.line(),
        v.failures.join("\n"),
        cluster.logs(),
        other.process.log()
    );
}

fn options(servers: usize, mode: &str) -> ClusterOptions {
    let mut options = ClusterOptions::simulated(2)
        .step_ms(20)
        .nats_servers(servers)
        .jetstream();
    options.extra.push((
        "coordinator",
        format!("checkpoint = {mode:?}\njetstream = \"on\"\nlease_ms = 1000"),
    ));
    options
}

/// Three `nats-server`s (three copies of each checkpoint), four streams, `sync` mode.
/// First one server dies mid-stream, in turn each: the checkpoint writes it took with
/// it are written again, so no stream that ended stays unfinished in JetStream (it
/// would be taken over with the others, and the count of claims would be off).
#[test]
fn streams_outlive_their_coordinator_and_its_disk() {
    let Some(mut cluster) = Cluster::start(options(3, "sync")) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(5)] {
        let v = drill::kill_nats_member(&mut cluster, sampling, 3, 40);
        assert!(v.ok(), "{:?}\n{}", v.failures, cluster.logs());
    }
    let other = cluster.start_coordinator();
    for sampling in [Sampling::Greedy, Sampling::Seeded(5)] {
        check(
            &drill::lose_coordinator(&mut cluster, &other.api, sampling, 2, 4, 40),
            &cluster,
            &other,
        );
    }
}

/// One `nats-server`, `async` mode: the client may hold tokens JetStream had not
/// acknowledged yet; the stream taken over regenerates them and sends only the rest.
#[test]
fn async_checkpoints_in_jetstream_survive_too() {
    let Some(mut cluster) = Cluster::start(options(1, "async")) else {
        return;
    };
    let other = cluster.start_coordinator();
    check(
        &drill::lose_coordinator(&mut cluster, &other.api, Sampling::Seeded(9), 2, 4, 40),
        &cluster,
        &other,
    );
}

/// Chunks of a streamed NATS answer on `inbox` until the final one: (position, text)
/// of each text chunk, and the stream's id and coordinator from the first.
async fn read_answer(
    sub: &mut async_nats::Subscriber,
    upto: Option<usize>,
) -> (Vec<(u32, String)>, String, String) {
    use baton_common::public::headers;
    use futures::StreamExt;
    let (mut texts, mut stream, mut coordinator) = (Vec::new(), String::new(), String::new());
    loop {
        if upto.is_some_and(|n| texts.len() >= n) {
            break;
        }
        let msg = tokio::time::timeout(std::time::Duration::from_secs(60), sub.next())
            .await
            .expect("a chunk in time")
            .expect("a chunk");
        let h = msg.headers.clone().expect("headers");
        assert!(
            h.get(headers::ERROR).is_none(),
            "error: {}",
            String::from_utf8_lossy(&msg.payload)
        );
        if stream.is_empty() {
            stream = h
                .get(headers::STREAM_ID)
                .map(|v| v.to_string())
                .unwrap_or_default();
            coordinator = h
                .get(headers::COORDINATOR)
                .map(|v| v.to_string())
                .unwrap_or_default();
        }
        let chunk: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap_or_default();
        let text = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("");
        if let (Some(p), false) = (h.get(headers::POSITION), text.is_empty()) {
            texts.push((p.as_str().parse().expect("a position"), text.to_string()));
        }
        if h.get(headers::FINAL).map(|v| v.as_str()) == Some("true") {
            break;
        }
    }
    (texts, stream, coordinator)
}

/// A NATS client replays a stream naming its coordinator, which is gone with its disk:
/// the coordinator that gets the replay reads the stream from JetStream (following it,
/// then taking it over) and the client gets exactly the rest.
#[test]
fn a_nats_replay_of_a_lost_coordinators_stream_gets_the_rest() {
    use baton_common::public::ReplayRequest;
    use baton_common::subjects::Subjects;
    let Some(mut cluster) = Cluster::start(options(1, "sync")) else {
        return;
    };
    let other = cluster.start_coordinator();
    let body = serde_json::json!({
        "model": cluster.model,
        "messages": [{"role": "user", "content": "count for me"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": true,
    });
    let reference = other.api.post_json("/v1/chat/completions", &{
        let mut whole = body.clone();
        whole["stream"] = false.into();
        whole
    });
    let reference = reference.expect("reference run").body["choices"][0]["message"]["content"]
        .as_str()
        .expect("reference text")
        .to_string();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let client = runtime
        .block_on(baton_common::nats::connect(
            &cluster.nats.config(),
            "takeover-test",
        ))
        .expect("connect");
    let subjects = Subjects::default();
    // Started on the first coordinator alone: the second leaves the queue group's
    // requests to it while it is the only one asked.
    let (head, stream, coordinator) = runtime.block_on(async {
        loop {
            let inbox = client.new_inbox();
            let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
            client
                .publish_with_reply(subjects.chat_completions(), inbox, body.to_string().into())
                .await
                .expect("publish");
            let (head, stream, coordinator) = read_answer(&mut sub, Some(5)).await;
            if coordinator == cluster_id(&cluster) {
                return (head, stream, coordinator);
            }
        }
    });
    cluster.replace_coordinator();
    let replay = ReplayRequest {
        stream: stream.parse().expect("a stream id"),
        after: head.last().map(|(p, _)| *p),
        coordinator: Some(coordinator.parse().expect("a coordinator id")),
    };
    let (rest, _, _) = runtime.block_on(async {
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
        client
            .publish_with_reply(
                subjects.replay(),
                inbox,
                serde_json::to_vec(&replay).expect("JSON").into(),
            )
            .await
            .expect("publish");
        read_answer(&mut sub, None).await
    });
    let positions: Vec<u32> = head.iter().chain(&rest).map(|(p, _)| *p).collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions only go up: {positions:?}"
    );
    let text: String = head.iter().chain(&rest).map(|(_, t)| t.as_str()).collect();
    assert_eq!(
        text,
        reference,
        "\n{}\n{}",
        cluster.logs(),
        other.process.log()
    );
}

/// The id of the cluster's first coordinator, from its log.
fn cluster_id(cluster: &Cluster) -> String {
    cluster
        .coordinator
        .log()
        .lines()
        .find(|l| l.contains("connected to NATS"))
        .and_then(|l| baton_integration_tests::cluster::field(l, "coordinator"))
        .expect("the coordinator's id in its log")
}
