//! One soak stream against its reference, token by token.

use std::collections::BTreeSet;

use crate::http::SseEvent;
use crate::tap::TappedStream;

/// What a client saw of one stream, token by token.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The stream id of the events' `id:` fields.
    pub stream: String,
    /// `(position, text)` of each text event, in the order they came.
    pub tokens: Vec<(u64, String)>,
    /// The final chunk's `finish_reason`.
    pub finish_reason: Option<String>,
    /// The position in the final chunk's `id:` (the number of generated tokens).
    pub final_position: Option<u64>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

impl Record {
    /// The text of the answer.
    pub fn text(&self) -> String {
        self.tokens.iter().map(|(_, t)| t.as_str()).collect()
    }
}

/// The record of a whole stream's events, or why it is not a complete one: an error
/// event, no `[DONE]`, an event without `id:` or with another stream's.
pub fn record(events: &[SseEvent]) -> Result<Record, String> {
    let mut r = Record {
        stream: String::new(),
        tokens: Vec::new(),
        finish_reason: None,
        final_position: None,
        prompt_tokens: None,
        completion_tokens: None,
    };
    let mut done = false;
    for e in events {
        if e.event.as_deref() == Some("error") {
            return Err(format!("error event: {}", e.data));
        }
        if e.is_done() {
            done = true;
            continue;
        }
        let (Some(stream), Some(position)) = (e.stream_id(), e.position()) else {
            return Err(format!(
                "an event without a `<stream>:<position>` id: {e:?}"
            ));
        };
        if r.stream.is_empty() {
            r.stream = stream.to_string();
        } else if r.stream != stream {
            return Err(format!("events of two streams: {} and {stream}", r.stream));
        }
        let text = e.text();
        if !text.is_empty() {
            r.tokens.push((position, text));
        }
        let Some(json) = e.json() else { continue };
        for c in json["choices"].as_array().into_iter().flatten() {
            if let Some(reason) = c["finish_reason"].as_str() {
                r.finish_reason = Some(reason.to_string());
                r.final_position = Some(position);
            }
        }
        if let Some(n) = json["usage"]["prompt_tokens"].as_u64() {
            r.prompt_tokens = Some(n);
        }
        if let Some(n) = json["usage"]["completion_tokens"].as_u64() {
            r.completion_tokens = Some(n);
        }
    }
    if !done {
        return Err("no [DONE]".into());
    }
    Ok(r)
}

/// An uninterrupted run of a request: what a client saw, and the token ids the tap saw.
#[derive(Debug, Clone)]
pub struct Reference {
    /// The client's view.
    pub record: Record,
    /// Token ids at positions `0..completion_tokens`.
    pub ids: Vec<u32>,
}

impl Reference {
    /// A reference from an uninterrupted run; an error when the run is not a clean one
    /// (usage missing, the tap short of ids, positions not going up).
    pub fn new(record: Record, tapped: Option<TappedStream>) -> Result<Reference, String> {
        let n = record
            .completion_tokens
            .ok_or("the reference run has no usage.completion_tokens")?;
        if record.tokens.windows(2).any(|w| w[1].0 <= w[0].0) {
            return Err(format!(
                "the reference run's positions do not go up: {:?}",
                record.tokens
            ));
        }
        let tapped = tapped.ok_or("the tap saw nothing of the reference run")?;
        let mut ids = tapped.id_sequence();
        if (ids.len() as u64) < n || tapped.conflicts > 0 || tapped.failed_over() {
            return Err(format!(
                "the tap saw {} of the reference run's {n} token ids ({} conflicts, attempts {:?})",
                ids.len(),
                tapped.conflicts,
                tapped.attempts
            ));
        }
        ids.truncate(n as usize);
        Ok(Reference { record, ids })
    }

    /// Generated tokens.
    pub fn tokens(&self) -> u64 {
        self.ids.len() as u64
    }
}

/// How one stream differs from its reference; all zero (and `ending` false) when it is
/// identical.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Diff {
    /// Reference positions the client never got.
    pub lost: u64,
    /// Events whose position is not above the one before (a token sent again).
    pub repeated: u64,
    /// Positions whose text differs, or that the reference does not have.
    pub differing: u64,
    /// Steps of more than one between consecutive event ids that the reference does not
    /// have (it skips positions of tokens with no text of their own).
    pub gaps: u64,
    /// Finish reason, usage or final position differ.
    pub ending: bool,
    /// Token ids the tap compared with the reference's.
    pub ids_checked: u64,
    /// Of those, ids that differ, plus positions sent again with another id.
    pub id_mismatches: u64,
    /// Reference positions whose id the tap did not see.
    pub ids_unseen: u64,
}

impl Diff {
    /// Whether the stream is identical to its reference (ids the tap missed aside).
    pub fn identical(&self) -> bool {
        self.lost == 0
            && self.repeated == 0
            && self.differing == 0
            && self.gaps == 0
            && !self.ending
            && self.id_mismatches == 0
    }
}

/// Compares a stream (and what the tap saw of it) with its reference.
pub fn compare(run: &Record, tapped: Option<&TappedStream>, reference: &Reference) -> Diff {
    let want = &reference.record;
    let mut d = Diff::default();
    let positions: Vec<u64> = run.tokens.iter().map(|(p, _)| *p).collect();
    let want_positions: BTreeSet<u64> = want.tokens.iter().map(|(p, _)| *p).collect();
    let steps: BTreeSet<(u64, u64)> = want.tokens.windows(2).map(|w| (w[0].0, w[1].0)).collect();
    for w in positions.windows(2) {
        if w[1] <= w[0] {
            d.repeated += 1;
        } else if w[1] > w[0] + 1 && !steps.contains(&(w[0], w[1])) {
            d.gaps += 1;
        }
    }
    let got: BTreeSet<u64> = positions.iter().copied().collect();
    d.lost = want_positions.difference(&got).count() as u64;
    for (p, text) in &run.tokens {
        let same = want
            .tokens
            .iter()
            .find(|(q, _)| q == p)
            .is_some_and(|(_, t)| t == text);
        if !same {
            d.differing += 1;
        }
    }
    d.ending = run.finish_reason != want.finish_reason
        || run.final_position != want.final_position
        || run.prompt_tokens != want.prompt_tokens
        || run.completion_tokens != want.completion_tokens;
    match tapped {
        Some(t) => {
            let seen = t.id_sequence();
            for (p, id) in reference.ids.iter().enumerate() {
                match seen.get(p) {
                    Some(got) => {
                        d.ids_checked += 1;
                        if got != id {
                            d.id_mismatches += 1;
                        }
                    }
                    None => d.ids_unseen += 1,
                }
            }
            d.id_mismatches += u64::from(t.conflicts);
        }
        None => d.ids_unseen = reference.tokens(),
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tokens: &[(u64, &str)]) -> Record {
        let n = tokens.last().map_or(0, |(p, _)| p + 1);
        Record {
            stream: "s".into(),
            tokens: tokens.iter().map(|(p, t)| (*p, t.to_string())).collect(),
            finish_reason: Some("length".into()),
            final_position: Some(n),
            prompt_tokens: Some(5),
            completion_tokens: Some(n),
        }
    }

    fn reference(tokens: &[(u64, &str)]) -> Reference {
        let record = rec(tokens);
        let ids = (0..record.completion_tokens.unwrap_or(0) as u32).collect();
        Reference { record, ids }
    }

    fn tapped(ids: &[u32], attempts: &[u32]) -> TappedStream {
        TappedStream {
            ids: ids
                .iter()
                .enumerate()
                .map(|(p, id)| (p as u32, *id))
                .collect(),
            conflicts: 0,
            attempts: attempts.iter().copied().collect(),
            finished: true,
        }
    }

    #[test]
    fn an_identical_stream_has_no_difference() {
        let r = reference(&[(0, "a"), (1, "b"), (2, "c")]);
        let d = compare(&r.record, Some(&tapped(&[0, 1, 2], &[0, 1])), &r);
        assert!(d.identical(), "{d:?}");
        assert_eq!(d.ids_checked, 3);
    }

    #[test]
    fn lost_repeated_and_differing_tokens_are_counted() {
        let r = reference(&[(0, "a"), (1, "b"), (2, "c"), (3, "d")]);
        let t = tapped(&[0, 1, 2, 3], &[0]);
        let lost = rec(&[(0, "a"), (2, "c"), (3, "d")]);
        let d = compare(&lost, Some(&t), &r);
        assert_eq!((d.lost, d.gaps, d.repeated), (1, 1, 0));
        let again = rec(&[(0, "a"), (1, "b"), (1, "b"), (2, "c"), (3, "d")]);
        let d = compare(&again, Some(&t), &r);
        assert_eq!((d.lost, d.gaps, d.repeated), (0, 0, 1));
        let other = rec(&[(0, "a"), (1, "x"), (2, "c"), (3, "d")]);
        let d = compare(&other, Some(&t), &r);
        assert_eq!(d.differing, 1);
        assert!(!d.identical());
    }

    #[test]
    fn gaps_the_reference_has_are_not_counted() {
        // Position 1's token had no text of its own (part of a character).
        let r = reference(&[(0, "a"), (2, "é"), (3, "d")]);
        let run = r.record.clone();
        let d = compare(&run, Some(&tapped(&[0, 1, 2, 3], &[0])), &r);
        assert!(d.identical(), "{d:?}");
    }

    #[test]
    fn token_ids_are_compared_and_conflicts_counted() {
        let r = reference(&[(0, "a"), (1, "b"), (2, "c")]);
        let mut t = tapped(&[0, 9, 2], &[0, 1]);
        let d = compare(&r.record, Some(&t), &r);
        assert_eq!((d.ids_checked, d.id_mismatches), (3, 1));
        t.ids.insert(1, 1);
        t.conflicts = 1;
        assert_eq!(compare(&r.record, Some(&t), &r).id_mismatches, 1);
        t.ids.remove(&2);
        t.conflicts = 0;
        let d = compare(&r.record, Some(&t), &r);
        assert!(d.identical());
        assert_eq!(d.ids_unseen, 1);
    }

    #[test]
    fn records_need_done_and_ids() {
        let event = |id: Option<&str>, data: &str| SseEvent {
            id: id.map(str::to_string),
            event: None,
            data: data.to_string(),
        };
        let events = vec![
            event(Some("s:0"), r#"{"choices":[{"delta":{"content":"Hi"}}]}"#),
            event(
                Some("s:1"),
                r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#,
            ),
            event(
                Some("s:1"),
                r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
            ),
            event(None, "[DONE]"),
        ];
        let r = record(&events).expect("a complete stream");
        assert_eq!(r.tokens, vec![(0, "Hi".to_string())]);
        assert_eq!(r.final_position, Some(1));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (Some(3), Some(1)));
        assert!(record(&events[..3]).is_err());
        let mut no_id = events.clone();
        no_id[0].id = None;
        assert!(record(&no_id).is_err());
    }
}
