//! Request validation: JSON bytes in, a [`ValidRequest`] (or an [`ApiError`]) out.
//!
//! Everything a client can get wrong is caught here, before any routing, with the
//! field to blame. Ranges follow OpenAI: `temperature` ≥ 0 (0 is greedy; values above
//! 2 are allowed), `top_p` in (0, 1], `n` = 1 only, `max_tokens` in
//! 1..=`max_tokens_limit`.
//!
//! `max_prompt_tokens` is checked here for token-id prompts, whose length is known; text
//! and chat prompts are counted by the worker after tokenizing (the limit travels in
//! the submit), before anything runs. Their bytes say nothing sure about their tokens
//! (one token may cover one byte or many), and `max_body_bytes` already bounds them.

use baton_common::config::CoordinatorConfig;
use baton_common::grammar::{check, choice_regex};
use baton_common::protocol::{
    ChatTurn, GenParams, Grammar, LogitBias, PromptSpec, ToolCall, ToolChoice, Tools,
};
use baton_common::tools::ToolFormat;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::choices::MAX_CHOICES;
use super::error::ApiError;
use super::openai::{
    ChatMessageIn, ChatRequest, CompletionRequest, NotSupported, SamplingFields, StructuredFields,
};

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

pub use crate::store::Endpoint;

/// A request that passed validation: what the worker needs, and how to answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    /// Which API.
    pub endpoint: Endpoint,
    /// The model name.
    pub model: String,
    /// The prompt, for the worker to tokenize.
    pub prompt: PromptSpec,
    /// Sampling parameters.
    pub params: GenParams,
    /// Answer as Server-Sent Events.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// Most prompt tokens (`max_prompt_tokens`; 0: the model's context only), for the
    /// worker to check after tokenizing.
    pub max_prompt_tokens: u32,
    /// Choices (`n`): each its own stream.
    pub n: u32,
}

/// Parses JSON bytes into `T`; malformed JSON is an OpenAI-shaped 400.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))
}

impl ValidRequest {
    /// A request body of `endpoint`, validated.
    pub fn parse(
        endpoint: Endpoint,
        body: &[u8],
        config: &CoordinatorConfig,
    ) -> Result<Self, ApiError> {
        match endpoint {
            Endpoint::Chat => Self::chat(body, config),
            Endpoint::Completion => Self::completion(body, config),
        }
    }

    /// Validates a `/v1/chat/completions` body.
    pub fn chat(body: &[u8], config: &CoordinatorConfig) -> Result<Self, ApiError> {
        let mut request: ChatRequest = parse_json(body)?;
        let model = model(request.model)?;
        let offered = request.unsupported.tools.take();
        let choice = request.unsupported.tool_choice.take();
        refuse_unsupported(&request.unsupported)?;
        let messages = request.messages.ok_or(ApiError::MissingField("messages"))?;
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        let turns = messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| turn(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let max_tokens = request
            .max_completion_tokens
            .or(request.sampling.max_tokens);
        let grammar = grammar(request.structured)?;
        let tools = tools(
            offered,
            choice,
            request.parallel_tool_calls,
            grammar.is_some(),
        )?;
        let mut valid = Self::finish(
            Endpoint::Chat,
            model,
            PromptSpec::Chat(turns),
            max_tokens,
            request.sampling,
            grammar,
            config,
        )?;
        valid.params.tools = tools;
        Ok(valid)
    }

    /// Validates a `/v1/completions` body.
    pub fn completion(body: &[u8], config: &CoordinatorConfig) -> Result<Self, ApiError> {
        let request: CompletionRequest = parse_json(body)?;
        let model = model(request.model)?;
        refuse_unsupported(&request.unsupported)?;
        let prompt = prompt(request.prompt.ok_or(ApiError::MissingField("prompt"))?)?;
        let max_tokens = request.sampling.max_tokens;
        let grammar = grammar(request.structured)?;
        Self::finish(
            Endpoint::Completion,
            model,
            prompt,
            max_tokens,
            request.sampling,
            grammar,
            config,
        )
    }

    fn finish(
        endpoint: Endpoint,
        model: String,
        prompt: PromptSpec,
        max_tokens: Option<i64>,
        s: SamplingFields,
        grammar: Option<Grammar>,
        config: &CoordinatorConfig,
    ) -> Result<Self, ApiError> {
        let limit = config.max_tokens_limit;
        let echo = s.echo.unwrap_or(false);
        if echo && endpoint == Endpoint::Chat {
            return Err(ApiError::invalid(
                "echo",
                "`echo` is for /v1/completions (a chat answer does not repeat its messages)",
            ));
        }
        let max_tokens = match max_tokens {
            // The worker stops at the end of the context (`finish_reason: "length"`), so
            // the limit means "what the context leaves", as vLLM's default does.
            None if config.default_max_tokens == 0 => limit,
            None => config.default_max_tokens.min(limit),
            // Scoring a prompt, as log-likelihood evaluations do.
            Some(0) if echo => 0,
            Some(n) if n <= 0 => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("`max_tokens` must be at least 1, got {n}"),
                ))
            }
            Some(n) if n > i64::from(limit) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("`max_tokens` is {n}, larger than this server's limit of {limit}"),
                ))
            }
            Some(n) => u32::try_from(n)
                .map_err(|_| ApiError::invalid("max_tokens", "`max_tokens` is out of range"))?,
        };
        // Ranges are checked on the f32 values workers get: 1e39 is a finite f64 but an
        // infinite f32, and 1e-50 a positive f64 but a zero f32.
        let temperature = s.temperature.unwrap_or(1.0);
        if !(temperature as f32).is_finite() || temperature < 0.0 {
            return Err(ApiError::invalid(
                "temperature",
                format!(
                    "`temperature` must be a number ≥ 0 that fits in an f32, got {temperature}"
                ),
            ));
        }
        let top_p = s.top_p.unwrap_or(1.0);
        if !top_p.is_finite() || (top_p as f32) <= 0.0 || top_p > 1.0 {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1] and not round to 0 as an f32, got {top_p}"),
            ));
        }
        // vLLM's clients write −1 for "off", as 0 is here.
        let top_k = match s.top_k {
            None | Some(-1) => 0,
            Some(k) => u32::try_from(k).map_err(|_| {
                ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be ≥ 0 (0 or −1 is off), got {k}"),
                )
            })?,
        };
        let repetition_penalty = s.repetition_penalty.unwrap_or(1.0);
        let penalty = repetition_penalty as f32;
        if !penalty.is_finite() || penalty <= 0.0 {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!(
                    "`repetition_penalty` must be > 0 (1 is off) and fit in an f32, got \
                     {repetition_penalty}"
                ),
            ));
        }
        let n = match s.n {
            None => 1,
            Some(n) if (1..=i64::from(MAX_CHOICES)).contains(&n) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!("`n` must be in 1..={MAX_CHOICES}, got {n}"),
                ))
            }
        };
        let seed = match s.seed {
            None => uuid::Uuid::new_v4().as_u64_pair().0,
            Some(n) => n
                .as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .ok_or_else(|| {
                    ApiError::invalid("seed", format!("`seed` must be an integer, got {n}"))
                })?,
        };
        let max_prompt_tokens = config.max_prompt_tokens;
        if let PromptSpec::Tokens(ids) = &prompt {
            if max_prompt_tokens > 0 && ids.len() > max_prompt_tokens as usize {
                return Err(ApiError::ContextLengthExceeded(format!(
                    "the prompt has {} tokens, more than this server's limit of \
                     {max_prompt_tokens} (max_prompt_tokens)",
                    ids.len()
                )));
            }
        }
        let penalty_in_range = |field: &'static str, v: Option<f64>| match v {
            None => Ok(0.0),
            Some(v) if (-2.0..=2.0).contains(&v) => Ok(v as f32),
            Some(v) => Err(ApiError::invalid(
                field,
                format!("`{field}` must be in [-2, 2], got {v}"),
            )),
        };
        let presence_penalty = penalty_in_range("presence_penalty", s.presence_penalty)?;
        let frequency_penalty = penalty_in_range("frequency_penalty", s.frequency_penalty)?;
        let min_p = match s.min_p {
            None => 0.0,
            Some(v) if (0.0..=1.0).contains(&v) => v as f32,
            Some(v) => {
                return Err(ApiError::invalid(
                    "min_p",
                    format!("`min_p` must be in [0, 1], got {v}"),
                ))
            }
        };
        let min_tokens = match s.min_tokens {
            None => 0,
            Some(n) if n >= 0 && n <= i64::from(max_tokens) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("`min_tokens` must be in 0..=max_tokens ({max_tokens}), got {n}"),
                ))
            }
        };
        let logprobs = logprobs(endpoint, s.logprobs, s.top_logprobs)?;
        let stream = s.stream.unwrap_or(false);
        Ok(Self {
            endpoint,
            model,
            prompt,
            params: GenParams {
                max_tokens,
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                repetition_penalty: penalty,
                seed,
                stop: stop(s.stop)?,
                ignore_eos: s.ignore_eos.unwrap_or(false),
                grammar,
                presence_penalty,
                frequency_penalty,
                min_p,
                logit_bias: logit_bias(s.logit_bias)?,
                min_tokens,
                stop_token_ids: stop_token_ids(s.stop_token_ids)?,
                logprobs,
                // The prompt's text and, with logprobs, its tokens' come back first.
                prompt_logprobs: echo.then_some(logprobs.unwrap_or(0)),
                // Set by `chat`.
                tools: None,
                // Set by the front, from the client's key.
                content_specials: false,
            },
            stream,
            include_usage: stream && s.stream_options.is_some_and(|o| o.include_usage),
            max_prompt_tokens,
            n,
        })
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls`: the functions offered (each checked
/// and its `parameters` compiled, so that a bad schema is a 400 here), and whether the
/// model may, must, or must call one named function. No tools, or `tool_choice: "none"`,
/// is no tools at all. A required call is held to its schema by a grammar, so it cannot
/// be combined with a response format.
fn tools(
    offered: Option<Value>,
    choice: Option<Value>,
    parallel: Option<Value>,
    constrained: bool,
) -> Result<Option<Tools>, ApiError> {
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ))
        }
    };
    let bad_choice = || {
        ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be \"none\", \"auto\", \"required\" or              {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(bad_choice()),
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Function(name.to_string()),
                _ => return Err(bad_choice()),
            }
        }
        Some(_) => return Err(bad_choice()),
    };
    let offered = match offered {
        Some(v) if !neutral(&v) => v,
        _ if choice == ToolChoice::Auto => return Ok(None),
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` asks for a call but `tools` declares no function",
            ))
        }
    };
    let functions =
        baton_common::tools::functions(&offered).map_err(|e| ApiError::invalid("tools", e.0))?;
    if let ToolChoice::Function(name) = &choice {
        if !functions.iter().any(|f| &f.name == name) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` names the function \"{}\", which `tools` does not declare",
                    name.chars().take(64).collect::<String>()
                ),
            ));
        }
    }
    if choice != ToolChoice::Auto {
        if constrained {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` \"required\" or a named function constrains the output, and so                  does the response format: ask for one of them",
            ));
        }
        // The call's grammar in each format a worker may use: all must compile.
        for format in [ToolFormat::Hermes, ToolFormat::Llama3Json] {
            let compiled = baton_common::tools::grammar(&functions, &choice, parallel, format)
                .and_then(|g| g.as_ref().map_or(Ok(()), baton_common::grammar::check));
            if let Err(e) = compiled {
                return Err(ApiError::invalid(
                    "tools",
                    format!("the tools' call grammar does not compile: {e}"),
                ));
            }
        }
    }
    Ok(Some(Tools {
        definitions: offered.to_string(),
        choice,
        parallel,
    }))
}

/// One of a message's `tool_calls`: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments as JSON text (or an object, written as text here).
fn history_call(i: usize, index: usize, v: &Value) -> Result<ToolCall, ApiError> {
    let at = format!("`messages[{i}].tool_calls[{index}]");
    let bad = |m: String| ApiError::invalid("messages", m);
    let f = v
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(format!("{at}.function` must be an object")))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(format!("{at}.function.name` must be a non-empty string")))?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(o @ Value::Object(_)) => o.to_string(),
        Some(_) => return Err(bad(format!("{at}.function.arguments` must be a string"))),
    };
    let id = match v.get("id") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(bad(format!("{at}.id` must be a string"))),
    };
    Ok(ToolCall {
        index: index as u32,
        id,
        name: name.to_string(),
        arguments,
    })
}

/// Most entries of `logit_bias` and of `stop_token_ids`.
pub const MAX_TOKEN_LIST: usize = 1024;

/// `logprobs` and `top_logprobs`: chat takes `logprobs: true` and `top_logprobs` 0..=20
/// alternatives; completions take `logprobs` N (0..=20) alone.
fn logprobs(
    endpoint: Endpoint,
    logprobs: Option<Value>,
    top: Option<i64>,
) -> Result<Option<u8>, ApiError> {
    const MAX: i64 = 20;
    let count = |field: &'static str, n: Option<i64>| match n {
        Some(n) if (0..=MAX).contains(&n) => Ok(n as u8),
        Some(n) => Err(ApiError::invalid(
            field,
            format!("`{field}` must be in 0..={MAX}, got {n}"),
        )),
        None => Ok(0),
    };
    match endpoint {
        Endpoint::Chat => {
            let on = match logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => b,
                Some(Value::Number(n)) if n.as_u64() == Some(0) => false,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "logprobs",
                        "`logprobs` must be a boolean (the number of alternatives is \
                         `top_logprobs`)",
                    ))
                }
            };
            match (on, top) {
                (false, Some(n)) if n != 0 => Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                )),
                (false, _) => Ok(None),
                (true, top) => Ok(Some(count("top_logprobs", top)?)),
            }
        }
        Endpoint::Completion => {
            if top.is_some_and(|n| n != 0) {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "completions take the number of alternatives in `logprobs`",
                ));
            }
            match logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(Some(count(
                    "logprobs",
                    Some(n.as_i64().unwrap_or(i64::MAX)),
                )?)),
                Some(_) => Err(ApiError::invalid(
                    "logprobs",
                    format!("`logprobs` must be an integer in 0..={MAX} or null"),
                )),
            }
        }
    }
}

/// `logit_bias`: an object from token ids (as strings, or numbers) to biases in
/// −100..=100.
fn logit_bias(v: Option<Value>) -> Result<Vec<LogitBias>, ApiError> {
    let field = "logit_bias";
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid(
                field,
                "`logit_bias` must be an object from token ids to biases",
            ))
        }
    };
    if map.len() > MAX_TOKEN_LIST {
        return Err(ApiError::invalid(
            field,
            format!(
                "`logit_bias` has {} entries, more than {MAX_TOKEN_LIST}",
                map.len()
            ),
        ));
    }
    let mut out: Vec<LogitBias> = map
        .iter()
        .map(|(key, v)| {
            let id = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid(field, format!("`logit_bias` key {key:?} is not a token id"))
            })?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok(LogitBias { id, bias: b as f32 }),
                _ => Err(ApiError::invalid(
                    field,
                    format!("`logit_bias` for token {id} must be a number in [-100, 100], got {v}"),
                )),
            }
        })
        .collect::<Result<_, _>>()?;
    out.sort_by_key(|b| b.id);
    if out.windows(2).any(|w| w[0].id == w[1].id) {
        return Err(ApiError::invalid(field, "`logit_bias` names a token twice"));
    }
    Ok(out)
}

/// `stop_token_ids`: an array of token ids.
fn stop_token_ids(v: Option<Value>) -> Result<Vec<u32>, ApiError> {
    let field = "stop_token_ids";
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) if items.len() <= MAX_TOKEN_LIST => items,
        Some(Value::Array(items)) => {
            return Err(ApiError::invalid(
                field,
                format!(
                    "`stop_token_ids` has {} ids, more than {MAX_TOKEN_LIST}",
                    items.len()
                ),
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                field,
                "`stop_token_ids` must be an array of token ids",
            ))
        }
    };
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::invalid(field, "`stop_token_ids` must hold integers in 0..2^32"))
}

/// The grammar a request asks for, from whichever of its structured-output fields is
/// set (two set is a 400), compiled once here so that one the worker could not use is
/// refused before anything is dispatched.
fn grammar(f: StructuredFields) -> Result<Option<Grammar>, ApiError> {
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    if let Some(v) = f.response_format {
        found.extend(response_format(v)?);
    }
    if let Some(v) = f.structured_outputs.filter(|v| !v.is_null()) {
        let field = "structured_outputs";
        let Value::Object(map) = v else {
            return Err(ApiError::invalid(
                field,
                "`structured_outputs` must be an object",
            ));
        };
        for (key, v) in map {
            let g = match key.as_str() {
                "json" => {
                    let at = "structured_outputs.json";
                    Some((at, schema_grammar(at, v)?))
                }
                "json_object" if v == Value::Bool(true) => Some((
                    "structured_outputs.json_object",
                    Grammar::JsonSchema(r#"{"type":"object"}"#.into()),
                )),
                "regex" => {
                    let at = "structured_outputs.regex";
                    Some((at, Grammar::Regex(string_field(at, v)?)))
                }
                "choice" => {
                    let at = "structured_outputs.choice";
                    Some((at, choices(at, v)?))
                }
                "grammar" => {
                    let at = "structured_outputs.grammar";
                    Some((at, Grammar::Lark(string_field(at, v)?)))
                }
                // JSON is generated without free whitespace already.
                "disable_any_whitespace" if v == Value::Bool(true) => None,
                _ if v.is_null() || v == Value::Bool(false) => None,
                other => {
                    return Err(ApiError::invalid(
                        field,
                        format!(
                            "`structured_outputs.{other}` is not supported; use `json`, \
                             `json_object`, `regex`, `choice` or `grammar`"
                        ),
                    ))
                }
            };
            found.extend(g);
        }
    }
    if let Some(v) = f.guided_json.filter(|v| !v.is_null()) {
        found.push(("guided_json", schema_grammar("guided_json", v)?));
    }
    if let Some(v) = f.guided_regex.filter(|v| !v.is_null()) {
        found.push((
            "guided_regex",
            Grammar::Regex(string_field("guided_regex", v)?),
        ));
    }
    if let Some(v) = f.guided_choice.filter(|v| !v.is_null()) {
        found.push(("guided_choice", choices("guided_choice", v)?));
    }
    if let Some(v) = f.guided_grammar.filter(|v| !v.is_null()) {
        found.push((
            "guided_grammar",
            Grammar::Lark(string_field("guided_grammar", v)?),
        ));
    }
    match found.len() {
        0 => Ok(None),
        1 => {
            let (field, g) = found.pop().expect("one");
            check(&g)
                .map_err(|e| ApiError::invalid(field, format!("`{field}` cannot be used: {e}")))?;
            Ok(Some(g))
        }
        _ => Err(ApiError::invalid(
            found[1].0,
            format!(
                "`{}` and `{}` both ask for structured output; give one",
                found[0].0, found[1].0
            ),
        )),
    }
}

/// OpenAI's `response_format`.
fn response_format(v: Value) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let field = "response_format";
    if v.is_null() {
        return Ok(None);
    }
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(field, "`response_format` must be an object with a `type`")
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some((
            field,
            Grammar::JsonSchema(r#"{"type":"object"}"#.into()),
        ))),
        "json_schema" => {
            let spec = v.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    field,
                    "`response_format.json_schema` is missing (an object with `name` and \
                     `schema`)",
                )
            })?;
            // vLLM also reads the schema under `json_schema`.
            let schema = spec
                .get("schema")
                .or_else(|| spec.get("json_schema"))
                .ok_or_else(|| {
                    ApiError::invalid(field, "`response_format.json_schema.schema` is missing")
                })?;
            let at = "response_format.json_schema.schema";
            Ok(Some((at, schema_grammar(at, schema.clone())?)))
        }
        other => Err(ApiError::invalid(
            field,
            format!(
                "`response_format.type` {other:?} is not supported; use \"text\", \
                 \"json_object\" or \"json_schema\""
            ),
        )),
    }
}

/// A JSON schema given as an object, a boolean, or its JSON text.
fn schema_grammar(field: &'static str, v: Value) -> Result<Grammar, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(Grammar::JsonSchema(v.to_string())),
        Value::String(text) => Ok(Grammar::JsonSchema(text)),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a JSON schema (an object)"),
        )),
    }
}

fn string_field(field: &'static str, v: Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a non-empty string"),
        )),
    }
}

fn choices(field: &'static str, v: Value) -> Result<Grammar, ApiError> {
    let items: Option<Vec<String>> = match &v {
        Value::Array(a) if !a.is_empty() => {
            a.iter().map(|c| c.as_str().map(str::to_owned)).collect()
        }
        _ => None,
    };
    match items {
        Some(items) if items.iter().all(|c| !c.is_empty()) => {
            Ok(Grammar::Regex(choice_regex(&items)))
        }
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a non-empty array of non-empty strings"),
        )),
    }
}

/// Whether `v` asks for nothing: null, false, 0, an empty string, array or object.
fn neutral(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Refuses a request that asks for something Baton does not do yet, naming the field;
/// values that ask for nothing (`logprobs: false`, `tools: []`, `best_of: 1`,
/// `response_format: {"type": "text"}`, `tool_choice: "none"` or `"auto"` without tools)
/// pass, as do keys no API defines.
pub fn refuse_unsupported(f: &NotSupported) -> Result<(), ApiError> {
    let no_tools = f.tools.as_ref().is_none_or(neutral) && f.functions.as_ref().is_none_or(neutral);
    type Check<'a> = (&'static str, &'a Option<Value>, &'a dyn Fn(&Value) -> bool);
    let checks: [Check<'_>; 7] = [
        ("best_of", &f.best_of, &|v| {
            neutral(v) || v.as_f64() == Some(1.0)
        }),
        ("suffix", &f.suffix, &neutral),
        ("tools", &f.tools, &neutral),
        ("functions", &f.functions, &neutral),
        ("tool_choice", &f.tool_choice, &|v| {
            neutral(v) || v == "none" || (v == "auto" && no_tools)
        }),
        ("function_call", &f.function_call, &|v| {
            neutral(v) || v == "none" || (v == "auto" && no_tools)
        }),
        ("prompt_logprobs", &f.prompt_logprobs, &neutral),
    ];
    for (field, value, passes) in checks {
        if let Some(v) = value {
            if !passes(v) {
                return Err(ApiError::invalid(
                    field,
                    format!("`{field}` is not supported by this server yet; leave it out"),
                ));
            }
        }
    }
    Ok(())
}

/// The model a request names (required, not blank).
pub(crate) fn model(model: Option<String>) -> Result<String, ApiError> {
    match model {
        None => Err(ApiError::MissingField("model")),
        Some(m) if m.trim().is_empty() => Err(ApiError::MissingField("model")),
        Some(m) => Ok(m),
    }
}

/// `prompt`: a string, `[string]`, `[token ids]` or `[[token ids]]`.
fn prompt(value: Value) -> Result<PromptSpec, ApiError> {
    let bad = |message: &str| ApiError::invalid("prompt", message);
    match value {
        Value::String(text) => Ok(PromptSpec::Text(text)),
        Value::Array(items) => match items.as_slice() {
            [] => Err(bad("`prompt` must not be empty")),
            [Value::String(text)] => Ok(PromptSpec::Text(text.clone())),
            [Value::Array(ids)] => token_ids(ids),
            [Value::Number(_), ..] => token_ids(&items),
            [_, _, ..] if items.iter().all(|v| v.is_string() || v.is_array()) => {
                Err(bad("only one prompt per request is supported"))
            }
            _ => Err(bad(
                "`prompt` must be a string, an array of one string, or token ids",
            )),
        },
        _ => Err(bad(
            "`prompt` must be a string, an array of one string, or token ids",
        )),
    }
}

fn token_ids(ids: &[Value]) -> Result<PromptSpec, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    ids.iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .map(PromptSpec::Tokens)
        .ok_or_else(|| ApiError::invalid("prompt", "token ids must be integers in 0..2^32"))
}

/// One chat message: `content` may be a string, text parts (joined by newlines) or null.
pub(crate) fn turn(i: usize, m: ChatMessageIn) -> Result<ChatTurn, ApiError> {
    let role = match m.role {
        Some(r) if !r.trim().is_empty() => r,
        _ => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages[{i}].role` is required"),
            ))
        }
    };
    let tool_calls = match m.tool_calls {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(k, c)| history_call(i, k, c))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages[{i}].tool_calls` must be an array"),
            ))
        }
    };
    let tool_call_id = match m.tool_call_id {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages[{i}].tool_call_id` must be a string"),
            ))
        }
    };
    let content = match m.content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let texts = parts
                .iter()
                .map(|p| {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(text)) => Ok(text),
                        _ => Err(ApiError::invalid(
                            "messages",
                            format!(
                                "`messages[{i}].content`: only parts of type `text` are supported"
                            ),
                        )),
                    }
                })
                .collect::<Result<Vec<&str>, _>>()?;
            texts.join("\n")
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages[{i}].content` must be a string or an array of text parts"),
            ))
        }
    };
    Ok(ChatTurn {
        role,
        content,
        tool_calls,
        tool_call_id,
    })
}

/// `stop`: null, a string, or an array of strings; empty strings are dropped.
fn stop(value: Option<Value>) -> Result<Vec<String>, ApiError> {
    let list = match value {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::invalid(
                    "stop",
                    "`stop` must be a string or an array of strings",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    let list: Vec<String> = list.into_iter().filter(|s| !s.is_empty()).collect();
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> CoordinatorConfig {
        CoordinatorConfig::default()
    }

    fn chat(v: Value) -> Result<ValidRequest, ApiError> {
        ValidRequest::chat(v.to_string().as_bytes(), &config())
    }

    fn completion(v: Value) -> Result<ValidRequest, ApiError> {
        ValidRequest::completion(v.to_string().as_bytes(), &config())
    }

    fn param(r: Result<ValidRequest, ApiError>) -> Option<&'static str> {
        r.expect_err("must be refused").param()
    }

    #[test]
    fn a_plain_chat_request_gets_openai_defaults() {
        let r = chat(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .expect("valid");
        assert_eq!(r.endpoint, Endpoint::Chat);
        assert_eq!(r.model, "m");
        assert_eq!(
            r.prompt,
            PromptSpec::Chat(vec![ChatTurn::new("user", "hi")])
        );
        // No `max_tokens`: up to the end of the context, within the server's limit.
        assert_eq!(r.params.max_tokens, config().max_tokens_limit);
        let mut fixed = config();
        fixed.default_max_tokens = 64;
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let r = ValidRequest::chat(body.to_string().as_bytes(), &fixed).expect("valid");
        assert_eq!(r.params.max_tokens, 64);
        assert_eq!(r.params.temperature, 1.0);
        assert_eq!(r.params.top_p, 1.0);
        assert_eq!((r.params.top_k, r.params.repetition_penalty), (0, 1.0));
        assert!(!r.stream && !r.include_usage && !r.params.ignore_eos);
        assert!(r.params.stop.is_empty());
    }

    #[test]
    fn every_field_is_read() {
        let r = chat(json!({"model": "m", "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}],
            "max_tokens": 9, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
            "top_k": 40, "repetition_penalty": 1.1, "seed": 42, "stop": ["x", ""], "n": 1,
            "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true,
            "logit_bias": {}}))
        .expect("valid");
        let PromptSpec::Chat(turns) = &r.prompt else {
            panic!("chat prompt")
        };
        assert_eq!(turns[0].content, "a\nb");
        assert_eq!(turns[1].content, "");
        assert_eq!(r.params.max_tokens, 7);
        assert_eq!(
            (r.params.temperature, r.params.top_p, r.params.top_k),
            (0.0, 0.5, 40)
        );
        assert_eq!(r.params.seed, 42);
        assert_eq!(r.params.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage && r.params.ignore_eos);
    }

    #[test]
    fn completion_prompts_take_every_openai_form() {
        let p =
            |prompt: Value| completion(json!({"model": "m", "prompt": prompt})).map(|r| r.prompt);
        assert_eq!(p(json!("hi")), Ok(PromptSpec::Text("hi".into())));
        assert_eq!(p(json!(["hi"])), Ok(PromptSpec::Text("hi".into())));
        assert_eq!(p(json!([1, 2, 3])), Ok(PromptSpec::Tokens(vec![1, 2, 3])));
        assert_eq!(p(json!([[4, 5]])), Ok(PromptSpec::Tokens(vec![4, 5])));
        assert_eq!(
            completion(json!({"model": "m", "prompt": "x", "stop": "\n"}))
                .expect("ok")
                .params
                .stop,
            vec!["\n".to_string()]
        );
        for bad in [
            json!([]),
            json!(["a", "b"]),
            json!([-1]),
            json!([1.5]),
            json!(3),
            json!([[]]),
            json!({}),
        ] {
            assert_eq!(
                p(bad.clone()).map_err(|e| e.param()),
                Err(Some("prompt")),
                "{bad}"
            );
        }
    }

    #[test]
    fn malformed_json_and_missing_fields_are_400() {
        let e = ValidRequest::chat(b"{\"model\": ", &config()).expect_err("malformed");
        assert_eq!((e.status().as_u16(), e.code()), (400, "invalid_json"));
        let e = ValidRequest::chat(b"[1, 2]", &config()).expect_err("not an object");
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(
            chat(json!({"messages": []})),
            Err(ApiError::MissingField("model"))
        );
        assert_eq!(
            chat(json!({"model": "m"})),
            Err(ApiError::MissingField("messages"))
        );
        assert_eq!(
            completion(json!({"model": "m"})),
            Err(ApiError::MissingField("prompt"))
        );
        assert_eq!(
            completion(json!({"model": "", "prompt": "x"})),
            Err(ApiError::MissingField("model"))
        );
        assert_eq!(
            param(chat(json!({"model": "m", "messages": []}))),
            Some("messages")
        );
        assert_eq!(
            param(chat(json!({"model": "m", "messages": [{"content": "x"}]}))),
            Some("messages")
        );
        assert_eq!(
            param(chat(
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
            )),
            Some("messages")
        );
        let e = chat(json!({"model": "m", "messages": "hi"})).expect_err("wrong type");
        assert_eq!(e.code(), "invalid_json");
    }

    #[test]
    fn out_of_range_parameters_are_400() {
        let with = |extra: Value| {
            let mut v = json!({"model": "m", "prompt": "x"});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            completion(v)
        };
        let limit = config().max_tokens_limit;
        assert_eq!(param(with(json!({"max_tokens": 0}))), Some("max_tokens"));
        assert_eq!(param(with(json!({"max_tokens": -3}))), Some("max_tokens"));
        assert_eq!(
            param(with(json!({"max_tokens": limit + 1}))),
            Some("max_tokens")
        );
        assert_eq!(
            with(json!({"max_tokens": limit}))
                .expect("at the limit")
                .params
                .max_tokens,
            limit
        );
        assert_eq!(
            param(with(json!({"temperature": -0.1}))),
            Some("temperature")
        );
        assert_eq!(param(with(json!({"top_p": 0}))), Some("top_p"));
        assert_eq!(param(with(json!({"top_p": 1.01}))), Some("top_p"));
        assert_eq!(param(with(json!({"top_k": -2}))), Some("top_k"));
        assert_eq!(with(json!({"top_k": -1})).expect("off").params.top_k, 0);
        assert_eq!(
            param(with(json!({"repetition_penalty": 0}))),
            Some("repetition_penalty")
        );
        // Values that pass as f64 but not as the f32 a worker gets.
        assert_eq!(
            param(with(json!({"temperature": 1e39}))),
            Some("temperature")
        );
        assert_eq!(param(with(json!({"top_p": 1e-50}))), Some("top_p"));
        for penalty in [1e39, 1e-50] {
            assert_eq!(
                param(with(json!({"repetition_penalty": penalty}))),
                Some("repetition_penalty")
            );
        }
        assert_eq!(param(with(json!({"n": 17}))), Some("n"));
        assert_eq!(param(with(json!({"seed": 1.5}))), Some("seed"));
        assert_eq!(param(with(json!({"stop": [1]}))), Some("stop"));
        assert_eq!(
            with(json!({"seed": -1}))
                .expect("negative seed")
                .params
                .seed,
            u64::MAX
        );
        // JSON has no NaN: a client that sends one sends malformed JSON.
        let e = ValidRequest::completion(
            br#"{"model":"m","prompt":"x","temperature":NaN}"#,
            &config(),
        )
        .expect_err("NaN");
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(with(json!({"n": 3})).expect("n").n, 3);
        for e in [
            with(json!({"top_p": 0})),
            with(json!({"n": 0})),
            with(json!({"n": 17})),
        ] {
            assert_eq!(e.expect_err("bad").status().as_u16(), 400);
        }
    }

    /// A request that asks for a feature this server does not have is a 400 naming the
    /// field, on both endpoints; the same field with a value that asks for nothing, and
    /// keys no API defines, pass.
    #[test]
    fn features_not_supported_are_400_and_neutral_values_pass() {
        let chat = |extra: Value| {
            let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            ValidRequest::chat(v.to_string().as_bytes(), &config())
        };
        let completion_with = |extra: Value| {
            let mut v = json!({"model": "m", "prompt": "x"});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            completion(v)
        };
        let one = |field: &str, value: &Value| {
            let mut v = serde_json::Map::new();
            v.insert(field.to_owned(), value.clone());
            Value::Object(v)
        };
        let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let refused = [
            ("best_of", json!(2)),
            ("suffix", json!("end")),
            ("functions", json!([{"name": "f"}])),
            ("prompt_logprobs", json!(1)),
        ];
        for (field, value) in refused {
            for result in [
                chat(one(field, &value)),
                completion_with(one(field, &value)),
            ] {
                let e = result.expect_err(field);
                assert_eq!(e.status().as_u16(), 400, "{field}");
                assert_eq!(e.param(), Some(field));
                assert_eq!(e.code(), "invalid_value");
                assert!(e.to_string().contains(field), "{e}");
            }
        }
        // Completions have no tools.
        for (field, value) in [("tools", tool.clone()), ("tool_choice", json!("required"))] {
            assert_eq!(param(completion_with(one(field, &value))), Some(field));
        }
        let neutral = [
            ("logprobs", json!(false)),
            ("logprobs", json!(0)),
            ("top_logprobs", json!(0)),
            ("echo", json!(false)),
            ("presence_penalty", json!(0)),
            ("frequency_penalty", json!(0.0)),
            ("logit_bias", json!({})),
            ("stop_token_ids", json!([])),
            ("best_of", json!(1)),
            ("response_format", json!({"type": "text"})),
            ("tools", json!([])),
            ("tool_choice", json!("none")),
            ("tool_choice", json!("auto")),
            ("parallel_tool_calls", json!(true)),
            ("user", json!("someone")),
            ("an_extension_nobody_defines", json!({"x": 1})),
        ];
        for (field, value) in neutral {
            let r = chat(one(field, &value)).expect(field);
            assert_eq!(r.params.tools, None, "{field}");
            completion_with(one(field, &value)).expect(field);
        }
    }

    /// `tools`, `tool_choice` and `parallel_tool_calls` become the worker's tool use, and
    /// history calls and results its turns; each fault is a 400 naming its field.
    #[test]
    fn tools_reach_the_worker_or_name_their_fault() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "now"}}]);
        let with = |extra: Value| {
            let mut c = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "tools": tools});
            for (k, x) in extra.as_object().expect("object") {
                c[k] = x.clone();
            }
            chat(c)
        };
        let t = with(json!({})).expect("auto").params.tools.expect("tools");
        assert_eq!((t.choice, t.parallel), (ToolChoice::Auto, true));
        assert_eq!(
            serde_json::from_str::<Value>(&t.definitions).ok(),
            Some(tools.clone())
        );
        let t = with(json!({"tool_choice": "required", "parallel_tool_calls": false}))
            .expect("required")
            .params
            .tools
            .expect("tools");
        assert_eq!((t.choice, t.parallel), (ToolChoice::Required, false));
        let named = json!({"type": "function", "function": {"name": "now"}});
        let t = with(json!({"tool_choice": named}))
            .expect("named")
            .params
            .tools;
        assert_eq!(
            t.map(|t| t.choice),
            Some(ToolChoice::Function("now".into()))
        );
        assert_eq!(
            with(json!({"tool_choice": "none"}))
                .expect("none")
                .params
                .tools,
            None
        );
        let faults = [
            (json!({"tool_choice": "always"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
                "tool_choice",
            ),
            (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f",
                                "parameters": {"type": "objekt"}}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f",
                                "parameters": "not a schema"}}]}),
                "tools",
            ),
            (
                json!({"tools": [], "tool_choice": "required"}),
                "tool_choice",
            ),
        ];
        for (extra, field) in faults {
            assert_eq!(param(with(extra.clone())), Some(field), "{extra}");
        }
        // History: an assistant's calls and a tool's result.
        let r = with(json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]}))
        .expect("history");
        let PromptSpec::Chat(turns) = r.prompt else {
            panic!("a chat")
        };
        assert_eq!(turns[1].tool_calls[0].name, "get_weather");
        assert_eq!(turns[1].tool_calls[0].arguments, r#"{"city": "Oslo"}"#);
        assert_eq!(turns[2].tool_call_id.as_deref(), Some("call_1"));
        for bad in [
            json!([{"role": "assistant", "tool_calls": {"id": "1"}}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]),
            json!([{"role": "tool", "tool_call_id": 7, "content": "x"}]),
        ] {
            assert_eq!(
                param(with(json!({"messages": bad}))),
                Some("messages"),
                "{bad}"
            );
        }
    }

    /// The sampling fields travel to the worker as given; each out-of-range value is a
    /// 400 naming its field.
    #[test]
    fn sampling_fields_reach_the_worker_or_name_their_fault() {
        let with = |extra: Value| {
            let mut c = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "max_tokens": 10});
            for (k, x) in extra.as_object().expect("object") {
                c[k] = x.clone();
            }
            chat(c)
        };
        let r = with(
            json!({"presence_penalty": 0.5, "frequency_penalty": -2, "min_p": 0.05,
                            "logit_bias": {"42": 100, " 7": -100.0}, "min_tokens": 10,
                            "stop_token_ids": [2, 0], "logprobs": true, "top_logprobs": 20}),
        )
        .expect("valid");
        let p = &r.params;
        assert_eq!(
            (p.presence_penalty, p.frequency_penalty, p.min_p),
            (0.5, -2.0, 0.05)
        );
        assert_eq!(
            p.logit_bias,
            vec![
                LogitBias {
                    id: 7,
                    bias: -100.0
                },
                LogitBias {
                    id: 42,
                    bias: 100.0
                }
            ]
        );
        assert_eq!((p.min_tokens, p.stop_token_ids.clone()), (10, vec![2, 0]));
        assert_eq!(p.logprobs, Some(20));
        assert_eq!(
            with(json!({"logprobs": true}))
                .expect("valid")
                .params
                .logprobs,
            Some(0)
        );
        assert_eq!(with(json!({})).expect("valid").params.logprobs, None);
        // Completions take the count in `logprobs`.
        let c = completion(json!({"model": "m", "prompt": "x", "logprobs": 3})).expect("valid");
        assert_eq!(c.params.logprobs, Some(3));
        let c = completion(json!({"model": "m", "prompt": "x", "logprobs": 0})).expect("valid");
        assert_eq!(c.params.logprobs, Some(0));
        // echo: the prompt is scored (with the request's logprobs count), and only then
        // may max_tokens be 0; chat has no echo.
        let c = completion(
            json!({"model": "m", "prompt": "x", "echo": true, "logprobs": 2,
                                  "max_tokens": 0}),
        )
        .expect("valid");
        assert_eq!(
            (c.params.prompt_logprobs, c.params.max_tokens),
            (Some(2), 0)
        );
        let c = completion(json!({"model": "m", "prompt": "x", "echo": true})).expect("valid");
        assert_eq!(c.params.prompt_logprobs, Some(0));
        let c = completion(json!({"model": "m", "prompt": "x", "echo": false})).expect("valid");
        assert_eq!(c.params.prompt_logprobs, None);
        assert_eq!(
            param(completion(
                json!({"model": "m", "prompt": "x", "max_tokens": 0})
            )),
            Some("max_tokens")
        );
        assert_eq!(param(with(json!({"echo": true}))), Some("echo"));
        for (body, field) in [
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"frequency_penalty": -3}), "frequency_penalty"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"min_p": -0.1}), "min_p"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"1": 101}}), "logit_bias"),
            (json!({"logit_bias": {"1": "big"}}), "logit_bias"),
            (json!({"logit_bias": {"1": 1, "01": 2}}), "logit_bias"),
            (json!({"logit_bias": [1]}), "logit_bias"),
            (json!({"min_tokens": 11}), "min_tokens"),
            (json!({"min_tokens": -1}), "min_tokens"),
            (json!({"stop_token_ids": [-1]}), "stop_token_ids"),
            (json!({"stop_token_ids": "2"}), "stop_token_ids"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (json!({"logprobs": "yes"}), "logprobs"),
        ] {
            assert_eq!(param(with(body.clone())), Some(field), "{body}");
        }
        let many: serde_json::Map<String, Value> = (0..=MAX_TOKEN_LIST)
            .map(|i| (i.to_string(), json!(1)))
            .collect();
        assert_eq!(param(with(json!({"logit_bias": many}))), Some("logit_bias"));
        for (body, field) in [
            (json!({"logprobs": 21}), "logprobs"),
            (json!({"logprobs": 1.5}), "logprobs"),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"top_logprobs": 1}), "top_logprobs"),
        ] {
            let mut c = json!({"model": "m", "prompt": "x"});
            for (k, x) in body.as_object().expect("object") {
                c[k] = x.clone();
            }
            assert_eq!(param(completion(c)), Some(field), "{body}");
        }
    }

    /// Every way of asking for structured output becomes its grammar, on both
    /// endpoints; a grammar that cannot be used, a malformed field, an unknown kind and
    /// two asks at once are each a 400 naming the field.
    #[test]
    fn structured_output_fields_become_grammars_or_name_their_fault() {
        let with = |extra: Value| {
            let mut c = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            let mut p = json!({"model": "m", "prompt": "x"});
            for (k, x) in extra.as_object().expect("object") {
                c[k] = x.clone();
                p[k] = x.clone();
            }
            let chat = ValidRequest::chat(c.to_string().as_bytes(), &config());
            let completion = completion(p);
            assert_eq!(
                chat.as_ref()
                    .map(|r| r.params.grammar.clone())
                    .map_err(|e| e.to_string()),
                completion
                    .as_ref()
                    .map(|r| r.params.grammar.clone())
                    .map_err(|e| e.to_string())
            );
            chat
        };
        let grammar = |extra: Value| with(extra).expect("accepted").params.grammar;
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let object = Some(Grammar::JsonSchema(r#"{"type":"object"}"#.into()));
        assert_eq!(grammar(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(grammar(json!({"response_format": null})), None);
        assert_eq!(
            grammar(json!({"response_format": {"type": "json_object"}})),
            object
        );
        assert_eq!(
            grammar(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": true}}})),
            Some(Grammar::JsonSchema(schema.to_string()))
        );
        assert_eq!(
            grammar(json!({"guided_json": schema.to_string()})),
            Some(Grammar::JsonSchema(schema.to_string()))
        );
        assert_eq!(
            grammar(json!({"guided_regex": "a+b"})),
            Some(Grammar::Regex("a+b".into()))
        );
        assert_eq!(
            grammar(json!({"guided_choice": ["yes", "n.o"]})),
            Some(Grammar::Regex(r"yes|n\.o".into()))
        );
        assert_eq!(
            grammar(json!({"guided_grammar": "start: \"a\""})),
            Some(Grammar::Lark("start: \"a\"".into()))
        );
        assert_eq!(
            grammar(json!({"structured_outputs": {"json_object": true}})),
            object
        );
        assert_eq!(
            grammar(
                json!({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": true}})
            ),
            Some(Grammar::Regex("a".into()))
        );
        let refused = [
            (
                json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "x", "schema": {"type": "objekt"}}}}),
                "response_format.json_schema.schema",
                "objekt",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
                "schema` is missing",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
                "json_schema` is missing",
            ),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
                "yaml",
            ),
            (
                json!({"response_format": "json"}),
                "response_format",
                "with a `type`",
            ),
            (
                json!({"guided_json": "{not json"}),
                "guided_json",
                "not valid JSON",
            ),
            (json!({"guided_json": 7}), "guided_json", "JSON schema"),
            (
                json!({"guided_regex": "(("}),
                "guided_regex",
                "unclosed group",
            ),
            (
                json!({"guided_regex": ""}),
                "guided_regex",
                "non-empty string",
            ),
            (
                json!({"guided_choice": []}),
                "guided_choice",
                "non-empty array",
            ),
            (
                json!({"guided_choice": ["a", 1]}),
                "guided_choice",
                "non-empty array",
            ),
            (
                json!({"guided_grammar": "start: nothing_here"}),
                "guided_grammar",
                "nothing_here",
            ),
            (
                json!({"structured_outputs": {"xml": "x"}}),
                "structured_outputs",
                "xml",
            ),
            (
                json!({"structured_outputs": {"disable_additional_properties": true}}),
                "structured_outputs",
                "disable_additional_properties",
            ),
            (
                json!({"structured_outputs": [1]}),
                "structured_outputs",
                "an object",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
                "both ask",
            ),
        ];
        for (extra, field, needle) in refused {
            let e = with(extra.clone()).expect_err(&extra.to_string());
            assert_eq!(e.status().as_u16(), 400, "{extra}");
            assert_eq!(e.param(), Some(field), "{extra}: {e}");
            assert_eq!(e.code(), "invalid_value");
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
    }

    #[test]
    fn token_prompts_over_max_prompt_tokens_are_refused_here() {
        let config = CoordinatorConfig {
            max_prompt_tokens: 3,
            ..CoordinatorConfig::default()
        };
        let body = |prompt: Value| json!({"model": "m", "prompt": prompt}).to_string();
        let e = ValidRequest::completion(body(json!([1, 2, 3, 4])).as_bytes(), &config)
            .expect_err("four tokens");
        assert_eq!(
            (e.status().as_u16(), e.code()),
            (400, "context_length_exceeded")
        );
        assert!(e.to_string().contains("max_prompt_tokens"), "{e}");
        let r = ValidRequest::completion(body(json!([1, 2, 3])).as_bytes(), &config)
            .expect("three tokens");
        assert_eq!(r.max_prompt_tokens, 3);
        // Text is counted by the worker: the limit travels with the request.
        let r = ValidRequest::completion(body(json!("a long text prompt")).as_bytes(), &config)
            .expect("text");
        assert_eq!(r.max_prompt_tokens, 3);
    }

    #[test]
    fn include_usage_needs_stream() {
        let r = completion(
            json!({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}),
        )
        .expect("valid");
        assert!(!r.include_usage);
    }
}
