//! Getting a sequence onto a worker: route, submit, and try another worker when one is
//! gone, full, draining, silent past the submit timeout, or runs another model.
//!
//! New streams get one round ([`Dispatcher::dispatch`]): a client waiting for its first
//! byte is better served by a quick 503 than by a long wait. Resumed streams wait for a
//! worker up to a deadline ([`Dispatcher::dispatch_until`]): their client already has
//! part of the answer.

use std::time::{Duration, Instant};

use actix::Addr;
use baton_common::ids::WorkerId;
use baton_common::protocol::{ErrorKind, SeqRequest, SubmitOutcome, WireError};
use tracing::debug;

use crate::actors::affinity::prefix_keys;
use crate::actors::messages::{ReleaseWorker, RouteStream};
use crate::actors::registry::Registry;
use crate::actors::router::RouteError;
use crate::nats::{NatsHandle, SubmitError};

/// Most workers one round offers a sequence to.
pub const MAX_SUBMIT_ATTEMPTS: usize = 3;

/// Pause between two rounds while a resumed stream waits for a worker.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// A worker took the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// The worker.
    pub worker: WorkerId,
    /// Prompt length in tokens, as the worker counted.
    pub prompt_tokens: u32,
}

/// Why no worker took the sequence.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The router found no worker.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The submit got no usable reply.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// A worker refused the sequence.
    #[error("{}", .0.message)]
    Refused(WireError),
    /// The registry actor is gone (the coordinator is stopping).
    #[error("the registry is not answering: {0}")]
    Mailbox(#[from] actix::MailboxError),
    /// The request, with room to resume it, would not fit in one NATS message.
    #[error(
        "the request takes {bytes} bytes on the cluster's message bus with room to resume \
         it after max_tokens tokens, more than the NATS server's max_payload of {limit} \
         bytes; shorten the prompt or max_tokens"
    )]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
}

impl DispatchError {
    /// Whether waiting and trying again may help.
    pub fn retryable(&self) -> bool {
        match self {
            DispatchError::Route(e) => !matches!(e, RouteError::UnknownModel(_)),
            DispatchError::Submit(e) => {
                !matches!(e, SubmitError::Decode(_) | SubmitError::TooLarge(_))
            }
            DispatchError::Refused(e) => matches!(
                e.kind,
                ErrorKind::Overloaded
                    | ErrorKind::Draining
                    | ErrorKind::ChainMismatch
                    | ErrorKind::Internal
            ),
            DispatchError::Mailbox(_) | DispatchError::TooLarge { .. } => false,
        }
    }

    /// The error as it travels to a stream's client.
    pub fn to_wire(&self) -> WireError {
        match self {
            DispatchError::Refused(e) => e.clone(),
            other => WireError {
                kind: ErrorKind::Internal,
                message: other.to_string(),
            },
        }
    }
}

/// Routes and submits sequences.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    /// Where workers are chosen.
    pub registry: Addr<Registry>,
    /// Where submits go.
    pub nats: NatsHandle,
    /// How long a worker has to answer a submit.
    pub submit_timeout: Duration,
}

impl Dispatcher {
    /// One round: up to [`MAX_SUBMIT_ATTEMPTS`] workers, skipping `exclude` and adding
    /// every worker that refuses for a reason another worker may not have. On success
    /// the worker counts one more stream in the registry; the caller releases it.
    pub async fn dispatch(
        &self,
        req: &SeqRequest,
        exclude: &mut Vec<WorkerId>,
    ) -> Result<Bound, DispatchError> {
        let mut last: Option<DispatchError> = None;
        let prefix = prefix_keys(&req.model, &req.prompt);
        for _ in 0..MAX_SUBMIT_ATTEMPTS {
            let route = self
                .registry
                .send(RouteStream {
                    model: req.model.clone(),
                    exclude: exclude.clone(),
                    prefixes: vec![prefix.clone()],
                })
                .await?;
            let worker = match route {
                Ok(w) => w,
                // A worker's refusal says more than "no other worker".
                Err(e) => return Err(last.unwrap_or(e.into())),
            };
            let outcome = self
                .nats
                .submit(worker, vec![req.clone()], self.submit_timeout)
                .await;
            let error = match outcome {
                Ok(reply) => {
                    let mine = reply.outcomes.into_iter().find(|o| match o {
                        SubmitOutcome::Accepted(a) => a.stream == req.stream,
                        SubmitOutcome::Refused(r) => r.stream == req.stream,
                    });
                    match mine {
                        Some(SubmitOutcome::Accepted(a)) => {
                            return Ok(Bound {
                                worker,
                                prompt_tokens: a.prompt_tokens,
                            })
                        }
                        Some(SubmitOutcome::Refused(r)) => DispatchError::Refused(r.error),
                        None => SubmitError::Unexpected("no outcome for the stream").into(),
                    }
                }
                Err(e) => e.into(),
            };
            self.registry.do_send(ReleaseWorker { worker });
            debug!(stream = %req.stream, %worker, error = %error, "submit not accepted");
            let next_worker = match &error {
                DispatchError::Refused(e) => matches!(
                    e.kind,
                    ErrorKind::Overloaded | ErrorKind::Draining | ErrorKind::ChainMismatch
                ),
                DispatchError::Submit(e) => e.worker_lost(),
                _ => false,
            };
            if !next_worker {
                return Err(error);
            }
            exclude.push(worker);
            last = Some(error);
        }
        Err(
            last.unwrap_or(DispatchError::Route(RouteError::ModelUnavailable(
                req.model.clone(),
            ))),
        )
    }

    /// Sends new sequences of one model to one worker in one submit message. Returns
    /// the worker tried (if any) and each sequence's outcome, in order; the caller
    /// retries refused ones one by one elsewhere.
    pub async fn dispatch_batch(
        &self,
        reqs: Vec<SeqRequest>,
    ) -> (
        Option<WorkerId>,
        Vec<(SeqRequest, Result<Bound, DispatchError>)>,
    ) {
        let Some(model) = reqs.first().map(|r| r.model.clone()) else {
            return (None, Vec::new());
        };
        let route = self
            .registry
            .send(RouteStream {
                prefixes: reqs
                    .iter()
                    .map(|r| prefix_keys(&model, &r.prompt))
                    .collect(),
                model,
                exclude: Vec::new(),
            })
            .await;
        let worker = match route {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                return (
                    None,
                    reqs.into_iter()
                        .map(|r| (r, Err(DispatchError::Route(e.clone()))))
                        .collect(),
                )
            }
            Err(e) => {
                let message = e.to_string();
                return (
                    None,
                    reqs.into_iter()
                        .map(|r| {
                            let e = DispatchError::Submit(SubmitError::Request(message.clone()));
                            (r, Err(e))
                        })
                        .collect(),
                );
            }
        };
        let reply = self
            .nats
            .submit(worker, reqs.clone(), self.submit_timeout)
            .await;
        let results: Vec<(SeqRequest, Result<Bound, DispatchError>)> = match reply {
            Ok(reply) => reqs
                .into_iter()
                .map(|r| {
                    let outcome = reply.outcomes.iter().find(|o| match o {
                        SubmitOutcome::Accepted(a) => a.stream == r.stream,
                        SubmitOutcome::Refused(x) => x.stream == r.stream,
                    });
                    let result = match outcome {
                        Some(SubmitOutcome::Accepted(a)) => Ok(Bound {
                            worker,
                            prompt_tokens: a.prompt_tokens,
                        }),
                        Some(SubmitOutcome::Refused(x)) => {
                            Err(DispatchError::Refused(x.error.clone()))
                        }
                        None => Err(SubmitError::Unexpected("no outcome for the stream").into()),
                    };
                    (r, result)
                })
                .collect(),
            Err(e) => {
                let message = e.to_string();
                reqs.into_iter()
                    .map(|r| {
                        let e = match &e {
                            SubmitError::NoResponders => SubmitError::NoResponders,
                            SubmitError::Timeout(d) => SubmitError::Timeout(*d),
                            SubmitError::TooLarge(m) => SubmitError::TooLarge(m.clone()),
                            _ => SubmitError::Request(message.clone()),
                        };
                        (r, Err(e.into()))
                    })
                    .collect()
            }
        };
        for (_, result) in &results {
            if result.is_err() {
                self.registry.do_send(ReleaseWorker { worker });
            }
        }
        (Some(worker), results)
    }

    /// Rounds until a worker takes the sequence, an error that waiting cannot fix, or
    /// `deadline`. Workers that refused are tried again in later rounds (they may have
    /// room by then), except those that run another model.
    pub async fn dispatch_until(
        &self,
        req: &SeqRequest,
        mut exclude: Vec<WorkerId>,
        deadline: Instant,
    ) -> Result<Bound, DispatchError> {
        let permanent = exclude.clone();
        loop {
            let mut round = exclude.clone();
            match self.dispatch(req, &mut round).await {
                Ok(bound) => return Ok(bound),
                Err(e) if e.retryable() && Instant::now() + RETRY_PAUSE < deadline => {
                    debug!(stream = %req.stream, error = %e, "no worker yet, waiting");
                    if let DispatchError::Refused(WireError {
                        kind: ErrorKind::ChainMismatch,
                        ..
                    }) = e
                    {
                        exclude = round;
                    } else {
                        exclude = permanent.clone();
                    }
                    actix_rt::time::sleep(RETRY_PAUSE).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
