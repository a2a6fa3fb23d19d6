//! Two real models in one cluster (Qwen2.5-Coder-0.5B and Gemma-3-270M, Q4_K_M, from
//! `scripts/models fetch`): `/v1/models` lists both with their context, requests go to
//! the model they name, and greedy text through the cluster is what `baton-worker
//! generate` gives for the same file and prompt. Skips without the files, unless
//! `BATON_REQUIRE_DOWNLOADS` is set.

use std::path::PathBuf;
use std::process::Command;

use baton_integration_tests::{
    assert_error, process::bin, workspace_root, Cluster, ClusterOptions,
};
use serde_json::json;

const QWEN: &str = "models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
const GEMMA: &str = "models/gemma-3-270m.Q4_K_M.gguf";

fn files() -> Option<Vec<PathBuf>> {
    let paths: Vec<PathBuf> = [QWEN, GEMMA]
        .iter()
        .map(|p| workspace_root().join(p))
        .collect();
    if let Some(missing) = paths.iter().find(|p| !p.is_file()) {
        assert!(
            std::env::var_os(baton_common::env::REQUIRE_DOWNLOADS).is_none(),
            "{} is absent (scripts/models fetch qwen2.5-coder-0.5b gemma-3-270m)",
            missing.display()
        );
        eprintln!("note: skipped: {} is absent", missing.display());
        return None;
    }
    Some(paths)
}

/// `baton-worker generate`'s greedy text for `prompt` (as a chat with `chat`).
fn generate(model: &str, prompt: &str, chat: bool, max_tokens: u32) -> String {
    let mut cmd = Command::new(bin("baton-worker"));
    cmd.current_dir(workspace_root())
        .env("RUST_LOG", "error")
        .args(["generate", "--model", model, "--prompt", prompt])
        .args(["--max-tokens", &max_tokens.to_string()]);
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd.output().expect("baton-worker generate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    // It ends the text with a newline of its own.
    text.strip_suffix('\n').unwrap_or(&text).to_owned()
}

#[test]
fn two_models_serve_side_by_side_as_they_do_alone() {
    let Some(paths) = files() else { return };
    let Some(cluster) = Cluster::start(ClusterOptions::real(2).models(paths)) else {
        return;
    };
    let (qwen, gemma) = ("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M", "gemma-3-270m.Q4_K_M");
    // Both listed once the second worker's heartbeat is in.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let listed = loop {
        let r = cluster.api.get("/v1/models").expect("models");
        let data = r.body["data"].as_array().cloned().unwrap_or_default();
        if data.len() == 2 || std::time::Instant::now() > deadline {
            break data;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut ids: Vec<&str> = listed.iter().filter_map(|m| m["id"].as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, [qwen, gemma], "{}", cluster.logs());
    for m in &listed {
        assert_eq!(m["max_model_len"], 32768, "{m}");
        assert_eq!(m["context_length"], 32768, "{m}");
    }

    let chat = cluster
        .api
        .post_json(
            "/v1/chat/completions",
            &json!({"model": qwen, "temperature": 0, "max_tokens": 24,
                    "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}),
        )
        .expect("chat");
    assert_eq!(chat.status, 200, "{}", chat.body);
    assert_eq!(
        chat.body["choices"][0]["message"]["content"].as_str(),
        Some(generate(QWEN, "Write a haiku about the sea.", true, 24).as_str()),
        "Qwen through the cluster and alone"
    );

    let text = cluster
        .api
        .post_json(
            "/v1/completions",
            &json!({"model": gemma, "temperature": 0, "max_tokens": 24,
                    "prompt": "The capital of France is"}),
        )
        .expect("completion");
    assert_eq!(text.status, 200, "{}", text.body);
    assert_eq!(
        text.body["choices"][0]["text"].as_str(),
        Some(generate(GEMMA, "The capital of France is", false, 24).as_str()),
        "Gemma through the cluster and alone"
    );

    // Gemma-3-270M's file has no chat template: a chat is refused, clearly.
    let refused = cluster
        .api
        .post_json(
            "/v1/chat/completions",
            &json!({"model": gemma, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .expect("reply");
    let error = assert_error(&refused, 400);
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("chat template")),
        "{error}"
    );
}
