//! Checkpoints in NATS JetStream, beside the local sled store, so that a stream outlives
//! the host of the coordinator that runs it.
//!
//! What JetStream holds (names from the subject prefix, `baton` below):
//! - key-value bucket `baton_checkpoints`: stream id → owner (the coordinator running
//!   it, 16 bytes big-endian) ‖ [`StreamRecord`] (rkyv, as in sled). The entry's
//!   revision makes a takeover exactly-once: a claim is a compare-and-set on it.
//! - stream `baton_tokens`, subjects `baton.v1.checkpoint.<stream>`: one message per
//!   group commit and stream with its new tokens (kind 0, then per token its position
//!   (u32 LE), the entry's length (u32 LE) and the entry as sled keeps it), and, once
//!   the stream ended, a last message (kind 1, then the record's value) that tells a
//!   reader following the subject that nothing more comes.
//! - key-value bucket `baton_coordinators`: each live coordinator's lease, a key it
//!   rewrites every third of `coordinator.lease_ms`. A coordinator whose lease has not
//!   changed for `lease_ms`, as seen by another, is dead to it: its unfinished streams
//!   are claimed and resumed (see [`Replica::orphans`]).
//!
//! Writes leave in order from one task, as soon as they are made; each is acknowledged
//! by JetStream once a quorum of its replicas holds it. [`Replica::flush`] waits for
//! the acknowledgements of everything written before it, so the `sync` checkpoint
//! mode's flush is "on disk here and on a quorum of NATS servers". A write JetStream
//! did not take (its server died with it in flight) is tried again for up to
//! [`RETRY_FOR`], after whatever was written meanwhile: readers take token messages by
//! position, not by order; a stream's last message is sent only once every write
//! before it is acknowledged; a record is not tried again once a newer one of its
//! stream was written.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, kv, stream};
use baton_common::ids::{CoordinatorId, StreamId};
use baton_common::subjects::Subjects;
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use crate::sessions::Update;
use crate::store::{decode_entry, decode_record, encode_record, StoredToken, StreamRecord};

mod writer;
use writer::write;

/// A token batch message.
const TOKENS: u8 = 0;
/// The message that ends a stream's subject.
const END: u8 = 1;

/// How long a write JetStream did not take is tried again: long enough for a client
/// whose server died to reconnect to another one.
pub const RETRY_FOR: Duration = Duration::from_secs(10);

/// Pauses between tries of something JetStream did not answer, growing from `first`
/// to a second, for [`RETRY_FOR`] in all.
pub struct Backoff {
    started: Instant,
    pause: Duration,
}

impl Backoff {
    pub fn new(first: Duration) -> Self {
        Self {
            started: Instant::now(),
            pause: first,
        }
    }

    /// Waits before the next try; `false` (at once) when the time for tries is over.
    pub async fn wait(&mut self) -> bool {
        if self.started.elapsed() >= RETRY_FOR {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_secs(1));
        true
    }
}

/// Why JetStream cannot hold the checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// Setting up or reading the JetStream stream or buckets failed.
    #[error("JetStream checkpoints: {0}")]
    JetStream(String),
    /// A value does not decode.
    #[error("JetStream checkpoints: damaged value for stream {0}: {1}")]
    Damaged(StreamId, String),
}

fn js_error(what: &str, e: impl std::fmt::Display) -> ReplicaError {
    ReplicaError::JetStream(format!("{what}: {e}"))
}

/// How the checkpoints are kept in JetStream.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaSettings {
    /// Copies of each checkpoint (1 to 3; JetStream acknowledges a write once a
    /// majority holds it).
    pub replicas: usize,
    /// A coordinator whose lease has not changed for this long is dead.
    pub lease: Duration,
    /// How long JetStream keeps a checkpoint nobody removed (its owner died after it
    /// ended): past the reconnect window, nobody reads it again.
    pub max_age: Duration,
}

/// A stream's record as JetStream holds it.
#[derive(Debug, Clone)]
pub struct Found {
    /// The stream.
    pub stream: StreamId,
    /// The coordinator that runs it (or ran it).
    pub owner: CoordinatorId,
    /// Its record.
    pub record: StreamRecord,
    /// The entry's revision (a claim must name it).
    pub revision: u64,
}

/// A stream this coordinator took over: its record and every token JetStream holds.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The stream.
    pub stream: StreamId,
    /// Its record (as the old owner left it).
    pub record: StreamRecord,
    /// Its tokens from position 0 (the longest run without a gap).
    pub tokens: Vec<StoredToken>,
}

/// Token entries of one stream: (position, entry as sled keeps it).
type Entries = Vec<(u32, Vec<u8>)>;

enum Op {
    Record(StreamId, Bytes, bool),
    Tokens(StreamId, Entries),
    Remove(StreamId),
    Flush(oneshot::Sender<Result<(), String>>),
}

/// When each other coordinator's lease last changed, as this one saw it.
struct Liveness {
    /// Per coordinator: its lease's revision, when that last changed, and whether it
    /// was already counted dead.
    seen: HashMap<CoordinatorId, (u64, Instant, bool)>,
    /// A coordinator's lease ran out since [`Replica::take_deaths`] last looked.
    died: bool,
    /// When the leases were first judged (owners never seen are dead only after a
    /// lease has passed since then).
    polled: Option<Instant>,
    /// When the watch over the leases last showed this coordinator's own renewal: the
    /// others are judged only while it is that recent, so that a watch (or a JetStream)
    /// that stalls never makes live coordinators look dead.
    heard: Option<Instant>,
}

impl Liveness {
    /// Whether the watch is known to be current: this coordinator's own lease, renewed
    /// every third of `lease`, showed up within one.
    fn current(&self, lease: Duration) -> bool {
        self.heard.is_some_and(|h| h.elapsed() < lease)
    }
}

struct Inner {
    client: async_nats::Client,
    subjects: Subjects,
    me: CoordinatorId,
    records: kv::Store,
    leases: kv::Store,
    tokens: stream::Stream,
    writer: mpsc::UnboundedSender<Op>,
    live: Mutex<Liveness>,
    settings: ReplicaSettings,
}

/// This coordinator's side of the checkpoints in JetStream (cheap to clone).
#[derive(Clone)]
pub struct Replica {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("replicas", &self.inner.settings.replicas)
            .finish()
    }
}

fn key(stream: StreamId) -> String {
    stream.to_string()
}

fn record_value(owner: CoordinatorId, record: &StreamRecord) -> Bytes {
    let mut value = owner.0.to_be_bytes().to_vec();
    value.extend_from_slice(&encode_record(record));
    value.into()
}

fn decode_value(
    stream: StreamId,
    value: &[u8],
) -> Result<(CoordinatorId, StreamRecord), ReplicaError> {
    let damaged = |e: String| ReplicaError::Damaged(stream, e);
    let owner: [u8; 16] = value
        .get(..16)
        .and_then(|o| o.try_into().ok())
        .ok_or_else(|| damaged("shorter than an owner".into()))?;
    let record = decode_record(&value[16..]).map_err(|e| damaged(e.to_string()))?;
    Ok((CoordinatorId(u128::from_be_bytes(owner)), record))
}

/// What one message of a stream's subject holds.
enum Message {
    Tokens(Vec<StoredToken>),
    End(Box<StreamRecord>),
}

fn decode_message(stream: StreamId, payload: &[u8]) -> Result<Message, ReplicaError> {
    let damaged = |e: &str| ReplicaError::Damaged(stream, e.to_string());
    match payload.split_first() {
        Some((&TOKENS, mut rest)) => {
            let mut tokens = Vec::new();
            while !rest.is_empty() {
                let head = rest.get(..8).ok_or_else(|| damaged("short token header"))?;
                let index = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
                let len = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
                let entry = rest
                    .get(8..8 + len)
                    .ok_or_else(|| damaged("short token entry"))?;
                tokens.push(decode_entry(index, entry).map_err(|e| damaged(&e.to_string()))?);
                rest = &rest[8 + len..];
            }
            Ok(Message::Tokens(tokens))
        }
        Some((&END, value)) => Ok(Message::End(Box::new(decode_value(stream, value)?.1))),
        _ => Err(damaged("unknown message kind")),
    }
}

impl Replica {
    /// Sets up (or finds) the JetStream stream and buckets, starts the writer and the
    /// lease. Fails when the server has no JetStream or refuses the set-up.
    pub async fn open(
        client: async_nats::Client,
        subjects: Subjects,
        me: CoordinatorId,
        settings: ReplicaSettings,
    ) -> Result<Replica, ReplicaError> {
        let js = jetstream::new(client.clone());
        let replicas = settings.replicas.clamp(1, 3);
        let records_bucket = subjects.jetstream_name("checkpoints");
        let records = bucket(
            &js,
            &records_bucket,
            "Baton: each stream's record and owner",
            settings.max_age,
            replicas,
        )
        .await?;
        // A dead coordinator's lease goes after a while; its streams are claimed long
        // before.
        let leases = bucket(
            &js,
            &subjects.jetstream_name("coordinators"),
            "Baton: the coordinators' leases",
            Duration::from_secs(3600),
            replicas,
        )
        .await?;
        let tokens = js
            .get_or_create_stream(stream::Config {
                name: subjects.jetstream_name("tokens"),
                description: Some("Baton: each stream's tokens".into()),
                subjects: vec![subjects.all_checkpoints()],
                max_age: settings.max_age,
                num_replicas: replicas,
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| js_error("creating the tokens stream", e))?;
        let (writer, ops) = mpsc::unbounded_channel();
        let replica = Replica {
            inner: Arc::new(Inner {
                client,
                subjects: subjects.clone(),
                me,
                records: records.clone(),
                leases,
                tokens: tokens.clone(),
                writer,
                live: Mutex::new(Liveness {
                    seen: HashMap::new(),
                    died: false,
                    polled: None,
                    heard: None,
                }),
                settings: ReplicaSettings {
                    replicas,
                    ..settings
                },
            }),
        };
        tokio::spawn(write(js, subjects, records_bucket, records, tokens, ops));
        replica.renew().await?;
        let lease = replica.clone();
        tokio::spawn(async move { lease.keep_lease().await });
        let watcher = replica.clone();
        tokio::spawn(async move { watcher.watch_leases().await });
        info!(
            replicas,
            lease_ms = settings.lease.as_millis() as u64,
            "checkpoints go to JetStream too"
        );
        Ok(replica)
    }

    /// Copies per checkpoint.
    pub fn replicas(&self) -> usize {
        self.inner.settings.replicas
    }

    /// This coordinator.
    pub fn me(&self) -> CoordinatorId {
        self.inner.me
    }

    /// Writes (or replaces) a stream's record, owned by this coordinator.
    pub fn put_record(&self, stream: StreamId, record: &StreamRecord) {
        let value = record_value(self.inner.me, record);
        let _ = self
            .inner
            .writer
            .send(Op::Record(stream, value, record.end.is_some()));
    }

    /// Appends tokens: (stream, position, entry as sled keeps it).
    pub fn append(&self, tokens: Vec<(StreamId, u32, Vec<u8>)>) {
        if tokens.is_empty() {
            return;
        }
        // Grouped by stream here: one message per stream and write.
        let mut by_stream: Vec<(StreamId, Entries)> = Vec::new();
        for (stream, index, entry) in tokens {
            match by_stream.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, v)) => v.push((index, entry)),
                None => by_stream.push((stream, vec![(index, entry)])),
            }
        }
        for (stream, entries) in by_stream {
            let _ = self.inner.writer.send(Op::Tokens(stream, entries));
        }
    }

    /// Removes a stream's record and tokens.
    pub fn remove(&self, stream: StreamId) {
        let _ = self.inner.writer.send(Op::Remove(stream));
    }

    /// Waits until JetStream acknowledged everything written before.
    pub async fn flush(&self) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        if self.inner.writer.send(Op::Flush(tx)).is_err() {
            return Err("the JetStream writer stopped".into());
        }
        rx.await
            .map_err(|_| "the JetStream writer stopped".to_string())?
    }

    /// How long a lease lasts.
    pub fn lease(&self) -> Duration {
        self.inner.settings.lease
    }

    /// Whether a lease has passed since the first poll of the leases (before, owners
    /// never seen are not known to be dead).
    pub fn settled(&self) -> bool {
        let live = self.inner.live.lock().expect("liveness lock");
        live.polled
            .is_some_and(|p| p.elapsed() >= self.inner.settings.lease)
    }

    /// Whether a coordinator's lease ran out since the last call.
    pub fn take_deaths(&self) -> bool {
        std::mem::take(&mut self.inner.live.lock().expect("liveness lock").died)
    }

    /// Whether `owner` is alive, as far as this coordinator can tell (itself always).
    pub fn alive(&self, owner: CoordinatorId) -> bool {
        if owner == self.inner.me {
            return true;
        }
        let lease = self.inner.settings.lease;
        let live = self.inner.live.lock().expect("liveness lock");
        if !live.current(lease) {
            return true;
        }
        match (live.seen.get(&owner), live.polled) {
            (Some((_, changed, _)), _) => changed.elapsed() < lease,
            // Never seen: alive until a lease has passed since the first poll.
            (None, Some(polled)) => polled.elapsed() < lease,
            (None, None) => true,
        }
    }

    /// A stream's record, when JetStream holds it.
    pub async fn lookup(&self, stream: StreamId) -> Result<Option<Found>, ReplicaError> {
        let entry = self
            .inner
            .records
            .entry(key(stream))
            .await
            .map_err(|e| js_error("reading a record", e))?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let (owner, record) = decode_value(stream, &entry.value)?;
        Ok(Some(Found {
            stream,
            owner,
            record,
            revision: entry.revision,
        }))
    }

    /// Takes `found` over: writes this coordinator as its owner, if nobody changed the
    /// record since it was read (else `None`: another coordinator was first), and
    /// reads its tokens.
    pub async fn claim(&self, found: Found) -> Result<Option<Claimed>, ReplicaError> {
        let value = record_value(self.inner.me, &found.record);
        match self
            .inner
            .records
            .update(key(found.stream), value, found.revision)
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => return Ok(None),
            Err(e) => return Err(js_error("claiming a stream", e)),
        }
        // The stream is this coordinator's now: its tokens must be read, however long
        // JetStream takes to answer.
        let mut backoff = Backoff::new(Duration::from_millis(100));
        let tokens = loop {
            match self.tokens(found.stream).await {
                Ok((tokens, _)) => break in_order(tokens),
                Err(e) => {
                    debug!(stream = %found.stream, error = %e, "reading a claimed stream's tokens; trying again");
                    if !backoff.wait().await {
                        return Err(e);
                    }
                }
            }
        };
        info!(stream = %found.stream, from = %found.owner, tokens = tokens.len(), "took over a stream of a dead coordinator");
        Ok(Some(Claimed {
            stream: found.stream,
            record: found.record,
            tokens,
        }))
    }

    /// A consumer over `stream`'s subject from its first message, and how many
    /// messages it holds now.
    async fn reader(
        &self,
        stream: StreamId,
    ) -> Result<(consumer::push::Ordered, u64), ReplicaError> {
        let consumer = self
            .inner
            .tokens
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.inner.client.new_inbox(),
                filter_subject: self.inner.subjects.checkpoint(stream),
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| js_error("reading a stream's tokens", e))?;
        let pending = consumer.cached_info().num_pending;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| js_error("reading a stream's tokens", e))?;
        Ok((messages, pending))
    }

    /// Every token JetStream holds for `stream` now, in order of writing, and its end
    /// when it has one.
    async fn tokens(
        &self,
        stream: StreamId,
    ) -> Result<(Vec<StoredToken>, Option<StreamRecord>), ReplicaError> {
        let (mut messages, pending) = self.reader(stream).await?;
        let mut tokens = Vec::new();
        let mut end = None;
        if pending == 0 {
            return Ok((tokens, end));
        }
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| js_error("reading a stream's tokens", e))?;
            match decode_message(stream, &message.payload)? {
                Message::Tokens(t) => tokens.extend(t),
                Message::End(record) => end = Some(*record),
            }
            let left = message
                .info()
                .map_err(|e| js_error("reading a stream's tokens", e))?
                .pending;
            if left == 0 {
                break;
            }
        }
        Ok((tokens, end))
    }

    /// Sends `found`'s stream to `tx` from JetStream: the tokens after `after` (whose
    /// chain hash, when given, must be `after_hash`), then, as its owner writes them,
    /// the rest until its end. What JetStream already holds is read before this
    /// returns (a diverged client is an error); the rest follows on a task of its own,
    /// which stops when `tx` closes.
    pub async fn follow(
        &self,
        found: &Found,
        after: Option<u32>,
        after_hash: Option<u64>,
        tx: mpsc::UnboundedSender<Update>,
    ) -> Result<(), crate::sessions::AttachError> {
        use crate::sessions::AttachError;
        let stream = found.stream;
        let (mut messages, pending) = self.reader(stream).await.map_err(attach_error)?;
        // What JetStream holds now is read whole before anything goes to the client, so
        // that a read that fails can be tried again from the start.
        let mut held = Vec::new();
        let mut left = pending;
        while left > 0 {
            let Some(message) = messages.next().await else {
                return Err(attach_error(js_error(
                    "reading a stream's tokens",
                    "the feed ended",
                )));
            };
            let message =
                message.map_err(|e| attach_error(js_error("reading a stream's tokens", e)))?;
            left = message.info().map(|i| i.pending).unwrap_or(0);
            let message = decode_message(stream, &message.payload).map_err(attach_error)?;
            let end = matches!(message, Message::End(_));
            held.push(message);
            if end {
                break;
            }
        }
        let mut feed = Feed {
            next: after.map_or(0, |a| a + 1),
            expect: after.zip(after_hash),
            ahead: BTreeMap::new(),
            tx,
        };
        if let (None, Some(p)) = (after, &found.record.prompt) {
            let _ = feed.tx.send(Update::Prompt(p.clone()));
        }
        for message in held {
            match message {
                Message::Tokens(tokens) => {
                    if let Err(index) = feed.tokens(tokens) {
                        return Err(AttachError::Diverged(stream, index));
                    }
                }
                Message::End(record) => {
                    feed.end(*record);
                    return Ok(());
                }
            }
        }
        // Live from here: the owner (or whoever takes the stream over) writes the rest.
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    m = messages.next() => m,
                    () = feed.tx.closed() => return,
                };
                let decoded = match message {
                    Some(Ok(m)) => decode_message(stream, &m.payload),
                    Some(Err(e)) => Err(js_error("following a stream's tokens", e)),
                    None => Err(js_error("following a stream's tokens", "the feed ended")),
                };
                match decoded {
                    Ok(Message::Tokens(tokens)) => {
                        if feed.tokens(tokens).is_err() {
                            return;
                        }
                    }
                    Ok(Message::End(record)) => return feed.end(*record),
                    Err(e) => {
                        warn!(%stream, error = %e, "lost a followed stream's feed");
                        let _ = feed
                            .tx
                            .send(Update::Failed(baton_common::protocol::WireError {
                                kind: baton_common::protocol::ErrorKind::Internal,
                                message: format!("{e}; reconnect to resume"),
                            }));
                        return;
                    }
                }
            }
        });
        Ok(())
    }

    /// Unfinished streams whose owner is dead, and ended ones of dead owners past
    /// `collect_before` (Unix seconds), which are removed.
    pub async fn orphans(&self, collect_before: u64) -> Result<Vec<Found>, ReplicaError> {
        let records = &self.inner.records;
        let held = records
            .status()
            .await
            .map_err(|e| js_error("reading the checkpoints bucket", e))?
            .values();
        let mut out = Vec::new();
        if held == 0 {
            return Ok(out);
        }
        // Every key's last value in one pass, not one request per key.
        let mut entries = records
            .watch_with_history(">")
            .await
            .map_err(|e| js_error("reading the checkpoints bucket", e))?;
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), entries.next()).await;
            let entry = match next {
                Ok(Some(Ok(entry))) => entry,
                Ok(Some(Err(e))) => return Err(js_error("reading the checkpoints bucket", e)),
                // Emptied meanwhile, or the server went away.
                Ok(None) | Err(_) => break,
            };
            let last = entry.delta == 0;
            if let (kv::Operation::Put, Ok(stream)) =
                (entry.operation, entry.key.parse::<StreamId>())
            {
                match decode_value(stream, &entry.value) {
                    Ok((owner, record)) if !self.alive(owner) => match record.end {
                        None => out.push(Found {
                            stream,
                            owner,
                            record,
                            revision: entry.revision,
                        }),
                        Some(_) if record.ended_at < collect_before => {
                            debug!(%stream, "collecting an ended stream of a dead coordinator");
                            self.remove(stream);
                        }
                        Some(_) => {}
                    },
                    Ok(_) => {}
                    Err(e) => warn!(%stream, error = %e, "skipping a checkpoint in JetStream"),
                }
            }
            if last {
                break;
            }
        }
        Ok(out)
    }

    /// Writes this coordinator's lease once.
    async fn renew(&self) -> Result<(), ReplicaError> {
        let stamp = Bytes::from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
                .to_le_bytes()
                .to_vec(),
        );
        self.inner
            .leases
            .put(self.inner.me.to_string(), stamp)
            .await
            .map_err(|e| js_error("renewing the lease", e))?;
        Ok(())
    }

    /// Renews this coordinator's lease and reads the others', every third of a lease.
    async fn keep_lease(self) {
        let mut tick = tokio::time::interval(self.inner.settings.lease / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = self.renew().await {
                warn!(error = %e, "cannot renew this coordinator's lease");
            }
            self.judge_leases();
        }
    }

    /// Follows every lease as it is written, on one watch for as long as this
    /// coordinator runs (made again when it breaks): polling with a fresh listing
    /// each time would make JetStream set up a consumer per poll and coordinator.
    async fn watch_leases(self) {
        loop {
            match self.inner.leases.watch_with_history(">").await {
                Ok(mut entries) => {
                    while let Some(entry) = entries.next().await {
                        match entry {
                            Ok(entry) => self.saw_lease(&entry.key, entry.revision),
                            Err(e) => {
                                warn!(error = %e, "the watch over the leases broke; watching again");
                                break;
                            }
                        }
                    }
                }
                Err(e) => warn!(error = %e, "cannot watch the coordinators' leases"),
            }
            tokio::time::sleep(self.inner.settings.lease / 3).await;
        }
    }

    fn saw_lease(&self, key: &str, revision: u64) {
        let Ok(id) = key.parse::<CoordinatorId>() else {
            return;
        };
        let now = Instant::now();
        let mut live = self.inner.live.lock().expect("liveness lock");
        if id == self.inner.me {
            live.heard = Some(now);
        }
        match live.seen.get_mut(&id) {
            Some(seen) if seen.0 == revision => {}
            Some(seen) => *seen = (revision, now, false),
            None => {
                live.seen.insert(id, (revision, now, false));
            }
        }
    }

    /// Counts dead the coordinators whose lease has not changed for `lease`, while the
    /// watch is current.
    fn judge_leases(&self) {
        let now = Instant::now();
        let lease = self.inner.settings.lease;
        let mut live = self.inner.live.lock().expect("liveness lock");
        if !live.current(lease) {
            return;
        }
        let me = self.inner.me;
        let mut died = false;
        for (id, seen) in live.seen.iter_mut() {
            if *id != me && !seen.2 && now.duration_since(seen.1) >= lease {
                seen.2 = true;
                died = true;
                info!(coordinator = %id, "a coordinator's lease ran out: taking over its streams");
            }
        }
        live.died |= died;
        live.polled.get_or_insert(now);
    }
}

/// Finds or makes a key-value bucket of one value per key. Made here as the stream
/// JetStream's key-value buckets are, not with the client's own call, which first asks
/// for account details that servers before 2.10 answer in another shape.
async fn bucket(
    js: &jetstream::Context,
    name: &str,
    description: &str,
    max_age: Duration,
    replicas: usize,
) -> Result<kv::Store, ReplicaError> {
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{name}"),
        description: Some(description.into()),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: stream::StorageType::File,
        num_replicas: replicas,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    })
    .await
    .map_err(|e| js_error(&format!("creating the {name} bucket"), e))?;
    js.get_key_value(name)
        .await
        .map_err(|e| js_error(&format!("opening the {name} bucket"), e))
}

/// An error of JetStream as an attach's: one JetStream may answer if asked again, or a
/// damaged value.
pub fn attach_error(e: ReplicaError) -> crate::sessions::AttachError {
    use crate::sessions::AttachError;
    match e {
        ReplicaError::JetStream(_) => AttachError::Unavailable(e.to_string()),
        ReplicaError::Damaged(..) => AttachError::Store(e.to_string()),
    }
}

/// A stream's tokens as JetStream holds them (in order of arrival, a write tried again
/// after later ones, a position possibly twice) as positions 0, 1, … up to the first
/// one missing.
fn in_order(tokens: Vec<StoredToken>) -> Vec<StoredToken> {
    let mut by_index = BTreeMap::new();
    for t in tokens {
        by_index.entry(t.index).or_insert(t);
    }
    let mut out = Vec::with_capacity(by_index.len());
    for (index, t) in by_index {
        if index as usize != out.len() {
            break;
        }
        out.push(t);
    }
    out
}

/// A follower's position in the stream it sends a client.
struct Feed {
    next: u32,
    expect: Option<(u32, u64)>,
    /// Positions past `next` already read: a write tried again lands after later ones.
    ahead: BTreeMap<u32, StoredToken>,
    tx: mpsc::UnboundedSender<Update>,
}

impl Feed {
    /// Sends the tokens the client lacks; `Err(position)` when the stream's token at
    /// the client's last position is not the client's.
    fn tokens(&mut self, tokens: Vec<StoredToken>) -> Result<(), u32> {
        for t in tokens {
            if let Some((at, hash)) = self.expect {
                if t.index == at {
                    if t.hash != hash {
                        let _ = self
                            .tx
                            .send(Update::Failed(crate::sessions::session::diverged(t.index)));
                        return Err(t.index);
                    }
                    self.expect = None;
                }
            }
            // A position written twice (a takeover regenerated what the old owner had
            // written but not yet acknowledged, or a write was tried again) goes out
            // once; one written ahead of a missing one waits for it.
            if t.index > self.next {
                self.ahead.entry(t.index).or_insert(t);
                continue;
            }
            if t.index < self.next {
                continue;
            }
            self.send(t);
            while let Some(t) = self.ahead.remove(&self.next) {
                self.send(t);
            }
        }
        Ok(())
    }

    fn send(&mut self, t: StoredToken) {
        self.next += 1;
        let _ = self.tx.send(Update::Token {
            index: t.index,
            text: t.text,
            hash: t.hash,
            logprobs: t.logprobs,
            tool_calls: t.tool_calls,
        });
    }

    fn end(self, record: StreamRecord) {
        use crate::store::StreamEnd;
        if let Some((&missing, _)) = self.ahead.first_key_value() {
            // Every write is acknowledged before the end is sent, so a gap here is a
            // write JetStream never took.
            let _ = self
                .tx
                .send(Update::Failed(baton_common::protocol::WireError {
                    kind: baton_common::protocol::ErrorKind::Internal,
                    message: format!(
                        "the checkpoint lacks position {} (before {missing}); reconnect to resume",
                        self.next
                    ),
                }));
            return;
        }
        let update = match record.end {
            Some(StreamEnd::Finished(f)) => Update::Finished(f),
            Some(StreamEnd::Failed(e)) => Update::Failed(e),
            None => return,
        };
        let _ = self.tx.send(update);
    }
}

#[cfg(test)]
mod tests;
