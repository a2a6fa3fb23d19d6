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
#[test]
fn streams_outlive_their_coordinator_and_its_disk() {
    let Some(mut cluster) = Cluster::start(options(3, "sync")) else {
        return;
    };
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
