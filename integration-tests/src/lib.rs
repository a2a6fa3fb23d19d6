//! End-to-end tests of Baton: real processes driven as users drive them.
//!
//! A test starts a private `nats-server` on a free port, a coordinator on another free
//! port and a few workers (the real default model, or the simulated engine where only
//! routing matters), then speaks HTTP and Server-Sent Events to the coordinator.
//! Every process is killed when its owner is dropped, so a failing test leaves nothing
//! running; a failing test prints every process's log.
//!
//! Tests skip, with a printed note, when `nats-server` or the model file is missing;
//! `scripts/setup` installs both. The binaries are found beside the test executable
//! (see [`process::bin_dir`]).
//!
//! # Layout
//! - [`process`]: child processes killed on drop, the `nats-server`, free ports, binaries.
//! - [`cluster`]: a whole cluster (NATS, coordinator, workers) from [`ClusterOptions`].
//! - [`drill`]: failover drills (kill a worker, restart the coordinator or NATS
//!   mid-stream) and their verdicts.
//! - [`soak`]: a bounded soak (steady load, a worker killed every few minutes, every
//!   stream checked token by token, memory sampled) and its verdict.
//! - [`tap`]: a subscriber to the workers' token messages, to check token ids.
//! - [`http`]: a blocking client for the API, an SSE reader, OpenAI error checks.
//! - [`secure`]: a NATS server with the shipped accounts and permissions (and TLS), and
//!   each role's credentials.
//! - [`generate`]: `baton-worker generate`, the reference a cluster's greedy text must match.

pub mod cluster;
pub mod drill;
pub mod http;
pub mod netns;
pub mod process;
pub mod secure;
pub mod soak;
pub mod tap;

use std::path::PathBuf;

pub use cluster::{ApiKeys, Cluster, ClusterOptions, Engine, DEFAULT_MODEL_NAME};
pub use http::{assert_error, summarize, Api, Reply, SseEvent, SseReader, StreamSummary};
pub use process::{Nats, Process};

/// The repository root: `BATON_ROOT` when set (the scripts set it), else the checkout
/// this crate was built in, else the current directory. (Cargo may reuse a binary built
/// in another checkout that shares the target directory, whose path may be gone.)
pub fn workspace_root() -> PathBuf {
    if let Some(root) = std::env::var_os("BATON_ROOT") {
        return PathBuf::from(root);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    if built.join("Cargo.toml").is_file() {
        built
    } else {
        std::env::current_dir().unwrap_or(built)
    }
}

/// Whether `python3` can import `module`; prints a skip note naming `package` (what
/// `scripts/setup` installs) when it cannot.
pub fn python_has(module: &str, package: &str) -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "note: skipped: python3 cannot import {module} (scripts/setup installs {package})"
        );
    }
    ok
}

/// Runs `integration-tests/python/<script>` with `args` and reads the one JSON object
/// it prints; panics with its stderr and the cluster's logs when it fails.
pub fn python_json(script: &str, args: &[&str], cluster: &Cluster) -> serde_json::Value {
    let path = workspace_root()
        .join("integration-tests/python")
        .join(script);
    let out = std::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{}\n{}",
        path.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr),
        cluster.logs()
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The text `baton-worker generate` prints for `prompt` with the default model, greedy
/// (temperature 0), with the weights kept as the serving workers keep them (`native-i16`).
/// With `chat`, the prompt is one user message through the chat template.
pub fn generate(prompt: &str, chat: bool, max_tokens: u32) -> String {
    generate_with(prompt, chat, max_tokens, &[])
}

/// What `baton-worker generate --json` prints for a greedy run with `extra` options:
/// the text, prompt and output ids, finish reason and (with `--logprobs N`) each token's
/// logprobs, as the engine computed them.
pub fn generate_json(
    prompt: &str,
    chat: bool,
    max_tokens: u32,
    extra: &[&str],
) -> serde_json::Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let out = generate_with(prompt, chat, max_tokens, &args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("generate --json printed {out:?}: {e}"))
}

/// [`generate`] with more options of `baton-worker generate` (`--json-schema …`).
pub fn generate_with(prompt: &str, chat: bool, max_tokens: u32, extra: &[&str]) -> String {
    generate_on(
        &cluster::default_model_path(),
        prompt,
        chat,
        max_tokens,
        extra,
    )
}

/// Qwen2.5-Coder-0.5B's file (`scripts/models fetch qwen2.5-coder-0.5b`), when it is
/// there; without it a note, or a failure when `BATON_REQUIRE_DOWNLOADS` is set.
pub fn qwen_model() -> Option<std::path::PathBuf> {
    let path = workspace_root().join("models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf");
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os(baton_common::env::REQUIRE_DOWNLOADS).is_none(),
        "{} is absent (scripts/models fetch qwen2.5-coder-0.5b)",
        path.display()
    );
    eprintln!("note: skipped: {} is absent", path.display());
    None
}

/// [`generate_with`] on the model at `model`.
pub fn generate_on(
    model: &std::path::Path,
    prompt: &str,
    chat: bool,
    max_tokens: u32,
    extra: &[&str],
) -> String {
    let mut cmd = std::process::Command::new(process::bin("baton-worker"));
    cmd.current_dir(workspace_root())
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", prompt])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(["--dtype", "native-i16"]);
    if !extra.contains(&"--temperature") {
        cmd.args(["--temperature", "0"]);
    }
    if chat {
        cmd.arg("--chat");
    }
    cmd.args(extra);
    let out = cmd.output().expect("running baton-worker generate");
    assert!(
        out.status.success(),
        "baton-worker generate failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("generate prints UTF-8");
    // It prints the completion and then one newline.
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}
