//! The checkpoint store: every stream's request and tokens, in sled.
//!
//! Three trees:
//! - `streams`: stream id (16 bytes, big-endian) → [`StreamRecord`] (rkyv): the request,
//!   how its answer is shaped, the key that opened it, its current attempt and worker,
//!   and how it ended.
//! - `tokens`: stream id ‖ position (4 bytes, big-endian) → token id (u32 LE) ‖ chain
//!   hash (u64 LE) ‖ text length (u32 LE) ‖ text (UTF-8), then, when the request asked
//!   for logprobs, the token's (f32 LE) ‖ its text offset (u32 LE) ‖ its bytes (u16 LE
//!   length first) ‖ the number of alternatives (u8) ‖ each as id (u32 LE) ‖ logprob
//!   (f32 LE) ‖ bytes (u16 LE length first). Keys sort by stream, then position, so one range scan reads a
//!   stream's tokens in order.
//! - `meta`: this coordinator's id, so that a restarted coordinator keeps its token
//!   subject and its workers' messages still reach it.
//!
//! With JetStream (see [`crate::replica`]) every write also goes there, and a flush
//! waits for both.
//!
//! Durability: [`Store::flush`] is sled's flush, which writes its buffers to the file
//! and syncs the written range. In `async` checkpoint mode (the default) sled flushes
//! by itself every 500 ms, and the sessions flush once a worker takes a stream, so that
//! its record is on disk before its first token reaches a client: a kill or power loss
//! loses up to 500 ms of tokens, which the resumed stream regenerates. In `sync` mode
//! the sessions flush once per batch of worker messages before any of its tokens
//! reaches a client, so a token a client has seen survives a coordinator kill and a
//! power loss (as far as the disk honours the sync).
//!
//! Memory: sled keeps the pages it has read or written in a cache of
//! `coordinator.store_cache_mib`, counted at the pages' size in the file (in memory they
//! take several times that). sled's own default, 1 GiB, would let the coordinator grow
//! with everything the store holds, some 145 bytes a token. What the sessions read back
//! (a reconnecting client's tokens, streams to recover after a restart) is mostly recent;
//! older pages are read from the file when needed.

use std::path::Path;

use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::{
    Finished, PromptEcho, SeqRequest, TokenEvent, TokenLogprobs, ToolCall, TopLogprob, WireError,
};
use rkyv::{rancor, util::AlignedVec, Archive, Deserialize, Serialize};

use crate::auth::KeyId;
use crate::replica::Replica;

/// Which API a stream's request came through (decides its answer's shapes); kept in its
/// record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// sled failed (I/O, corruption, or another process holds the directory).
    #[error("checkpoint store: {0}")]
    Sled(#[from] sled::Error),
    /// A record does not decode (written by another version, or damaged).
    #[error("checkpoint store: damaged record: {0}")]
    Damaged(String),
    /// JetStream did not acknowledge a write.
    #[error("checkpoints in JetStream: {0}")]
    Replica(String),
    /// The thread running a flush panicked or was cancelled.
    #[error("checkpoint store: the flush did not complete: {0}")]
    FlushLost(String),
}

/// How a stream ended.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum StreamEnd {
    /// Normally.
    Finished(Finished),
    /// With an error.
    Failed(WireError),
}

/// One stream, as the store keeps it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StreamRecord {
    /// The request, as first dispatched (attempt 0, no resume).
    pub request: SeqRequest,
    /// Which API it came through (the shape of its chunks).
    pub endpoint: Endpoint,
    /// Whether the client asked for a usage chunk.
    pub include_usage: bool,
    /// Unix seconds when the stream was created (the `created` of every chunk).
    pub created: u64,
    /// The current attempt ([`SeqRequest::attempt`]).
    pub attempt: u32,
    /// The worker running the current attempt, once one accepted it.
    pub worker: Option<WorkerId>,
    /// How it ended; `None` while it runs.
    pub end: Option<StreamEnd>,
    /// Unix seconds when it ended (0 while it runs).
    pub ended_at: u64,
    /// The API key that opened it (`None`: opened while the API was open, or over
    /// NATS). Only that key, or an admin key, may reattach to it over HTTP.
    pub owner: Option<KeyId>,
    /// The scored prompt, once a worker sent it (a completion's `echo`).
    pub prompt: Option<PromptEcho>,
    /// Which of its request's choices (`n`) it is: the group's first stream is this one's
    /// id minus it.
    pub choice: u32,
}

/// One checkpointed token.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredToken {
    /// Position in the output.
    pub index: u32,
    /// Token id.
    pub id: u32,
    /// Chain hash after it.
    pub hash: u64,
    /// Text that became final with it.
    pub text: String,
    /// Its logprobs, when the request asked.
    pub logprobs: Option<TokenLogprobs>,
    /// Tool calls it completed.
    pub tool_calls: Vec<ToolCall>,
}

impl From<StoredToken> for TokenEvent {
    fn from(t: StoredToken) -> Self {
        TokenEvent {
            index: t.index,
            id: t.id,
            hash: t.hash,
            text: t.text,
            logprobs: t.logprobs,
            tool_calls: t.tool_calls,
        }
    }
}

/// What one collection of the store did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Collected {
    /// Streams removed (ended before the cut, or unreadable).
    pub removed: usize,
    /// Streams left.
    pub kept: usize,
}

/// The sled database of one coordinator.
#[derive(Clone)]
pub struct Store {
    db: sled::Db,
    streams: sled::Tree,
    tokens: sled::Tree,
    meta: sled::Tree,
    /// Where every write also goes, when checkpoints are kept in JetStream too.
    replica: Option<Replica>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("streams", &self.streams.len())
            .finish()
    }
}

fn token_key(stream: StreamId, index: u32) -> [u8; 20] {
    let mut key = [0u8; 20];
    key[..16].copy_from_slice(&stream.0.to_be_bytes());
    key[16..].copy_from_slice(&index.to_be_bytes());
    key
}

pub(crate) fn encode_record(record: &StreamRecord) -> Vec<u8> {
    rkyv::to_bytes::<rancor::Error>(record)
        .expect("serializing owned values into a growable buffer cannot fail")
        .into_vec()
}

pub(crate) fn decode_record(bytes: &[u8]) -> Result<StreamRecord, StoreError> {
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<StreamRecord, rancor::Error>(&aligned)
        .map_err(|e| StoreError::Damaged(e.to_string()))
}

/// Reads a token entry's fields in order.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.bytes.len() < n {
            return Err(StoreError::Damaged("short token entry".into()));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn f32(&mut self) -> Result<f32, StoreError> {
        Ok(f32::from_le_bytes(self.array()?))
    }

    fn text(&mut self) -> Result<String, StoreError> {
        let len = self.u32()? as usize;
        String::from_utf8(self.take(len)?.to_vec())
            .map_err(|_| StoreError::Damaged("token text is not UTF-8".into()))
    }

    fn short_bytes(&mut self) -> Result<Vec<u8>, StoreError> {
        let n = u16::from_le_bytes(self.array()?) as usize;
        Ok(self.take(n)?.to_vec())
    }
}

fn put_short_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // A token's bytes are a few dozen at most; anything longer is cut, never misread.
    let n = bytes.len().min(u16::MAX as usize);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&bytes[..n]);
}

/// A token entry's sections after its text, each behind its tag byte.
const LOGPROBS: u8 = 1;
const TOOL_CALLS: u8 = 2;

fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

pub(crate) fn encode_token(t: &TokenEvent) -> Vec<u8> {
    let mut value = Vec::with_capacity(16 + t.text.len());
    value.extend_from_slice(&t.id.to_le_bytes());
    value.extend_from_slice(&t.hash.to_le_bytes());
    put_text(&mut value, &t.text);
    if !t.tool_calls.is_empty() {
        value.push(TOOL_CALLS);
        value.extend_from_slice(&(t.tool_calls.len() as u32).to_le_bytes());
        for c in &t.tool_calls {
            value.extend_from_slice(&c.index.to_le_bytes());
            put_text(&mut value, &c.id);
            put_text(&mut value, &c.name);
            put_text(&mut value, &c.arguments);
        }
    }
    if let Some(l) = &t.logprobs {
        value.push(LOGPROBS);
        value.extend_from_slice(&l.logprob.to_le_bytes());
        value.extend_from_slice(&l.text_offset.to_le_bytes());
        put_short_bytes(&mut value, &l.bytes);
        let top = &l.top[..l.top.len().min(u8::MAX as usize)];
        value.push(top.len() as u8);
        for alt in top {
            value.extend_from_slice(&alt.id.to_le_bytes());
            value.extend_from_slice(&alt.logprob.to_le_bytes());
            put_short_bytes(&mut value, &alt.bytes);
        }
    }
    value
}

fn decode_token(key: &[u8], value: &[u8]) -> Result<StoredToken, StoreError> {
    let index = u32::from_be_bytes(
        key.get(16..20)
            .and_then(|k| k.try_into().ok())
            .ok_or_else(|| StoreError::Damaged("short token key".into()))?,
    );
    decode_entry(index, value)
}

/// A token entry (as [`encode_token`] wrote it) at position `index`.
pub(crate) fn decode_entry(index: u32, value: &[u8]) -> Result<StoredToken, StoreError> {
    let mut r = Reader { bytes: value };
    let id = r.u32()?;
    let hash = u64::from_le_bytes(r.array()?);
    let text = r.text()?;
    let mut tool_calls = Vec::new();
    if r.bytes.first() == Some(&TOOL_CALLS) {
        r.take(1)?;
        let n = r.u32()?;
        for _ in 0..n {
            tool_calls.push(ToolCall {
                index: r.u32()?,
                id: r.text()?,
                name: r.text()?,
                arguments: r.text()?,
            });
        }
    }
    let logprobs = if r.bytes.is_empty() {
        None
    } else {
        if r.take(1)?[0] != LOGPROBS {
            return Err(StoreError::Damaged(
                "unknown section in a token entry".into(),
            ));
        }
        let logprob = r.f32()?;
        let text_offset = r.u32()?;
        let bytes = r.short_bytes()?;
        let n = r.take(1)?[0];
        let top = (0..n)
            .map(|_| {
                Ok(TopLogprob {
                    id: r.u32()?,
                    logprob: r.f32()?,
                    bytes: r.short_bytes()?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if !r.bytes.is_empty() {
            return Err(StoreError::Damaged(
                "trailing bytes in a token entry".into(),
            ));
        }
        Some(TokenLogprobs {
            logprob,
            bytes,
            text_offset,
            top,
        })
    };
    Ok(StoredToken {
        index,
        id,
        hash,
        text,
        logprobs,
        tool_calls,
    })
}

impl Store {
    /// Opens (or creates) the store in `dir`, with a page cache of at most
    /// `cache_bytes` (sled needs at least 256). Fails when another process holds it.
    pub fn open(dir: &Path, cache_bytes: u64) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes.max(256))
            .flush_every_ms(Some(500))
            .open()?;
        Ok(Self {
            streams: db.open_tree("streams")?,
            tokens: db.open_tree("tokens")?,
            meta: db.open_tree("meta")?,
            db,
            replica: None,
        })
    }

    /// The same store, with every write also sent to `replica`.
    pub fn with_replica(mut self, replica: Replica) -> Self {
        self.replica = Some(replica);
        self
    }

    /// Where writes also go, if anywhere.
    pub fn replica(&self) -> Option<&Replica> {
        self.replica.as_ref()
    }

    /// Writes a stream taken over from another coordinator, here only (JetStream holds
    /// it already).
    pub fn adopt(
        &self,
        stream: StreamId,
        record: &StreamRecord,
        tokens: &[TokenEvent],
    ) -> Result<(), StoreError> {
        self.streams
            .insert(stream.0.to_be_bytes(), encode_record(record))?;
        for t in tokens {
            self.tokens
                .insert(token_key(stream, t.index), encode_token(t))?;
        }
        Ok(())
    }

    /// The id kept in the store, or `fresh` (then kept) when there is none yet.
    pub fn coordinator_id(&self, fresh: u128) -> Result<u128, StoreError> {
        if let Some(v) = self.meta.get("coordinator_id")? {
            let bytes: [u8; 16] = v
                .as_ref()
                .try_into()
                .map_err(|_| StoreError::Damaged("coordinator id".into()))?;
            return Ok(u128::from_be_bytes(bytes));
        }
        self.meta.insert("coordinator_id", &fresh.to_be_bytes())?;
        self.db.flush()?;
        Ok(fresh)
    }

    /// Writes (or replaces) a stream's record.
    pub fn put_stream(&self, stream: StreamId, record: &StreamRecord) -> Result<(), StoreError> {
        self.streams
            .insert(stream.0.to_be_bytes(), encode_record(record))?;
        if let Some(replica) = &self.replica {
            replica.put_record(stream, record);
        }
        Ok(())
    }

    /// A stream's record.
    pub fn stream(&self, stream: StreamId) -> Result<Option<StreamRecord>, StoreError> {
        self.streams
            .get(stream.0.to_be_bytes())?
            .map(|v| decode_record(&v))
            .transpose()
    }

    /// Removes a stream and its tokens (the record first: tokens without a record are
    /// never read).
    pub fn remove_stream(&self, stream: StreamId) -> Result<(), StoreError> {
        self.remove_local(stream)?;
        if let Some(replica) = &self.replica {
            replica.remove(stream);
        }
        Ok(())
    }

    /// Removes a stream and its tokens here only (another coordinator owns it now).
    pub fn remove_local(&self, stream: StreamId) -> Result<(), StoreError> {
        self.streams.remove(stream.0.to_be_bytes())?;
        for key in self.tokens.scan_prefix(stream.0.to_be_bytes()).keys() {
            self.tokens.remove(key?)?;
        }
        Ok(())
    }

    /// Appends tokens (of any streams), one insert each.
    ///
    /// Not one `sled::Batch`: the first batch switches sled, for the rest of the
    /// process, to a lock that every write takes exclusively and every flush holds
    /// shared while it waits for the disk, so appending would wait for the flush
    /// running beside it. Atomicity across tokens is not needed: a restarted
    /// coordinator keeps each stream's longest run of positions from 0 and regenerates
    /// the rest.
    pub fn append<'a>(
        &self,
        tokens: impl IntoIterator<Item = (StreamId, &'a TokenEvent)>,
    ) -> Result<(), StoreError> {
        let mut replicated = Vec::new();
        for (stream, t) in tokens {
            let entry = encode_token(t);
            if self.replica.is_some() {
                replicated.push((stream, t.index, entry.clone()));
            }
            self.tokens.insert(token_key(stream, t.index), entry)?;
        }
        if let Some(replica) = &self.replica {
            replica.append(replicated);
        }
        Ok(())
    }

    /// Writes everything so far to the file and syncs it, on a blocking thread of the
    /// runtime (sled's own `flush_async` wakes every thread of its pool to run it).
    pub async fn flush(&self) -> Result<(), StoreError> {
        let db = self.db.clone();
        let local = async {
            tokio::task::spawn_blocking(move || db.flush())
                .await
                .map_err(|e| StoreError::FlushLost(e.to_string()))??;
            Ok::<(), StoreError>(())
        };
        match &self.replica {
            None => local.await,
            Some(replica) => {
                let (local, replicated) = futures::join!(local, replica.flush());
                local?;
                replicated.map_err(StoreError::Replica)
            }
        }
    }

    /// A stream's tokens from position `from` on, in order.
    pub fn tokens(&self, stream: StreamId, from: u32) -> Result<Vec<StoredToken>, StoreError> {
        let start = token_key(stream, from);
        let end = token_key(stream, u32::MAX);
        let mut out = Vec::new();
        for item in self.tokens.range(start..=end) {
            let (k, v) = item?;
            out.push(decode_token(&k, &v)?);
        }
        Ok(out)
    }

    /// Every stream that has not ended (to dispatch again after a restart). Damaged
    /// records are skipped with a warning.
    pub fn unfinished(&self) -> Result<Vec<(StreamId, StreamRecord)>, StoreError> {
        let mut out = Vec::new();
        for item in self.streams.iter() {
            let (k, v) = item?;
            let Ok(bytes) = <[u8; 16]>::try_from(k.as_ref()) else {
                continue;
            };
            match decode_record(&v) {
                Ok(r) if r.end.is_none() => out.push((StreamId(u128::from_be_bytes(bytes)), r)),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "skipping a damaged stream record"),
            }
        }
        Ok(out)
    }

    /// Removes streams that ended before `before` (Unix seconds).
    pub fn collect(&self, before: u64) -> Result<Collected, StoreError> {
        let mut old = Vec::new();
        let mut seen = 0;
        for item in self.streams.iter() {
            let (k, v) = item?;
            seen += 1;
            let Ok(bytes) = <[u8; 16]>::try_from(k.as_ref()) else {
                continue;
            };
            match decode_record(&v) {
                Ok(r) if r.end.is_some() && r.ended_at < before => {
                    old.push(StreamId(u128::from_be_bytes(bytes)))
                }
                Ok(_) => {}
                // A record nobody can read is garbage too.
                Err(_) => old.push(StreamId(u128::from_be_bytes(bytes))),
            }
        }
        for stream in &old {
            self.remove_stream(*stream)?;
        }
        Ok(Collected {
            removed: old.len(),
            kept: seen - old.len(),
        })
    }

    /// Streams in the store.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Whether the store holds no stream.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::{FinishReason, GenParams, PromptSpec};

    fn record() -> StreamRecord {
        StreamRecord {
            request: SeqRequest {
                stream: StreamId(5),
                model: "m".into(),
                prompt: PromptSpec::Text("hi".into()),
                params: GenParams::greedy(4),
                attempt: 0,
                resume: None,
                max_prompt_tokens: 0,
            },
            endpoint: Endpoint::Chat,
            include_usage: true,
            created: 1,
            attempt: 0,
            worker: None,
            end: None,
            ended_at: 0,
            owner: Some(KeyId::of("sk-test")),
            prompt: None,
            choice: 0,
        }
    }

    fn call() -> ToolCall {
        ToolCall {
            index: 0,
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Oslo"}"#.into(),
        }
    }

    fn token(index: u32, text: &str) -> TokenEvent {
        TokenEvent {
            index,
            id: index + 100,
            hash: u64::from(index) * 7,
            text: text.into(),
            logprobs: None,
            tool_calls: Vec::new(),
        }
    }

    /// Opens the store again once the dropped one has let go of its file lock: sled's
    /// background threads may still hold the file for a moment after the last handle
    /// drops (a new process never waits: the old one's lock died with it).
    async fn reopen(dir: &Path) -> Store {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match Store::open(dir, 1 << 20) {
                Ok(store) => return store,
                Err(StoreError::Sled(sled::Error::Io(_)))
                    if std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("reopen: {e:?}"),
            }
        }
    }

    #[actix_rt::test]
    async fn records_and_tokens_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (StreamId(5), StreamId(6));
        {
            let store = Store::open(dir.path(), 1 << 20).expect("open");
            assert_eq!(store.coordinator_id(42).expect("id"), 42);
            store.put_stream(a, &record()).expect("put");
            let mut done = record();
            done.end = Some(StreamEnd::Finished(Finished {
                reason: FinishReason::Stop,
                prompt_tokens: 1,
                completion_tokens: 2,
                cached_tokens: 0,
            }));
            done.ended_at = 10;
            store.put_stream(b, &done).expect("put");
            let (t0, mut t1, t2) = (token(0, "a"), token(1, "é"), token(0, "z"));
            t1.logprobs = Some(TokenLogprobs {
                logprob: -0.25,
                bytes: "é".as_bytes().to_vec(),
                text_offset: 1,
                top: vec![
                    TopLogprob {
                        id: 101,
                        logprob: -0.25,
                        bytes: "é".as_bytes().to_vec(),
                    },
                    TopLogprob {
                        id: 7,
                        logprob: f32::NEG_INFINITY,
                        bytes: vec![0xc3],
                    },
                ],
            });
            t1.tool_calls = vec![call()];
            store
                .append([(a, &t0), (a, &t1), (b, &t2)])
                .expect("append");
            store.flush().await.expect("flush");
        }
        let store = reopen(dir.path()).await;
        assert_eq!(store.coordinator_id(7).expect("id"), 42, "the id is kept");
        let tokens = store.tokens(a, 0).expect("tokens");
        let t1 = token(1, "é");
        let t1 = TokenEvent {
            logprobs: tokens.get(1).and_then(|t| t.logprobs.clone()),
            ..t1
        };
        assert_eq!(
            t1.logprobs
                .as_ref()
                .map(|l| (l.logprob, l.top.len(), l.top[1].bytes.clone())),
            Some((-0.25, 2, vec![0xc3])),
            "logprobs are kept"
        );
        assert_eq!(
            tokens,
            vec![
                StoredToken {
                    index: 0,
                    id: 100,
                    hash: 0,
                    text: "a".into(),
                    logprobs: None,
                    tool_calls: Vec::new(),
                },
                StoredToken {
                    index: 1,
                    id: 101,
                    hash: 7,
                    text: "é".into(),
                    logprobs: t1.logprobs.clone(),
                    tool_calls: vec![call()],
                },
            ]
        );
        assert_eq!(store.tokens(a, 1).expect("tokens").len(), 1);
        let open = store.unfinished().expect("unfinished");
        assert_eq!(open.len(), 1);
        assert_eq!(open[0], (a, record()));
        // Collection removes only ended streams older than the cut, with their tokens.
        let collected = |removed, kept| Collected { removed, kept };
        assert_eq!(store.collect(10).expect("collect"), collected(0, 2));
        assert_eq!(store.collect(11).expect("collect"), collected(1, 1));
        assert!(store.stream(b).expect("get").is_none());
        assert!(store.tokens(b, 0).expect("tokens").is_empty());
        assert_eq!(store.len(), 1);
    }

    #[actix_rt::test]
    async fn a_cache_smaller_than_the_data_reads_everything_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 4 KiB of cache for ~100 KiB of tokens: most pages live only in the file.
        let store = Store::open(dir.path(), 4096).expect("open");
        let streams: Vec<StreamId> = (0..20).map(|i| StreamId(1000 + i)).collect();
        let text = "x".repeat(40);
        for stream in &streams {
            let tokens: Vec<TokenEvent> = (0..100).map(|i| token(i, &text)).collect();
            store
                .append(tokens.iter().map(|t| (*stream, t)))
                .expect("append");
        }
        store.flush().await.expect("flush");
        for stream in &streams {
            let back = store.tokens(*stream, 0).expect("tokens");
            assert_eq!(back.len(), 100);
            assert!(back
                .iter()
                .enumerate()
                .all(|(i, t)| t.index == i as u32 && t.text == text));
        }
    }

    #[test]
    fn damaged_records_are_errors() {
        assert!(decode_record(b"garbage").is_err());
        assert!(decode_token(&[0; 20], &[1, 2]).is_err());
        let mut t = TokenEvent {
            index: 0,
            id: 1,
            hash: 2,
            text: "ab".into(),
            logprobs: Some(TokenLogprobs {
                logprob: -1.0,
                bytes: b"ab".to_vec(),
                text_offset: 7,
                top: vec![TopLogprob {
                    id: 1,
                    logprob: -1.0,
                    bytes: b"ab".to_vec(),
                }],
            }),
            tool_calls: vec![call()],
        };
        let whole = encode_token(&t);
        let back = decode_token(&[0; 20], &whole).expect("decodes");
        assert_eq!(
            (back.tool_calls, back.logprobs),
            (t.tool_calls.clone(), t.logprobs.clone())
        );
        let calls_end = {
            let mut no_logprobs = t.clone();
            no_logprobs.logprobs = None;
            encode_token(&no_logprobs).len()
        };
        // Every cut of an entry is an error or an entry without its last sections, never
        // a panic.
        for cut in 0..whole.len() {
            if let Ok(back) = decode_token(&[0; 20], &whole[..cut]) {
                assert!(cut == 18 || cut == calls_end, "cut {cut} decodes");
                assert!(back.logprobs.is_none());
            }
        }
        t.logprobs = None;
        t.tool_calls.clear();
        assert_eq!(encode_token(&t).len(), 18);
    }
}
