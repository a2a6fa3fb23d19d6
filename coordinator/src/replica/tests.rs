use super::*;
use crate::store::{encode_token, Endpoint, StreamEnd};
use baton_common::protocol::{
    FinishReason, Finished, GenParams, PromptSpec, SeqRequest, TokenEvent,
};

fn record(end: Option<StreamEnd>) -> StreamRecord {
    StreamRecord {
        request: SeqRequest {
            stream: StreamId(9),
            model: "m".into(),
            prompt: PromptSpec::Text("hi".into()),
            params: GenParams::greedy(4),
            attempt: 0,
            resume: None,
            max_prompt_tokens: 0,
        },
        endpoint: Endpoint::Chat,
        include_usage: false,
        created: 1,
        attempt: 2,
        worker: None,
        end,
        ended_at: 0,
        owner: None,
        prompt: None,
        choice: 0,
    }
}

fn token(index: u32, text: &str) -> TokenEvent {
    TokenEvent {
        index,
        id: 100 + index,
        hash: u64::from(index) * 31,
        text: text.into(),
        logprobs: None,
        tool_calls: Vec::new(),
    }
}

/// A token message as the writer builds it.
fn tokens_message(tokens: &[TokenEvent]) -> Vec<u8> {
    let mut payload = vec![TOKENS];
    for t in tokens {
        let entry = encode_token(t);
        payload.extend_from_slice(&t.index.to_le_bytes());
        payload.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        payload.extend_from_slice(&entry);
    }
    payload
}

#[test]
fn values_and_messages_read_back() {
    let stream = StreamId(9);
    let owner = CoordinatorId(0xfeed);
    let value = record_value(owner, &record(None));
    let (back_owner, back) = decode_value(stream, &value).expect("decodes");
    assert_eq!((back_owner, back), (owner, record(None)));

    let tokens = [token(0, "a"), token(1, "é"), token(2, "")];
    match decode_message(stream, &tokens_message(&tokens)).expect("decodes") {
        Message::Tokens(back) => {
            let back: Vec<TokenEvent> = back.into_iter().map(TokenEvent::from).collect();
            assert_eq!(back, tokens);
        }
        Message::End(_) => panic!("tokens read as an end"),
    }

    let ended = record(Some(StreamEnd::Finished(Finished {
        reason: FinishReason::Length,
        prompt_tokens: 3,
        completion_tokens: 4,
        cached_tokens: 0,
    })));
    let mut end = vec![END];
    end.extend_from_slice(&record_value(owner, &ended));
    match decode_message(stream, &end).expect("decodes") {
        Message::End(back) => assert_eq!(*back, ended),
        Message::Tokens(_) => panic!("an end read as tokens"),
    }
}

#[test]
fn damaged_values_and_messages_are_errors_never_panics() {
    let stream = StreamId(9);
    let value = record_value(CoordinatorId(1), &record(None));
    for cut in 0..value.len() {
        assert!(
            decode_value(stream, &value[..cut]).is_err(),
            "cut {cut} decodes"
        );
    }
    let message = tokens_message(&[token(0, "ab"), token(1, "cd")]);
    let boundary = 1 + 8 + encode_token(&token(0, "ab")).len();
    for cut in 1..message.len() {
        // A cut at a token's boundary is a shorter batch; any other cut is an error.
        if let Ok(Message::Tokens(t)) = decode_message(stream, &message[..cut]) {
            assert!(
                (cut == 1 && t.is_empty()) || (cut == boundary && t.len() == 1),
                "cut {cut} decodes"
            );
        }
    }
    assert!(decode_message(stream, &[]).is_err());
    assert!(decode_message(stream, &[7, 1, 2, 3]).is_err());
    assert!(decode_message(stream, &[END, 1, 2]).is_err());
}

#[test]
fn feeds_skip_what_the_client_has_and_check_its_hash() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut feed = Feed {
        next: 2,
        expect: Some((1, 31)),
        ahead: BTreeMap::new(),
        tx,
    };
    let batch = (0..4).map(|i| stored(token(i, "x"))).collect();
    assert_eq!(feed.tokens(batch), Ok(()));
    // Position 3 written twice (by a dead owner, then by the one that took over).
    assert_eq!(
        feed.tokens(vec![stored(token(3, "x")), stored(token(4, "y"))]),
        Ok(())
    );
    let mut got = Vec::new();
    while let Ok(Update::Token { index, .. }) = rx.try_recv() {
        got.push(index);
    }
    assert_eq!(got, vec![2, 3, 4]);

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut feed = Feed {
        next: 2,
        expect: Some((1, 999)),
        ahead: BTreeMap::new(),
        tx,
    };
    assert_eq!(feed.tokens(vec![stored(token(1, "x"))]), Err(1));
    assert!(matches!(rx.try_recv(), Ok(Update::Failed(_))));
}

fn stored(t: TokenEvent) -> StoredToken {
    decode_entry(t.index, &encode_token(&t)).expect("entry")
}

fn finished() -> StreamRecord {
    record(Some(StreamEnd::Finished(Finished {
        reason: FinishReason::Length,
        prompt_tokens: 3,
        completion_tokens: 6,
        cached_tokens: 0,
    })))
}

#[test]
fn a_write_tried_again_after_later_ones_reads_in_order() {
    // Positions 2–3 were tried again after 4–5 landed; 4 also arrived twice.
    let arrived = [0, 1, 4, 5, 2, 3, 4]
        .map(|i| stored(token(i, &format!("t{i}"))))
        .to_vec();
    let texts = |v: &[StoredToken]| v.iter().map(|t| t.text.clone()).collect::<Vec<_>>();
    assert_eq!(
        texts(&in_order(arrived.clone())),
        ["t0", "t1", "t2", "t3", "t4", "t5"]
    );
    // A claim keeps positions up to the first missing one.
    let gap = [0, 1, 3].map(|i| stored(token(i, "x"))).to_vec();
    assert_eq!(in_order(gap).len(), 2);

    // A follower holds what came early and sends it once the gap is filled.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut feed = Feed {
        next: 1,
        expect: None,
        ahead: BTreeMap::new(),
        tx,
    };
    for t in arrived {
        assert_eq!(feed.tokens(vec![t]), Ok(()));
    }
    feed.end(finished());
    let mut got = Vec::new();
    let mut ended = false;
    while let Ok(update) = rx.try_recv() {
        match update {
            Update::Token { index, text, .. } => got.push((index, text)),
            Update::Finished(_) => ended = true,
            _ => panic!("unexpected update"),
        }
    }
    let want: Vec<(u32, String)> = (1..6).map(|i| (i, format!("t{i}"))).collect();
    assert_eq!(got, want);
    assert!(ended);
}

#[test]
fn an_end_after_a_gap_fails_the_feed_instead_of_finishing_short() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut feed = Feed {
        next: 0,
        expect: None,
        ahead: BTreeMap::new(),
        tx,
    };
    let batch = [0, 1, 3].map(|i| stored(token(i, "x"))).to_vec();
    assert_eq!(feed.tokens(batch), Ok(()));
    feed.end(finished());
    let updates: Vec<Update> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    assert_eq!(updates.len(), 3, "two tokens, then the failure");
    match updates.last() {
        Some(Update::Failed(e)) => {
            assert!(e.message.contains("lacks position 2"), "{}", e.message)
        }
        _ => panic!("the feed finished with a position missing"),
    }
}
