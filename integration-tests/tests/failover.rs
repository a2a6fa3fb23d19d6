//! Shortened failover drills (`scripts/drill` runs the full ones): a stream survives a
//! worker killed mid-generation, a worker told to stop, a coordinator restart (the client
//! reconnects with `Last-Event-ID`), a NATS restart and one server of a NATS cluster
//! dying, with exactly the text of an uninterrupted run.

use baton_integration_tests::drill::{self, Sampling, Verdict};
use baton_integration_tests::{Cluster, ClusterOptions};

fn check(v: &Verdict, cluster: &Cluster) {
    println!("{} (at {:?})", v.line(), std::time::SystemTime::now());
    assert!(
        v.ok(),
        "{}\n{}\n{}",
        v.line(),
        v.failures.join("\n"),
        cluster.logs()
    );
}

#[test]
fn simulated_streams_survive_every_drill() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(20)) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(3)] {
        check(&drill::kill_worker(&mut cluster, sampling, 3, 40), &cluster);
    }
    check(
        &drill::stop_worker(&mut cluster, Sampling::Greedy, 1, 40),
        &cluster,
    );
    check(
        &drill::restart_coordinator(&mut cluster, Sampling::Greedy, 2, 40),
        &cluster,
    );
    check(
        &drill::restart_nats(&mut cluster, Sampling::Greedy, 1, 40),
        &cluster,
    );
}

/// Three `nats-server`s joined by routes; the coordinator and the workers are given all
/// three. One server dies mid-stream — the coordinator's, then the serving worker's,
/// then one carrying neither — and every stream ends as an uninterrupted run; the
/// server, started again, rejoins.
#[test]
fn streams_survive_one_of_three_nats_servers_dying() {
    let options = ClusterOptions::simulated(2).step_ms(20).nats_servers(3);
    let Some(mut cluster) = Cluster::start(options) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(5)] {
        check(
            &drill::kill_nats_member(&mut cluster, sampling, 3, 40),
            &cluster,
        );
    }
}

/// Every process in a network namespace of its own, on three `nats-server`s: the
/// serving worker, the coordinator's server and the coordinator are each cut off the
/// network mid-stream (sockets open, packets lost) and healed; every stream ends as an
/// uninterrupted run and what was cut off rejoins. Skipped, with a note, where network
/// namespaces cannot be made (not root).
#[test]
fn streams_survive_a_process_cut_off_the_network() {
    let options = ClusterOptions::simulated(2)
        .step_ms(20)
        .nats_servers(3)
        .partitioned();
    let Some(mut cluster) = Cluster::start(options) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(5)] {
        check(&drill::partition(&mut cluster, sampling, 3, 40), &cluster);
    }
}

/// A coordinator killed mid-stream, in both checkpoint modes. With `async` (the
/// default) it loses the tokens it had not flushed yet (sled flushes every 500 ms): the
/// client reconnects holding more than the store, and the restarted coordinator
/// regenerates them and sends only what the client lacks. With `sync` the store holds
/// every token the client saw.
#[test]
fn both_checkpoint_modes_survive_a_coordinator_kill() {
    for mode in ["async", "sync"] {
        let mut options = ClusterOptions::simulated(1).step_ms(20);
        options
            .extra
            .push(("coordinator", format!("checkpoint = {mode:?}")));
        let Some(mut cluster) = Cluster::start(options) else {
            return;
        };
        for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
            let verdict = drill::restart_coordinator(&mut cluster, sampling, 3, 40);
            println!("checkpoint = {mode}:");
            check(&verdict, &cluster);
        }
    }
}

#[test]
fn real_model_streams_survive_a_killed_worker() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(2)) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(11)] {
        check(&drill::kill_worker(&mut cluster, sampling, 1, 24), &cluster);
    }
    check(
        &drill::restart_coordinator(&mut cluster, Sampling::Seeded(5), 1, 24),
        &cluster,
    );
    // A stream held to a JSON schema: the worker's grammar state is rebuilt from the
    // tokens so far on the one that takes over.
    for sampling in [Sampling::Greedy, Sampling::Seeded(7)] {
        check(
            &drill::kill_worker_structured(&mut cluster, sampling, 1, 200),
            &cluster,
        );
    }
    // A stream that must call a function: killed half-way through the call.
    for sampling in [Sampling::Greedy, Sampling::Seeded(3)] {
        check(
            &drill::kill_worker_tool_call(&mut cluster, sampling, 1, 200),
            &cluster,
        );
    }
}

/// Qwen2.5-Coder-0.5B (Q4_K_M, `scripts/models fetch qwen2.5-coder-0.5b`): a worker
/// killed with SIGKILL mid-stream, greedy and sampled; the stream goes on on the other
/// worker with exactly the text of an uninterrupted run. Skips without the file, unless
/// `BATON_REQUIRE_DOWNLOADS` is set.
#[test]
fn qwen_streams_survive_a_killed_worker() {
    let Some(path) = baton_integration_tests::qwen_model() else {
        return;
    };
    let Some(mut cluster) = Cluster::start(ClusterOptions::real(2).models(vec![path])) else {
        return;
    };
    for sampling in [Sampling::Greedy, Sampling::Seeded(3)] {
        check(&drill::kill_worker(&mut cluster, sampling, 1, 24), &cluster);
    }
}
