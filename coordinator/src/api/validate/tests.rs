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
    let p = |prompt: Value| completion(json!({"model": "m", "prompt": prompt})).map(|r| r.prompt);
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
        grammar(json!({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": true}})),
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
    let r =
        ValidRequest::completion(body(json!([1, 2, 3])).as_bytes(), &config).expect("three tokens");
    assert_eq!(r.max_prompt_tokens, 3);
    // Text is counted by the worker: the limit travels with the request.
    let r = ValidRequest::completion(body(json!("a long text prompt")).as_bytes(), &config)
        .expect("text");
    assert_eq!(r.max_prompt_tokens, 3);
}

#[test]
fn include_usage_needs_stream() {
    let r =
        completion(json!({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}))
            .expect("valid");
    assert!(!r.include_usage);
}
