//! Tool calling: the functions a chat may call, the format a model calls them in, the
//! grammar that holds `tool_choice: required` (or a named function) to a valid call, and
//! the parser that finds calls in a model's output as it streams.
//!
//! Formats follow the model's chat template:
//! - **Hermes** (Qwen2.5, Qwen3, Hermes 2 and 3, …): the template lists the tools itself
//!   and the model answers `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`,
//!   one block per call.
//! - **Llama 3 JSON** (Llama 3.1–3.3): the template lists the tools; the model's whole
//!   answer is `{"name": …, "parameters": {…}}` (several separated by `;`).
//! - **Generic**: a template that takes no tools. Baton adds the Hermes instructions to
//!   the system message itself ([`generic_prompt`]) and parses the Hermes format; past
//!   calls and results are written into the turns as Hermes text.
//!
//! The parser's state is a function of the text so far, whatever its pieces: a resumed
//! stream replays its text and goes on exactly as the first attempt would have.

use serde_json::{json, Map, Value};

use crate::grammar::{self, GrammarError};
use crate::protocol::{Grammar, ToolCall, ToolChoice};

/// How a model calls tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks; the template lists the tools.
    Hermes,
    /// The whole answer is `{"name", "parameters"}`; the template lists the tools.
    Llama3Json,
    /// The template takes no tools: Baton's own prompt and the Hermes blocks.
    Generic,
}

impl ToolFormat {
    /// The format a chat template's source speaks (`None`: no template).
    pub fn of_template(source: Option<&str>) -> ToolFormat {
        match source {
            Some(s) if s.contains("<tool_call>") && s.contains("tools") => ToolFormat::Hermes,
            Some(s) if s.contains("\"parameters\": dictionary of argument name") => {
                ToolFormat::Llama3Json
            }
            _ => ToolFormat::Generic,
        }
    }

    /// Whether the template itself is given the tools and the history's calls.
    pub fn native(self) -> bool {
        self != ToolFormat::Generic
    }

    /// A short name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3-json",
            ToolFormat::Generic => "generic",
        }
    }
}

/// One function a chat may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// Most functions one request may declare.
pub const MAX_TOOLS: usize = 128;

/// Why a `tools` list cannot be used: the message names the item and its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolsError(pub String);

/// The functions of OpenAI's `tools` array: every item `{"type": "function", "function":
/// {"name", "description"?, "parameters"?, "strict"?}}`, names `[A-Za-z0-9_-]{1,64}` and
/// unique, `parameters` a JSON schema object (none: no arguments).
pub fn functions(tools: &Value) -> Result<Vec<Function>, ToolsError> {
    let bad = |m: String| Err(ToolsError(m));
    let Value::Array(items) = tools else {
        return bad("`tools` must be an array of tools".into());
    };
    if items.len() > MAX_TOOLS {
        return bad(format!(
            "`tools` holds {} tools, more than {MAX_TOOLS}",
            items.len()
        ));
    }
    let mut out: Vec<Function> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Some(obj) = item.as_object() else {
            return bad(format!("`tools[{i}]` must be an object"));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return bad(format!(
                    "`tools[{i}].type` is \"{}\"; only \"function\" is supported",
                    cut(other)
                ))
            }
            None => return bad(format!("`tools[{i}].type` must be \"function\"")),
        }
        let Some(f) = obj.get("function").and_then(Value::as_object) else {
            return bad(format!("`tools[{i}].function` must be an object"));
        };
        let name = match f.get("name").and_then(Value::as_str) {
            Some(n) if valid_name(n) => n.to_string(),
            Some(n) => {
                return bad(format!(
                    "`tools[{i}].function.name` \"{}\" must be 1 to 64 letters, digits, `_` or `-`",
                    cut(n)
                ))
            }
            None => return bad(format!("`tools[{i}].function.name` is required")),
        };
        if out.iter().any(|g| g.name == name) {
            return bad(format!(
                "`tools[{i}].function.name`: \"{name}\" is declared twice"
            ));
        }
        if let Some(d) = f.get("description") {
            if !d.is_string() && !d.is_null() {
                return bad(format!(
                    "`tools[{i}].function.description` must be a string"
                ));
            }
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return bad(format!(
                    "`tools[{i}].function.parameters` must be a JSON schema (an object)"
                ))
            }
        };
        grammar::check(&Grammar::JsonSchema(parameters.to_string())).map_err(|e| {
            ToolsError(format!(
                "`tools[{i}].function.parameters` is not a usable JSON schema: {e}"
            ))
        })?;
        out.push(Function { name, parameters });
    }
    Ok(out)
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// At most 64 characters of a client's string, for an error message.
fn cut(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The JSON schema of one call of `f` in `format`.
fn call_schema(f: &Function, format: ToolFormat) -> Value {
    let args = match format {
        ToolFormat::Llama3Json => "parameters",
        ToolFormat::Hermes | ToolFormat::Generic => "arguments",
    };
    let mut properties = Map::new();
    properties.insert("name".into(), json!({"const": f.name}));
    properties.insert(args.into(), f.parameters.clone());
    json!({
        "type": "object",
        "properties": properties,
        "required": ["name", args],
        "additionalProperties": false,
    })
}

/// The grammar a `required` or named `choice` puts on the output (`None` for `auto`):
/// one call (several with `parallel`, Hermes formats only) of the allowed functions,
/// each valid against its schema, and nothing else.
pub fn grammar(
    functions: &[Function],
    choice: &ToolChoice,
    parallel: bool,
    format: ToolFormat,
) -> Result<Option<Grammar>, GrammarError> {
    let allowed: Vec<&Function> = match choice {
        ToolChoice::Auto => return Ok(None),
        ToolChoice::Required => functions.iter().collect(),
        ToolChoice::Function(name) => functions.iter().filter(|f| &f.name == name).collect(),
    };
    let mut schemas: Vec<Value> = allowed.iter().map(|f| call_schema(f, format)).collect();
    let mut schema = match schemas.len() {
        0 => {
            return Err(GrammarError::Compile(
                "`tool_choice` names a function that `tools` does not declare".into(),
            ))
        }
        1 => schemas.remove(0),
        _ => json!({ "anyOf": schemas }),
    };
    grammar::compact_layout(&mut schema);
    Ok(Some(match format {
        ToolFormat::Llama3Json => Grammar::JsonSchema(schema.to_string()),
        ToolFormat::Hermes | ToolFormat::Generic => {
            let more = if parallel { " (\"\\n\" call)*" } else { "" };
            Grammar::Lark(format!(
                "start: call{more}\ncall: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"\n"
            ))
        }
    }))
}

/// The system text that tells a model whose template takes no tools what it may call,
/// and how (the Hermes format).
pub fn generic_prompt(tools: &Value) -> String {
    let mut out = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools.as_array().into_iter().flatten() {
        out.push('\n');
        out.push_str(&tool.to_string());
    }
    out.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    out
}

/// A past call as Hermes text (the generic format's history).
pub fn hermes_call(name: &str, arguments: &str) -> String {
    let args = serde_json::from_str::<Value>(arguments)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| arguments.to_string());
    format!(
        "{OPEN}\n{{\"name\": {}, \"arguments\": {args}}}\n{CLOSE}",
        Value::from(name)
    )
}

/// A tool's result as Hermes text (the generic format's history).
pub fn hermes_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A piece of a call found in the output, as it travels: a call's first piece has its
/// name, later ones more of its arguments; the id is left for the coordinator, which
/// names calls after their stream.
fn piece(index: u32, name: String, arguments: String) -> ToolCall {
    ToolCall {
        index,
        id: String::new(),
        name,
        arguments,
    }
}

/// What a piece of output became.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    /// Text for the reply's `content`.
    pub content: String,
    /// Calls completed.
    pub calls: Vec<ToolCall>,
}

/// Finds tool calls in an output, piece by piece. Text that may still turn out to be
/// part of a call (the start of `<tool_call>`, a Llama 3 answer that opens with `{`),
/// and whitespace that may end up between calls, is held until it is decided.
#[derive(Debug, Clone)]
pub struct ToolParser {
    format: ToolFormat,
    /// Calls found so far.
    calls: u32,
    /// Inside a `<tool_call>` block (Hermes), or in a JSON answer (Llama 3).
    in_call: bool,
    /// Llama 3: whether the answer's first character was seen.
    decided: bool,
    /// Hermes: a call whose name went out, its arguments going out as they come.
    streaming: Option<ArgScan>,
    /// Text not yet given out.
    held: String,
}

impl ToolParser {
    /// A parser for an output in `format`.
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            calls: 0,
            in_call: false,
            decided: false,
            streaming: None,
            held: String::new(),
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> u32 {
        self.calls
    }

    /// The next piece of the output's text.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        let mut out = Parsed::default();
        match self.format {
            ToolFormat::Llama3Json => self.llama3(&mut out),
            ToolFormat::Hermes | ToolFormat::Generic => self.hermes(&mut out, false),
        }
        out
    }

    /// The output ended: everything held is decided.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        match self.format {
            ToolFormat::Llama3Json => {
                let text = std::mem::take(&mut self.held);
                if self.in_call {
                    match llama3_calls(&text) {
                        Some(calls) => {
                            for (name, arguments) in calls {
                                self.found(&mut out, name, arguments);
                            }
                        }
                        None => out.content = text,
                    }
                } else {
                    out.content = text;
                }
            }
            ToolFormat::Hermes | ToolFormat::Generic => {
                self.hermes(&mut out, true);
                let text = std::mem::take(&mut self.held);
                if self.streaming.take().is_some() {
                    // Its arguments are out: the call ends with the output.
                    self.in_call = false;
                    self.calls += 1;
                } else if self.in_call {
                    // An unclosed block: a call if its JSON is whole (a model that ends
                    // without the closing tag), text otherwise.
                    self.in_call = false;
                    match hermes_call_json(&text) {
                        Some((name, arguments)) => self.found(&mut out, name, arguments),
                        None => {
                            out.content.push_str(OPEN);
                            out.content.push_str(&text);
                        }
                    }
                } else if self.calls == 0 {
                    out.content.push_str(&text);
                } else {
                    out.content.push_str(text.trim_end());
                }
            }
        }
        out
    }

    fn found(&mut self, out: &mut Parsed, name: String, arguments: String) {
        out.calls.push(piece(self.calls, name, arguments));
        self.calls += 1;
    }

    fn hermes(&mut self, out: &mut Parsed, ending: bool) {
        loop {
            if self.in_call && self.streaming.is_none() {
                if let Some((name, len)) = call_header(&self.held) {
                    // `{"name": …, "arguments": ` is out: the name goes now, the
                    // arguments as they come.
                    out.calls.push(piece(self.calls, name, String::new()));
                    self.held.drain(..len);
                    self.streaming = Some(ArgScan::default());
                }
            }
            if let Some(scan) = self.streaming.as_mut() {
                if !scan.ended() {
                    let n = scan.feed(&self.held);
                    if n > 0 {
                        let arguments = self.held[..n].to_string();
                        out.calls.push(piece(self.calls, String::new(), arguments));
                        self.held.drain(..n);
                    }
                }
                // What follows the arguments (the object's `}`) waits for the block's end.
                let Some(end) = self.held.find(CLOSE).filter(|_| scan.ended()) else {
                    return;
                };
                self.held.drain(..end + CLOSE.len());
                self.streaming = None;
                self.in_call = false;
                self.calls += 1;
                continue;
            }
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else {
                    return;
                };
                let body: String = self.held[..end].to_string();
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
                match hermes_call_json(&body) {
                    Some((name, arguments)) => self.found(out, name, arguments),
                    None => {
                        out.content.push_str(OPEN);
                        out.content.push_str(&body);
                        out.content.push_str(CLOSE);
                    }
                }
                continue;
            }
            if let Some(start) = self.held.find(OPEN) {
                // Whitespace before a call separates; text before it is content.
                out.content.push_str(self.held[..start].trim_end());
                self.held.drain(..start + OPEN.len());
                self.in_call = true;
                continue;
            }
            if ending {
                return;
            }
            // Hold a tail that may open a call, and the whitespace before it.
            let tag = (1..OPEN.len())
                .rev()
                .find(|&k| self.held.ends_with(&OPEN[..k]))
                .unwrap_or(0);
            let free = &self.held[..self.held.len() - tag];
            let cut = free.trim_end().len();
            out.content.push_str(&self.held[..cut]);
            self.held.drain(..cut);
            return;
        }
    }

    fn llama3(&mut self, out: &mut Parsed) {
        if self.decided {
            if !self.in_call {
                out.content.push_str(&std::mem::take(&mut self.held));
            }
            return;
        }
        match self.held.trim_start().chars().next() {
            None => {}
            Some('{') => {
                self.decided = true;
                self.in_call = true;
            }
            Some(_) => {
                self.decided = true;
                out.content.push_str(&std::mem::take(&mut self.held));
            }
        }
    }
}

/// The head of a Hermes call as models write it, `{"name": "<name>", "arguments": ` and
/// the `{` that opens the arguments: the name and the length before that `{`. `None`
/// until the text says so (or when it is written otherwise: such a call goes out whole
/// when its block ends).
fn call_header(body: &str) -> Option<(String, usize)> {
    let ws = |s: &str| s.trim_start().len();
    let mut rest = body.trim_start().strip_prefix('{')?.trim_start();
    rest = rest.strip_prefix("\"name\"")?.trim_start();
    rest = rest.strip_prefix(':')?.trim_start();
    // The name: a JSON string.
    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = values.next()?.ok()?;
    rest = rest[values.byte_offset()..].trim_start();
    rest = rest.strip_prefix(',')?.trim_start();
    rest = rest.strip_prefix("\"arguments\"")?.trim_start();
    rest = rest.strip_prefix(':')?;
    let value = body.len() - ws(rest);
    body[value..].starts_with('{').then_some((name, value))
}

/// Follows a JSON object as it streams, to know where it ends.
#[derive(Debug, Clone, Default)]
struct ArgScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The object closed, or the text stopped being one (a `<` outside a string: the
    /// block's end tag came first).
    ended: bool,
}

impl ArgScan {
    fn ended(&self) -> bool {
        self.ended
    }

    /// The length of `text`'s prefix that belongs to the object.
    fn feed(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.ended = true;
                        return i + 1;
                    }
                }
                '<' => {
                    self.ended = true;
                    return i;
                }
                _ => {}
            }
        }
        text.len()
    }
}

/// Adds a call's piece to `calls`: a piece with a name starts a call (and has its id,
/// once named), one without adds to the arguments of the call of its index.
pub fn merge(calls: &mut Vec<ToolCall>, piece: ToolCall) {
    match calls.iter_mut().rev().find(|c| c.index == piece.index) {
        Some(call) if piece.name.is_empty() => call.arguments.push_str(&piece.arguments),
        _ => calls.push(piece),
    }
}

/// The arguments of a call as compact JSON text: an object, or a string holding one (a
/// model that encodes them twice).
fn arguments_text(v: Option<&Value>) -> Option<String> {
    match v {
        None | Some(Value::Null) => Some("{}".into()),
        Some(o @ Value::Object(_)) => Some(o.to_string()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(o @ Value::Object(_)) => Some(o.to_string()),
            _ => None,
        },
        Some(_) => None,
    }
}

/// `{"name": …, "arguments" (or "parameters"): {…}}`.
fn call_of(v: &Value) -> Option<(String, String)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = obj.get("arguments").or_else(|| obj.get("parameters"));
    Some((name, arguments_text(args)?))
}

fn hermes_call_json(body: &str) -> Option<(String, String)> {
    call_of(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

/// A Llama 3 answer's calls: JSON objects separated by `;` (or whitespace), all calls.
fn llama3_calls(text: &str) -> Option<Vec<(String, String)>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(call_of(&value)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
               {"type": "function", "function": {"name": "now"}}])
    }

    /// Parses `text` in the pieces given and gathers the result.
    fn run(format: ToolFormat, pieces: &[&str]) -> Parsed {
        let mut p = ToolParser::new(format);
        let mut all = Parsed::default();
        for piece in pieces {
            let got = p.push(piece);
            all.content.push_str(&got.content);
            got.calls.into_iter().for_each(|c| merge(&mut all.calls, c));
        }
        let got = p.finish();
        all.content.push_str(&got.content);
        got.calls.into_iter().for_each(|c| merge(&mut all.calls, c));
        all
    }

    fn call(index: u32, name: &str, arguments: &str) -> ToolCall {
        piece(index, name.into(), arguments.into())
    }

    #[test]
    fn templates_name_their_format() {
        let qwen = "{%- if tools %}<tools>{% endif %}<tool_call>\n";
        assert_eq!(ToolFormat::of_template(Some(qwen)), ToolFormat::Hermes);
        let llama = r#"{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}"#;
        assert_eq!(ToolFormat::of_template(Some(llama)), ToolFormat::Llama3Json);
        assert_eq!(
            ToolFormat::of_template(Some("<|im_start|>{{ m.content }}")),
            ToolFormat::Generic
        );
        assert_eq!(ToolFormat::of_template(None), ToolFormat::Generic);
    }

    #[test]
    fn tools_are_checked_item_by_item() {
        let fs = functions(&weather()).expect("valid");
        assert_eq!(fs.len(), 2);
        assert_eq!(
            fs[1].parameters,
            json!({"type": "object", "properties": {}})
        );
        let cases = [
            (json!({}), "must be an array"),
            (json!([1]), "`tools[0]` must be an object"),
            (json!([{"type": "retrieval"}]), "only \"function\""),
            (
                json!([{"type": "function"}]),
                "`tools[0].function` must be an object",
            ),
            (
                json!([{"type": "function", "function": {}}]),
                "name` is required",
            ),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                "letters, digits",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "f"}}]),
                "declared twice",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
                "must be a JSON schema",
            ),
            (
                json!([{"type": "function", "function": {"name": "f",
                        "parameters": {"type": "objekt"}}}]),
                "`tools[0].function.parameters` is not a usable JSON schema",
            ),
        ];
        for (tools, needle) in cases {
            let e = functions(&tools).expect_err("must fail").0;
            assert!(e.contains(needle), "{tools}: {e}");
        }
    }

    #[test]
    fn required_and_named_choices_compile_in_every_format() {
        let fs = functions(&weather()).expect("valid");
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Generic,
        ] {
            for choice in [ToolChoice::Required, ToolChoice::Function("now".into())] {
                for parallel in [false, true] {
                    let g = grammar(&fs, &choice, parallel, format)
                        .expect("builds")
                        .expect("a grammar");
                    assert_eq!(grammar::check(&g), Ok(()), "{format:?} {choice:?}: {g:?}");
                }
            }
            assert_eq!(grammar(&fs, &ToolChoice::Auto, true, format), Ok(None));
            assert!(grammar(&fs, &ToolChoice::Function("nope".into()), false, format).is_err());
        }
    }

    #[test]
    fn hermes_blocks_become_calls_and_the_rest_stays_text() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n";
        let got = run(ToolFormat::Hermes, &[text]);
        assert_eq!(got.content, "Let me look.");
        // Arguments written as models write them stream as they are.
        assert_eq!(
            got.calls,
            vec![
                call(0, "get_weather", r#"{"city": "Oslo"}"#),
                call(1, "now", "{}")
            ]
        );
        // Plain text passes whole, a lone `<` included.
        let plain = run(
            ToolFormat::Hermes,
            &["a < b ", "and <tool", " not a call\n"],
        );
        assert_eq!(plain.content, "a < b and <tool not a call\n");
        assert!(plain.calls.is_empty());
        // A block that is not a call is text; an unclosed one with whole JSON is a call.
        let bad = run(ToolFormat::Hermes, &["<tool_call>\nnope\n</tool_call>"]);
        assert_eq!(bad.content, "<tool_call>\nnope\n</tool_call>");
        let open = run(
            ToolFormat::Generic,
            &["<tool_call>\n{\"name\": \"now\", \"parameters\": {}}"],
        );
        assert_eq!(open.calls, vec![call(0, "now", "{}")]);
        let cut = run(ToolFormat::Generic, &["<tool_call>\n{\"name\": \"no"]);
        assert_eq!(cut.content, "<tool_call>\n{\"name\": \"no");
        // Arguments encoded twice are read once.
        let twice = run(
            ToolFormat::Hermes,
            &[r#"<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>"#],
        );
        assert_eq!(twice.calls, vec![call(0, "f", r#"{"a":1}"#)]);
    }

    #[test]
    fn llama3_answers_are_calls_when_they_are_json() {
        let got = run(
            ToolFormat::Llama3Json,
            &[
                " {\"name\": \"get_weather\", ",
                "\"parameters\": {\"city\": \"Oslo\"}}",
            ],
        );
        assert_eq!(got.content, "");
        assert_eq!(
            got.calls,
            vec![call(0, "get_weather", r#"{"city":"Oslo"}"#)]
        );
        let two = run(
            ToolFormat::Llama3Json,
            &[r#"{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}"#],
        );
        assert_eq!(two.calls.len(), 2);
        let text = run(ToolFormat::Llama3Json, &["Hello ", "{there}"]);
        assert_eq!(text.content, "Hello {there}");
        let not_call = run(ToolFormat::Llama3Json, &["{\"answer\": 1}"]);
        assert_eq!(not_call.content, "{\"answer\": 1}");
        assert!(not_call.calls.is_empty());
    }

    /// A call's name goes out as soon as it is written, its arguments piece by piece; a
    /// `<` outside a string ends arguments that never closed.
    #[test]
    fn arguments_stream_as_they_come() {
        let mut p = ToolParser::new(ToolFormat::Hermes);
        assert_eq!(
            p.push("<tool_call>\n{\"name\": \"f\", \"argu").calls,
            vec![]
        );
        assert_eq!(
            p.push("ments\": {\"a\": \"x}").calls,
            vec![call(0, "f", ""), call(0, "", "{\"a\": \"x}")]
        );
        assert_eq!(p.push("<\"}").calls, vec![call(0, "", "<\"}")]);
        assert_eq!(p.calls(), 0, "the call ends with its block");
        assert_eq!(p.push("}\n</tool_call>").calls, vec![]);
        assert_eq!(p.calls(), 1);
        let broken = run(
            ToolFormat::Hermes,
            &["<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1\n</tool_call>ok"],
        );
        assert_eq!(broken.calls, vec![call(0, "f", "{\"a\": 1\n")]);
        assert_eq!(broken.content, "ok");
    }

    /// However the text is cut into pieces, the same content and calls come out: the
    /// parser's state is a function of the text so far, as a resume needs.
    #[test]
    fn pieces_do_not_change_the_result() {
        let texts = [
            "Sure.  \n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"a<b\"}}\n</tool_call>\n\n<tool_call>{\"name\": \"g\"}</tool_call> done \n",
            "no calls here <tool_ <tool_cal but < and >\n\n",
            "<tool_call>\nbroken\n</tool_call>tail",
            "   \n<tool_call>{\"name\": \"f\", \"arguments\": {}}",
        ];
        for format in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            for text in texts {
                let whole = run(format, &[text]);
                let chars: Vec<char> = text.chars().collect();
                let mut seed = 0x9e37_79b9_u64;
                for _ in 0..200 {
                    let mut pieces = Vec::new();
                    let mut at = 0;
                    while at < chars.len() {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let n = 1 + (seed >> 60) as usize;
                        let end = (at + n).min(chars.len());
                        pieces.push(chars[at..end].iter().collect::<String>());
                        at = end;
                    }
                    let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
                    assert_eq!(run(format, &refs), whole, "{format:?} {pieces:?}");
                }
            }
        }
    }
}
