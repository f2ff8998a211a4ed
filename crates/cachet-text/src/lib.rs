//! The text side of cachet, in one place:
//!
//! * [`TextTokenizer`]: the trait a model's tokenizer implements (encode, decode, special
//!   tokens, token bytes, chat rendering); object safe, shared as `Arc<dyn TextTokenizer>`.
//!   The GGUF tokenizer implements it in `cachet-model`; [`ByteTokenizer`] is the simulated
//!   model's.
//! * [`ChatMessage`]: one chat message as the OpenAI API sends it (roles, content, name, tool
//!   calls, tool call ids), and how each field reaches a template ([`message`]).
//! * [`ChatTemplate`]: a model's Jinja chat template compiled with minijinja the way
//!   transformers renders it, bounded in time and output, with [`TemplateCaps`] saying whether
//!   it renders tools itself ([`template`]).
//! * [`IncrementalDetokenizer`]: token ids to text deltas that never split a character, at a
//!   cost per token that does not grow with the output ([`detok`]).
//! * [`StopMatcher`]: stop strings over a stream of deltas on one Aho-Corasick automaton, with
//!   documented limits ([`stop`]); [`TokenStops`]: the same strings on token ids, for the
//!   engine to end a request at the token that completes one ([`token_stop`]).
//! * [`ReasoningParser`]: `<think>` reasoning separated from the answer over streamed text,
//!   as vLLM's `--reasoning-parser qwen3|deepseek_r1` ([`reasoning`]).

pub mod byte;
pub mod detok;
pub mod message;
pub mod reasoning;
pub mod stop;
pub mod template;
pub mod token_stop;
pub mod tokenizer;
pub mod tools;

pub use byte::ByteTokenizer;
pub use detok::{IncrementalDetokenizer, TokenizerRef, MAX_HELD_TOKENS};
pub use message::{ChatMessage, FunctionCall, MessageError, Role, ToolCall, ToolCallKind};
pub use reasoning::{split_reasoning, ReasoningDelta, ReasoningFormat, ReasoningParser};
pub use stop::{
    validate_stops, StopError, StopMatcher, StopOutcome, MAX_STOP_BYTES, MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_BYTES,
};
pub use template::{
    ChatRequest, ChatTemplate, TemplateCaps, TemplateError, CHATML_TEMPLATE, MAX_RENDERED_BYTES,
    MAX_TEMPLATE_BYTES, TEMPLATE_FUEL, TEMPLATE_RECURSION_LIMIT,
};
pub use token_stop::{TokenBytes, TokenStops};
pub use tokenizer::{TextTokenizer, TokenizerError};
pub use tools::{parse_tool_calls, ParsedCall, ToolCallParser, ToolEvent, ToolFormat};
