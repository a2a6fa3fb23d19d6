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
mod tests;
