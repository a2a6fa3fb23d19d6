//! Hot model swaps on the workers serving running streams, and the swaps that must be refused.

use super::*;

/// The SHA-256 of a file, hex.
pub fn sha256_hex(path: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    let bytes = std::fs::read(path).expect("reading a model file");
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Orders worker `id` to load `path` (an admin request); the reply as it came.
pub fn load_model(cluster: &Cluster, id: &str, body: Value) -> crate::http::Reply {
    cluster
        .api
        .post_json(&format!("/admin/workers/{id}/models"), &body)
        .expect("the coordinator answers a model load")
}

/// Hot-swaps the model of the workers serving four running streams, `runs` times: each
/// to a fresh copy of the model file (its SHA-256 beside it), served under the same
/// name. The streams finish on the model they began on; each must end as an
/// uninterrupted run. Then two swaps that must be refused — a wrong SHA-256 and a
/// truncated GGUF — each reply saying why, after which the old model still serves the
/// same text. The gap is the swap order → the next token of each stream.
pub fn swap_model(
    cluster: &mut Cluster,
    sampling: Sampling,
    runs: usize,
    max_tokens: u32,
    model_file: &std::path::Path,
) -> Verdict {
    let mut verdict = Verdict::named(format!(
        "hot-swap the model under 4 streams ({})",
        sampling.name()
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let bodies: Vec<Value> = (0..4)
        .map(|i| request(cluster, sampling, max_tokens, i))
        .collect();
    let mut references = Vec::new();
    for body in &bodies {
        match reference(cluster, body) {
            Ok(r) => references.push(r),
            Err(e) => {
                verdict.runs = runs * 4;
                verdict.failures.push(e);
                return verdict;
            }
        }
    }
    for run in 0..runs {
        let copy = dir.path().join(format!("swap-{run}.gguf"));
        std::fs::copy(model_file, &copy).expect("copying the model file");
        std::fs::write(
            dir.path().join(format!("swap-{run}.gguf.sha256")),
            format!("{}  swap-{run}.gguf\n", sha256_hex(&copy)),
        )
        .expect("writing the SHA-256");
        let readers: Vec<Reader> = bodies
            .iter()
            .map(|b| Reader::spawn(cluster.api.stream(PATH, b)))
            .collect();
        let mut seens: Vec<Seen> = (0..4).map(|_| Seen::default()).collect();
        let mut workers = Vec::new();
        for (i, (reader, seen)) in readers.iter().zip(&mut seens).enumerate() {
            if !reader.until(seen, 2 + run % 3, STREAM_TIMEOUT) {
                verdict
                    .failures
                    .push(format!("run {run}, stream {i}: ended before the swap"));
                continue;
            }
            let stream = seen.stream_id().unwrap_or_default();
            if let Some(w) = serving_worker(cluster, &stream).and_then(|w| cluster.worker_id(w)) {
                if !workers.contains(&w) {
                    workers.push(w);
                }
            }
        }
        let swapped_at = Instant::now();
        let mut retiring = 0;
        for w in &workers {
            let reply = load_model(
                cluster,
                w,
                json!({"path": copy.display().to_string(), "name": cluster.model}),
            );
            if reply.status != 200 {
                verdict.failures.push(format!(
                    "run {run}: the swap on worker {w} answered {}: {}",
                    reply.status, reply.body
                ));
            }
            retiring += reply.body["retiring_streams"].as_u64().unwrap_or(0);
        }
        // The switch must have found streams running, or nothing was tested.
        if retiring == 0 {
            verdict.failures.push(format!(
                "run {run}: no stream was running when the new model took over (raise \
                 --max-tokens)"
            ));
        }
        for (i, (reader, mut seen)) in readers.into_iter().zip(seens).enumerate() {
            reader.rest(&mut seen, STREAM_TIMEOUT);
            judge(
                &mut verdict,
                &seen,
                &references[i],
                swapped_at,
                &format!("run {run}, stream {i}"),
            );
        }
    }
    // Swaps that must be refused, the old model serving on: on a live worker (the
    // first ones of an earlier drill may have been killed).
    let live = (0..cluster.workers.len())
        .rev()
        .find(|&i| cluster.workers[i].try_status().is_none());
    let Some(worker) = live.and_then(|i| cluster.worker_id(i)) else {
        verdict
            .failures
            .push("no live worker with an id in its log".into());
        return verdict;
    };
    let bytes = std::fs::read(model_file).expect("reading the model file");
    let cut = dir.path().join("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 3]).expect("writing a truncated copy");
    let refusals = [
        (
            json!({"path": model_file.display().to_string(), "sha256": "0".repeat(64), "name": cluster.model}),
            "SHA-256",
        ),
        (
            json!({"path": cut.display().to_string(), "sha256": sha256_hex(&cut), "name": cluster.model}),
            "not a GGUF file",
        ),
    ];
    for (body, why) in refusals {
        let reply = load_model(cluster, &worker, body);
        if reply.status != 400 || !reply.body.to_string().contains(why) {
            verdict.failures.push(format!(
                "a swap to a bad file answered {} (wanted 400 naming {why:?}): {}",
                reply.status, reply.body
            ));
        }
    }
    last_run(
        cluster,
        &bodies[0],
        &references[0],
        &mut verdict,
        "after the refused swaps",
    );
    verdict
}
