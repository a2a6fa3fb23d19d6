//! Structured output's grammars, compiled with llguidance.
//!
//! A [`Grammar`] travels as the client wrote it. The coordinator compiles it once
//! against a one-byte-per-token vocabulary ([`check`]) so that a schema or expression
//! that cannot be used is a 400 before anything is dispatched; the worker compiles it
//! against its model's tokenizer ([`top_level`] and a `ParserFactory` of its own) and
//! masks each draw with the tokens the grammar allows.
//!
//! JSON is generated compact (`", "` between items, `": "` after keys, no other
//! whitespace) unless the schema's own `x-guidance` object says otherwise: with free
//! whitespace a small model can fill its whole budget with newlines inside an object.

use std::sync::OnceLock;

use llguidance::{api::TopLevelGrammar, ParserFactory};
use serde_json::{json, Value};

use crate::protocol::Grammar;

/// The grammar engine and its version: part of every worker's model fingerprint, since
/// another version may allow other tokens at the same point (a test checks it against
/// `Cargo.lock`).
pub const ENGINE: &str = "llguidance 1.9.1";

/// Why a grammar cannot be used.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum GrammarError {
    /// A JSON schema that is not JSON, or not an object or boolean.
    #[error("the JSON schema is not valid JSON: {0}")]
    NotJson(String),
    /// llguidance refused it (an unknown type, an unsupported keyword, a bad regex, a
    /// grammar over its size limits, …).
    #[error("{0}")]
    Compile(String),
}

/// The schema's JSON with Baton's default layout options, unless it brings its own.
fn schema_value(text: &str) -> Result<Value, GrammarError> {
    let mut schema: Value =
        serde_json::from_str(text).map_err(|e| GrammarError::NotJson(e.to_string()))?;
    match &mut schema {
        Value::Object(_) => compact_layout(&mut schema),
        Value::Bool(_) => {}
        other => {
            return Err(GrammarError::NotJson(format!(
                "a schema is an object or a boolean, not {}",
                match other {
                    Value::Null => "null",
                    Value::Number(_) => "a number",
                    Value::String(_) => "a string",
                    _ => "an array",
                }
            )))
        }
    }
    Ok(schema)
}

/// Gives an object schema Baton's compact layout, unless it has its own `x-guidance`.
pub fn compact_layout(schema: &mut Value) {
    if let Value::Object(map) = schema {
        if !map.contains_key("x-guidance") {
            map.insert(
                "x-guidance".into(),
                json!({
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                }),
            );
        }
    }
}

/// The grammar in llguidance's terms.
pub fn top_level(grammar: &Grammar) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match grammar {
        Grammar::JsonSchema(text) => TopLevelGrammar::from_json_schema(schema_value(text)?),
        Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
    })
}

/// Compiles `grammar` against a vocabulary of single bytes: every error the grammar
/// itself can cause shows here, whatever the model's tokenizer.
pub fn check(grammar: &Grammar) -> Result<(), GrammarError> {
    static FACTORY: OnceLock<ParserFactory> = OnceLock::new();
    let factory = FACTORY.get_or_init(|| {
        let env = toktrie::ApproximateTokEnv::single_byte_env();
        let mut factory =
            ParserFactory::new_simple(&env).expect("a single-byte vocabulary makes a factory");
        factory.quiet();
        factory
    });
    factory
        .create_parser(top_level(grammar)?)
        .map(drop)
        .map_err(|e| GrammarError::Compile(first_line(&e.to_string())))
}

/// llguidance's messages can run over several lines (a regex with a caret under it):
/// one line, its parts joined.
pub fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.chars().all(|c| c == '^' || c == ' '))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A regular expression matching exactly one of `choices` (vLLM's `guided_choice`).
pub fn choice_regex(choices: &[String]) -> String {
    choices
        .iter()
        .map(|c| regex_escape(c))
        .collect::<Vec<_>>()
        .join("|")
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_grammars_compile_and_bad_ones_name_their_fault() {
        let ok = [
            Grammar::JsonSchema(r#"{"type":"object"}"#.into()),
            Grammar::JsonSchema(
                r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#
                    .into(),
            ),
            Grammar::JsonSchema("true".into()),
            Grammar::Regex(r"\d{3}-[a-z]+".into()),
            Grammar::Lark(r#"start: "yes" | "no""#.into()),
            Grammar::Regex(choice_regex(&["a.b".into(), "c|d".into(), "(x) y".into()])),
        ];
        for g in &ok {
            assert_eq!(check(g), Ok(()), "{g:?}");
        }
        let bad = [
            (Grammar::JsonSchema("{not json".into()), "not valid JSON"),
            (Grammar::JsonSchema("42".into()), "not a number"),
            (Grammar::JsonSchema(r#"{"type":"objekt"}"#.into()), "objekt"),
            (Grammar::Regex("((".into()), "unclosed group"),
            (
                Grammar::Lark("start: undefined_rule".into()),
                "undefined_rule",
            ),
        ];
        for (g, needle) in &bad {
            let e = check(g).expect_err("must not compile").to_string();
            assert!(e.contains(needle), "{g:?}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn the_engine_version_is_the_locked_one() {
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"))
            .expect("the workspace's Cargo.lock");
        let version = lock
            .split("[[package]]")
            .find(|p| p.contains("name = \"llguidance\""))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
            .expect("llguidance in Cargo.lock")
            .trim_matches('"');
        assert_eq!(ENGINE, format!("llguidance {version}"));
    }

    #[test]
    fn choices_match_themselves_only() {
        let rx = choice_regex(&["a.b".into(), "yes".into()]);
        assert_eq!(rx, r"a\.b|yes");
    }
}
