//! Opening an answer's streams, whatever the front: one stream per choice, recorded and
//! handed to the sessions, each guarded so that a client that goes away stops it.

use std::time::{SystemTime, UNIX_EPOCH};

use actix::Addr;
use baton_common::ids::StreamId;
use baton_common::protocol::SeqRequest;
use tokio::sync::mpsc::unbounded_channel;

use super::choices::{choice_seed, member, Member};
use super::error::ApiError;
use super::validate::ValidRequest;
use crate::auth::KeyId;
use crate::sessions::{Detach, Sessions, StartStream};
use crate::store::StreamRecord;

/// Tells the sessions when a client's answer is dropped (finished, or the client went
/// away): a stream nobody listens to any more stops on its worker.
#[derive(Debug)]
pub struct StreamGuard {
    stream: StreamId,
    sessions: Addr<Sessions>,
}

impl StreamGuard {
    /// Guards the subscription of one client to `stream`.
    pub fn new(stream: StreamId, sessions: Addr<Sessions>) -> Self {
        Self { stream, sessions }
    }

    /// The stream.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.sessions.do_send(Detach {
            stream: self.stream,
        });
    }
}

/// The streams of a request's choices, each taken by a worker.
pub struct Opened {
    /// The first choice's stream (the request id).
    pub group: StreamId,
    /// Unix seconds, the `created` of every chunk.
    pub created: u64,
    /// Prompt tokens, as the worker of the first choice counted.
    pub prompt_tokens: u32,
    /// Their updates, one per choice.
    pub members: Vec<Member>,
    /// Stop the streams when the client goes away (dropped).
    pub guards: Vec<StreamGuard>,
}

/// Records a validated request as one new stream per choice (`n`), owned by `owner` (the
/// key that opened it, if any), and waits until workers take them all; the HTTP and
/// NATS fronts both start streams here. The choices are submitted together, so that
/// they share a batch.
pub async fn open_streams(
    sessions: &Addr<Sessions>,
    request: &ValidRequest,
    owner: Option<KeyId>,
) -> Result<Opened, ApiError> {
    let group = StreamId::random();
    let created = unix_now();
    let mut members = Vec::with_capacity(request.n as usize);
    let mut guards = Vec::with_capacity(request.n as usize);
    let mut pending = Vec::with_capacity(request.n as usize);
    for choice in 0..request.n {
        let stream = member(group, choice);
        let mut params = request.params.clone();
        params.seed = choice_seed(params.seed, choice);
        let record = StreamRecord {
            request: SeqRequest {
                stream,
                model: request.model.clone(),
                prompt: request.prompt.clone(),
                params,
                attempt: 0,
                resume: None,
                max_prompt_tokens: request.max_prompt_tokens,
            },
            endpoint: request.endpoint,
            include_usage: request.include_usage,
            created,
            attempt: 0,
            worker: None,
            end: None,
            ended_at: 0,
            owner,
            prompt: None,
            choice,
        };
        let (tx, events) = unbounded_channel();
        // From here on, a client that goes away stops the stream.
        guards.push(StreamGuard::new(stream, sessions.clone()));
        members.push(Member {
            choice,
            stream,
            events,
            done: false,
        });
        pending.push(
            sessions
                .send(StartStream {
                    stream,
                    record,
                    subscriber: tx,
                })
                .await?,
        );
    }
    let mut prompt_tokens = 0;
    for (i, accepted) in pending.into_iter().enumerate() {
        let n = match accepted.await {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return Err(ApiError::from_dispatch(e, &request.model)),
            Err(_) => return Err(ApiError::Internal("the stream's session closed".into())),
        };
        if i == 0 {
            prompt_tokens = n;
        }
    }
    Ok(Opened {
        group,
        created,
        prompt_tokens,
        members,
        guards,
    })
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
