//! What the sessions need of the workers, as a trait: [`WorkerLink`]. The cluster's is
//! [`NatsLink`] (the dispatcher, the registry and NATS); tests use an in-memory one.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use baton_common::ids::{StreamId, WorkerId};
use baton_common::protocol::SeqRequest;
use tracing::warn;

use crate::actors::messages::{ForgetWorker, ReleaseWorker};
use crate::dispatch::{Bound, DispatchError, Dispatcher};
use crate::nats::Probe;

/// A future the sessions actor awaits on its own thread.
pub type LinkFuture<T> = Pin<Box<dyn Future<Output = T>>>;

/// Each sequence of a batch with its outcome, and the worker tried.
pub type BatchOutcome = (
    Option<WorkerId>,
    Vec<(SeqRequest, Result<Bound, DispatchError>)>,
);

/// Getting sequences onto workers and off them.
pub trait WorkerLink {
    /// Offers `request` to workers other than `exclude`: one round, or until `deadline`.
    fn dispatch(
        &self,
        request: SeqRequest,
        exclude: Vec<WorkerId>,
        deadline: Option<Instant>,
    ) -> LinkFuture<Result<Bound, DispatchError>>;

    /// Sends new sequences of one model to one worker in one message.
    fn dispatch_batch(&self, requests: Vec<SeqRequest>) -> LinkFuture<BatchOutcome>;

    /// Tells `worker` to stop `streams` (each up to the attempt given).
    fn cancel(&self, worker: WorkerId, streams: Vec<(StreamId, u32)>);

    /// Asks `worker` whether it is alive and still holds `streams`.
    fn probe(
        &self,
        worker: WorkerId,
        streams: Vec<(StreamId, u32)>,
        timeout: Duration,
    ) -> LinkFuture<Probe>;

    /// One stream fewer runs on `worker` (the registry's count for routing).
    fn release(&self, worker: WorkerId);

    /// `worker` is gone: the registry drops it now.
    fn forget(&self, worker: WorkerId);

    /// `worker` left the registry: its message sequences are dropped.
    fn forget_sequences(&self, worker: WorkerId);
}

/// The cluster's link: the dispatcher, with its registry and NATS connection.
#[derive(Debug, Clone)]
pub struct NatsLink {
    dispatcher: Dispatcher,
}

impl NatsLink {
    /// The link through `dispatcher` (its registry and NATS connection).
    pub fn new(dispatcher: Dispatcher) -> Self {
        Self { dispatcher }
    }
}

impl WorkerLink for NatsLink {
    fn dispatch(
        &self,
        request: SeqRequest,
        exclude: Vec<WorkerId>,
        deadline: Option<Instant>,
    ) -> LinkFuture<Result<Bound, DispatchError>> {
        let dispatcher = self.dispatcher.clone();
        Box::pin(async move {
            match deadline {
                Some(deadline) => dispatcher.dispatch_until(&request, exclude, deadline).await,
                None => {
                    let mut exclude = exclude;
                    dispatcher.dispatch(&request, &mut exclude).await
                }
            }
        })
    }

    fn dispatch_batch(&self, requests: Vec<SeqRequest>) -> LinkFuture<BatchOutcome> {
        let dispatcher = self.dispatcher.clone();
        Box::pin(async move { dispatcher.dispatch_batch(requests).await })
    }

    fn cancel(&self, worker: WorkerId, streams: Vec<(StreamId, u32)>) {
        let nats = self.dispatcher.nats.clone();
        actix::spawn(async move {
            if let Err(e) = nats.cancel(worker, streams).await {
                warn!(%worker, error = %e, "cannot publish a cancel");
            }
        });
    }

    fn probe(
        &self,
        worker: WorkerId,
        streams: Vec<(StreamId, u32)>,
        timeout: Duration,
    ) -> LinkFuture<Probe> {
        let nats = self.dispatcher.nats.clone();
        Box::pin(async move { nats.probe(worker, streams, timeout).await })
    }

    fn release(&self, worker: WorkerId) {
        self.dispatcher.registry.do_send(ReleaseWorker { worker });
    }

    fn forget(&self, worker: WorkerId) {
        self.dispatcher.registry.do_send(ForgetWorker { worker });
    }

    fn forget_sequences(&self, worker: WorkerId) {
        self.dispatcher.nats.forget_worker(worker);
    }
}

/// An in-memory link for tests: workers in a list take every sequence (the first one
/// not excluded), and every call is recorded.
#[cfg(test)]
pub mod fake {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;
    use crate::actors::router::RouteError;

    /// What the fake link was asked.
    #[derive(Debug, Default)]
    pub struct Calls {
        /// Sequences offered, with the worker that took each (`None`: none).
        pub dispatched: Vec<(SeqRequest, Option<WorkerId>)>,
        /// Cancels sent.
        pub cancelled: Vec<(WorkerId, StreamId, u32)>,
        /// Releases.
        pub released: Vec<WorkerId>,
    }

    /// Workers that accept everything.
    #[derive(Debug, Clone, Default)]
    pub struct FakeLink {
        /// The workers, in order of preference.
        pub workers: Rc<RefCell<Vec<WorkerId>>>,
        /// What was asked.
        pub calls: Rc<RefCell<Calls>>,
    }

    impl FakeLink {
        fn take(&self, request: &SeqRequest, exclude: &[WorkerId]) -> Result<Bound, DispatchError> {
            let worker = self
                .workers
                .borrow()
                .iter()
                .copied()
                .find(|w| !exclude.contains(w));
            self.calls
                .borrow_mut()
                .dispatched
                .push((request.clone(), worker));
            match worker {
                Some(worker) => Ok(Bound {
                    worker,
                    prompt_tokens: 3,
                }),
                None => Err(DispatchError::Route(RouteError::NoLiveWorkers)),
            }
        }
    }

    impl WorkerLink for FakeLink {
        fn dispatch(
            &self,
            request: SeqRequest,
            exclude: Vec<WorkerId>,
            _deadline: Option<Instant>,
        ) -> LinkFuture<Result<Bound, DispatchError>> {
            let result = self.take(&request, &exclude);
            Box::pin(async move { result })
        }

        fn dispatch_batch(&self, requests: Vec<SeqRequest>) -> LinkFuture<BatchOutcome> {
            let results: Vec<_> = requests
                .into_iter()
                .map(|r| {
                    let result = self.take(&r, &[]);
                    (r, result)
                })
                .collect();
            let worker = results
                .first()
                .and_then(|(_, r)| r.as_ref().ok().map(|b| b.worker));
            Box::pin(async move { (worker, results) })
        }

        fn cancel(&self, worker: WorkerId, streams: Vec<(StreamId, u32)>) {
            let mut calls = self.calls.borrow_mut();
            for (stream, attempt) in streams {
                calls.cancelled.push((worker, stream, attempt));
            }
        }

        fn probe(
            &self,
            worker: WorkerId,
            _streams: Vec<(StreamId, u32)>,
            _timeout: Duration,
        ) -> LinkFuture<Probe> {
            let alive = self.workers.borrow().contains(&worker);
            Box::pin(async move {
                match alive {
                    true => Probe::Alive(Vec::new()),
                    false => Probe::Gone,
                }
            })
        }

        fn release(&self, worker: WorkerId) {
            self.calls.borrow_mut().released.push(worker);
        }

        fn forget(&self, worker: WorkerId) {
            self.workers.borrow_mut().retain(|w| *w != worker);
        }

        fn forget_sequences(&self, _worker: WorkerId) {}
    }
}
