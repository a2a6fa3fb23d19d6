//! A token tap: listens to what workers send coordinators, to check token ids.
//!
//! Clients see text and positions, not token ids. The tap subscribes to every
//! coordinator's token subject (`<p>.v1.coord.*.tokens`) beside the coordinator and notes,
//! per stream, the token id each worker sent at each position, from every attempt. A
//! resumed stream's new worker may send again positions the dead one had sent; the ids
//! must agree (a *conflict* otherwise), and the ids at positions `0..n` must be those of
//! an uninterrupted run of the same request.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use baton_common::protocol::{self, Body, EventKind};
use baton_common::subjects::Subjects;
use futures::StreamExt;

/// What the tap saw of one stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TappedStream {
    /// Token id per position (the first one seen, when attempts disagree).
    pub ids: BTreeMap<u32, u32>,
    /// Positions sent again with a different id.
    pub conflicts: u32,
    /// The attempts that sent events (`0` only: the stream never moved).
    pub attempts: BTreeSet<u32>,
    /// Whether a `Finished` event came.
    pub finished: bool,
}

impl TappedStream {
    /// Whether the stream was resumed on another worker.
    pub fn failed_over(&self) -> bool {
        self.attempts.iter().any(|&a| a > 0)
    }

    /// The ids at positions `0..`, while there is no hole.
    pub fn id_sequence(&self) -> Vec<u32> {
        self.ids
            .iter()
            .enumerate()
            .take_while(|(i, (p, _))| *i as u32 == **p)
            .map(|(_, (_, id))| *id)
            .collect()
    }
}

type Streams = Arc<Mutex<HashMap<String, TappedStream>>>;

/// A subscription to every coordinator's tokens, on a thread of its own; it ends when
/// the tap is dropped.
pub struct TokenTap {
    streams: Streams,
    /// Messages that did not decode as protocol messages.
    malformed: Arc<AtomicU64>,
    /// Dropping it stops the thread.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl TokenTap {
    /// Subscribes at `nats_url` (subjects under the default prefix) and returns once the
    /// subscription is in place.
    pub fn start(nats_url: &str) -> Result<TokenTap, String> {
        let streams: Streams = Arc::default();
        let malformed = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let url = nats_url.to_string();
        let (into, bad) = (streams.clone(), malformed.clone());
        std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("tap runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(listen(url, into, bad, ready_tx, stop_rx));
        });
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => Ok(TokenTap {
                streams,
                malformed,
                _stop: stop_tx,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the token tap did not subscribe within 10 s".into()),
        }
    }

    /// Waits (up to `timeout`) until `stream` has finished, then hands over and forgets
    /// what was seen of it; what there is when the time is up otherwise.
    pub fn take(&self, stream: &str, timeout: Duration) -> Option<TappedStream> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut streams = self.streams.lock().expect("tap lock");
                let finished = streams.get(stream).is_some_and(|s| s.finished);
                if finished || Instant::now() >= deadline {
                    return streams.remove(stream);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Forgets `stream` (one that ended without being checked).
    pub fn forget(&self, stream: &str) {
        self.streams.lock().expect("tap lock").remove(stream);
    }

    /// Messages that did not decode.
    pub fn malformed(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }
}

async fn listen(
    url: String,
    streams: Streams,
    malformed: Arc<AtomicU64>,
    ready: mpsc::Sender<Result<(), String>>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let subscribed = async {
        let client = async_nats::connect(&url)
            .await
            .map_err(|e| format!("tap: connecting to {url}: {e}"))?;
        let sub = client
            .subscribe(Subjects::default().all_tokens())
            .await
            .map_err(|e| format!("tap: subscribing: {e}"))?;
        // The server has the subscription once a round trip has gone through.
        client
            .flush()
            .await
            .map_err(|e| format!("tap: flushing: {e}"))?;
        Ok::<_, String>((client, sub))
    }
    .await;
    let (_client, mut sub) = match subscribed {
        Ok(s) => {
            let _ = ready.send(Ok(()));
            s
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    loop {
        tokio::select! {
            _ = &mut stop => return,
            message = sub.next() => {
                let Some(message) = message else { return };
                match protocol::decode(&message.payload) {
                    Ok(wire) => note(&streams, wire.body),
                    Err(_) => {
                        malformed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

/// Notes one message's events.
fn note(streams: &Streams, body: Body) {
    let Body::Tokens(batch) = body else { return };
    let mut streams = streams.lock().expect("tap lock");
    for event in batch.events {
        let s = streams.entry(event.stream.to_string()).or_default();
        s.attempts.insert(event.attempt);
        match event.kind {
            EventKind::Token(t) => {
                let id = *s.ids.entry(t.index).or_insert(t.id);
                if id != t.id {
                    s.conflicts += 1;
                }
            }
            EventKind::Finished(_) => s.finished = true,
            EventKind::Failed(_) | EventKind::Prompt(_) | EventKind::Progress(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_sequences_stop_at_the_first_hole() {
        let mut s = TappedStream::default();
        for (p, id) in [(0, 10), (1, 11), (3, 13)] {
            s.ids.insert(p, id);
        }
        assert_eq!(s.id_sequence(), vec![10, 11]);
        s.attempts.insert(0);
        assert!(!s.failed_over());
        s.attempts.insert(1);
        assert!(s.failed_over());
    }
}
