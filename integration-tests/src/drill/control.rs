//! Drills that break the control plane: the coordinator, the NATS servers, the network.

use super::*;

/// Kills the coordinator mid-stream and starts it again; the client reconnects with
/// `Last-Event-ID` and reads the rest.
pub fn restart_coordinator(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    let mut verdict = Verdict::named(format!("restart the coordinator ({})", sampling.name()));
    let body = request(cluster, sampling, max_tokens, 1);
    let Some(reference) = first_run(cluster, &body, &mut verdict, runs) else {
        return verdict;
    };
    for i in 0..runs {
        let label = format!("run {i}");
        let Some((reader, mut seen)) = started(cluster, &body, i, max_tokens, &mut verdict, &label)
        else {
            continue;
        };
        let broke_at = Instant::now();
        cluster.restart_coordinator();
        // What the old connection still delivered before it broke.
        reader.rest(&mut seen, Duration::from_secs(5));
        seen.events.retain(|(_, e)| !e.is_done());
        let Some(last) = seen.last_id() else {
            verdict.runs += 1;
            verdict
                .failures
                .push(format!("{label}: no event id to reconnect with"));
            continue;
        };
        let again = Reader::spawn(cluster.api.stream_from(PATH, &body, Some(&last)));
        again.rest(&mut seen, STREAM_TIMEOUT);
        judge(&mut verdict, &seen, &reference, broke_at, &label);
    }
    verdict
}

/// Kills (`SIGKILL`) the coordinator that owns `streams` running streams and deletes its
/// checkpoint store; each client reconnects with `Last-Event-ID` to `other`, a second
/// coordinator, and must get the rest. The checkpoints live on in JetStream
/// ([`ClusterOptions::jetstream`](crate::ClusterOptions::jetstream)), and a live
/// coordinator takes the streams over once the dead one's lease runs out. A fresh
/// coordinator (another id: its store is empty) takes the first one's place, so either
/// may be the one that takes over: `other` then follows what it writes.
pub fn lose_coordinator(
    cluster: &mut Cluster,
    other: &crate::http::Api,
    sampling: Sampling,
    runs: usize,
    streams: usize,
    max_tokens: u32,
) -> Verdict {
    let mut verdict = Verdict::named(format!(
        "lose the coordinator of {streams} streams and its disk ({})",
        sampling.name()
    ));
    let bodies: Vec<Value> = (0..streams)
        .map(|k| request(cluster, sampling, max_tokens, 20 + k))
        .collect();
    let mut references = Vec::new();
    for body in &bodies {
        match first_run(cluster, body, &mut verdict, runs * streams) {
            Some(r) => references.push(r),
            None => return verdict,
        }
    }
    for i in 0..runs {
        // All at once, so that none is near its end when the coordinator dies.
        let readers: Vec<Reader> = bodies
            .iter()
            .map(|body| Reader::spawn(cluster.api.stream(PATH, body)))
            .collect();
        let mut open = Vec::new();
        for (k, reader) in readers.into_iter().enumerate() {
            let label = format!("run {i}, stream {k}");
            let mut seen = Seen::default();
            if reader.until(&mut seen, break_after(i + k, max_tokens), STREAM_TIMEOUT) {
                open.push((k, label, reader, seen));
            } else {
                verdict.runs += 1;
                verdict
                    .failures
                    .push(format!("{label}: the stream ended before the break"));
            }
        }
        let claims_before = taken_over(other);
        let mut broke = 0;
        let broke_at = Instant::now();
        cluster.replace_coordinator();
        let mut again = Vec::new();
        for (k, label, reader, mut seen) in open {
            // What the old connection still delivered before it broke.
            reader.rest(&mut seen, Duration::from_secs(5));
            if !seen.events.iter().any(|(_, e)| e.is_done()) {
                broke += 1;
            }
            seen.events.retain(|(_, e)| !e.is_done());
            let Some(last) = seen.last_id() else {
                verdict.runs += 1;
                verdict
                    .failures
                    .push(format!("{label}: no event id to reconnect with"));
                continue;
            };
            match other.try_stream_from(PATH, &bodies[k], Some(&last)) {
                Ok(sse) => again.push((k, label, Reader::spawn(sse), seen)),
                Err(e) => {
                    verdict.runs += 1;
                    verdict.failures.push(format!("{label}: reconnecting: {e}"));
                }
            }
        }
        for (k, label, reader, mut seen) in again {
            reader.rest(&mut seen, STREAM_TIMEOUT);
            judge(&mut verdict, &seen, &references[k], broke_at, &label);
        }
        // Each stream that had not ended claimed exactly once, by one of the two live
        // coordinators.
        let claims = taken_over(other).saturating_sub(claims_before) + taken_over(&cluster.api);
        if claims != broke {
            verdict.failures.push(format!(
                "run {i}: {broke} streams lost their coordinator but {claims} were taken over"
            ));
        }
    }
    verdict
}

/// Streams a coordinator took over from dead ones (its metric).
fn taken_over(api: &crate::http::Api) -> u64 {
    api.get("/metrics")
        .ok()
        .and_then(|r| {
            r.body
                .as_str()?
                .lines()
                .find_map(|l| l.strip_prefix("baton_streams_taken_over_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(0, |v| v as u64)
}

/// Kills `nats-server` mid-stream and starts it again on the same port.
pub fn restart_nats(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    let mut verdict = Verdict::named(format!("restart nats-server ({})", sampling.name()));
    let body = request(cluster, sampling, max_tokens, 2);
    let Some(reference) = first_run(cluster, &body, &mut verdict, runs) else {
        return verdict;
    };
    for i in 0..runs {
        let label = format!("run {i}");
        let Some((reader, mut seen)) = started(cluster, &body, i, max_tokens, &mut verdict, &label)
        else {
            continue;
        };
        let broke_at = Instant::now();
        cluster.restart_nats(Duration::from_millis(500));
        reader.rest(&mut seen, STREAM_TIMEOUT);
        judge(&mut verdict, &seen, &reference, broke_at, &label);
    }
    verdict
}

/// Which server of a NATS cluster run `i` kills: the coordinator's, the serving worker's,
/// then one that carries neither (when there is one).
fn nats_target(cluster: &Cluster, i: usize, worker: &str) -> Option<(usize, &'static str)> {
    let coordinator = cluster.nats_server_of("baton-coordinator");
    let serving = cluster.nats_server_of(&format!("baton-worker-{worker}"));
    match i % 3 {
        0 => coordinator.map(|s| (s, "the coordinator's")),
        1 => serving.map(|s| (s, "the serving worker's")),
        _ => (0..cluster.nats_count())
            .find(|&s| Some(s) != coordinator && Some(s) != serving)
            .map(|s| (s, "a bystander"))
            .or(coordinator.map(|s| (s, "the coordinator's"))),
    }
}

/// On a cluster of several `nats-server`s, kills (`SIGKILL`) one mid-stream — the one the
/// coordinator is connected to, the serving worker's, or one carrying neither, in turn —
/// and leaves it down until the stream has ended; then starts it again and checks it
/// rejoined the cluster (routes to every other server) and a stream is served.
pub fn kill_nats_member(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    let servers = cluster.nats_count();
    let mut verdict = Verdict::named(format!(
        "kill 1 of {servers} nats-servers ({})",
        sampling.name()
    ));
    let body = request(cluster, sampling, max_tokens, 3);
    let Some(reference) = first_run(cluster, &body, &mut verdict, runs) else {
        return verdict;
    };
    for i in 0..runs {
        let mut label = format!("run {i}");
        let Some((reader, mut seen)) = started(cluster, &body, i, max_tokens, &mut verdict, &label)
        else {
            continue;
        };
        let stream = seen.stream_id().unwrap_or_default();
        let worker = serving_worker(cluster, &stream)
            .and_then(|w| cluster.worker_id(w))
            .unwrap_or_default();
        let Some((target, role)) = nats_target(cluster, i, &worker) else {
            verdict.runs += 1;
            verdict.failures.push(format!(
                "{label}: no nats-server found carrying the coordinator or worker {worker}"
            ));
            continue;
        };
        label = format!(
            "{label} ({role} server, {})",
            cluster.nats_server(target).name()
        );
        let broke_at = Instant::now();
        cluster.nats_server(target).kill();
        reader.rest(&mut seen, STREAM_TIMEOUT);
        judge(&mut verdict, &seen, &reference, broke_at, &label);
        let server = cluster.nats_server(target);
        server.start_again();
        if !server.wait_routes(Duration::from_secs(20)) {
            verdict.failures.push(format!(
                "{label}: {} did not rejoin the cluster within 20 s (routes: {:?})",
                server.name(),
                server.routes()
            ));
            continue;
        }
        // Routed is not recovered: JetStream's leaders and replicas catch up after.
        // What follows (the next kill, or another drill) starts from a cluster whole.
        for k in 0..cluster.nats_count() {
            let server = cluster.nats_server(k);
            if !server.wait_healthy(Duration::from_secs(30)) {
                verdict.failures.push(format!(
                    "{label}: {} did not call itself healthy within 30 s of the rejoin",
                    server.name()
                ));
            }
        }
    }
    // The cluster whole again serves a stream from start to end.
    last_run(cluster, &body, &reference, &mut verdict, "after the drill");
    verdict
}

/// How long a partition drill keeps the coordinator cut off: less than a client's
/// patience, more than its NATS connection's (three missed pings).
pub const COORDINATOR_CUT: Duration = Duration::from_secs(3);

/// What run `i` of [`partition`] cuts off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    Worker,
    CoordinatorsServer,
    Coordinator,
}

/// Partitions, on a cluster made with [`crate::ClusterOptions::partitioned`]: each run
/// cuts one process off the network mid-stream (its sockets open, its packets lost), in
/// turn the serving worker (until the stream has ended: it resumes on another worker),
/// the `nats-server` carrying the coordinator's connection (until the stream has ended:
/// the coordinator moves to another server) and the coordinator itself (for
/// [`COORDINATOR_CUT`]: the client's connection waits), then heals it. Each stream must
/// end as an uninterrupted run, and what was cut off must rejoin: the worker counted
/// live again, the server routing to every other, the coordinator answering; a last
/// whole stream must match too.
pub fn partition(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
) -> Verdict {
    let mut verdict = Verdict::named(format!("cut one process off ({})", sampling.name()));
    let body = request(cluster, sampling, max_tokens, 5);
    let Some(reference) = first_run(cluster, &body, &mut verdict, runs) else {
        return verdict;
    };
    let workers = cluster.workers.len();
    for i in 0..runs {
        let cut = [Cut::Worker, Cut::CoordinatorsServer, Cut::Coordinator][i % 3];
        let mut label = format!("run {i}");
        let Some((reader, mut seen)) = started(cluster, &body, i, max_tokens, &mut verdict, &label)
        else {
            continue;
        };
        let stream = seen.stream_id().unwrap_or_default();
        let (host, server) = match cut {
            Cut::Worker => (
                serving_worker(cluster, &stream).and_then(|w| cluster.worker_host(w).cloned()),
                None,
            ),
            Cut::CoordinatorsServer => {
                let s = cluster.nats_server_of("baton-coordinator");
                (s.and_then(|s| cluster.nats_server(s).host().cloned()), s)
            }
            Cut::Coordinator => (cluster.coordinator_host().cloned(), None),
        };
        let Some(host) = host else {
            verdict.runs += 1;
            verdict.failures.push(format!(
                "{label}: no namespace found for the {cut:?} (a partitioned cluster?)"
            ));
            continue;
        };
        label = format!("{label} ({cut:?} cut off, {})", host.ns);
        let broke_at = Instant::now();
        cluster.cut(&host);
        if cut == Cut::Coordinator {
            std::thread::sleep(COORDINATOR_CUT);
            cluster.heal(&host);
            reader.rest(&mut seen, STREAM_TIMEOUT);
        } else {
            reader.rest(&mut seen, STREAM_TIMEOUT);
            cluster.heal(&host);
        }
        judge(&mut verdict, &seen, &reference, broke_at, &label);
        // The part cut off rejoins.
        let rejoined = match cut {
            Cut::Worker => wait_live(cluster, workers, Duration::from_secs(30)),
            Cut::CoordinatorsServer => {
                server.is_some_and(|s| cluster.nats_server(s).wait_routes(Duration::from_secs(30)))
            }
            Cut::Coordinator => wait_live(cluster, workers, Duration::from_secs(30)),
        };
        if !rejoined {
            verdict
                .failures
                .push(format!("{label}: did not rejoin within 30 s of the heal"));
        }
    }
    last_run(cluster, &body, &reference, &mut verdict, "after the drill");
    verdict
}

/// Waits until the coordinator answers `/health` counting `n` live workers.
fn wait_live(cluster: &Cluster, n: usize, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let counted = cluster
            .api
            .get("/health")
            .ok()
            .and_then(|r| r.body["workers"].as_u64());
        if counted == Some(n as u64) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}
