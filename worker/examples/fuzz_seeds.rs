//! Writes the seed inputs of the fuzz targets (`fuzz/`): valid GGUF files, wire messages
//! and request bodies, one directory per target. `scripts/fuzz` runs it before fuzzing:
//!
//! ```text
//! cargo run --release -p baton-worker --example fuzz_seeds -- fuzz/corpus
//! ```

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context};
use baton_common::ids::{CoordinatorId, StreamId, WorkerId};
use baton_common::protocol::{
    encode, Accepted, Body, Cancel, ChatTurn, DrainReply, DrainWorker, Envelope, ErrorKind,
    EventKind, FinishReason, Finished, GenParams, Heartbeat, LoadModel, LogitBias, ModelInfo,
    Probe, ProbeReply, PromptSpec, Refused, Resume, SeqRequest, StreamAttempt, StreamEvent, Submit,
    SubmitOutcome, SubmitReply, TokenBatch, TokenEvent, ToolCall, ToolChoice, Tools, UnloadModel,
    Wire, WireError, PROTOCOL_VERSION,
};
use baton_common::public::{
    encode_reply, Chunk, ClusterStatus, CoordinatorStatus, Drained, ErrorReply, Final, LoadStatus,
    ModelStatus, Reply, Whole, WorkerStatus,
};
use baton_worker::engine::gguf::{GgmlType, GgufFile, GgufWriter};
use baton_worker::engine::llama::synthetic::{write_synthetic_llama, SyntheticSpec};
use baton_worker::engine::llama::{config::Activation, Arch, LlamaConfig};
use baton_worker::engine::tokenizer::Tokenizer;

fn main() -> anyhow::Result<()> {
    let out: PathBuf = std::env::args_os()
        .nth(1)
        .context("usage: fuzz_seeds <corpus directory>")?
        .into();
    gguf_seeds(&dir(&out, "gguf")?)?;
    wire_seeds(&dir(&out, "wire")?)?;
    http_seeds(&dir(&out, "http")?)?;
    Ok(())
}

fn dir(out: &Path, target: &str) -> anyhow::Result<PathBuf> {
    let dir = out.join(target);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// Whole models, small enough for the target's `-max_len`: one layer, 32 wide, the
/// synthetic tokenizer (288 tokens) and ChatML; and the metadata alone.
fn gguf_seeds(dir: &Path) -> anyhow::Result<()> {
    let config = LlamaConfig {
        arch: Arch::Llama,
        n_layers: 1,
        hidden: 32,
        ffn: 32,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 16,
        vocab: 288,
        context_length: 16,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
        rope_scale: 1.0,
        rope_dims: 16,
        rope_attn_factor: 1.0,
        rope_original_context: 16,
        activation: Activation::Silu,
        embed_scale: 1.0,
        attn_scale: 0.25,
        sliding: None,
    };
    for (ty, untied) in [
        (GgmlType::Q8_0, false),
        (GgmlType::Q4_1, true),
        (GgmlType::F16, false),
    ] {
        let spec = SyntheticSpec {
            config: config.clone(),
            weight_type: ty,
            seed: 1,
            untied_output: untied,
        };
        let path = dir.join(format!("model-{}.gguf", ty.name().to_lowercase()));
        write_synthetic_llama(&path, &spec)?;
        let file = GgufFile::open(&path)?;
        Tokenizer::from_gguf(&file)?;
        if ty == GgmlType::Q8_0 {
            // The same metadata without tensors: the tokenizer's and template's inputs.
            let mut w = GgufWriter::new();
            for (key, value) in file.metadata() {
                w.add_metadata(key.clone(), value.clone())?;
            }
            let mut bytes = Vec::new();
            w.write(&mut bytes)?;
            Tokenizer::from_gguf(&GgufFile::from_bytes(bytes.clone())?)?;
            write(dir, "metadata.gguf", &bytes)?;
        }
    }
    Ok(())
}

/// One message of every kind, and the public API's replies and JSON bodies.
fn wire_seeds(dir: &Path) -> anyhow::Result<()> {
    let (stream, worker, coordinator) = (StreamId(11), WorkerId(22), CoordinatorId(33));
    let attempt = StreamAttempt { stream, attempt: 1 };
    let error = WireError {
        kind: ErrorKind::Overloaded,
        message: "full".into(),
    };
    let params = GenParams {
        max_tokens: 16,
        temperature: 0.7,
        top_p: 0.9,
        top_k: 40,
        repetition_penalty: 1.1,
        seed: 7,
        stop: vec!["\n\n".into()],
        ignore_eos: false,
        grammar: None,
        presence_penalty: 0.5,
        frequency_penalty: -0.25,
        min_p: 0.05,
        logit_bias: vec![LogitBias {
            id: 3,
            bias: -100.0,
        }],
        min_tokens: 2,
        stop_token_ids: vec![7],
        logprobs: Some(2),
        prompt_logprobs: Some(1),
        tools: Some(Tools {
            definitions:
                r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#
                    .into(),
            choice: ToolChoice::Function("f".into()),
            parallel: false,
        }),
        content_specials: true,
    };
    let call = ToolCall {
        index: 0,
        id: "call_1".into(),
        name: "f".into(),
        arguments: r#"{"a":1}"#.into(),
    };
    let bodies = [
        Body::Heartbeat(Heartbeat {
            worker,
            models: vec![ModelInfo {
                name: "m".into(),
                context_length: 2048,
                fingerprint: 5,
            }],
            capacity: 8,
            running: 1,
            queued: 2,
            kv_used_bytes: 1 << 20,
            kv_budget_bytes: 1 << 30,
            draining: false,
            version: "0.1.0".into(),
        }),
        Body::Submit(Submit {
            coordinator,
            sequences: vec![
                SeqRequest {
                    stream,
                    model: "m".into(),
                    prompt: PromptSpec::Chat(vec![
                        ChatTurn::new("user", "hi"),
                        ChatTurn {
                            tool_calls: vec![call.clone()],
                            ..ChatTurn::new("assistant", "")
                        },
                        ChatTurn {
                            tool_call_id: Some("call_1".into()),
                            ..ChatTurn::new("tool", "42")
                        },
                    ]),
                    params: params.clone(),
                    attempt: 0,
                    resume: None,
                    max_prompt_tokens: 0,
                },
                SeqRequest {
                    stream: StreamId(12),
                    model: "m".into(),
                    prompt: PromptSpec::Tokens(vec![1, 2, 3]),
                    params,
                    attempt: 2,
                    resume: Some(Resume {
                        tokens: vec![4, 5],
                        hash: 0xfeed,
                    }),
                    max_prompt_tokens: 512,
                },
            ],
        }),
        Body::SubmitReply(SubmitReply {
            outcomes: vec![
                SubmitOutcome::Accepted(Accepted {
                    stream,
                    prompt_tokens: 3,
                }),
                SubmitOutcome::Refused(Refused {
                    stream,
                    error: error.clone(),
                }),
            ],
        }),
        Body::Cancel(Cancel {
            streams: vec![attempt],
        }),
        Body::Tokens(TokenBatch {
            worker,
            events: vec![
                StreamEvent {
                    stream,
                    attempt: 1,
                    kind: EventKind::Token(TokenEvent {
                        index: 0,
                        id: 42,
                        hash: 9,
                        text: "héllo".into(),
                        logprobs: Some(baton_common::protocol::TokenLogprobs {
                            logprob: -0.75,
                            bytes: b"h\xc3".to_vec(),
                            text_offset: 2,
                            top: vec![baton_common::protocol::TopLogprob {
                                id: 5,
                                logprob: -1.5,
                                bytes: b"x".to_vec(),
                            }],
                        }),
                        tool_calls: vec![call.clone()],
                    }),
                },
                StreamEvent {
                    stream,
                    attempt: 1,
                    kind: EventKind::Finished(Finished {
                        reason: FinishReason::Stop,
                        prompt_tokens: 3,
                        completion_tokens: 1,
                        cached_tokens: 0,
                    }),
                },
                StreamEvent {
                    stream,
                    attempt: 1,
                    kind: EventKind::Failed(error.clone()),
                },
            ],
        }),
        Body::Probe(Probe {
            streams: vec![attempt],
        }),
        Body::ProbeReply(ProbeReply {
            worker,
            running: 1,
            queued: 0,
            missing: vec![attempt],
        }),
        Body::Drain(DrainWorker {
            reason: "maintenance".into(),
            handover_after_ms: Some(300),
        }),
        Body::DrainReply(DrainReply {
            worker,
            running: 1,
            queued: 0,
        }),
        Body::LoadModel(LoadModel {
            path: "models/new.gguf".into(),
            sha256: Some("00".repeat(32)),
            name: Some("new".into()),
            add: false,
        }),
        Body::UnloadModel(UnloadModel { name: "old".into() }),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let wire = Wire {
            envelope: Envelope {
                publisher: 1,
                seq: i as u64,
                version: PROTOCOL_VERSION,
            },
            body,
        };
        write(dir, &format!("message-{i}"), &encode(&wire))?;
    }
    let end = Final {
        finish_reason: "stop".into(),
        prompt_tokens: 3,
        completion_tokens: 1,
        cached_tokens: 0,
        logprobs: vec![],
    };
    let replies = [
        Reply::Chunk(Chunk {
            text: "hi".into(),
            logprobs: vec![],
            tool_calls: vec![call.clone()],
        }),
        Reply::Final(end.clone()),
        Reply::Whole(Whole {
            id: "cmpl-1".into(),
            model: "m".into(),
            text: "hi".into(),
            logprobs: vec![],
            prompt: None,
            tool_calls: vec![call],
            end,
        }),
        Reply::Error(ErrorReply {
            code: "model_not_found".into(),
            kind: "invalid_request_error".into(),
            param: Some("model".into()),
            message: "no".into(),
        }),
        Reply::Status(ClusterStatus {
            coordinator: CoordinatorStatus {
                id: coordinator,
                requests: 1,
                malformed_requests: 0,
                garbage: 0,
            },
            health: "ok".into(),
            workers: vec![WorkerStatus {
                id: worker,
                models: vec!["m".into()],
                capacity: 8,
                running: 1,
                queued: 0,
                kv_used_bytes: 1,
                kv_budget_bytes: 2,
                draining: false,
                version: "0.1.0".into(),
                last_seen_ms: 3,
                in_flight: 1,
            }],
            models: vec![ModelStatus {
                name: "m".into(),
                context_length: 2048,
                workers: 1,
            }],
            load: LoadStatus::default(),
        }),
        Reply::Drained(Drained {
            worker,
            draining: true,
            running: 0,
            queued: 0,
        }),
    ];
    for (i, reply) in replies.into_iter().enumerate() {
        write(dir, &format!("reply-{i}"), &encode_reply(&reply))?;
    }
    let replay = format!(r#"{{"stream": "{stream}", "after": 7, "coordinator": "{coordinator}"}}"#);
    write(dir, "replay.json", replay.as_bytes())?;
    write(
        dir,
        "drain.json",
        format!(r#"{{"worker": "{worker}"}}"#).as_bytes(),
    )?;
    write(dir, "stream-id", stream.to_string().as_bytes())?;
    Ok(())
}

/// Request bodies of both endpoints, with every field, and a `Last-Event-ID`.
fn http_seeds(dir: &Path) -> anyhow::Result<()> {
    let bodies = [
        r#"{"model": "m", "prompt": "Once upon a time", "max_tokens": 16}"#,
        r#"{"model": "m", "prompt": [[1, 2, 3]], "temperature": 0, "stop": "\n"}"#,
        r#"{"model": "m", "prompt": ["hi"], "top_p": 0.5, "top_k": 40, "seed": -1, "n": 1,
            "repetition_penalty": 1.1, "stream": true, "stream_options": {"include_usage": true},
            "ignore_eos": true, "stop": ["a", "b", ""]}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null}], "max_completion_tokens": 8,
            "max_tokens": 9, "temperature": 1.5, "seed": 42}"#,
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}"#,
    ];
    for (i, body) in bodies.iter().enumerate() {
        let value: serde_json::Value = serde_json::from_str(body)?;
        ensure!(value.is_object(), "seed {i} is not a JSON object");
        write(dir, &format!("body-{i}.json"), body.as_bytes())?;
    }
    write(
        dir,
        "last-event-id",
        format!("{}:17", StreamId(11)).as_bytes(),
    )?;
    Ok(())
}
