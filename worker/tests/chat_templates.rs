//! The chat templates of each family (Llama 3.1 and 3.2, Qwen2.5, Qwen3, Gemma, Mistral
//! Nemo, Phi-3.5, SmolLM3), rendered by minijinja as transformers renders them: the
//! templates are llama.cpp's copies (`models/templates`, which `scripts/setup` extracts
//! into `$BATON_CACHE/llamacpp/templates`); `scripts/template_fixtures.py` recorded what
//! transformers renders for a few conversations, with and without tools.

use std::path::{Path, PathBuf};

use baton_common::env;
use baton_worker::engine::chat::{ChatMessage, ChatTemplate, TemplateVars};
use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Deserialize)]
struct Fixture {
    templates: Vec<Template>,
}

#[derive(Deserialize)]
struct Template {
    file: String,
    sha256: String,
    bos_token: String,
    eos_token: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    rendered: String,
}

fn templates_dir() -> Option<PathBuf> {
    let cache = std::env::var_os(env::CACHE)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/baton"));
    let dir = cache.join("llamacpp/templates");
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var_os(env::REQUIRE_DOWNLOADS).is_none(),
        "{} is absent (scripts/setup extracts it)",
        dir.display()
    );
    eprintln!("skipping: {} is absent (run scripts/setup)", dir.display());
    None
}

/// Each family's template names the tool format Baton speaks with it.
#[test]
fn family_templates_name_their_tool_format() {
    use baton_common::tools::ToolFormat;
    let Some(dir) = templates_dir() else { return };
    let cases = [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat::Hermes),
        ("Qwen-Qwen3-0.6B.jinja", ToolFormat::Hermes),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
            ToolFormat::Hermes,
        ),
        (
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            ToolFormat::Llama3Json,
        ),
        (
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            ToolFormat::Llama3Json,
        ),
        (
            "meta-llama-Llama-3.3-70B-Instruct.jinja",
            ToolFormat::Llama3Json,
        ),
        // Mistral's own `[TOOL_CALLS]` format is not parsed: the generic prompt.
        (
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            ToolFormat::Generic,
        ),
        ("google-gemma-2-2b-it.jinja", ToolFormat::Generic),
        ("HuggingFaceTB-SmolLM3-3B.jinja", ToolFormat::Generic),
    ];
    for (file, want) in cases {
        let source = std::fs::read_to_string(dir.join(file)).expect("template file");
        let template = ChatTemplate::new(source, String::new(), String::new())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(template.tool_format(), want, "{file}");
    }
}

#[test]
fn family_templates_render_as_transformers_renders_them() {
    let Some(dir) = templates_dir() else { return };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/rendered.json");
    let fixture: Fixture =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("parses");
    assert!(fixture.templates.len() >= 8);
    let mut failures = Vec::new();
    for t in &fixture.templates {
        let source = std::fs::read_to_string(dir.join(&t.file)).expect("template file");
        let sha: String = Sha256::digest(source.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            sha, t.sha256,
            "{}: the template the fixture was made from",
            t.file
        );
        let template = ChatTemplate::new(source, t.bos_token.clone(), t.eos_token.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", t.file));
        for c in &t.cases {
            let vars = TemplateVars {
                tools: c.tools.clone(),
                date_string: Some("02 Dec 2026".into()),
            };
            match template.render_with(&c.messages, c.add_generation_prompt, &vars) {
                Ok(ours) if ours == c.rendered => {}
                Ok(ours) => failures.push(format!(
                    "{} {}:\n--- ours\n{ours}\n--- transformers\n{}",
                    t.file, c.name, c.rendered
                )),
                Err(e) => failures.push(format!("{} {}: {e}", t.file, c.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
