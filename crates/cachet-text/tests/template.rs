//! Chat templates in the styles of the families cachet serves, written here to read the same
//! fields the published Qwen2.5, Llama 3.x and Hermes templates read (`tools | tojson`,
//! `message.tool_calls`, `tool_call.function`, `function.arguments | tojson`, `'tool_calls' in
//! message`, `tool_call_id`, `name`, `strftime_now`), with the exact prompts derived by hand.

use std::time::{Duration, UNIX_EPOCH};

use cachet_text::{
    ChatMessage, ChatRequest, ChatTemplate, Role, TemplateCaps, TemplateError, ToolCall,
    MAX_RENDERED_BYTES, MAX_TEMPLATE_BYTES, TEMPLATE_FUEL,
};
use serde_json::json;

const QWEN_STYLE: &str = include_str!("templates/qwen_style.jinja");

const LLAMA_STYLE: &str = include_str!("templates/llama_style.jinja");

const HERMES_STYLE: &str = include_str!("templates/hermes_style.jinja");
/// Mistral's templates reject tool call ids that are not 9 alphanumerics.
const MISTRAL_STYLE: &str = include_str!("templates/mistral_style.jinja");

fn weather_tool() -> serde_json::Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"]
            }
        }
    })
}

fn tool_loop() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Weather in Paris?"),
        ChatMessage::assistant_tool_calls(
            "",
            vec![ToolCall::function(
                "call_1",
                "get_weather",
                r#"{"city":"Paris"}"#,
            )],
        ),
        ChatMessage::tool("call_1", "18 C"),
    ]
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::new(None, "", "").unwrap();
    let msgs = [ChatMessage::system("S"), ChatMessage::user("Hi")];
    assert_eq!(
        t.render(&ChatRequest::new(&msgs, true)).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&ChatRequest::new(&msgs[1..], false)).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
    assert_eq!(t.caps(), TemplateCaps::default());
    assert_eq!(ChatTemplate::chatml().caps(), TemplateCaps::default());
}

#[test]
fn qwen_style_tools_and_tool_calls() {
    let t = ChatTemplate::new(Some(QWEN_STYLE), "", "<|im_end|>").unwrap();
    assert_eq!(
        t.caps(),
        TemplateCaps {
            renders_tools: true,
            renders_tool_calls: true
        }
    );
    let tools = [weather_tool()];
    let msgs = tool_loop();
    let s = t
        .render(&ChatRequest::new(&msgs, true).with_tools(&tools))
        .unwrap();
    assert_eq!(
        s,
        concat!(
            "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n",
            r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
            "\n</tools><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n",
            r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
            "\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n"
        )
    );
    // No tools (or an empty list): the plain system turn.
    let s = t
        .render(&ChatRequest::new(&msgs[..2], true).with_tools(&[]))
        .unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn llama_style_reads_tool_calls_by_key_and_the_date() {
    let t = ChatTemplate::new(Some(LLAMA_STYLE), "<|begin_of_text|>", "<|eot_id|>").unwrap();
    assert_eq!(
        t.caps(),
        TemplateCaps {
            renders_tools: true,
            renders_tool_calls: true
        }
    );
    let tools = [weather_tool()];
    let msgs = tool_loop();
    let day = UNIX_EPOCH + Duration::from_secs(1_721_952_000); // 2024-07-26
    let s = t
        .render(&ChatRequest::new(&msgs, true).with_tools(&tools).at(day))
        .unwrap();
    let tool_json = r#"{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {
                    "type": "string"
                }
            },
            "required": [
                "city"
            ]
        }
    }
}"#;
    let expected = format!(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\n\nTools:\n{tool_json}\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n{{\"name\": \"get_weather\", \"parameters\": {{\"city\": \"Paris\"}}}}<|eot_id|>\
         <|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(s, expected);
    // Without tools the template sees `tools = none`.
    let s = t
        .render(&ChatRequest::new(&msgs[1..2], false).at(day))
        .unwrap();
    assert_eq!(
        s,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\n\n<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
    );
}

#[test]
fn hermes_style_names_ids_and_unparsed_arguments() {
    let t = ChatTemplate::new(Some(HERMES_STYLE), "", "").unwrap();
    // It renders calls but not the tool list.
    assert_eq!(
        t.caps(),
        TemplateCaps {
            renders_tools: false,
            renders_tool_calls: true
        }
    );
    let mut user = ChatMessage::user("hi");
    user.name = Some("alice".into());
    let msgs = [
        user,
        ChatMessage::assistant_tool_calls(
            "ok",
            vec![
                ToolCall::function("c1", "f", "not json"),
                ToolCall::function("c2", "g", "[1,2]"),
                ToolCall::function("c3", "h", r#"{"k": "é<&>", "n": 1.5}"#),
            ],
        ),
        ChatMessage::tool("c1", "done"),
        ChatMessage::new(Role::Developer, "dev"),
    ];
    let s = t.render(&ChatRequest::new(&msgs, false)).unwrap();
    assert_eq!(
        s,
        concat!(
            "<|im_start|>user name=alice\nhi<|im_end|>\n",
            "<|im_start|>assistant\nok",
            "<tool_call>\n{\"id\": \"c1\", \"name\": \"f\", \"arguments\": \"not json\"}\n</tool_call>",
            "<tool_call>\n{\"id\": \"c2\", \"name\": \"g\", \"arguments\": \"[1,2]\"}\n</tool_call>",
            "<tool_call>\n{\"id\": \"c3\", \"name\": \"h\", \"arguments\": {\"k\": \"é<&>\", \"n\": 1.5}}\n</tool_call>",
            "<|im_end|>\n",
            "<|im_start|>tool id=c1\ndone<|im_end|>\n",
            "<|im_start|>system\ndev<|im_end|>\n"
        )
    );
}

#[test]
fn mistral_style_nine_character_ids() {
    let t = ChatTemplate::new(Some(MISTRAL_STYLE), "<s>", "</s>").unwrap();
    // The probes use a nine-character id, so the template's own tool format is found.
    assert_eq!(
        t.caps(),
        TemplateCaps {
            renders_tools: true,
            renders_tool_calls: true
        }
    );
    let tools = [json!({"type": "function", "function": {"name": "f"}})];
    let msgs = [
        ChatMessage::user("Hi"),
        ChatMessage::assistant_tool_calls(
            "",
            vec![ToolCall::function("abc123xyz", "f", r#"{"a": 1}"#)],
        ),
        ChatMessage::tool("abc123xyz", "ok"),
    ];
    assert_eq!(
        t.render(&ChatRequest::new(&msgs, false).with_tools(&tools))
            .unwrap(),
        concat!(
            r#"[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "f"}}][/AVAILABLE_TOOLS]"#,
            "[INST] Hi[/INST]",
            r#"[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abc123xyz"}]</s>"#,
            r#"[TOOL_RESULTS] {"content": "ok", "call_id": "abc123xyz"}[/TOOL_RESULTS]"#
        )
    );
    let bad = [
        ChatMessage::user("Hi"),
        ChatMessage::assistant_tool_calls("", vec![ToolCall::function("call_1", "f", "{}")]),
    ];
    assert_eq!(
        t.render(&ChatRequest::new(&bad, false)),
        Err(TemplateError::Raised(
            "Tool call IDs should be alphanumeric strings with length 9!".into()
        ))
    );
}

#[test]
fn tojson_writes_what_python_json_dumps_writes() {
    let cases = [
        (
            r#"{{ {"a": [1, 2], "b": "é<"} | tojson }}"#,
            r#"{"a": [1, 2], "b": "é<"}"#,
        ),
        (r#"{{ {"b": 1, "a": 2} | tojson }}"#, r#"{"b": 1, "a": 2}"#),
        (
            r#"{{ {"b": 1, "a": 2} | tojson(sort_keys=true) }}"#,
            r#"{"a": 2, "b": 1}"#,
        ),
        (
            r#"{{ {"a": [1, 2], "b": {}, "c": []} | tojson(indent=2) }}"#,
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {},\n  \"c\": []\n}",
        ),
        (
            r#"{{ {"a": [1, 2]} | tojson(separators=(",", ":")) }}"#,
            r#"{"a":[1,2]}"#,
        ),
        (
            r#"{{ "é😀\x01" | tojson(ensure_ascii=true) }}"#,
            r#""\u00e9\ud83d\ude00\u0001""#,
        ),
        (r#"{{ "é" | tojson(true) }}"#, r#""\u00e9""#),
        (r#"{{ [1] | tojson(1) }}"#, "[\n 1\n]"),
        (r#"{{ "a\"b\\c\n" | tojson }}"#, r#""a\"b\\c\n""#),
        (r#"{{ none | tojson }}"#, "null"),
    ];
    for (src, want) in cases {
        let t = ChatTemplate::new(Some(src), "", "").unwrap();
        assert_eq!(
            t.render(&ChatRequest::new(&[], false)).unwrap(),
            want,
            "{src}"
        );
    }
    let t = ChatTemplate::new(Some("{{ 1 | tojson(bogus=1) }}"), "", "").unwrap();
    assert!(matches!(
        t.render(&ChatRequest::new(&[], false)),
        Err(TemplateError::Render(_))
    ));
}

#[test]
fn strftime_now_formats() {
    let src = r#"{{ strftime_now("%d %b %Y|%Y-%m-%d %H:%M:%S|%A %a %B %j %y|%%|%e|%-d|%Q") }}"#;
    let t = ChatTemplate::new(Some(src), "", "").unwrap();
    let at = |secs: i64| {
        let time = if secs >= 0 {
            UNIX_EPOCH + Duration::from_secs(secs as u64)
        } else {
            UNIX_EPOCH - Duration::from_secs((-secs) as u64)
        };
        t.render(&ChatRequest::new(&[], false).at(time)).unwrap()
    };
    // Expected values from Python's datetime.strftime in UTC.
    assert_eq!(
        at(0),
        "01 Jan 1970|1970-01-01 00:00:00|Thursday Thu January 001 70|%| 1|1|%Q"
    );
    assert_eq!(
        at(951_782_400),
        "29 Feb 2000|2000-02-29 00:00:00|Tuesday Tue February 060 00|%|29|29|%Q"
    );
    assert_eq!(
        at(1_735_689_599),
        "31 Dec 2024|2024-12-31 23:59:59|Tuesday Tue December 366 24|%|31|31|%Q"
    );
    assert_eq!(
        at(-86_400),
        "31 Dec 1969|1969-12-31 00:00:00|Wednesday Wed December 365 69|%|31|31|%Q"
    );
}

#[test]
fn kwargs_reach_the_template_but_never_replace_its_inputs() {
    let src = "{{ enable_thinking }}|{{ messages | length }}|{{ bos_token }}";
    let t = ChatTemplate::new(Some(src), "<s>", "").unwrap();
    let kw = json!({"enable_thinking": false, "messages": [], "bos_token": "X"});
    let msgs = [ChatMessage::user("a")];
    let s = t
        .render(&ChatRequest::new(&msgs, false).with_kwargs(kw.as_object().unwrap()))
        .unwrap();
    // Python booleans, as Jinja under transformers prints them.
    assert_eq!(s, "False|1|<s>");
}

#[test]
fn errors_are_typed() {
    let raise = ChatTemplate::new(
        Some("{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok"),
        "",
        "",
    )
    .unwrap();
    assert_eq!(
        raise.render(&ChatRequest::new(&[ChatMessage::assistant("x")], false)),
        Err(TemplateError::Raised("roles must alternate".into()))
    );
    assert_eq!(
        raise
            .render(&ChatRequest::new(&[ChatMessage::user("x")], false))
            .unwrap(),
        "ok"
    );
    assert!(matches!(
        ChatTemplate::new(Some("{% for %}"), "", ""),
        Err(TemplateError::Syntax(_))
    ));
    let big = "x".repeat(MAX_TEMPLATE_BYTES + 1);
    assert_eq!(
        ChatTemplate::new(Some(&big), "", "").unwrap_err(),
        TemplateError::TooLarge {
            len: MAX_TEMPLATE_BYTES + 1,
            max: MAX_TEMPLATE_BYTES
        }
    );
    // An undefined variable used in an operation is a render error, not a panic.
    let t = ChatTemplate::new(Some("{{ nothing.here + 1 }}"), "", "").unwrap();
    assert!(matches!(
        t.render(&ChatRequest::new(&[], false)),
        Err(TemplateError::Render(_))
    ));
}

#[test]
fn renders_are_bounded() {
    // Ten billion iterations: stopped by fuel.
    let spin = ChatTemplate::new(
        Some("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
        "",
        "",
    )
    .unwrap();
    assert_eq!(
        spin.render(&ChatRequest::new(&[], false)),
        Err(TemplateError::OutOfFuel { max: TEMPLATE_FUEL })
    );
    // 100,000 copies of a 1 KiB message: stopped by the output cap.
    let blow_up = ChatTemplate::new(
        Some("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"),
        "",
        "",
    )
    .unwrap();
    let msgs = [ChatMessage::user("y".repeat(1024))];
    assert_eq!(
        blow_up.render(&ChatRequest::new(&msgs, false)),
        Err(TemplateError::OutputTooLarge {
            max: MAX_RENDERED_BYTES
        })
    );
    // Unbounded recursion: stopped by the recursion limit, not the stack.
    let recurse = ChatTemplate::new(
        Some("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
        "",
        "",
    )
    .unwrap();
    assert!(matches!(
        recurse.render(&ChatRequest::new(&[], false)),
        Err(TemplateError::Render(_))
    ));
}

/// The fuel a Qwen-style render spends per message, which TEMPLATE_FUEL is sized by.
#[test]
fn fuel_per_message_is_small() {
    let t = ChatTemplate::new(Some(QWEN_STYLE), "", "").unwrap();
    let mut msgs = vec![ChatMessage::system("s")];
    let (_, base) = t.render_counted(&ChatRequest::new(&msgs, true)).unwrap();
    for i in 0..100 {
        msgs.push(ChatMessage::user(format!("u{i}")));
        msgs.push(ChatMessage::assistant(format!("a{i}")));
    }
    let (_, plain) = t.render_counted(&ChatRequest::new(&msgs, true)).unwrap();
    let per_message = (plain - base) / 200;
    let mut calls = vec![ChatMessage::system("s")];
    for i in 0..100 {
        calls.extend(tool_loop().into_iter().skip(1).map(|mut m| {
            m.content.push_str(&i.to_string());
            m
        }));
    }
    let tools = [weather_tool()];
    let (_, tooled) = t
        .render_counted(&ChatRequest::new(&calls, true).with_tools(&tools))
        .unwrap();
    let per_turn = (tooled - base) / 100;
    eprintln!(
        "fuel: base {base}, per plain message {per_message}, per tool-calling turn {per_turn}"
    );
    assert!(per_message > 0 && per_message < 100, "{per_message}");
    assert!(per_turn < 400, "{per_turn}");
    // So TEMPLATE_FUEL admits at least 20,000 tool-calling turns.
    assert!(TEMPLATE_FUEL / per_turn >= 10_000);
}
