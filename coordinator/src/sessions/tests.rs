//! The table, event by event, with a fake clock: no actor, no NATS. Each test feeds the
//! events a scenario has (a new stream, worker messages, dispatch outcomes, ticks,
//! probes, clients coming and going) and checks the effects and what clients receive.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use baton_common::config::CheckpointMode;
use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{
    ErrorKind, EventKind, FinishReason, Finished, GenParams, PromptSpec, SeqRequest, StreamEvent,
    TokenBatch, TokenEvent, WireError,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::oneshot;

use super::failover::abandoned;
use super::messages::{Attach, AttachError, StartStream};
use super::session::{Held, Phase, Session, Update};
use super::table::{Dispatch, Effect, SessionSettings, SessionTable};
use crate::auth::{KeyId, StreamAccess};
use crate::dispatch::{Bound, DispatchError};
use crate::metrics::Metrics;
use crate::nats::Probe;
use crate::store::{Endpoint, Store, StreamRecord};

const W1: WorkerId = WorkerId(1);
const W2: WorkerId = WorkerId(2);
const S1: StreamId = StreamId(11);
const S2: StreamId = StreamId(12);

fn settings() -> SessionSettings {
    SessionSettings {
        checkpoint: CheckpointMode::Off,
        reconnect_window: Duration::from_secs(600),
        stall_probe: Duration::from_millis(200),
        stall_timeout: Duration::from_secs(30),
        resume_deadline: Duration::from_secs(30),
        max_resumes: 3,
        max_batch: 1,
        max_wait: Duration::from_millis(5),
        max_streams: 100,
        max_detached: 100,
        max_detached_per_key: 10,
        max_payload: 1 << 20,
    }
}

fn record(stream: StreamId, prompt: &str, max_tokens: u32) -> StreamRecord {
    StreamRecord {
        request: SeqRequest {
            stream,
            model: "m".into(),
            prompt: PromptSpec::Text(prompt.into()),
            params: GenParams::greedy(max_tokens),
            attempt: 0,
            resume: None,
            max_prompt_tokens: 0,
        },
        endpoint: Endpoint::Completion,
        include_usage: false,
        created: 0,
        attempt: 0,
        worker: None,
        end: None,
        ended_at: 0,
        owner: None,
        prompt: None,
        choice: 0,
    }
}

fn token(index: u32) -> EventKind {
    EventKind::Token(TokenEvent {
        index,
        id: 100 + index,
        hash: 1000 + u64::from(index),
        text: format!("t{index}"),
        logprobs: None,
        tool_calls: Vec::new(),
    })
}

fn finished(tokens: u32) -> EventKind {
    EventKind::Finished(Finished {
        reason: FinishReason::Length,
        prompt_tokens: 3,
        completion_tokens: tokens,
        cached_tokens: 0,
    })
}

fn failed(kind: ErrorKind) -> EventKind {
    EventKind::Failed(WireError {
        kind,
        message: "worker says no".into(),
    })
}

/// A client's view of a stream.
struct Client {
    rx: UnboundedReceiver<Update>,
    accepted: oneshot::Receiver<Result<u32, DispatchError>>,
}

impl Client {
    /// Every update received so far.
    fn updates(&mut self) -> Vec<Update> {
        let mut out = Vec::new();
        while let Ok(u) = self.rx.try_recv() {
            out.push(u);
        }
        out
    }

    /// The texts of the tokens received so far (anything else is left out).
    fn texts(&mut self) -> Vec<String> {
        self.updates()
            .into_iter()
            .filter_map(|u| match u {
                Update::Token { text, .. } => Some(text),
                _ => None,
            })
            .collect()
    }
}

/// The table and a fake clock.
struct Harness {
    table: SessionTable,
    now: Instant,
    /// The store's directory, when there is one.
    _dir: Option<tempfile::TempDir>,
}

impl Harness {
    fn new() -> Self {
        Self::with(settings())
    }

    fn with(settings: SessionSettings) -> Self {
        Self {
            table: SessionTable::new(settings, None, Metrics::new()),
            now: Instant::now(),
            _dir: None,
        }
    }

    /// With a checkpoint store in `mode`.
    fn stored(mode: CheckpointMode) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), 1 << 20).expect("store");
        let mut s = settings();
        s.checkpoint = mode;
        Self {
            table: SessionTable::new(s, Some(store), Metrics::new()),
            now: Instant::now(),
            _dir: Some(dir),
        }
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
    }

    /// A new stream; its effects.
    fn start(&mut self, record: StreamRecord) -> (Client, Vec<Effect>) {
        let (tx, rx) = unbounded_channel();
        let stream = record.request.stream;
        let (accepted, effects) = self.table.start(
            StartStream {
                stream,
                record,
                subscriber: tx,
            },
            self.now,
        );
        (Client { rx, accepted }, effects)
    }

    /// A new stream taken by `worker`; its client.
    fn running(&mut self, stream: StreamId, worker: WorkerId) -> Client {
        let (mut client, effects) = self.start(record(stream, "hi", 8));
        let d = dispatch(effects);
        self.bind(d, worker);
        assert!(matches!(client.accepted.try_recv(), Ok(Ok(3))));
        client
    }

    /// `d` is taken by `worker`; the effects.
    fn bind(&mut self, d: Box<Dispatch>, worker: WorkerId) -> Vec<Effect> {
        let bound = Bound {
            worker,
            prompt_tokens: 3,
        };
        self.table
            .dispatched(d.stream, d.attempt, Ok(bound), d.reply, self.now)
    }

    /// A worker message with `events` for `stream` (at `attempt`).
    fn events(
        &mut self,
        worker: WorkerId,
        stream: StreamId,
        attempt: u32,
        events: Vec<EventKind>,
    ) -> Vec<Effect> {
        let batch = TokenBatch {
            worker,
            events: events
                .into_iter()
                .map(|kind| StreamEvent {
                    stream,
                    attempt,
                    kind,
                })
                .collect(),
        };
        self.table.tokens(vec![batch], self.now)
    }

    fn phase(&self, stream: StreamId) -> Option<Phase> {
        self.table.sessions.get(&stream).map(|s| s.phase)
    }

    fn attach(
        &mut self,
        stream: StreamId,
        after: Option<u32>,
        after_hash: Option<u64>,
        access: StreamAccess,
    ) -> (Result<Client, AttachError>, Vec<Effect>) {
        let (tx, rx) = unbounded_channel();
        let (attached, effects) = self.table.attach(
            Attach {
                stream,
                after,
                after_hash,
                subscriber: tx,
                access,
            },
            self.now,
        );
        let client = attached.map(|_| Client {
            rx,
            accepted: oneshot::channel().1,
        });
        (client, effects)
    }
}

/// The one dispatch among `effects`.
fn dispatch(effects: Vec<Effect>) -> Box<Dispatch> {
    let mut found: Vec<Box<Dispatch>> = effects
        .into_iter()
        .filter_map(|e| match e {
            Effect::Dispatch(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(found.len(), 1, "one dispatch");
    found.remove(0)
}

fn dispatches(effects: &[Effect]) -> Vec<StreamId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(d) => Some(d.stream),
            _ => None,
        })
        .collect()
}

fn cancels(effects: &[Effect]) -> Vec<(WorkerId, StreamId, u32)> {
    effects
        .iter()
        .flat_map(|e| match e {
            Effect::Cancel { worker, streams } => {
                streams.iter().map(|(s, a)| (*worker, *s, *a)).collect()
            }
            _ => Vec::new(),
        })
        .collect()
}

fn released(effects: &[Effect]) -> Vec<WorkerId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Release(w) => Some(*w),
            _ => None,
        })
        .collect()
}

#[test]
fn a_new_stream_gets_one_round_and_its_client_learns_the_worker_took_it() {
    let mut h = Harness::new();
    let (mut client, effects) = h.start(record(S1, "hi", 8));
    let d = dispatch(effects);
    assert_eq!((d.stream, d.attempt), (S1, 0));
    assert!(d.deadline.is_none(), "a new stream gets one round");
    assert!(d.request.resume.is_none());
    assert_eq!(h.phase(S1), Some(Phase::Dispatching));
    h.bind(d, W1);
    assert!(matches!(client.accepted.try_recv(), Ok(Ok(3))));
    assert_eq!(h.phase(S1), Some(Phase::Running(W1)));
}

#[test]
fn a_stream_no_worker_takes_is_refused_and_forgotten() {
    let mut h = Harness::new();
    let (mut client, effects) = h.start(record(S1, "hi", 8));
    let d = dispatch(effects);
    let refusal = DispatchError::Refused(WireError {
        kind: ErrorKind::PromptTooLong,
        message: "long".into(),
    });
    h.table
        .dispatched(d.stream, d.attempt, Err(refusal), d.reply, h.now);
    assert!(matches!(
        client.accepted.try_recv(),
        Ok(Err(DispatchError::Refused(_)))
    ));
    assert!(h.table.is_empty());
}

#[test]
fn tokens_reach_the_client_in_order_and_the_end_ends_the_stream() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0), token(1)]);
    assert_eq!(client.texts(), ["t0", "t1"]);
    let effects = h.events(W1, S1, 0, vec![token(2), finished(3)]);
    let updates = client.updates();
    assert!(matches!(&updates[0], Update::Token { index: 2, .. }));
    assert!(matches!(&updates[1], Update::Finished(f) if f.completion_tokens == 3));
    assert!(h.table.is_empty(), "an ended stream leaves memory");
    assert_eq!(released(&effects), [W1]);
}

#[test]
fn duplicate_and_out_of_order_tokens_are_dropped() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0), token(1), token(0), token(1)]);
    assert_eq!(client.texts(), ["t0", "t1"]);
    h.events(W1, S1, 0, vec![token(1), token(2)]);
    assert_eq!(client.texts(), ["t2"]);
    assert_eq!(h.table.sessions[&S1].tokens.len(), 3);
}

#[test]
fn a_skipped_position_resumes_the_stream_from_its_last_token() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0), token(1)]);
    // Token 2 was lost: 3 arrives.
    let effects = h.events(W1, S1, 0, vec![token(3)]);
    assert_eq!(cancels(&effects), [(W1, S1, 0)], "the old attempt stops");
    assert_eq!(released(&effects), [W1]);
    let d = dispatch(effects);
    assert_eq!(d.attempt, 1);
    assert!(d.deadline.is_some(), "a resumed stream waits for a worker");
    let resume = d.request.resume.clone().expect("a resume");
    assert_eq!(resume.tokens, [100, 101]);
    assert_eq!(resume.hash, 1001);
    assert_eq!(client.texts(), ["t0", "t1"], "nothing after the gap");
    // The new attempt goes on from position 2.
    h.bind(d, W2);
    h.events(W2, S1, 1, vec![token(2), token(3)]);
    assert_eq!(client.texts(), ["t2", "t3"]);
}

#[test]
fn events_of_an_old_attempt_are_dropped_and_cancelled() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0)]);
    let d = dispatch(h.events(W1, S1, 0, vec![failed(ErrorKind::Internal)]));
    h.bind(d, W2);
    // The first worker was still sending.
    let effects = h.events(W1, S1, 0, vec![token(1)]);
    assert_eq!(cancels(&effects), [(W1, S1, 0)]);
    assert_eq!(client.texts(), ["t0"]);
    assert_eq!(h.phase(S1), Some(Phase::Running(W2)));
}

#[test]
fn a_worker_that_fails_a_stream_is_avoided() {
    let mut h = Harness::new();
    let _client = h.running(S1, W1);
    let d = dispatch(h.events(W1, S1, 0, vec![failed(ErrorKind::Internal)]));
    assert_eq!(d.exclude, [W1]);
    assert_eq!(d.attempt, 1);
    assert_eq!(h.table.sessions[&S1].resumes, 1);
}

#[test]
fn a_failure_that_is_the_requests_own_ends_the_stream() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    let effects = h.events(W1, S1, 0, vec![failed(ErrorKind::InvalidRequest)]);
    assert!(dispatches(&effects).is_empty(), "not moved elsewhere");
    assert!(
        matches!(client.updates()[..], [Update::Failed(ref e)] if e.kind == ErrorKind::InvalidRequest)
    );
    assert!(h.table.is_empty());
}

#[test]
fn a_draining_workers_hand_over_does_not_count_against_the_limit() {
    let mut s = settings();
    s.max_resumes = 1;
    let mut h = Harness::with(s);
    let mut client = h.running(S1, W1);
    for (from, to) in [(W1, W2), (W2, W1), (W1, W2)] {
        let attempt = h.table.sessions[&S1].attempt();
        let d = dispatch(h.events(from, S1, attempt, vec![failed(ErrorKind::Draining)]));
        assert_eq!(d.exclude, [from]);
        h.bind(d, to);
    }
    assert_eq!(h.table.sessions[&S1].resumes, 0);
    assert!(client.updates().is_empty(), "the client sees nothing");
}

#[test]
fn the_resume_limit_fails_the_stream() {
    let mut s = settings();
    s.max_resumes = 2;
    let mut h = Harness::with(s);
    let mut client = h.running(S1, W1);
    for _ in 0..2 {
        let attempt = h.table.sessions[&S1].attempt();
        let d = dispatch(h.events(W1, S1, attempt, vec![failed(ErrorKind::Internal)]));
        h.bind(d, W1);
    }
    let effects = h.events(W1, S1, 2, vec![failed(ErrorKind::Internal)]);
    assert!(dispatches(&effects).is_empty());
    match &client.updates()[..] {
        [Update::Failed(e)] => {
            assert_eq!(e.kind, ErrorKind::Internal);
            assert!(e.message.contains("resumed 2 times"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(h.table.is_empty());
}

#[test]
fn a_resumed_stream_no_worker_takes_in_time_fails() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    let d = dispatch(h.events(W1, S1, 0, vec![failed(ErrorKind::Internal)]));
    let none = DispatchError::Route(crate::actors::router::RouteError::NoLiveWorkers);
    h.table
        .dispatched(d.stream, d.attempt, Err(none), d.reply, h.now);
    match &client.updates()[..] {
        [Update::Failed(e)] => assert!(e.message.contains("could continue"), "{}", e.message),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_worker_whose_heartbeats_stop_has_its_streams_moved() {
    let mut h = Harness::new();
    let _a = h.running(S1, W1);
    let _b = h.running(S2, W2);
    let effects = h.table.worker_left(W1, h.now);
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::ForgetSequences(w) if *w == W1)));
    assert_eq!(dispatches(&effects), [S1], "only the lost worker's stream");
    assert_eq!(h.phase(S2), Some(Phase::Running(W2)));
}

#[test]
fn a_silent_stream_gets_its_worker_probed_then_moves_when_stalled() {
    let mut h = Harness::new();
    let _client = h.running(S1, W1);
    h.advance(Duration::from_millis(100));
    assert!(h.table.tick(h.now).is_empty(), "not yet");
    h.advance(Duration::from_millis(150));
    let effects = h.table.tick(h.now);
    assert!(
        matches!(&effects[..], [Effect::Probe { worker, streams, .. }] if *worker == W1 && streams == &[(S1, 0)])
    );
    // One probe at a time per worker.
    assert!(h.table.tick(h.now).is_empty());
    // The worker answers and holds the stream: it stays until the stall timeout.
    h.table.probed(W1, Probe::Alive(Vec::new()), h.now);
    h.advance(Duration::from_secs(30));
    let d = dispatch(h.table.tick(h.now));
    assert_eq!(d.exclude, [W1]);
}

#[test]
fn a_probe_that_finds_nobody_forgets_the_worker() {
    let mut h = Harness::new();
    let _client = h.running(S1, W1);
    h.advance(Duration::from_millis(250));
    h.table.tick(h.now);
    let effects = h.table.probed(W1, Probe::Gone, h.now);
    assert!(effects
        .iter()
        .any(|e| matches!(e, Effect::Forget(w) if *w == W1)));
    assert_eq!(dispatch(effects).exclude, [W1]);
}

#[test]
fn a_probe_that_finds_the_stream_missing_resumes_it() {
    let mut h = Harness::new();
    let _a = h.running(S1, W1);
    let _b = h.running(S2, W1);
    h.advance(Duration::from_millis(250));
    h.table.tick(h.now);
    let effects = h.table.probed(W1, Probe::Alive(vec![(S2, 0)]), h.now);
    assert_eq!(dispatches(&effects), [S2]);
    assert_eq!(h.phase(S1), Some(Phase::Running(W1)));
}

#[test]
fn a_long_prompts_progress_is_not_a_stall() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    for chunk in 1..=10 {
        h.advance(Duration::from_secs(20));
        h.events(W1, S1, 0, vec![EventKind::Progress(chunk * 256)]);
        let effects = h.table.tick(h.now);
        assert!(dispatches(&effects).is_empty(), "moved after chunk {chunk}");
    }
    // Clients are told (their idle timers start again), with nothing to show.
    assert!(client
        .updates()
        .iter()
        .all(|u| matches!(u, Update::Progress)));
    h.advance(Duration::from_secs(31));
    assert_eq!(
        dispatches(&h.table.tick(h.now)),
        [S1],
        "silence is still a stall"
    );
}

#[test]
fn the_stall_window_grows_with_the_prompt_before_the_first_token() {
    let mut h = Harness::new();
    let (_client, effects) = h.start(record(S1, "long", 8));
    let d = dispatch(effects);
    h.table.dispatched(
        d.stream,
        d.attempt,
        Ok(Bound {
            worker: W1,
            prompt_tokens: 4096,
        }),
        d.reply,
        h.now,
    );
    // 4,096 prompt tokens: five windows of 30 s.
    h.advance(Duration::from_secs(149));
    assert!(dispatches(&h.table.tick(h.now)).is_empty());
    h.advance(Duration::from_secs(2));
    assert_eq!(dispatches(&h.table.tick(h.now)), [S1]);
}

#[test]
fn a_stream_that_ends_short_resumes() {
    let mut h = Harness::new();
    let mut client = h.running(S1, W1);
    let effects = h.events(W1, S1, 0, vec![token(0), finished(2)]);
    assert_eq!(dispatches(&effects), [S1]);
    assert_eq!(client.texts(), ["t0"]);
    let cancelled = EventKind::Finished(Finished {
        reason: FinishReason::Cancelled,
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_tokens: 0,
    });
    let d = dispatch(effects);
    h.bind(d, W2);
    assert_eq!(dispatches(&h.events(W2, S1, 1, vec![cancelled])), [S1]);
}

#[test]
fn a_client_that_leaves_stops_the_worker_and_the_stream_waits_for_it() {
    let mut h = Harness::new();
    let client = h.running(S1, W1);
    drop(client);
    let effects = h.table.detach(S1, h.now);
    assert_eq!(cancels(&effects), [(W1, S1, 0)]);
    assert_eq!(released(&effects), [W1]);
    assert!(matches!(h.phase(S1), Some(Phase::Detached { .. })));
}

#[test]
fn a_stream_nobody_comes_back_to_is_forgotten_after_the_window() {
    let mut h = Harness::new();
    drop(h.running(S1, W1));
    h.table.detach(S1, h.now);
    h.advance(Duration::from_secs(599));
    h.table.tick(h.now);
    assert_eq!(h.table.len(), 1);
    h.advance(Duration::from_secs(1));
    h.table.tick(h.now);
    assert!(h.table.is_empty());
}

#[test]
fn a_client_back_with_last_event_id_gets_the_rest_and_the_stream_resumes() {
    let mut h = Harness::new();
    let client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0), token(1), token(2)]);
    drop(client);
    h.table.detach(S1, h.now);
    let (back, effects) = h.attach(S1, Some(0), Some(1000), StreamAccess::Any);
    let mut back = back.expect("attached");
    assert_eq!(back.texts(), ["t1", "t2"], "what came after its position");
    let d = dispatch(effects);
    assert_eq!(d.attempt, 1);
    assert_eq!(
        d.request.resume.as_ref().expect("resume").tokens,
        [100, 101, 102]
    );
    assert_eq!(h.table.sessions[&S1].resumes, 0, "not a failure");
    h.bind(d, W2);
    h.events(W2, S1, 1, vec![token(3)]);
    assert_eq!(back.texts(), ["t3"]);
}

#[test]
fn a_client_holding_another_text_or_another_keys_stream_is_refused() {
    let mut h = Harness::new();
    let (_client, effects) = h.start(StreamRecord {
        owner: Some(KeyId([7; 32])),
        ..record(S1, "hi", 8)
    });
    h.bind(dispatch(effects), W1);
    h.events(W1, S1, 0, vec![token(0), token(1)]);
    let (r, _) = h.attach(S1, Some(1), Some(999), StreamAccess::Any);
    assert!(matches!(r, Err(AttachError::Diverged(s, 1)) if s == S1));
    let (r, _) = h.attach(S1, None, None, StreamAccess::Owner(KeyId([8; 32])));
    assert!(matches!(r, Err(AttachError::Unknown(_))));
    let (r, _) = h.attach(S1, None, None, StreamAccess::Owner(KeyId([7; 32])));
    assert!(r.is_ok());
}

#[test]
fn events_of_an_unknown_stream_are_cancelled() {
    let mut h = Harness::new();
    let effects = h.events(W1, S2, 4, vec![token(0)]);
    assert_eq!(cancels(&effects), [(W1, S2, 4)]);
    // A long prompt still running for a stream that is gone stops too.
    let effects = h.events(W1, S2, 4, vec![EventKind::Progress(512)]);
    assert_eq!(cancels(&effects), [(W1, S2, 4)]);
    // Its end needs no cancel.
    assert!(cancels(&h.events(W1, S2, 4, vec![finished(1)])).is_empty());
}

#[test]
fn only_live_streams_count_against_max_streams() {
    let mut s = settings();
    s.max_streams = 2;
    let mut h = Harness::with(s);
    let _a = h.running(S1, W1);
    drop(h.running(S2, W1));
    h.table.detach(S2, h.now);
    let (_c, effects) = h.start(record(StreamId(13), "hi", 8));
    assert_eq!(
        dispatches(&effects).len(),
        1,
        "the detached stream does not count"
    );
    let (mut refused, effects) = h.start(record(StreamId(14), "hi", 8));
    assert!(effects.is_empty());
    assert!(matches!(
        refused.accepted.try_recv(),
        Ok(Err(DispatchError::Refused(ref e))) if e.kind == ErrorKind::Overloaded
    ));
}

#[test]
fn a_request_that_cannot_fit_one_message_is_refused_up_front() {
    let mut s = settings();
    s.max_payload = 4096;
    let mut h = Harness::with(s);
    let (mut c, effects) = h.start(record(S1, &"x".repeat(5000), 8));
    assert!(effects.is_empty());
    assert!(matches!(
        c.accepted.try_recv(),
        Ok(Err(DispatchError::TooLarge { .. }))
    ));
    // Room for the tokens a resume carries counts too.
    let (mut c, _) = h.start(record(S2, "short", 2000));
    assert!(matches!(
        c.accepted.try_recv(),
        Ok(Err(DispatchError::TooLarge { .. }))
    ));
    assert!(h.table.is_empty());
}

#[test]
fn new_streams_arriving_together_share_a_submit() {
    let mut s = settings();
    s.max_batch = 4;
    let mut h = Harness::with(s);
    let (_a, effects) = h.start(record(S1, "a", 8));
    assert!(matches!(&effects[..], [Effect::SubmitBatch { requests, .. }] if requests.len() == 1));
    // Within the window: the first waits for it, the next join.
    let (_b, effects) = h.start(record(S2, "b", 8));
    assert!(matches!(&effects[..], [Effect::Wake { .. }]));
    let (_c, effects) = h.start(record(StreamId(13), "c", 8));
    assert!(effects.is_empty());
    h.advance(Duration::from_millis(5));
    let effects = h.table.wake("m", h.now);
    match &effects[..] {
        [Effect::SubmitBatch {
            requests, replies, ..
        }] => {
            assert_eq!(requests.len(), 2);
            assert_eq!(replies.len(), 2);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_batch_refused_for_room_is_tried_once_more_elsewhere() {
    let mut s = settings();
    s.max_batch = 4;
    let mut h = Harness::with(s);
    let (mut a, effects) = h.start(record(S1, "a", 8));
    let Some(Effect::SubmitBatch {
        model,
        requests,
        replies,
    }) = effects.into_iter().next()
    else {
        panic!("a submit");
    };
    let full = || {
        DispatchError::Refused(WireError {
            kind: ErrorKind::Overloaded,
            message: "full".into(),
        })
    };
    let results = requests.into_iter().map(|r| (r, Err(full()))).collect();
    let d = dispatch(
        h.table
            .batch_done(&model, Some(W1), results, replies, h.now),
    );
    assert_eq!(d.exclude, [W1]);
    assert!(
        d.fallback.is_some(),
        "without another worker, the refusal is the answer"
    );
    h.bind(d, W2);
    assert!(matches!(a.accepted.try_recv(), Ok(Ok(3))));
}

#[test]
fn sync_checkpoints_reach_the_client_after_the_flush_and_flushes_group() {
    let mut h = Harness::stored(CheckpointMode::Sync);
    let mut client = h.running(S1, W1);
    let effects = h.events(W1, S1, 0, vec![token(0)]);
    assert!(matches!(&effects[..], [Effect::Flush(_)]));
    assert!(client.texts().is_empty(), "not before it is on disk");
    // More arrives during the flush: it waits for the next one.
    let effects = h.events(W1, S1, 0, vec![token(1)]);
    assert!(effects.is_empty(), "one flush at a time");
    let effects = h.table.flushed(Ok(()), h.now);
    assert_eq!(client.texts(), ["t0"]);
    assert!(matches!(&effects[..], [Effect::Flush(_)]));
    h.table.flushed(Ok(()), h.now);
    assert_eq!(client.texts(), ["t1"]);
}

#[test]
fn an_end_waiting_for_a_slow_flush_is_not_probed_or_resumed() {
    let mut h = Harness::stored(CheckpointMode::Sync);
    let mut client = h.running(S1, W1);
    let effects = h.events(W1, S1, 0, vec![token(0), token(1), finished(2)]);
    assert!(matches!(&effects[..], [Effect::Flush(_)]));
    // The flush takes long (JetStream electing a leader); the worker has forgotten
    // the stream it finished. Neither the stall probe nor the worker's loss moves it.
    h.advance(Duration::from_secs(2));
    let effects = h.table.tick(h.now);
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::Probe { .. })),
        "{effects:?}"
    );
    assert!(dispatches(&h.table.worker_left(W1, h.now)).is_empty());
    h.table.flushed(Ok(()), h.now);
    let updates = client.updates();
    assert_eq!(updates.len(), 3, "{updates:?}");
    assert!(matches!(updates.last(), Some(Update::Finished(_))));
}

#[test]
fn async_checkpoints_hold_a_new_streams_tokens_until_its_record_is_on_disk() {
    let mut h = Harness::stored(CheckpointMode::Async);
    let (mut client, effects) = h.start(record(S1, "hi", 8));
    let effects = h.bind(dispatch(effects), W1);
    assert!(matches!(&effects[..], [Effect::Flush(_)]), "{effects:?}");
    h.events(W1, S1, 0, vec![token(0)]);
    assert!(client.texts().is_empty());
    h.table.flushed(Ok(()), h.now);
    assert_eq!(client.texts(), ["t0"]);
    // From then on, tokens go at once.
    h.events(W1, S1, 0, vec![token(1)]);
    assert_eq!(client.texts(), ["t1"]);
}

#[test]
fn a_restarted_coordinator_runs_its_unfinished_streams_again() {
    let mut h = Harness::stored(CheckpointMode::Sync);
    let _client = h.running(S1, W1);
    h.events(W1, S1, 0, vec![token(0), token(1)]);
    h.table.flushed(Ok(()), h.now);
    // A new table on the same store: the coordinator restarted.
    let store = h.table.store.clone().expect("a store");
    let mut table = SessionTable::new(h.table.settings.clone(), Some(store), Metrics::new());
    assert_eq!(table.recover(), 1);
    let mut effects = table.effects();
    assert_eq!(cancels(&effects), [(W1, S1, 0)], "the old attempt stops");
    effects = table.restart(h.now);
    let d = dispatch(effects);
    assert_eq!(d.attempt, 1);
    assert_eq!(d.request.resume.expect("resume").tokens, [100, 101]);
    assert!(table.sessions[&S1].orphan, "it runs with no client");
    // A client that reconnects gets what it lacks.
    let (tx, mut rx) = unbounded_channel();
    let (attached, _) = table.attach(
        Attach {
            stream: S1,
            after: Some(0),
            after_hash: None,
            subscriber: tx,
            access: StreamAccess::Any,
        },
        h.now,
    );
    assert!(attached.is_ok());
    assert!(matches!(rx.try_recv(), Ok(Update::Token { index: 1, .. })));
}

// One session's fan-out, without the table.

fn session(phase: Phase) -> Session {
    let held = Held {
        id: 7,
        hash: 1,
        text: "a".into(),
        logprobs: None,
        tool_calls: Vec::new(),
    };
    let mut s = Session::new(record(StreamId(1), "hi", 4), vec![held], Instant::now());
    s.phase = phase;
    s
}

#[test]
fn a_client_gets_no_token_twice() {
    let mut s = session(Phase::Running(WorkerId(1)));
    let (fresh, mut fresh_rx) = unbounded_channel();
    let (back, mut back_rx) = unbounded_channel();
    s.subscribe(fresh, 0, None);
    // This client has tokens up to position 2 already.
    s.subscribe(back, 3, None);
    for index in 1..5 {
        s.send(&Update::Token {
            index,
            text: format!("t{index}"),
            hash: 100 + u64::from(index),
            logprobs: None,
            tool_calls: Vec::new(),
        });
    }
    let drain = |rx: &mut UnboundedReceiver<Update>| {
        let mut got = Vec::new();
        while let Ok(Update::Token { index, .. }) = rx.try_recv() {
            got.push(index);
        }
        got
    };
    assert_eq!(drain(&mut fresh_rx), vec![1, 2, 3, 4]);
    assert_eq!(drain(&mut back_rx), vec![3, 4]);
    assert_eq!(s.subscribers.len(), 2);
}

#[test]
fn a_client_holding_another_text_is_told_and_dropped() {
    let mut s = session(Phase::Running(WorkerId(1)));
    let (tx, mut rx) = unbounded_channel();
    // The client holds position 2 with a hash the regenerated stream will not have.
    s.subscribe(tx, 3, Some((2, 999)));
    for index in 1..4 {
        s.send(&Update::Token {
            index,
            text: format!("t{index}"),
            hash: 100 + u64::from(index),
            logprobs: None,
            tool_calls: Vec::new(),
        });
    }
    match rx.try_recv() {
        Ok(Update::Failed(e)) => assert_eq!(e.kind, ErrorKind::ChainMismatch),
        other => panic!("expected a chain mismatch, got {other:?}"),
    }
    assert!(rx.try_recv().is_err(), "nothing after the failure");
    assert!(s.subscribers.is_empty());
}

#[test]
fn streams_left_by_their_clients_are_dropped_after_the_window() {
    let window = Duration::from_secs(600);
    let t0 = Instant::now();
    let sessions: HashMap<StreamId, Session> = [
        (StreamId(1), session(Phase::Detached { since: t0 })),
        (
            StreamId(2),
            session(Phase::Detached {
                since: t0 + Duration::from_secs(300),
            }),
        ),
        (StreamId(3), session(Phase::Running(WorkerId(9)))),
        (StreamId(4), session(Phase::Dispatching)),
    ]
    .into_iter()
    .collect();
    let at = |secs| abandoned(&sessions, t0 + Duration::from_secs(secs), window, 99, 99);
    assert!(at(599).is_empty());
    assert_eq!(at(600), vec![StreamId(1)]);
    let mut late = at(3600);
    late.sort_by_key(|s| s.0);
    assert_eq!(late, vec![StreamId(1), StreamId(2)], "never a live stream");
}

#[test]
fn detached_streams_are_bounded_in_all_and_by_key() {
    let window = Duration::from_secs(600);
    let t0 = Instant::now();
    let (a, b) = (KeyId([1; 32]), KeyId([2; 32]));
    // Stream i left its client at second i: five of key a, three of key b, two
    // without a key; one live stream of key a.
    let owners = [a, a, b, a, b, a, b, a]
        .map(Some)
        .into_iter()
        .chain([None, None]);
    let mut sessions: HashMap<StreamId, Session> = owners
        .enumerate()
        .map(|(i, owner)| {
            let since = t0 + Duration::from_secs(i as u64);
            let mut s = session(Phase::Detached { since });
            s.record.owner = owner;
            (StreamId(i as u128), s)
        })
        .collect();
    let mut live = session(Phase::Running(WorkerId(9)));
    live.record.owner = Some(a);
    sessions.insert(StreamId(99), live);
    let now = t0 + Duration::from_secs(20);
    let sorted = |mut v: Vec<StreamId>| {
        v.sort_by_key(|s| s.0);
        v.into_iter().map(|s| s.0).collect::<Vec<_>>()
    };
    // Two a key: key a keeps its newest two (7, 5), key b its newest two (6, 4).
    assert_eq!(
        sorted(abandoned(&sessions, now, window, 99, 2)),
        [0, 1, 2, 3]
    );
    // Five in all, newest first: 9, 8, 7, 6, 5.
    assert_eq!(
        sorted(abandoned(&sessions, now, window, 5, 99)),
        [0, 1, 2, 3, 4]
    );
    // Both: 9, 8 (no key), 7, 6, 5; 4 is b's second but past five in all.
    assert_eq!(
        sorted(abandoned(&sessions, now, window, 5, 2)),
        [0, 1, 2, 3, 4]
    );
    assert_eq!(
        sorted(abandoned(&sessions, now, window, 6, 2)),
        [0, 1, 2, 3]
    );
}

/// The actor runs the table's effects through its link: with an in-memory link, a new
/// stream is taken, its worker fails it, and it moves to the other worker.
#[actix_rt::test]
async fn the_actor_runs_effects_through_its_link() {
    use super::link::fake::FakeLink;
    use super::Sessions;
    use crate::actors::messages::DispatchTokens;
    use actix::Actor;

    let link = FakeLink::default();
    link.workers.borrow_mut().extend([W1, W2]);
    let table = SessionTable::new(settings(), None, Metrics::new());
    let sessions = Sessions::new(table, std::rc::Rc::new(link.clone())).start();
    let (tx, mut rx) = unbounded_channel();
    let accepted = sessions
        .send(StartStream {
            stream: S1,
            record: record(S1, "hi", 8),
            subscriber: tx,
        })
        .await
        .expect("the actor answers");
    assert_eq!(accepted.await.expect("answered").ok(), Some(3));
    let batch = |worker, attempt, kind| TokenBatch {
        worker,
        events: vec![StreamEvent {
            stream: S1,
            attempt,
            kind,
        }],
    };
    let failed = failed(ErrorKind::Internal);
    let batches = vec![batch(W1, 0, token(0)), batch(W1, 0, failed)];
    sessions
        .send(DispatchTokens { batches })
        .await
        .expect("the actor answers");
    assert!(matches!(
        rx.recv().await,
        Some(Update::Token { index: 0, .. })
    ));
    // Let the resume's dispatch run on the actor.
    for _ in 0..50 {
        if link.calls.borrow().dispatched.len() == 2 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
    let calls = link.calls.borrow();
    assert_eq!(calls.dispatched.len(), 2);
    let (resumed, worker) = &calls.dispatched[1];
    assert_eq!(*worker, Some(W2), "the failing worker is avoided");
    assert_eq!(resumed.attempt, 1);
    assert_eq!(calls.cancelled, [(W1, S1, 0)]);
}
