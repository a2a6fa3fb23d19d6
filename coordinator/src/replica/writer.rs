//! The writer task: every write to JetStream leaves from it, in order.

use super::*;

/// The writer: sends each write as it comes, keeps the acknowledgements in order, and
/// answers each flush once everything before it is acknowledged.
pub(super) async fn write(
    js: jetstream::Context,
    subjects: Subjects,
    records_bucket: String,
    records: kv::Store,
    tokens: stream::Stream,
    mut ops: mpsc::UnboundedReceiver<Op>,
) {
    type Ack = futures::future::BoxFuture<'static, Result<(), String>>;
    let mut acks: FuturesOrdered<Ack> = FuturesOrdered::new();
    let (mut sent, mut acked) = (0u64, 0u64);
    // How many writes are acknowledged (or given up), for ends waiting on them.
    let (acked_tx, acked_rx) = watch::channel(0u64);
    // Per stream, the last record written and not yet acknowledged.
    let newest: Arc<Mutex<HashMap<StreamId, u64>>> = Arc::default();
    let mut waiters: VecDeque<(u64, oneshot::Sender<Result<(), String>>)> = VecDeque::new();
    let mut failure: Option<String> = None;
    let record_subject = |stream: StreamId| format!("$KV.{records_bucket}.{}", key(stream));
    loop {
        tokio::select! {
            op = ops.recv() => {
                let Some(op) = op else { return };
                let mut batch = vec![op];
                while let Ok(op) = ops.try_recv() {
                    batch.push(op);
                }
                for op in batch {
                    let fut: Ack = match op {
                        Op::Flush(tx) => {
                            waiters.push_back((sent, tx));
                            continue;
                        }
                        Op::Record(stream, value, ended) => {
                            let at = sent;
                            newest.lock().expect("newest records").insert(stream, at);
                            let subject = record_subject(stream);
                            let first = js.publish(subject.clone(), value.clone()).await;
                            let (seen, done) = (newest.clone(), newest.clone());
                            let superseded = move || {
                                seen.lock().expect("newest records").get(&stream) != Some(&at)
                            };
                            let put = acknowledged(js.clone(), subject, value.clone(), first, superseded);
                            sent += 1;
                            acks.push_back(Box::pin(async move {
                                let result = put.await;
                                let mut newest = done.lock().expect("newest records");
                                if newest.get(&stream) == Some(&at) {
                                    newest.remove(&stream);
                                }
                                result
                            }));
                            if !ended {
                                continue;
                            }
                            // The end goes out once everything before it is in, so
                            // that no token of the stream lands after it.
                            let mut end = vec![END];
                            end.extend_from_slice(&value);
                            let (js, subject, at) = (js.clone(), subjects.checkpoint(stream), sent);
                            let mut acked = acked_rx.clone();
                            Box::pin(async move {
                                let _ = acked.wait_for(|&a| a >= at).await;
                                let end = Bytes::from(end);
                                let first = js.publish(subject.clone(), end.clone()).await;
                                acknowledged(js, subject, end, first, || false).await
                            })
                        }
                        Op::Tokens(stream, entries) => {
                            let mut payload = vec![TOKENS];
                            for (index, entry) in entries {
                                payload.extend_from_slice(&index.to_le_bytes());
                                payload.extend_from_slice(&(entry.len() as u32).to_le_bytes());
                                payload.extend_from_slice(&entry);
                            }
                            let (subject, payload) = (subjects.checkpoint(stream), Bytes::from(payload));
                            let first = js.publish(subject.clone(), payload.clone()).await;
                            Box::pin(acknowledged(js.clone(), subject, payload, first, || false))
                        }
                        Op::Remove(stream) => {
                            let (records, tokens) = (records.clone(), tokens.clone());
                            let subject = subjects.checkpoint(stream);
                            Box::pin(async move {
                                records.purge(key(stream)).await.map_err(|e| e.to_string())?;
                                tokens.purge().filter(subject).await.map_err(|e| e.to_string())?;
                                Ok(())
                            })
                        }
                    };
                    sent += 1;
                    acks.push_back(fut);
                }
            }
            Some(result) = acks.next(), if !acks.is_empty() => {
                acked += 1;
                acked_tx.send_replace(acked);
                if let Err(e) = result {
                    warn!(error = %e, "JetStream did not take a checkpoint write");
                    failure.get_or_insert(e);
                }
            }
        }
        while waiters.front().is_some_and(|(target, _)| *target <= acked) {
            let (_, tx) = waiters.pop_front().expect("a waiter");
            let _ = tx.send(failure.take().map_or(Ok(()), Err));
        }
    }
}

/// One write's acknowledgement; `first` is its first publication, made in order by the
/// writer. A write JetStream did not take is published again (after whatever was
/// written since) until it is taken, `superseded` says a newer write makes it moot, or
/// [`RETRY_FOR`] has passed.
async fn acknowledged(
    js: jetstream::Context,
    subject: String,
    payload: Bytes,
    first: Result<jetstream::context::PublishAckFuture, jetstream::context::PublishError>,
    superseded: impl Fn() -> bool,
) -> Result<(), String> {
    let mut backoff = Backoff::new(Duration::from_millis(50));
    let mut attempt = first;
    loop {
        let error = match attempt {
            Ok(ack) => match ack.await {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        debug!(%subject, %error, "JetStream did not take a checkpoint write; trying again");
        if !backoff.wait().await {
            return Err(format!("{subject}: {error}"));
        }
        if superseded() {
            return Ok(());
        }
        attempt = js.publish(subject.clone(), payload.clone()).await;
    }
}
