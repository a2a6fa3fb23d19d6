//! Token logprobs in OpenAI's two shapes.
//!
//! Chat answers carry `logprobs: {"content": [{"token", "logprob", "bytes",
//! "top_logprobs": [...]}, ...], "refusal": null}`; text completions carry the legacy
//! `logprobs: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
//! "text_offset"}`. A streamed chunk carries the entries of the tokens since the last
//! chunk: a token whose text is held back (part of a character, or of a possible stop
//! string) has its entry sent with the next chunk that has text, or with the final one.
//! `text_offset` is the worker's: where the token's text starts in the output's text.

use baton_common::protocol::{PromptEcho, TokenLogprobs};
use serde::Serialize;
use serde_json::{Map, Value};

use super::validate::Endpoint;

/// What JSON has for a log-probability of −∞ (a token no draw could pick): OpenAI's
/// floor.
const FLOOR: f32 = -9999.0;

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        FLOOR
    }
}

/// A token's text as clients read it: its bytes as UTF-8, with U+FFFD for a character
/// it holds only part of (its `bytes` are exact).
fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[derive(Debug, Serialize)]
struct ChatTop {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

#[derive(Debug, Serialize)]
struct ChatEntry {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<ChatTop>,
}

/// Collects the entries of one answer (or of one chunk at a time) in the shape of its
/// endpoint.
#[derive(Debug, Clone)]
pub struct LogprobsWriter {
    endpoint: Endpoint,
    /// Entries not yet sent; `None` the first token of an echoed prompt's bytes (it has
    /// no log-probability).
    pending: Vec<(Option<TokenLogprobs>, Vec<u8>)>,
    /// Whether the request asked for logprobs.
    asked: bool,
    /// Characters of an echoed prompt: generated tokens' offsets count from its end.
    shift: u32,
}

impl LogprobsWriter {
    /// A writer for answers of `endpoint` to a request that `asked` for logprobs or not.
    pub fn new(endpoint: Endpoint, asked: bool) -> Self {
        Self {
            endpoint,
            pending: Vec::new(),
            asked,
            shift: 0,
        }
    }

    /// Adds a token's logprobs (`None`: the request did not ask).
    pub fn push(&mut self, logprobs: Option<&TokenLogprobs>) {
        if let Some(l) = logprobs {
            let l = TokenLogprobs {
                text_offset: l.text_offset + self.shift,
                ..l.clone()
            };
            let bytes = l.bytes.clone();
            self.pending.push((Some(l), bytes));
        }
    }

    /// Adds an echoed prompt's entries (a completion's `echo`): its first token without
    /// a log-probability, then the others; later tokens' offsets count from its end.
    pub fn push_prompt(&mut self, prompt: &PromptEcho) {
        self.shift = prompt.text.chars().count() as u32;
        if !self.asked {
            return;
        }
        self.pending.push((None, prompt.first.clone()));
        for l in &prompt.logprobs {
            self.pending.push((Some(l.clone()), l.bytes.clone()));
        }
    }

    /// The `logprobs` value of the entries pushed since the last call: null when the
    /// request did not ask.
    pub fn take(&mut self) -> Option<Value> {
        if !self.asked {
            return None;
        }
        let entries = std::mem::take(&mut self.pending);
        Some(match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<ChatEntry> = entries
                    .into_iter()
                    .filter_map(|(l, _)| l)
                    .map(|l| ChatEntry {
                        token: token_text(&l.bytes),
                        logprob: finite(l.logprob),
                        top_logprobs: l
                            .top
                            .into_iter()
                            .map(|t| ChatTop {
                                token: token_text(&t.bytes),
                                logprob: finite(t.logprob),
                                bytes: t.bytes,
                            })
                            .collect(),
                        bytes: l.bytes,
                    })
                    .collect();
                serde_json::json!({"content": content, "refusal": null})
            }
            Endpoint::Completion => {
                let mut tokens = Vec::with_capacity(entries.len());
                let mut token_logprobs = Vec::with_capacity(entries.len());
                let mut top_logprobs = Vec::with_capacity(entries.len());
                let mut text_offset = Vec::with_capacity(entries.len());
                for (l, bytes) in entries {
                    tokens.push(token_text(&bytes));
                    let Some(l) = l else {
                        // An echoed prompt's first token: nothing before it to score it.
                        text_offset.push(0);
                        token_logprobs.push(Value::Null);
                        top_logprobs.push(Value::Null);
                        continue;
                    };
                    text_offset.push(l.text_offset);
                    token_logprobs.push(Value::from(finite(l.logprob)));
                    let mut top = Map::new();
                    for t in l.top {
                        // Two tokens spelled alike keep the likelier one's entry.
                        top.entry(token_text(&t.bytes))
                            .or_insert(Value::from(finite(t.logprob)));
                    }
                    top_logprobs.push(Value::Object(top));
                }
                serde_json::json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top_logprobs,
                    "text_offset": text_offset,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_common::protocol::TopLogprob;
    use serde_json::json;

    fn entry(bytes: &[u8], logprob: f32, top: &[(&[u8], f32)]) -> TokenLogprobs {
        TokenLogprobs {
            logprob,
            bytes: bytes.to_vec(),
            text_offset: 0,
            top: top
                .iter()
                .enumerate()
                .map(|(i, (b, l))| TopLogprob {
                    id: i as u32,
                    logprob: *l,
                    bytes: b.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn nothing_asked_is_null() {
        let mut w = LogprobsWriter::new(Endpoint::Chat, false);
        w.push(None);
        assert_eq!(w.take(), None);
    }

    #[test]
    fn chat_entries_have_openais_shape() {
        let mut w = LogprobsWriter::new(Endpoint::Chat, true);
        w.push(Some(&entry(
            b"Hi",
            -0.5,
            &[(b"Hi", -0.5), (b"\xc3", f32::NEG_INFINITY)],
        )));
        assert_eq!(
            w.take(),
            Some(
                json!({"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                 {"token": "\u{fffd}", "logprob": -9999.0, "bytes": [195]}]}],
                "refusal": null})
            )
        );
        // Asked, but no token since the last chunk: an empty list, not null.
        assert_eq!(w.take(), Some(json!({"content": [], "refusal": null})));
    }

    #[test]
    fn completion_entries_have_the_legacy_shape() {
        let mut w = LogprobsWriter::new(Endpoint::Completion, true);
        w.push(Some(&entry(b" a", -1.0, &[(b" a", -1.0), (b" b", -2.0)])));
        w.push(Some(&TokenLogprobs {
            text_offset: 2,
            ..entry("é".as_bytes(), -0.25, &[])
        }));
        assert_eq!(
            w.take(),
            Some(
                json!({"tokens": [" a", "é"], "token_logprobs": [-1.0, -0.25],
                        "top_logprobs": [{" a": -1.0, " b": -2.0}, {}],
                        "text_offset": [0, 2]})
            )
        );
        // A chunk of no token (a reconnect that had everything but the end) still
        // carries the shape.
        assert_eq!(w.take().expect("asked")["tokens"], json!([]));
    }

    #[test]
    fn an_echoed_prompt_comes_first_and_shifts_the_offsets() {
        let mut w = LogprobsWriter::new(Endpoint::Completion, true);
        w.push_prompt(&PromptEcho {
            text: "Hi you".into(),
            first: b"Hi".to_vec(),
            logprobs: vec![TokenLogprobs {
                text_offset: 2,
                ..entry(b" you", -2.5, &[(b" there", -0.5)])
            }],
        });
        w.push(Some(&entry(b"!", -1.0, &[])));
        assert_eq!(
            w.take(),
            Some(json!({"tokens": ["Hi", " you", "!"],
                        "token_logprobs": [null, -2.5, -1.0],
                        "top_logprobs": [null, {" there": -0.5}, {}],
                        "text_offset": [0, 2, 6]}))
        );
    }
}
