use super::*;

fn call(name: &str, args: &str) -> ParsedCall {
    ParsedCall {
        name: name.into(),
        arguments: args.into(),
    }
}

/// The parser fed `text` in pieces of `n` bytes (at char boundaries) gives the same result as
/// whole, and never emits a partial marker as content.
fn parse_in_pieces(format: ToolFormat, text: &str, n: usize) -> (String, Vec<ParsedCall>) {
    let mut p = ToolCallParser::new(format);
    let mut events = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let mut j = (i + n).min(text.len());
        while !text.is_char_boundary(j) {
            j += 1;
        }
        events.extend(p.push(&text[i..j]));
        i = j;
    }
    events.extend(p.finish());
    collect(events)
}

fn check(format: ToolFormat, text: &str, content: &str, calls: &[ParsedCall]) {
    for n in [1, 2, 3, 5, 7, 64, 10_000] {
        let (c, k) = parse_in_pieces(format, text, n);
        assert_eq!(c, content, "content, pieces of {n}: {text:?}");
        assert_eq!(k, calls, "calls, pieces of {n}: {text:?}");
    }
}

#[test]
fn hermes_single_parallel_and_surrounding_text() {
    let f = ToolFormat::Hermes;
    check(
        f,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "",
        &[call("get_weather", r#"{"city": "Paris"}"#)],
    );
    check(
        f,
        "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": \"}\"}]}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"b\"}\n</tool_call>",
        "Let me check.\n",
        &[call("a", r#"{"x": [1, {"y": "}"}]}"#), call("b", "{}")],
    );
    // No call at all; a lone `<` and a near-marker stay content.
    check(f, "1 < 2 and <tool_ca", "1 < 2 and <tool_ca", &[]);
    // A block that is not a call is given back as text.
    check(
        f,
        "<tool_call>oops</tool_call>",
        "<tool_call>oops</tool_call>",
        &[],
    );
    // Arguments sent as a JSON string are decoded.
    check(
        f,
        "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
        "",
        &[call("f", r#"{"a": 1}"#)],
    );
    // Cut off inside the end marker after a whole call: the call, and no marker as content.
    check(
        f,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": 1}}\n</tool_c",
        "",
        &[call("f", "{}"), call("g", r#"{"a": 1}"#)],
    );
    // Cut off inside the arguments: the call ends with what it has.
    check(
        f,
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1",
        "",
        &[call("f", r#"{"a": 1"#)],
    );
}

#[test]
fn streaming_events_are_incremental_and_name_comes_first() {
    let mut p = ToolCallParser::new(ToolFormat::Hermes);
    let mut ev = p.push("Sure<tool_");
    assert_eq!(
        ev,
        vec![ToolEvent::Content("Sure".into())],
        "the partial marker is held"
    );
    ev = p.push("call>{\"name\": \"f\", \"argu");
    assert_eq!(
        ev,
        vec![ToolEvent::Start {
            index: 0,
            name: "f".into()
        }]
    );
    ev = p.push("ments\": {\"a\": ");
    assert_eq!(
        ev,
        vec![ToolEvent::Arguments {
            index: 0,
            text: "{\"a\": ".into()
        }]
    );
    ev = p.push("1}}</tool_call>");
    assert_eq!(
        ev,
        vec![
            ToolEvent::Arguments {
                index: 0,
                text: "1}".into()
            },
            ToolEvent::End { index: 0 }
        ]
    );
    assert!(p.finish().is_empty());
    assert_eq!(p.num_calls(), 1);
    // Arguments before the name are held until the name is known.
    let mut p = ToolCallParser::new(ToolFormat::Hermes);
    assert!(p.push("<tool_call>{\"arguments\": {\"a\": 1}, ").is_empty());
    assert_eq!(
        p.push("\"name\": \"g\"}"),
        vec![
            ToolEvent::Start {
                index: 0,
                name: "g".into()
            },
            ToolEvent::Arguments {
                index: 0,
                text: "{\"a\": 1}".into()
            },
            ToolEvent::End { index: 0 }
        ]
    );
}

#[test]
fn llama3_json_at_the_start_only() {
    let f = ToolFormat::Llama3Json;
    check(
        f,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
        "",
        &[call("get_weather", r#"{"city": "Oslo"}"#)],
    );
    check(
        f,
        "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"n\": 2}}",
        "",
        &[call("a", "{}"), call("b", r#"{"n": 2}"#)],
    );
    // JSON that is not a call, and prose with braces, are content.
    check(f, "{\"answer\": 42}", "{\"answer\": 42}", &[]);
    check(
        f,
        "The set {1, 2} is small.",
        "The set {1, 2} is small.",
        &[],
    );
    check(f, "plain answer", "plain answer", &[]);
}

#[test]
fn mistral_list() {
    let f = ToolFormat::Mistral;
    check(
        f,
        "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"q\": \"x, y\"}}, {\"name\": \"b\", \"arguments\": {}}]",
        "",
        &[call("a", r#"{"q": "x, y"}"#), call("b", "{}")],
    );
    check(
        f,
        "Calling.[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}]",
        "Calling.",
        &[call("a", "{}")],
    );
    check(f, "[TOOL_CALL no", "[TOOL_CALL no", &[]);
}

#[test]
fn render_call_round_trips_through_the_parser() {
    for f in [
        ToolFormat::Hermes,
        ToolFormat::Generic,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
    ] {
        let text = f.render_call("lookup", r#"{"k": "v \"q\""}"#);
        check(f, &text, "", &[call("lookup", r#"{"k": "v \"q\""}"#)]);
        assert_eq!(ToolFormat::parse(f.as_str()), Some(f));
    }
}

#[test]
fn detection_from_a_rendered_call() {
    assert_eq!(
        ToolFormat::detect("<|im_start|>assistant\n<tool_call>\n{...}"),
        Some(ToolFormat::Hermes)
    );
    assert_eq!(
        ToolFormat::detect("[TOOL_CALLS][{...}]"),
        Some(ToolFormat::Mistral)
    );
    assert_eq!(
        ToolFormat::detect("{\"name\": \"f\", \"parameters\": {}}<|eot_id|>"),
        Some(ToolFormat::Llama3Json)
    );
    assert_eq!(ToolFormat::detect("assistant: f(x)"), None);
}
