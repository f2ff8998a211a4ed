//! Chat template rendering: hostile conversations through the family templates, and arbitrary
//! template sources; every outcome is Ok or a TemplateError, never a panic, a hang or
//! unbounded memory.
//!
//! Input: `selector flags segment 0xFF segment ...`. Selector % 5: 0 ChatML, 1 Qwen-style,
//! 2 Llama-style, 3 Hermes-style, 4 the first segment is the template source. Flags: bit 0
//! add_generation_prompt, bit 1 the last segment is a JSON tools list. The other segments are
//! messages (see `cachet_text_fuzz::message`).
#![no_main]

use cachet_text::{ChatRequest, ChatTemplate, TemplateError};
use cachet_text_fuzz::{message, split, text, SEP};
use libfuzzer_sys::fuzz_target;

const QWEN: &str = include_str!("../../tests/templates/qwen_style.jinja");
const LLAMA: &str = include_str!("../../tests/templates/llama_style.jinja");
const HERMES: &str = include_str!("../../tests/templates/hermes_style.jinja");

fuzz_target!(|data: &[u8]| {
    let [sel, flags, rest @ ..] = data else {
        return;
    };
    let mut segs = split(rest, SEP);
    let custom;
    let source = match sel % 5 {
        0 => None,
        1 => Some(QWEN),
        2 => Some(LLAMA),
        3 => Some(HERMES),
        _ => {
            custom = text(segs.remove(0));
            Some(custom.as_str())
        }
    };
    let tools: Vec<serde_json::Value> = if flags & 2 != 0 {
        segs.pop()
            .and_then(|t| serde_json::from_slice::<Vec<serde_json::Value>>(t).ok())
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let msgs: Vec<_> = segs.iter().filter_map(|s| message(s)).collect();
    let t = match ChatTemplate::new(source, "<s>", "</s>") {
        Ok(t) => t,
        Err(TemplateError::Panicked(p)) => panic!("template engine panicked: {p}"),
        Err(_) => return,
    };
    let req = ChatRequest::new(&msgs, flags & 1 != 0).with_tools(&tools);
    match t.render(&req) {
        Ok(s) => {
            if sel % 5 == 0 {
                // ChatML renders every message's content.
                for m in &msgs {
                    assert!(s.contains(m.content.as_str()));
                }
            }
        }
        Err(TemplateError::Panicked(p)) => panic!("template engine panicked: {p}"),
        Err(_) => {}
    }
});
