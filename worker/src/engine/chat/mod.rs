//! Chat prompts: the GGUF's `tokenizer.chat_template`, a Hugging Face Jinja template, rendered
//! with minijinja the way transformers' `apply_chat_template(.., tokenize=False)` renders it.
//!
//! transformers renders with `trim_blocks` and `lstrip_blocks` on and passes `messages`,
//! `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`), plus a
//! `raise_exception(message)` function templates call to reject a conversation (roles that do
//! not alternate, say). All of that is provided here. Templates are written for Python's
//! Jinja, so they also call Python methods on values (`message['content'].strip()`,
//! `.startswith(..)`, `dict.items()`); the common string and map methods are provided here
//! too, and so are transformers' `tojson` (Python's spacing, `indent`) and `strftime_now`
//! (`chat/python.rs`). A template may also read `tools` (OpenAI's function list, or none) and a
//! fixed `date_string` ([`TemplateVars`]). Not provided: `{% break %}` / `{% continue %}`
//! (minijinja's `loop_controls` feature).
//!
//! SmolLM2's template is ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, a
//! default system message when the first message is not a system one, and
//! `<|im_start|>assistant\n` for the generation prompt. It needs none of the Python methods.

use minijinja::value::{from_args, Value, ValueKind};
use minijinja::{context, Environment, Error as JinjaError, ErrorKind, State};
use serde::{Deserialize, Serialize};

use baton_common::tools::{self, ToolFormat};

use crate::engine::gguf::{GgufError, GgufFile, MetaValue};

mod python;

/// What a template may read beside the messages.
#[derive(Debug, Clone, Default)]
pub struct TemplateVars {
    /// OpenAI's `tools` (`[{"type": "function", "function": {...}}]`), for templates that
    /// take them; `None` renders as `tools = none`, as transformers passes it.
    pub tools: Option<serde_json::Value>,
    /// A date for templates that print one (Llama 3's `date_string`); unset, such a
    /// template prints today's (`strftime_now`) or its own default.
    pub date_string: Option<String>,
}

/// The name the template is stored under in its environment.
const TEMPLATE: &str = "chat";

/// One message of a conversation, in OpenAI's shape (as transformers takes it).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (templates may accept others).
    pub role: String,
    /// The text of the message (null reads as empty).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// The functions an assistant message called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
    /// Which call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// One call in an assistant message: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments as a JSON value (templates print them with `tojson`, as
/// vLLM passes them).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatToolCall {
    /// The call's id.
    #[serde(default)]
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// What was called.
    pub function: ChatFunctionCall,
}

/// The function of a [`ChatToolCall`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatFunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments (an object, or the text the client sent when it is not JSON).
    pub arguments: serde_json::Value,
}

fn function_kind() -> String {
    "function".into()
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// Everything that can go wrong loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// `tokenizer.chat_template` (or the token list) has the wrong type.
    #[error("chat template metadata: {0}")]
    Metadata(#[from] GgufError),
    /// The template does not compile.
    #[error("chat template does not compile: {0}")]
    Syntax(#[source] JinjaError),
    /// The template failed while rendering (an unknown filter, a type error...).
    #[error("chat template failed: {0}")]
    Render(#[source] JinjaError),
    /// The template called `raise_exception`: it does not accept this conversation.
    #[error("chat template rejected the conversation: {0}")]
    Rejected(String),
}

impl ChatError {
    /// A stable identifier of the error kind, for logs, metrics and response bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            ChatError::Metadata(_) => "metadata",
            ChatError::Syntax(_) => "syntax",
            ChatError::Render(_) => "render",
            ChatError::Rejected(_) => "rejected",
        }
    }
}

/// The error `raise_exception` attaches to its minijinja error, so a rejection is told apart
/// from a template bug by type rather than by message text.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template with the special tokens it is rendered with.
#[derive(Clone)]
pub struct ChatTemplate {
    /// Holds the compiled template and the functions and methods it may call.
    env: Environment<'static>,
    /// Passed to the template as `bos_token`.
    bos: String,
    /// Passed to the template as `eos_token`.
    eos: String,
    /// How the model calls tools, read from the template's source.
    tools: ToolFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The template of a GGUF file (`tokenizer.chat_template`), or `None` if it has none.
    /// `bos_token` and `eos_token` are the spellings of `tokenizer.ggml.bos_token_id` and
    /// `eos_token_id` (empty when the file has no such id).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Option<Self>, ChatError> {
        if gguf.get("tokenizer.chat_template").is_none() {
            return Ok(None);
        }
        let source = gguf.get_str("tokenizer.chat_template")?.to_owned();
        let token = |key: &str| -> Result<String, ChatError> {
            if gguf.get(key).is_none() {
                return Ok(String::new());
            }
            let id = gguf.get_u64(key)?;
            let spelling = gguf
                .get("tokenizer.ggml.tokens")
                .and_then(MetaValue::as_array)
                .and_then(|tokens| tokens.get(usize::try_from(id).ok()?))
                .and_then(MetaValue::as_str);
            Ok(spelling.unwrap_or_default().to_owned())
        };
        let bos = token("tokenizer.ggml.bos_token_id")?;
        let eos = token("tokenizer.ggml.eos_token_id")?;
        Self::new(source, bos, eos).map(Some)
    }

    /// Compile `source`, to be rendered with `bos` and `eos` as `bos_token` and `eos_token`.
    pub fn new(source: String, bos: String, eos: String) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, JinjaError> {
                Err(
                    JinjaError::new(ErrorKind::InvalidOperation, message.clone())
                        .with_source(Raised(message)),
                )
            },
        );
        env.set_unknown_method_callback(python_method);
        env.add_filter("tojson", python::tojson);
        env.add_function("strftime_now", python::strftime_now);
        let tools = ToolFormat::of_template(Some(&source));
        env.add_template_owned(TEMPLATE, source)
            .map_err(ChatError::Syntax)?;
        Ok(ChatTemplate {
            env,
            bos,
            eos,
            tools,
        })
    }

    /// How the model calls tools.
    pub fn tool_format(&self) -> ToolFormat {
        self.tools
    }

    /// The prompt for `messages` with `tools` (OpenAI's array; `None`: none offered). A
    /// template that takes tools gets them, and the history's calls and results, as they
    /// are; any other gets Baton's tool prompt in its system message and the history
    /// written as Hermes text ([`baton_common::tools`]).
    pub fn render_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        if self.tools.native() {
            let vars = TemplateVars {
                tools: tools.cloned(),
                date_string: None,
            };
            return self.render_with(messages, add_generation_prompt, &vars);
        }
        let messages = generic_messages(messages, tools);
        self.render_with(&messages, add_generation_prompt, &TemplateVars::default())
    }

    /// [`ChatTemplate::render_tools`] with each message's text replaced by a mark, to find
    /// where the template puts each message ([`message_spans`]).
    pub fn render_marked(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: format!("{MARK_OPEN}{i}{MARK_CLOSE}"),
                ..m.clone()
            })
            .collect();
        self.render_tools(&marked, tools, add_generation_prompt)
    }

    /// The prompt for `messages`; with `add_generation_prompt`, it ends with what opens the
    /// assistant's reply (`<|im_start|>assistant\n` for ChatML).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(messages, add_generation_prompt, &TemplateVars::default())
    }

    /// [`ChatTemplate::render`] with `tools` and the other [`TemplateVars`].
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String, ChatError> {
        let template = self.env.get_template(TEMPLATE).map_err(ChatError::Render)?;
        let base = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            tools => vars.tools.as_ref().map(Value::from_serialize),
        };
        let ctx = match &vars.date_string {
            Some(date) => context! { date_string => date, ..base },
            None => base,
        };
        template.render(ctx).map_err(|err| match raised(&err) {
            Some(message) => ChatError::Rejected(message),
            None => ChatError::Render(err),
        })
    }
}

/// A conversation with tools for a template that takes none: the tool prompt joins the
/// system message (or opens the conversation as one), calls become Hermes text in their
/// assistant message, and each run of `tool` messages one user message of results.
fn generic_messages(
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        if m.role == "tool" {
            let result = tools::hermes_response(&m.content);
            match out.last_mut() {
                Some(last) if last.role == "user" && last.content.ends_with("</tool_response>") => {
                    last.content.push('\n');
                    last.content.push_str(&result);
                }
                _ => out.push(ChatMessage::new("user", result)),
            }
            continue;
        }
        out.push(ChatMessage::new(m.role.clone(), m.content.clone()).with_calls(&m.tool_calls));
    }
    if let Some(tools) = tools {
        let prompt = tools::generic_prompt(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{prompt}", first.content);
            }
            _ => out.insert(0, ChatMessage::new("system", prompt)),
        }
    }
    out
}

impl ChatMessage {
    /// This message with `calls` written after its text as Hermes blocks.
    fn with_calls(mut self, calls: &[ChatToolCall]) -> Self {
        for c in calls {
            let args = match &c.function.arguments {
                serde_json::Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            if !self.content.is_empty() {
                self.content.push('\n');
            }
            self.content
                .push_str(&tools::hermes_call(&c.function.name, &args));
        }
        self
    }
}

/// The message of a `raise_exception` anywhere in an error's chain of sources.
fn raised(err: &JinjaError) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(Raised(message)) = current.downcast_ref::<Raised>() {
            return Some(message.clone());
        }
        source = current.source();
    }
    None
}

/// The Python methods chat templates call most, for values minijinja has no such method on:
/// on strings `strip`, `lstrip`, `rstrip` (optional set of characters), `startswith`,
/// `endswith`, `upper`, `lower`, `title`, `capitalize`, `replace` (optional count), `split`
/// (optional separator and maximum) and `join`; on maps `items`, `keys`, `values` and `get`
/// (optional default).
fn python_method(
    state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, JinjaError> {
    if let Some(s) = value.as_str() {
        return match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<&str>,) = from_args(args)?;
                let strip = |c: char| chars.map_or(c.is_whitespace(), |set| set.contains(c));
                Ok(Value::from(match method {
                    "strip" => s.trim_matches(strip),
                    "lstrip" => s.trim_start_matches(strip),
                    _ => s.trim_end_matches(strip),
                }))
            }
            "startswith" => {
                let (prefix,): (&str,) = from_args(args)?;
                Ok(Value::from(s.starts_with(prefix)))
            }
            "endswith" => {
                let (suffix,): (&str,) = from_args(args)?;
                Ok(Value::from(s.ends_with(suffix)))
            }
            "upper" | "lower" | "title" | "capitalize" => {
                let () = from_args(args)?;
                state.apply_filter(method, std::slice::from_ref(value))
            }
            "replace" => {
                let (old, new, count): (&str, &str, Option<i64>) = from_args(args)?;
                Ok(Value::from(
                    match count.and_then(|n| usize::try_from(n).ok()) {
                        Some(n) => s.replacen(old, new, n),
                        None => s.replace(old, new),
                    },
                ))
            }
            "split" => {
                let (sep, max): (Option<&str>, Option<i64>) = from_args(args)?;
                let max = max.and_then(|n| usize::try_from(n).ok());
                let parts = python_split(s, sep, max)?;
                Ok(Value::from_iter(parts.into_iter().map(Value::from)))
            }
            "join" => {
                let (items,): (Value,) = from_args(args)?;
                let parts = items
                    .try_iter()?
                    .map(|item| item.to_string())
                    .collect::<Vec<_>>();
                Ok(Value::from(parts.join(s)))
            }
            _ => Err(JinjaError::from(ErrorKind::UnknownMethod)),
        };
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => {
                let () = from_args(args)?;
                state.apply_filter("items", std::slice::from_ref(value))
            }
            "keys" => {
                let () = from_args(args)?;
                Ok(Value::from(value.try_iter()?.collect::<Vec<_>>()))
            }
            "values" => {
                let () = from_args(args)?;
                let values = value
                    .try_iter()?
                    .map(|key| value.get_item(&key))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Value::from(values))
            }
            "get" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                let found = value.get_item(&key)?;
                Ok(if found.is_undefined() {
                    default.unwrap_or(Value::from(()))
                } else {
                    found
                })
            }
            _ => Err(JinjaError::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(JinjaError::from(ErrorKind::UnknownMethod))
}

/// Python's `str.split(sep, maxsplit)`: without `sep`, runs of whitespace separate and
/// leading and trailing whitespace yields no empty pieces.
fn python_split<'a>(
    s: &'a str,
    sep: Option<&str>,
    max: Option<usize>,
) -> Result<Vec<&'a str>, JinjaError> {
    match sep {
        Some("") => Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            "split: empty separator",
        )),
        Some(sep) => Ok(match max {
            Some(n) => s.splitn(n + 1, sep).collect(),
            None => s.split(sep).collect(),
        }),
        None => {
            let mut parts = Vec::new();
            let mut rest = s.trim_start();
            while !rest.is_empty() {
                if max == Some(parts.len()) {
                    parts.push(rest);
                    break;
                }
                match rest.find(char::is_whitespace) {
                    Some(end) => {
                        parts.push(&rest[..end]);
                        rest = rest[end..].trim_start();
                    }
                    None => {
                        parts.push(rest);
                        break;
                    }
                }
            }
            Ok(parts)
        }
    }
}

/// Marks the text of message `i` in a rendering made to find where messages land
/// ([`ChatTemplate::render_marked`]): private-use characters no client text needs.
const MARK_OPEN: char = '\u{E000}';
const MARK_CLOSE: char = '\u{E001}';

/// Where the rendered prompt `text` holds the messages that spell special tokens (as
/// `writes` tells). `marked` is the same rendering with each message's text replaced by
/// its mark ([`ChatTemplate::render_marked`]): putting each message's text (or, for
/// templates that trim it, its trimmed text) back in place of its marks must give `text`
/// exactly, and the ranges are where it went. Otherwise (the template rewrote a text) the
/// error is the index of the first message that spells special tokens.
pub fn message_spans(
    text: &str,
    marked: &str,
    messages: &[ChatMessage],
    writes: impl Fn(&ChatMessage) -> bool,
) -> Result<Vec<std::ops::Range<usize>>, usize> {
    for trimmed in [false, true] {
        let mut rebuilt = String::with_capacity(text.len());
        let mut spans = Vec::new();
        let mut rest = marked;
        let mut whole = true;
        while let Some(open) = rest.find(MARK_OPEN) {
            rebuilt.push_str(&rest[..open]);
            let after = &rest[open + MARK_OPEN.len_utf8()..];
            let Some(close) = after.find(MARK_CLOSE) else {
                whole = false;
                break;
            };
            let Some(m) = after[..close]
                .parse::<usize>()
                .ok()
                .and_then(|i| messages.get(i))
            else {
                whole = false;
                break;
            };
            let content = if trimmed {
                m.content.trim()
            } else {
                m.content.as_str()
            };
            let start = rebuilt.len();
            rebuilt.push_str(content);
            if writes(m) {
                spans.push(start..rebuilt.len());
            }
            rest = &after[close + MARK_CLOSE.len_utf8()..];
        }
        rebuilt.push_str(rest);
        if whole && rebuilt == text {
            return Ok(spans);
        }
    }
    Err(messages.iter().position(writes).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's `tokenizer.chat_template`, verbatim.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source.to_owned(), "<s>".to_owned(), "</s>".to_owned())
            .expect("template compiles")
    }

    /// A template that takes no tools gets Baton's tool prompt in its system message, the
    /// history's calls as Hermes blocks and the tools' results as one user message.
    #[test]
    fn templates_without_tools_get_the_generic_tool_prompt_and_history() {
        let chatml = template(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        );
        assert_eq!(chatml.tool_format(), ToolFormat::Generic);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let call = ChatToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: ChatFunctionCall {
                name: "f".into(),
                arguments: serde_json::json!({"a": 1}),
            },
        };
        let messages = [
            ChatMessage::new("user", "go"),
            ChatMessage {
                tool_calls: vec![call.clone(), call],
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::new("tool", "one")
            },
            ChatMessage::new("tool", "two"),
        ];
        let text = chatml
            .render_tools(&messages, Some(&tools), false)
            .expect("renders");
        let block = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\":1}}\n</tool_call>";
        let want = format!(
            "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n\
             <|im_start|>assistant\n{block}\n{block}<|im_end|>\n\
             <|im_start|>user\n<tool_response>\none\n</tool_response>\n\
             <tool_response>\ntwo\n</tool_response><|im_end|>\n",
            tools::generic_prompt(&tools)
        );
        assert_eq!(text, want);
        // Without tools offered, the history is still written the same way.
        let plain = chatml
            .render_tools(&messages, None, false)
            .expect("renders");
        assert!(plain.starts_with("<|im_start|>user\ngo"), "{plain}");
        assert!(plain.contains(block), "{plain}");
    }

    #[test]
    fn smollm2_inserts_a_default_system_message() {
        let t = template(SMOLLM2);
        let prompt = t
            .render(&[ChatMessage::new("user", "Hi!")], true)
            .expect("renders");
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
             Hugging Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn smollm2_keeps_a_given_system_message() {
        let t = template(SMOLLM2);
        let messages = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "2+2?"),
            ChatMessage::new("assistant", "4"),
        ];
        let prompt = t.render(&messages, false).expect("renders");
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n"
        );
    }

    #[test]
    fn special_tokens_and_blocks_are_trimmed_like_transformers() {
        let t = template("{{ bos_token }}\n{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n{{ eos_token }}");
        let prompt = t
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false,
            )
            .expect("renders");
        assert_eq!(prompt, "<s>\n  a\n  b\n</s>");
    }

    #[test]
    fn raise_exception_rejects_the_conversation() {
        let t = template(
            "{% for m in messages %}{% if m.role == 'tool' %}\
             {{ raise_exception('no tools here: ' ~ m.content) }}{% endif %}{% endfor %}ok",
        );
        assert_eq!(
            t.render(&[ChatMessage::new("user", "x")], true)
                .expect("renders"),
            "ok"
        );
        let err = t
            .render(&[ChatMessage::new("tool", "x")], true)
            .expect_err("rejected");
        assert_eq!(err.kind(), "rejected");
        assert!(matches!(err, ChatError::Rejected(ref m) if m == "no tools here: x"));
    }

    #[test]
    fn errors_have_kinds() {
        let err = ChatTemplate::new("{% for %}".to_owned(), String::new(), String::new())
            .expect_err("syntax error");
        assert_eq!(err.kind(), "syntax");
        let err = template("{{ messages | no_such_filter }}")
            .render(&[], false)
            .expect_err("unknown filter");
        assert_eq!(err.kind(), "render");
    }

    #[test]
    fn python_string_methods() {
        let t = template(
            "{% set c = messages[0].content %}[{{ c.strip() }}|{{ c.lstrip() }}|{{ c.rstrip() }}|\
             {{ c.strip(' x') }}|{{ c.upper() }}|{{ c.strip().startswith('a') }}|\
             {{ c.strip().endswith('b') }}|{{ c.replace('a', 'A') }}|{{ c.split() }}|\
             {{ c.split(None, 1) }}|{{ c.split('a') }}|{{ '-'.join(['p', 'q']) }}|\
             {{ c.title() }}]",
        );
        let prompt = t
            .render(&[ChatMessage::new("user", " xa b ")], false)
            .expect("renders");
        assert_eq!(
            prompt,
            "[xa b|xa b | xa b|a b| XA B |False|True| xA b |[\"xa\", \"b\"]|\
             [\"xa\", \"b \"]|[\" x\", \" b \"]|p-q| Xa B ]"
        );
    }

    #[test]
    fn python_map_methods() {
        let t = template(
            "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}\
             {{ m.keys() | join(',') }}/{{ m.values() | join(',') }}/\
             {{ m.get('role') }}/{{ m.get('name', 'anon') }}/{{ m.get('name') is none }}{% endfor %}",
        );
        let prompt = t
            .render(&[ChatMessage::new("user", "hi")], false)
            .expect("renders");
        assert_eq!(
            prompt,
            "role=user;content=hi;role,content/user,hi/user/anon/True"
        );
    }

    #[test]
    fn unknown_methods_still_fail() {
        let err = template("{{ messages[0].content.frobnicate() }}")
            .render(&[ChatMessage::new("user", "hi")], false)
            .expect_err("unknown method");
        assert_eq!(err.kind(), "render");
    }
}
