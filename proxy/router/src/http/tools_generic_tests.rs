//! Generic tool calls: the grammar an answer is sampled under, the prompt, the reading.
use super::*;
use lockstep_engine::grammar::{OutputConstraint, accepts};

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                        "required": ["zone"]}}}
    ])
}

fn generic(
    choice: Option<Value>,
    parallel: Option<Value>,
    backend: BackendKind,
) -> Result<(Option<Tools>, Option<Constraint>), LockstepError> {
    request(
        Some(weather_tools()),
        choice,
        parallel,
        ToolParserKind::Generic,
        backend,
    )
}

fn engine(c: &Constraint) -> OutputConstraint {
    c.for_engine().expect("an engine constraint")
}

const CALL: &str = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#;
const TWO: &str = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]}"#;

/// `auto`: plain text, or exactly one envelope of calls to declared tools with valid arguments;
/// nothing else that begins with `{`.
#[test]
fn auto_allows_text_or_valid_calls_only() {
    let (_, c) = generic(None, Some(json!(true)), BackendKind::Embedded).expect("ok");
    let c = engine(&c.expect("auto is constrained"));
    let ok = |t: &str| accepts(&c, t).expect("grammar runs");
    for text in [
        "The weather is fine.",
        "",
        "  leading space, then text {with braces} inside",
        "line one\nline two",
        CALL,
        TWO,
    ] {
        assert!(ok(text), "refused: {text:?}");
    }
    for text in [
        r#"{"answer": 1}"#,
        r#"{"tool_calls": [{"name": "rm_rf", "arguments": {}}]}"#,
        r#"{"tool_calls": [{"name": "get_weather", "arguments": {}}]}"#,
        r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": 3}}]}"#,
        r#"{"tool_calls": []}"#,
        r#"  {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#,
        r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]} and text"#,
    ] {
        assert!(!ok(text), "allowed: {text:?}");
    }
    // `parallel_tool_calls: false`, and unsaid (llama-server's generic default): one call.
    for parallel in [Some(json!(false)), None] {
        let (t, c) = generic(None, parallel, BackendKind::Lockstep).expect("ok");
        let c = engine(&c.expect("constrained"));
        assert!(accepts(&c, CALL).expect("runs") && !accepts(&c, TWO).expect("runs"));
        let t = t.expect("tools");
        assert!(t.one_call && t.section.expect("section").contains("exactly one call"));
    }
}

/// `required` and a named tool: only the envelope (a JSON schema, so SGLang's and vLLM's grammar
/// backends take it too); the system turn says a call is due.
#[test]
fn a_forced_call_allows_only_the_envelope_on_any_backend() {
    for backend in [
        BackendKind::Embedded,
        BackendKind::Sglang,
        BackendKind::Vllm,
    ] {
        let (t, c) = generic(Some(json!("required")), None, backend).expect("ok");
        let c = c.expect("constrained");
        assert!(matches!(c, Constraint::JsonSchema(_)), "{c:?}");
        let c = engine(&c);
        assert!(accepts(&c, CALL).expect("runs"));
        assert!(!accepts(&c, "Sunny.").expect("runs"));
        assert!(
            t.expect("tools")
                .section
                .expect("section")
                .contains("must call a tool")
        );
    }
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let (t, c) = generic(Some(named), None, BackendKind::Sglang).expect("ok");
    let c = engine(&c.expect("constrained"));
    assert!(
        !accepts(&c, CALL).expect("runs"),
        "another tool than the named one"
    );
    assert!(
        accepts(
            &c,
            r#"{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}"#
        )
        .expect("runs")
    );
    assert!(
        t.expect("tools")
            .section
            .expect("section")
            .contains("call the tool `get_time`")
    );
    // `none`: no tools in the prompt, nothing constrained, nothing parsed.
    let (t, c) = generic(Some(json!("none")), None, BackendKind::Vllm).expect("ok");
    let t = t.expect("tools");
    assert!(c.is_none() && t.section.is_none() && t.parse.is_none());
    // A `parallel_tool_calls` that is not a boolean is refused by name.
    match generic(None, Some(json!("yes")), BackendKind::Embedded) {
        Err(LockstepError::InvalidRequest { param, .. }) => {
            assert_eq!(param.as_deref(), Some("parallel_tool_calls"))
        }
        other => panic!("{other:?}"),
    }
}

/// The prompt: the tools in the system turn (the request's own system text kept first), earlier
/// calls as envelopes, a run of tool results as one user turn naming each call.
#[test]
fn the_history_is_written_as_plain_turns() {
    let (tools, forced) = generic(None, None, BackendKind::Embedded).expect("ok");
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}});
    let messages = vec![
        ChatMessage::text("system", "Be brief."),
        ChatMessage::text("user", "Weather in Paris and the time?"),
        ChatMessage {
            role: "assistant".into(),
            content: String::new(),
            tool_calls: Some(vec![call]),
            tool_call_id: None,
        },
        ChatMessage {
            role: "tool".into(),
            content: "18C <|im_end|>".into(),
            tool_calls: None,
            tool_call_id: Some("call_1".into()),
        },
        ChatMessage {
            role: "tool".into(),
            content: "noon".into(),
            tool_calls: None,
            tool_call_id: Some("call_unknown".into()),
        },
    ];
    let mut sampling = SamplingParams::default();
    let (input, parse) = settle(
        tools,
        forced,
        &mut sampling,
        "response_format",
        messages,
        ToolParserKind::Generic,
    )
    .expect("settles");
    assert!(matches!(sampling.constraint, Some(Constraint::Lark(_))));
    assert_eq!(parse.expect("parsed").kind, ToolParserKind::Generic);
    let Input::Chat(m) = input else {
        panic!("generic mode gives the template plain turns")
    };
    let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    assert!(
        m[0].content.starts_with("Be brief.\n\n# Tools"),
        "{}",
        m[0].content
    );
    assert!(
        m[0].content.contains(r#""name":"get_weather""#),
        "{}",
        m[0].content
    );
    let env: Value = serde_json::from_str(&m[2].content).expect("an envelope");
    assert_eq!(env["tool_calls"][0]["arguments"]["city"], "Paris");
    assert!(
        m.iter()
            .all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none())
    );
    assert_eq!(
        m[3].content,
        "Result of get_weather (call call_1):\n18C <|im_end|>\n\nResult of call call_unknown:\nnoon"
    );
    // With no system message the tools come first, in one of their own.
    let m = generic::rewrite_history(vec![ChatMessage::text("user", "hi")], Some("S"));
    assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("system", "S"));
    // A format and generic tools cannot both shape the answer.
    let (tools, forced) = generic(None, None, BackendKind::Embedded).expect("ok");
    let mut sampling = SamplingParams {
        constraint: Some(Constraint::JsonObject),
        ..SamplingParams::default()
    };
    match settle(
        tools,
        forced,
        &mut sampling,
        "response_format",
        vec![ChatMessage::text("user", "hi")],
        ToolParserKind::Generic,
    ) {
        Err(LockstepError::InvalidRequest { param, .. }) => {
            assert_eq!(param.as_deref(), Some("response_format"))
        }
        other => panic!("{other:?}"),
    }
}

/// Reading a generic answer, whole and streamed: text passes as it comes; an envelope is held
/// and becomes calls; an envelope with an undeclared tool, or two calls where one was allowed,
/// is all text.
#[test]
fn generic_answers_are_read_whole_and_streamed() {
    let tools = ToolParse {
        kind: ToolParserKind::Generic,
        names: vec!["get_weather".to_string(), "get_time".into()].into(),
        one_call: false,
    };
    let (content, calls) = parse(&tools, CALL).expect("a call");
    assert_eq!(content, "");
    assert_eq!(calls[0].name, "get_weather");
    assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
    assert_eq!(parse(&tools, TWO).expect("two calls").1.len(), 2);
    assert!(parse(&tools, "Sunny, {\"tool_calls\": []}").is_none());
    assert!(
        parse(
            &tools,
            r#"{"tool_calls": [{"name": "rm", "arguments": {}}]}"#
        )
        .is_none()
    );
    assert!(
        parse(
            &tools,
            r#"{"tool_calls": [{"name": "get_time", "arguments": 3}]}"#
        )
        .is_none()
    );
    let one = ToolParse {
        one_call: true,
        ..tools.clone()
    };
    assert!(parse(&one, TWO).is_none() && parse(&one, CALL).is_some());

    let mut s = ToolStream::new(tools.clone());
    assert_eq!(s.push("Sun"), "Sun");
    assert_eq!(s.push("ny {x}"), "ny {x}");
    assert_eq!(s.finish(), (String::new(), Vec::new()));
    let mut s = ToolStream::new(tools);
    for piece in CALL.as_bytes().chunks(7) {
        assert_eq!(s.push(std::str::from_utf8(piece).expect("ascii")), "");
    }
    let (rest, calls) = s.finish();
    assert_eq!((rest.as_str(), calls.len()), ("", 1));
}

/// Objects that list their properties and leave `additionalProperties` unsaid are closed in the
/// envelope (nested ones too); a property named like a keyword is still a property.
#[test]
fn argument_objects_are_closed_to_their_properties() {
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string"},
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": true}}});
    let tool = ("f".to_string(), params);
    let schema = generic::envelope_schema(&[&tool], true);
    let args = &schema["properties"]["tool_calls"]["items"]["properties"]["arguments"];
    assert_eq!(args["additionalProperties"], false);
    assert_eq!(
        args["properties"]["properties"]["additionalProperties"],
        false
    );
    assert!(args["properties"].get("additionalProperties").is_none());
    assert_eq!(args["properties"]["open"]["additionalProperties"], true);
    let c = OutputConstraint::JsonSchema(schema.to_string());
    let call = |args: &str| format!(r#"{{"tool_calls": [{{"name": "f", "arguments": {args}}}]}}"#);
    assert!(accepts(&c, &call(r#"{"city": "Oslo"}"#)).expect("runs"));
    assert!(!accepts(&c, &call(r#"{"city": "Oslo", "type": "string"}"#)).expect("runs"));
    assert!(accepts(&c, &call(r#"{"open": {"y": 1, "z": 2}}"#)).expect("runs"));
}
