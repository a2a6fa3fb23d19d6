//! What the `wire` fuzz target runs (`fuzz/fuzz_targets/wire.rs`), here so that
//! `cargo test` replays the inputs in `fuzz/regressions/wire/` through the very same code.
//!
//! [`wire`] hands arbitrary bytes to every checked decoder of bytes that arrive over
//! NATS: coordinator ⇄ worker messages ([`crate::protocol::decode`]), the public API's
//! rkyv replies ([`crate::public::decode_reply`]), its JSON admin bodies and the ids in
//! its headers. A decoder may refuse the bytes; it must never panic. What it accepts
//! must survive a round trip: encoding the decoded value and decoding that again gives
//! the same bytes.

use crate::ids::{CoordinatorId, StreamId, WorkerId};
use crate::protocol::{decode, encode};
use crate::public::{decode_reply, encode_reply, DrainRequest, ReplayRequest};

/// Runs `target` on every file in `fuzz/regressions/<name>/` (the inputs that fuzz
/// target once crashed on; hidden files skipped), for the crates' regression tests.
/// Panics if the folder cannot be read, as a missing folder would silently test nothing.
/// The folder is found from the crate directory `cargo test` gives the test at run time
/// (every crate sits beside `fuzz/`), else the one this crate was built from: a test
/// binary reused from a build of another checkout reads this checkout's inputs.
pub fn replay(name: &str, mut target: impl FnMut(&[u8])) {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let dir = crate_dir.join("../fuzz/regressions").join(name);
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        {
            continue;
        }
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("replaying {}", path.display());
        target(&data);
    }
}

/// Feeds `data` to every wire decoder; panics only on a bug (a decoder that panics, or
/// a value that does not survive its round trip).
pub fn wire(data: &[u8]) {
    if let Ok(message) = decode(data) {
        // Compared as bytes: a NaN in a float field is not equal to itself.
        let bytes = encode(&message);
        let again = decode(&bytes).expect("a decoded message encodes to a valid one");
        assert_eq!(encode(&again), bytes, "a message changed in a round trip");
    }
    if let Ok(reply) = decode_reply(data) {
        let bytes = encode_reply(&reply);
        let again = decode_reply(&bytes).expect("a decoded reply encodes to a valid one");
        assert_eq!(
            encode_reply(&again),
            bytes,
            "a reply changed in a round trip"
        );
    }
    if let Ok(replay) = serde_json::from_slice::<ReplayRequest>(data) {
        let json = serde_json::to_vec(&replay).expect("a replay request serializes");
        let again: ReplayRequest = serde_json::from_slice(&json).expect("its JSON parses");
        assert_eq!(again, replay, "a replay request changed in a round trip");
    }
    if let Ok(drain) = serde_json::from_slice::<DrainRequest>(data) {
        let json = serde_json::to_vec(&drain).expect("a drain request serializes");
        let again: DrainRequest = serde_json::from_slice(&json).expect("its JSON parses");
        assert_eq!(again, drain, "a drain request changed in a round trip");
    }
    // Header values (`Baton-Stream-Id`, `Baton-Coordinator`) and admin paths carry ids.
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(id) = text.parse::<StreamId>() {
            assert_eq!(id.to_string().parse::<StreamId>().ok(), Some(id));
        }
        let _ = text.parse::<WorkerId>();
        let _ = text.parse::<CoordinatorId>();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Body, Cancel, Envelope, StreamAttempt, Wire, PROTOCOL_VERSION};

    #[test]
    fn valid_and_invalid_inputs_pass() {
        let message = encode(&Wire {
            envelope: Envelope {
                publisher: 1,
                seq: 2,
                version: PROTOCOL_VERSION,
            },
            body: Body::Cancel(Cancel {
                streams: vec![StreamAttempt {
                    stream: StreamId(3),
                    attempt: 4,
                }],
            }),
        });
        wire(&message);
        wire(&message[..message.len() / 2]);
        wire(b"");
        wire(br#"{"stream": "00000000000000000000000000000001", "after": 3}"#);
        wire(br#"{"worker": "00000000000000000000000000000002"}"#);
        wire(StreamId(5).to_string().as_bytes());
    }
}
