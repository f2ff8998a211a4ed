//! Reasoning in the open: models that think between `<think>` and `</think>` before they answer
//! (Qwen3, the DeepSeek-R1 distills), separated from the answer as vLLM's reasoning parsers do
//! (`--reasoning-parser qwen3|deepseek_r1`), incrementally over streamed text.
//!
//! * `qwen3`: the output is reasoning only when it opens with `<think>` (or the prompt left a
//!   `<think>` open, as the thinking templates do); otherwise it is all answer (the template
//!   closed the block itself when `enable_thinking` is false).
//! * `deepseek_r1`: the output starts in reasoning (the template adds `<think>`), an opening tag
//!   the model writes anyway is dropped; a prompt that already closed the block (`</think>`)
//!   starts in the answer.
//!
//! Either way the reasoning runs to the first `</think>`; everything after it is answer (a later
//! tag included), and the tags themselves are in neither part. The text right after a tag is
//! kept as the model wrote it (Qwen3's `"\n\n"` after `</think>` starts the answer), as in vLLM.
//! A reasoning block never closed stays reasoning: streamed text cannot be taken back, and the
//! whole-text form ([`split_reasoning`]) is the streamed one run at once (vLLM's non-streaming
//! Qwen3 parser instead turns an unclosed block into answer).
//!
//! A tag split across deltas is held back until it is complete or can no longer be one: held
//! text is at most a tag's length.

/// Which model family's reasoning markup to parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    Qwen3,
    DeepSeekR1,
}

impl ReasoningFormat {
    /// vLLM's `--reasoning-parser` name.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningFormat::Qwen3 => "qwen3",
            ReasoningFormat::DeepSeekR1 => "deepseek_r1",
        }
    }

    /// From vLLM's `--reasoning-parser` name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "qwen3" => Some(ReasoningFormat::Qwen3),
            "deepseek_r1" => Some(ReasoningFormat::DeepSeekR1),
            _ => None,
        }
    }
}

/// The tag that opens reasoning.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes it.
pub const THINK_CLOSE: &str = "</think>";

/// One delta's text, split.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
    /// Some of this delta's text lay inside the reasoning block, its tags included.
    pub in_reasoning: bool,
    /// Generated tokens now known to be reasoning ([`ReasoningParser::push_tokens`]): those
    /// generated inside the block (the closing tag's included), and those of an opening tag
    /// once it is complete.
    pub reasoning_tokens: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not known yet whether the output opens a block (`qwen3`): text is held while it is a
    /// prefix of `<think>`.
    Opening,
    /// Inside the block; `strip_open`: an opening tag at its very start is dropped.
    Reasoning {
        strip_open: bool,
    },
    Answer,
}

/// The incremental parser of one output.
#[derive(Clone, Debug)]
pub struct ReasoningParser {
    state: State,
    held: String,
    /// Tokens pushed while it was not known whether the output opens a block.
    pending_tokens: usize,
}

impl ReasoningParser {
    /// A parser for an output that follows a prompt ending as `prompt` does: a prompt whose
    /// last tag (trailing whitespace aside) is an open `<think>` starts in reasoning, one that
    /// ends with `</think>` starts in the answer.
    pub fn new(format: ReasoningFormat, prompt: &str) -> Self {
        let tail = prompt.trim_end();
        let state = if tail.ends_with(THINK_CLOSE) {
            State::Answer
        } else if tail.ends_with(THINK_OPEN) {
            State::Reasoning { strip_open: false }
        } else {
            match format {
                ReasoningFormat::Qwen3 => State::Opening,
                ReasoningFormat::DeepSeekR1 => State::Reasoning { strip_open: true },
            }
        };
        ReasoningParser {
            state,
            held: String::new(),
            pending_tokens: 0,
        }
    }

    /// Whether the output is (still) inside a reasoning block.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning { .. })
    }

    /// Feed the next piece of output text, the text of `tokens` generated tokens; the delta
    /// says how many tokens are now known to be reasoning.
    pub fn push_tokens(&mut self, text: &str, tokens: usize) -> ReasoningDelta {
        let before = self.state;
        let mut out = self.push(text);
        out.reasoning_tokens = match before {
            State::Reasoning { .. } => tokens,
            State::Answer => 0,
            State::Opening => {
                self.pending_tokens += tokens;
                match self.state {
                    State::Opening => 0,
                    State::Answer if !out.in_reasoning => {
                        self.pending_tokens = 0;
                        0
                    }
                    _ => std::mem::take(&mut self.pending_tokens),
                }
            }
        };
        out
    }

    /// Feed the next piece of output text.
    pub fn push(&mut self, text: &str) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
                State::Opening | State::Reasoning { strip_open: true } => {
                    if self.held.starts_with(THINK_OPEN) {
                        self.held.drain(..THINK_OPEN.len());
                        out.in_reasoning = true;
                        self.state = State::Reasoning { strip_open: false };
                    } else if THINK_OPEN.starts_with(self.held.as_str()) {
                        // Could still become the tag (empty included): wait.
                        out.in_reasoning |= self.state != State::Opening && !self.held.is_empty();
                        return out;
                    } else {
                        self.state = match self.state {
                            State::Opening => State::Answer,
                            _ => State::Reasoning { strip_open: false },
                        };
                    }
                }
                State::Reasoning { strip_open: false } => {
                    out.in_reasoning |= !self.held.is_empty();
                    if let Some(at) = self.held.find(THINK_CLOSE) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + THINK_CLOSE.len());
                        self.state = State::Answer;
                        continue;
                    }
                    // Emit all but a tail that could begin the closing tag.
                    let keep = partial_suffix(&self.held, THINK_CLOSE);
                    let emit = self.held.len() - keep;
                    out.reasoning.push_str(&self.held[..emit]);
                    self.held.drain(..emit);
                    return out;
                }
            }
        }
    }

    /// The output ended: release held text (a tag never completed is text of the part it was
    /// in).
    pub fn finish(&mut self) -> ReasoningDelta {
        let held = std::mem::take(&mut self.held);
        let mut out = ReasoningDelta::default();
        match self.state {
            State::Opening | State::Answer => out.content = held,
            State::Reasoning { .. } => {
                out.in_reasoning = !held.is_empty();
                out.reasoning = held;
            }
        }
        out
    }
}

/// The length of the longest proper prefix of `tag` that `text` ends with (on a character
/// boundary, since tags are ASCII).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

/// A whole output split into reasoning (`None` when there was none) and answer.
pub fn split_reasoning(
    format: ReasoningFormat,
    prompt: &str,
    text: &str,
) -> (Option<String>, String) {
    let mut p = ReasoningParser::new(format, prompt);
    let a = p.push(text);
    let b = p.finish();
    let reasoning = a.reasoning + &b.reasoning;
    let seen = a.in_reasoning || b.in_reasoning;
    (seen.then_some(reasoning), a.content + &b.content)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts of `text` fed in two pieces split at byte `at`.
    fn split_at(format: ReasoningFormat, prompt: &str, text: &str, at: usize) -> (String, String) {
        let mut p = ReasoningParser::new(format, prompt);
        let (mut r, mut c) = (String::new(), String::new());
        for piece in [&text[..at], &text[at..]] {
            let d = p.push(piece);
            r += &d.reasoning;
            c += &d.content;
        }
        let d = p.finish();
        (r + &d.reasoning, c + &d.content)
    }

    /// Every split point gives the whole text's answer, and so does feeding it byte by byte.
    fn check(format: ReasoningFormat, prompt: &str, text: &str, reasoning: &str, content: &str) {
        for at in 0..=text.len() {
            if text.is_char_boundary(at) {
                assert_eq!(
                    split_at(format, prompt, text, at),
                    (reasoning.to_string(), content.to_string()),
                    "{format:?} {text:?} split at {at}"
                );
            }
        }
        let mut p = ReasoningParser::new(format, prompt);
        let (mut r, mut c) = (String::new(), String::new());
        for ch in text.chars() {
            let d = p.push(ch.encode_utf8(&mut [0; 4]));
            r += &d.reasoning;
            c += &d.content;
        }
        let d = p.finish();
        assert_eq!(
            (r + &d.reasoning, c + &d.content),
            (reasoning.into(), content.into())
        );
    }

    #[test]
    fn qwen3_separates_a_block_at_every_split() {
        use ReasoningFormat::Qwen3;
        check(
            Qwen3,
            "",
            "<think>\nLet me see.\n</think>\n\nIt is 4.",
            "\nLet me see.\n",
            "\n\nIt is 4.",
        );
        // No block: all answer, a later tag included.
        check(
            Qwen3,
            "",
            "It is 4. <think>x</think>",
            "",
            "It is 4. <think>x</think>",
        );
        check(Qwen3, "", "<thin", "", "<thin");
        // The prompt opened the block (a thinking template): reasoning from the first byte.
        check(
            Qwen3,
            "<|im_start|>assistant\n<think>\n",
            "hmm, ü</think>ok",
            "hmm, ü",
            "ok",
        );
        // The prompt closed it (enable_thinking false): all answer.
        check(
            Qwen3,
            "assistant\n<think>\n\n</think>\n\n",
            "</think>ok",
            "",
            "</think>ok",
        );
        // Never closed: reasoning to the end, a partial closing tag included.
        check(Qwen3, "", "<think>still going</thi", "still going</thi", "");
        // Near-misses of the tags are text.
        check(Qwen3, "", "<think>a</thinkb</think>c<", "a</thinkb", "c<");
    }

    #[test]
    fn deepseek_r1_starts_in_reasoning_at_every_split() {
        use ReasoningFormat::DeepSeekR1;
        check(
            DeepSeekR1,
            "",
            "Let me see.</think>It is 4.",
            "Let me see.",
            "It is 4.",
        );
        // An opening tag the model writes anyway is dropped.
        check(DeepSeekR1, "", "<think>why</think>\nso", "why", "\nso");
        check(DeepSeekR1, "", "<thinx</think>y", "<thinx", "y");
        // Never closed: all reasoning.
        check(DeepSeekR1, "", "only thoughts", "only thoughts", "");
        check(
            DeepSeekR1,
            "<｜Assistant｜><think>\n",
            "a</think>b",
            "a",
            "b",
        );
        check(
            DeepSeekR1,
            "<think>\n\n</think>",
            "just the answer",
            "",
            "just the answer",
        );
    }

    #[test]
    fn whole_text_split_and_reasoning_flags() {
        use ReasoningFormat::*;
        assert_eq!(
            split_reasoning(Qwen3, "", "<think>r</think>c"),
            (Some("r".into()), "c".into())
        );
        assert_eq!(split_reasoning(Qwen3, "", "plain"), (None, "plain".into()));
        // An empty block is still a block.
        assert_eq!(
            split_reasoning(Qwen3, "", "<think></think>c"),
            (Some(String::new()), "c".into())
        );
        assert_eq!(split_reasoning(DeepSeekR1, "", ""), (None, String::new()));
        let mut p = ReasoningParser::new(DeepSeekR1, "");
        assert!(p.in_reasoning());
        assert!(p.push("ab").in_reasoning);
        let d = p.push("</think>x");
        assert!(d.in_reasoning && !p.in_reasoning());
        assert!(!p.push("y").in_reasoning);
        assert_eq!(ReasoningFormat::parse("deepseek_r1"), Some(DeepSeekR1));
        assert_eq!(ReasoningFormat::parse(Qwen3.as_str()), Some(Qwen3));
        assert_eq!(ReasoningFormat::parse("granite"), None);
    }

    /// Token counts: an opening tag split over tokens counts once complete; tokens of an
    /// answer never; the token that closes the block does.
    #[test]
    fn reasoning_tokens_count_the_block_and_its_tags() {
        use ReasoningFormat::*;
        let count = |format, pieces: &[&str]| {
            let mut p = ReasoningParser::new(format, "");
            pieces
                .iter()
                .map(|t| p.push_tokens(t, 1).reasoning_tokens)
                .sum::<usize>()
        };
        // "<", "think", ">" then 2 tokens of thought, "</", "think>", then 2 of answer.
        let text = ["<", "think", ">", "a", "b", "</", "think>", "c", "d"];
        assert_eq!(count(Qwen3, &text), 7);
        assert_eq!(count(DeepSeekR1, &text), 7);
        // A near-miss of the opening tag is answer: nothing counts.
        assert_eq!(count(Qwen3, &["<", "thin", "g>", "</think>"]), 0);
        // DeepSeek-R1 without an opening tag: everything up to the close.
        assert_eq!(count(DeepSeekR1, &["a", "</think>", "b"]), 2);
        // Empty pieces (held bytes of a character) inside the block count too.
        assert_eq!(count(DeepSeekR1, &["", "a", "</think>", ""]), 3);
    }
}
