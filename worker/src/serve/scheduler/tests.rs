use super::*;
use crate::serve::sim::SimEngine;
use baton_common::protocol::{GenParams, PromptSpec, Resume, TokenEvent};
use std::time::Duration;

fn request(stream: u128, resume: Option<Resume>, attempt: u32) -> SeqRequest {
    SeqRequest {
        stream: StreamId(stream),
        model: "sim".into(),
        prompt: PromptSpec::Text("three word prompt".into()),
        params: GenParams::greedy(6),
        attempt,
        resume,
        max_prompt_tokens: 0,
    }
}

struct Harness {
    commands: mpsc::Sender<Command>,
    out: tokio::sync::mpsc::UnboundedReceiver<Outbox>,
    load: Arc<Load>,
}

impl Harness {
    fn new() -> Self {
        let (commands, rx) = mpsc::channel();
        let (tx, out) = tokio::sync::mpsc::unbounded_channel();
        let engine = SimEngine::new("sim".into(), Duration::from_millis(1));
        let limits = Limits {
            max_running: 4,
            max_queued: 4,
            kv_budget: u64::MAX,
        };
        // Later models: named as asked, with a fingerprint of their own (another
        // model's chains).
        let loader: Loader<SimEngine> = Arc::new(|spec: &LoadSpec| {
            Ok(
                SimEngine::new(spec.name.clone(), Duration::from_millis(1)).with_fingerprint(
                    xxhash_rust::xxh3::xxh3_64(spec.path.to_string_lossy().as_bytes()),
                ),
            )
        });
        let load: Arc<Load> = Arc::default();
        let shared = load.clone();
        std::thread::spawn(move || run(engine, loader, limits, rx, tx, shared));
        Self {
            commands,
            out,
            load,
        }
    }

    fn order(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<ModelResult>) -> Command,
    ) -> ModelResult {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.commands.send(make(reply)).expect("engine thread");
        rx.blocking_recv().expect("reply")
    }

    fn load_model(&self, path: &str, name: &str, add: bool, ok: bool) -> ModelResult {
        let shown = path.to_owned();
        self.order(|reply| Command::Load {
            spec: LoadSpec {
                path: path.into(),
                name: name.into(),
            },
            check: Box::new(move || {
                if ok {
                    Ok(())
                } else {
                    anyhow::bail!("{shown}: its SHA-256 is not the one expected")
                }
            }),
            add,
            reply,
        })
    }

    fn served(&self) -> Vec<String> {
        self.load.models().into_iter().map(|m| m.name).collect()
    }

    fn submit(&self, req: SeqRequest) -> SubmitOutcome {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.commands
            .send(Command::Submit {
                coordinator: CoordinatorId(1),
                sequences: vec![req],
                reply,
            })
            .expect("engine thread");
        rx.blocking_recv().expect("reply").remove(0)
    }

    /// Every event of `stream` until it ends.
    fn drain(&mut self, stream: u128) -> Vec<StreamEvent> {
        let mut got = Vec::new();
        loop {
            let outbox = self.out.blocking_recv().expect("events");
            for (_, events) in outbox {
                for e in events {
                    if e.stream == StreamId(stream) {
                        let end = !matches!(e.kind, EventKind::Token(_));
                        got.push(e);
                        if end {
                            return got;
                        }
                    }
                }
            }
        }
    }
}

fn tokens(events: &[StreamEvent]) -> Vec<TokenEvent> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Token(t) => Some(t.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn prompts_over_max_prompt_tokens_are_refused() {
    let h = Harness::new();
    // The simulated prompt "three word prompt" is three tokens.
    let mut req = request(1, None, 0);
    req.max_prompt_tokens = 2;
    match h.submit(req) {
        SubmitOutcome::Refused(r) => {
            assert_eq!(r.error.kind, ErrorKind::PromptTooLong);
            assert!(
                r.error.message.contains("max_prompt_tokens"),
                "{}",
                r.error.message
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let mut req = request(2, None, 0);
    req.max_prompt_tokens = 3;
    assert!(matches!(h.submit(req), SubmitOutcome::Accepted(_)));
}

#[test]
fn tokens_carry_the_chain_and_a_resume_must_match_it() {
    let mut h = Harness::new();
    assert!(matches!(
        h.submit(request(1, None, 0)),
        SubmitOutcome::Accepted(_)
    ));
    let first = tokens(&h.drain(1));
    assert_eq!(first.len(), 6);
    // The hashes are the chain over the prompt's ids, then each token.
    let fingerprint = SimEngine::new("sim".into(), Duration::ZERO)
        .model_info()
        .fingerprint;
    let started = SimEngine::new("sim".into(), Duration::ZERO)
        .start(&request(1, None, 0))
        .map_err(|e| e.message)
        .expect("start");
    let mut chain = Chain::new(fingerprint, &started.prompt_ids);
    for t in &first {
        assert_eq!(t.hash, chain.push(t.id));
    }

    // A resume at position 2 with the right hash goes on from index 2.
    let done: Vec<u32> = first[..2].iter().map(|t| t.id).collect();
    let good = Resume {
        tokens: done.clone(),
        hash: first[1].hash,
    };
    assert!(matches!(
        h.submit(request(2, Some(good), 1)),
        SubmitOutcome::Accepted(_)
    ));
    let events = h.drain(2);
    assert!(events.iter().all(|e| e.attempt == 1));
    let rest = tokens(&events);
    let want: Vec<(u32, u32, u64)> = first[2..].iter().map(|t| (t.index, t.id, t.hash)).collect();
    let got: Vec<(u32, u32, u64)> = rest.iter().map(|t| (t.index, t.id, t.hash)).collect();
    assert_eq!(got, want);

    // A wrong hash is refused: another model.
    let bad = Resume {
        tokens: done,
        hash: first[1].hash ^ 1,
    };
    match h.submit(request(3, Some(bad), 1)) {
        SubmitOutcome::Refused(r) => assert_eq!(r.error.kind, ErrorKind::ChainMismatch),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_cancel_spares_a_newer_attempt() {
    let mut h = Harness::new();
    let mut long = request(1, None, 0);
    long.params.max_tokens = 1000;
    assert!(matches!(h.submit(long.clone()), SubmitOutcome::Accepted(_)));
    long.attempt = 1;
    assert!(matches!(h.submit(long), SubmitOutcome::Accepted(_)));
    h.commands
        .send(Command::Cancel(vec![(StreamId(1), 0)]))
        .expect("engine thread");
    h.commands
        .send(Command::Cancel(vec![(StreamId(1), 1)]))
        .expect("engine thread");
    let events = h.drain(1);
    let last = events.last().expect("an end");
    assert_eq!(last.attempt, 1);
    assert!(matches!(last.kind, EventKind::Finished(_)));
    // Attempt 0 was superseded by attempt 1 and produced nothing after it.
    let attempts: Vec<u32> = events.iter().map(|e| e.attempt).collect();
    let first_new = attempts.iter().position(|&a| a == 1).unwrap_or(0);
    assert!(attempts[first_new..].iter().all(|&a| a == 1));
}

#[test]
fn a_hand_over_fails_every_held_stream_as_draining() {
    let mut h = Harness::new();
    // Four long streams (the harness queues at most four between two steps).
    for stream in 1..=4 {
        let mut long = request(stream, None, 0);
        long.params.max_tokens = 1000;
        assert!(matches!(h.submit(long), SubmitOutcome::Accepted(_)));
    }
    h.commands.send(Command::HandOver).expect("engine thread");
    let mut ends: HashMap<StreamId, EventKind> = HashMap::new();
    while ends.len() < 4 {
        let outbox = h.out.blocking_recv().expect("events");
        for e in outbox.into_iter().flat_map(|(_, events)| events) {
            if !matches!(e.kind, EventKind::Token(_)) {
                assert!(ends.insert(e.stream, e.kind).is_none(), "two ends");
            }
        }
    }
    for (stream, end) in ends {
        match end {
            EventKind::Failed(e) => assert_eq!(e.kind, ErrorKind::Draining),
            other => panic!("stream {stream} ended with {other:?}"),
        }
    }
}

#[test]
fn a_swap_lets_running_streams_finish_on_the_old_model() {
    let mut h = Harness::new();
    let mut long = request(1, None, 0);
    long.params.max_tokens = 200;
    assert!(matches!(h.submit(long), SubmitOutcome::Accepted(_)));
    let change = h
        .load_model("new.gguf", "sim2", false, true)
        .expect("loaded");
    assert_eq!(
        change.loaded.as_ref().map(|m| m.name.as_str()),
        Some("sim2")
    );
    let names: Vec<&str> = change.serving.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["sim2"]);
    assert_eq!(h.served(), ["sim2"]);
    // New requests: the new model only.
    match h.submit(request(2, None, 0)) {
        SubmitOutcome::Refused(r) => {
            assert_eq!(r.error.kind, ErrorKind::UnknownModel);
            assert!(r.error.message.contains("\"sim2\""), "{}", r.error.message);
        }
        other => panic!("the replaced model took a new stream: {other:?}"),
    }
    let mut on_new = request(3, None, 0);
    on_new.model = "sim2".into();
    assert!(matches!(h.submit(on_new), SubmitOutcome::Accepted(_)));
    // The stream that began on the old model ends there, every token given.
    let events = h.drain(1);
    assert_eq!(tokens(&events).len(), 200);
    assert!(matches!(
        events.last().map(|e| &e.kind),
        Some(EventKind::Finished(_))
    ));
}

#[test]
fn a_resume_from_before_a_swap_goes_on_on_the_old_model() {
    let mut h = Harness::new();
    let mut long = request(1, None, 0);
    long.params.max_tokens = 300;
    assert!(matches!(h.submit(long.clone()), SubmitOutcome::Accepted(_)));
    h.load_model("new.gguf", "sim", false, true)
        .expect("loaded");
    // A resume of that stream (as after a lost message) names the old model's
    // chain: the new model (another fingerprint) cannot reproduce it, the old one,
    // still finishing its streams, can.
    let first = tokens(&h.drain(1));
    let mut again = long.clone();
    again.stream = StreamId(5);
    assert!(matches!(
        h.submit(again.clone()),
        SubmitOutcome::Accepted(_)
    ));
    let fresh = tokens(&h.drain(5));
    assert_ne!(
        fresh[0].hash, first[0].hash,
        "the new model's chain differs"
    );
    // The old model was dropped once its last stream ended: nothing can resume there now.
    let resume = Resume {
        tokens: first[..3].iter().map(|t| t.id).collect(),
        hash: first[2].hash,
    };
    let mut resumed = long;
    resumed.attempt = 1;
    resumed.resume = Some(resume.clone());
    match h.submit(resumed.clone()) {
        SubmitOutcome::Refused(r) => assert_eq!(r.error.kind, ErrorKind::ChainMismatch),
        other => panic!("expected a chain mismatch, got {other:?}"),
    }
    // While the old model still runs a stream, the same resume lands there.
    let mut h = Harness::new();
    let mut keep = request(9, None, 0);
    keep.params.max_tokens = 100_000;
    assert!(matches!(h.submit(keep), SubmitOutcome::Accepted(_)));
    h.load_model("new.gguf", "sim", false, true)
        .expect("loaded");
    assert!(matches!(h.submit(resumed), SubmitOutcome::Accepted(_)));
    let rest = tokens(&h.drain(1));
    let want: Vec<(u32, u64)> = first[3..].iter().map(|t| (t.id, t.hash)).collect();
    let got: Vec<(u32, u64)> = rest.iter().map(|t| (t.id, t.hash)).collect();
    assert_eq!(got, want);
}

#[test]
fn a_failed_load_keeps_the_model_served() {
    let mut h = Harness::new();
    let err = h
        .load_model("bad.gguf", "sim2", false, false)
        .expect_err("refused");
    assert_eq!(err.kind, ErrorKind::InvalidRequest);
    assert!(
        err.message.contains("bad.gguf") && err.message.contains("SHA-256"),
        "{}",
        err.message
    );
    assert_eq!(h.served(), ["sim"]);
    assert!(matches!(
        h.submit(request(1, None, 0)),
        SubmitOutcome::Accepted(_)
    ));
    assert_eq!(tokens(&h.drain(1)).len(), 6);
}

#[test]
fn a_second_model_is_added_and_unloaded() {
    let mut h = Harness::new();
    let err = h
        .order(|reply| Command::Unload {
            name: "sim".into(),
            reply,
        })
        .expect_err("the last model stays");
    assert!(err.message.contains("only model"), "{}", err.message);
    h.load_model("two.gguf", "two", true, true).expect("added");
    let mut served = h.served();
    served.sort();
    assert_eq!(served, ["sim", "two"]);
    let err = h
        .load_model("two.gguf", "two", true, true)
        .expect_err("already there");
    assert!(err.message.contains("already serves"), "{}", err.message);
    let mut on_two = request(2, None, 0);
    on_two.model = "two".into();
    assert!(matches!(h.submit(on_two), SubmitOutcome::Accepted(_)));
    assert_eq!(tokens(&h.drain(2)).len(), 6);
    let change = h
        .order(|reply| Command::Unload {
            name: "sim".into(),
            reply,
        })
        .expect("unloaded");
    let names: Vec<&str> = change.serving.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["two"]);
    let err = h
        .order(|reply| Command::Unload {
            name: "nothing".into(),
            reply,
        })
        .expect_err("unknown");
    assert_eq!(err.kind, ErrorKind::UnknownModel);
    assert!(matches!(
        h.submit(request(3, None, 0)),
        SubmitOutcome::Refused(_)
    ));
}

#[test]
fn a_load_that_panics_is_refused_and_a_drain_answers_a_load_under_way() {
    let h = Harness::new();
    let err = h
        .order(|reply| Command::Load {
            spec: LoadSpec {
                path: "boom.gguf".into(),
                name: "sim".into(),
            },
            check: Box::new(|| panic!("the check broke")),
            add: false,
            reply,
        })
        .expect_err("a panic is a refusal");
    assert!(err.message.contains("the check broke"), "{}", err.message);
    assert_eq!(h.served(), ["sim"]);
    // A slow load, then a drain: the load is answered at once, not when it ends.
    let (reply, rx) = tokio::sync::oneshot::channel();
    h.commands
        .send(Command::Load {
            spec: LoadSpec {
                path: "slow.gguf".into(),
                name: "sim".into(),
            },
            check: Box::new(|| {
                std::thread::sleep(Duration::from_secs(5));
                Ok(())
            }),
            add: false,
            reply,
        })
        .expect("engine thread");
    std::thread::sleep(Duration::from_millis(50));
    let began = std::time::Instant::now();
    h.commands.send(Command::Drain).expect("engine thread");
    let err = rx
        .blocking_recv()
        .expect("an answer")
        .expect_err("draining");
    assert_eq!(err.kind, ErrorKind::Draining);
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn a_replacing_load_takes_the_place_of_its_name_only() {
    let h = Harness::new();
    h.load_model("two.gguf", "two", true, true).expect("added");
    let change = h
        .load_model("two-b.gguf", "two", false, true)
        .expect("replaced");
    let mut names: Vec<&str> = change.serving.iter().map(|m| m.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["sim", "two"], "the other model stays");
    let err = h
        .load_model("three.gguf", "three", false, true)
        .expect_err("which one?");
    assert!(
        err.message.contains("name the model to replace"),
        "{}",
        err.message
    );
    // Tokenizing for a model not served says what is.
    let (reply, rx) = tokio::sync::oneshot::channel();
    h.commands
        .send(Command::Tokenize {
            request: TokenizeRequest {
                model: "nothing".into(),
                input: baton_common::protocol::TokenizeInput::Ids(vec![1]),
            },
            reply,
        })
        .expect("engine thread");
    match rx.blocking_recv().expect("an answer") {
        TokenizeReply::Failed(e) => {
            assert_eq!(e.kind, ErrorKind::UnknownModel);
            assert!(e.message.contains("\"two\""), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
}
