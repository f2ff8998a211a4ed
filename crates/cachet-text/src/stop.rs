//! Stop strings over a stream of text deltas.
//!
//! Text that could still turn out to be the start of a stop string is held back; the matched
//! stop string and everything after it are never emitted. Within the text received so far the
//! earliest match wins, and at the same position the longest stop string (then the first one
//! listed).
//!
//! With the matched stop string kept ([`StopMatcher::including_match`], vLLM's
//! `include_stop_str_in_output`) nothing is held back: the text runs through the end of the
//! first stop string to end, and nothing after it is emitted.
//!
//! All stop strings live in one Aho-Corasick automaton whose state is carried from delta to
//! delta, so a push costs time proportional to the delta, whatever the number of stop strings:
//! each byte is one transition, and the held-back text is the longest suffix of the stream that
//! is a prefix of some stop string, which is the depth of the automaton's state (looked up in a
//! table built with the automaton). Limits: [`MAX_STOP_STRINGS`], [`MAX_STOP_BYTES`] each and
//! [`MAX_STOP_TOTAL_BYTES`] in all, checked by [`validate_stops`]; the held-back text is never
//! longer than `MAX_STOP_BYTES - 1`.

use std::collections::HashMap;

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::{Anchored, MatchKind};
use thiserror::Error;

/// Most stop strings one request may give (OpenAI allows 4, Anthropic's `stop_sequences` has
/// no documented cap; vLLM none).
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in UTF-8 bytes.
pub const MAX_STOP_BYTES: usize = 512;
/// Most bytes of all stop strings together.
pub const MAX_STOP_TOTAL_BYTES: usize = 8 * 1024;

/// A stop-string list over a documented limit.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StopError {
    #[error("{count} stop strings given; at most {max} (MAX_STOP_STRINGS) are allowed")]
    TooMany { count: usize, max: usize },
    #[error("stop string {index} is {len} bytes; at most {max} (MAX_STOP_BYTES) are allowed")]
    TooLong {
        index: usize,
        len: usize,
        max: usize,
    },
    #[error(
        "the stop strings total {total} bytes; at most {max} (MAX_STOP_TOTAL_BYTES) are allowed"
    )]
    TooLarge { total: usize, max: usize },
    #[error("stop strings could not be compiled: {0}")]
    Build(String),
}

/// Checks a request's stop strings against the limits (empty strings count towards the number
/// but are otherwise ignored).
pub fn validate_stops<S: AsRef<str>>(stops: &[S]) -> Result<(), StopError> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(StopError::TooMany {
            count: stops.len(),
            max: MAX_STOP_STRINGS,
        });
    }
    let mut total = 0usize;
    for (index, s) in stops.iter().enumerate() {
        let len = s.as_ref().len();
        if len > MAX_STOP_BYTES {
            return Err(StopError::TooLong {
                index,
                len,
                max: MAX_STOP_BYTES,
            });
        }
        total += len;
    }
    if total > MAX_STOP_TOTAL_BYTES {
        return Err(StopError::TooLarge {
            total,
            max: MAX_STOP_TOTAL_BYTES,
        });
    }
    Ok(())
}

/// What one [`StopMatcher::push`] lets through.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to emit now.
    pub emit: String,
    /// Index (into [`StopMatcher::stops`]) of the stop string that matched; the request must end.
    pub matched: Option<usize>,
}

struct Compiled {
    nfa: NFA,
    /// Depth (bytes from the root) of every trie state: the length of the stream suffix the
    /// state stands for.
    depth: HashMap<StateID, usize>,
}

/// Finds the earliest occurrence of any stop string in the generated text.
#[derive(Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    compiled: Option<Compiled>,
    state: Option<StateID>,
    /// Text received but not yet emitted: always a possible prefix of a stop string.
    pending: String,
    /// The matched stop string is emitted too (nothing is held back).
    include_match: bool,
    done: bool,
}

impl std::fmt::Debug for StopMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopMatcher")
            .field("stops", &self.stops)
            .field("pending", &self.pending)
            .field("include_match", &self.include_match)
            .field("done", &self.done)
            .finish()
    }
}

impl StopMatcher {
    /// Validates the stop strings ([`validate_stops`]) and compiles them; empty strings are
    /// ignored.
    pub fn new(stops: Vec<String>) -> Result<Self, StopError> {
        validate_stops(&stops)?;
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        if stops.is_empty() {
            return Ok(StopMatcher::default());
        }
        let nfa = NFA::builder()
            .match_kind(MatchKind::Standard)
            .build(&stops)
            .map_err(|e| StopError::Build(e.to_string()))?;
        let start = nfa
            .start_state(Anchored::No)
            .map_err(|e| StopError::Build(e.to_string()))?;
        let mut depth = HashMap::new();
        depth.insert(start, 0);
        for s in &stops {
            let mut sid = start;
            for (i, &b) in s.as_bytes().iter().enumerate() {
                sid = nfa.next_state(Anchored::No, sid, b);
                depth.insert(sid, i + 1);
            }
        }
        Ok(StopMatcher {
            stops,
            compiled: Some(Compiled { nfa, depth }),
            state: Some(start),
            pending: String::new(),
            include_match: false,
            done: false,
        })
    }

    /// The same matcher, emitting the stop string that ends the text too: text through the
    /// end of the first occurrence of any stop string, nothing held back before it.
    pub fn including_match(mut self) -> Self {
        self.include_match = true;
        self
    }

    /// The stop strings in use (empty ones dropped).
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Bytes currently held back.
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.feed(text, true)
    }

    /// Feeds text of tokens that may not end the request (those within `min_tokens`, as
    /// vLLM's detokenizer checks stop strings only once the output is longer): the automaton
    /// advances, so a stop string that begins here can still end in later text, but a match
    /// that ends here is not one.
    pub fn push_unmatched(&mut self, text: &str) -> StopOutcome {
        self.feed(text, false)
    }

    fn feed(&mut self, text: &str, may_match: bool) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        let (Some(c), Some(mut sid)) = (&self.compiled, self.state) else {
            return StopOutcome {
                emit: text.to_string(),
                matched: None,
            };
        };
        let base = self.pending.len();
        self.pending.push_str(text);
        // (start, length, index) of the best match: earliest start, then longest, then first.
        let mut best: Option<(usize, usize, usize)> = None;
        // With the match kept: (end, index) of the first stop string to end.
        let mut kept: Option<(usize, usize)> = None;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            sid = c.nfa.next_state(Anchored::No, sid, b);
            if may_match && c.nfa.is_match(sid) {
                let end = base + i + 1;
                if self.include_match {
                    // The first stop string to end ends the text, itself included (at the same
                    // end, the longest is the one reported).
                    let idx = (0..c.nfa.match_len(sid))
                        .map(|k| c.nfa.match_pattern(sid, k))
                        .max_by_key(|&pid| (c.nfa.pattern_len(pid), std::cmp::Reverse(pid)))
                        .map_or(0, |pid| pid.as_usize());
                    kept = Some((end, idx));
                    break;
                }
                for k in 0..c.nfa.match_len(sid) {
                    let pid = c.nfa.match_pattern(sid, k);
                    let len = c.nfa.pattern_len(pid);
                    let cand = (end.saturating_sub(len), len, pid.as_usize());
                    let better = match best {
                        None => true,
                        Some((s, l, idx)) => {
                            cand.0 < s || (cand.0 == s && (len > l || (len == l && cand.2 < idx)))
                        }
                    };
                    if better {
                        best = Some(cand);
                    }
                }
            }
        }
        self.state = Some(sid);
        // The text ends where the stop string starts, or where it ends when it is kept.
        if let Some((cut, idx)) = kept.or(best.map(|(start, _, idx)| (start, idx))) {
            let mut emit = std::mem::take(&mut self.pending);
            emit.truncate(floor_char_boundary(&emit, cut));
            self.done = true;
            return StopOutcome {
                emit,
                matched: Some(idx),
            };
        }
        // Hold back the stream's longest suffix that is a prefix of some stop string (nothing
        // when the stop string is emitted anyway).
        let hold = match c.depth.get(&sid) {
            _ if self.include_match => 0,
            Some(&d) => d.min(self.pending.len()),
            // Every state is a trie node recorded at build time; if not, hold what may matter.
            None => self.pending.len().min(MAX_STOP_BYTES - 1),
        };
        let cut = floor_char_boundary(&self.pending, self.pending.len() - hold);
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome {
            emit,
            matched: None,
        }
    }

    /// The request ended without a match: release what was held back.
    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        std::mem::take(&mut self.pending)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = matcher(stops);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn match_across_pieces_is_not_emitted() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), Some(0))
        );
    }

    #[test]
    fn an_included_stop_string_ends_the_text_and_nothing_is_held() {
        let mut m = matcher(&["END", "ND!"]).including_match();
        // No holdback: "E" and "N" could begin "END", yet they are emitted at once.
        assert_eq!(m.push("abc E").emit, "abc E");
        assert_eq!(m.push("N").emit, "N");
        // "END" ends first (at "D"); its text runs to there, the rest of the piece is cut.
        let o = m.push("D! tail");
        assert_eq!((o.emit.as_str(), o.matched), ("D", Some(0)));
        assert_eq!(m.push("more").emit, "");
        assert_eq!(m.flush(), "");
        // Two stop strings ending at one byte: the longest is the one reported.
        let mut m = matcher(&["b", "ab"]).including_match();
        let o = m.push("xab-");
        assert_eq!((o.emit.as_str(), o.matched), ("xab", Some(1)));
        // Within min_tokens the matcher passes text through, and a later piece may end it.
        let mut m = matcher(&["ab"]).including_match();
        assert_eq!(m.push_unmatched("ab").emit, "ab");
        let o = m.push("cab!");
        assert_eq!((o.emit.as_str(), o.matched), ("cab", Some(0)));
    }

    #[test]
    fn unmatched_text_ends_no_stop_but_may_begin_one() {
        // "ab" completed in unmatched text is text; the next "ab" ends the request.
        let mut m = matcher(&["ab"]);
        assert_eq!(m.push_unmatched("xa").emit, "x");
        let o = m.push_unmatched("b");
        assert_eq!((o.emit.as_str(), o.matched), ("", None));
        let o = m.push("-ab!");
        assert_eq!((o.emit.as_str(), o.matched), ("ab-", Some(0)));
        // "abc" begun in unmatched text and ended after it is a match.
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push_unmatched("zab").emit, "z");
        let o = m.push("cd");
        assert_eq!((o.emit.as_str(), o.matched), ("", Some(0)));
        // Held unmatched text is released by a flush.
        let mut m = matcher(&["abc"]);
        assert_eq!(m.push_unmatched("ab").emit, "");
        assert_eq!(m.flush(), "ab");
    }

    #[test]
    fn partial_prefix_is_held_then_released() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("hello ST").emit, "hello ");
        assert_eq!(m.held(), 2);
        assert_eq!(m.push("AR").emit, "STAR");
        assert_eq!(m.push("S").emit, "");
        assert_eq!(m.flush(), "S");
    }

    #[test]
    fn earliest_match_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".to_string(), Some(1))
        );
        // A longer stop string that starts earlier but ends later wins within one delta...
        assert_eq!(run(&["bc", "abcd"], &["abcd"]), ("".to_string(), Some(1)));
        // ...but across deltas the first complete match ends the stream.
        assert_eq!(
            run(&["bc", "abcd"], &["abc", "d"]),
            ("a".to_string(), Some(0))
        );
    }

    #[test]
    fn at_the_same_position_the_longest_then_the_first() {
        assert_eq!(run(&["ab", "abc"], &["xabc"]), ("x".to_string(), Some(1)));
        assert_eq!(run(&["ab", "ab"], &["xab"]), ("x".to_string(), Some(0)));
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), None));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".to_string(), None));
        assert!(matcher(&["", "x"]).stops() == ["x"]);
    }

    #[test]
    fn unicode_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "?é", "!"]),
            ("café?".to_string(), Some(0))
        );
        assert_eq!(run(&["éa"], &["é", "é"]), ("éé".to_string(), None));
    }

    #[test]
    fn after_match_nothing_more() {
        let mut m = matcher(&["x"]);
        assert_eq!(m.push("axb").emit, "a");
        assert_eq!(m.push("more").emit, "");
        assert_eq!(m.flush(), "");
    }

    /// The held-back text is the longest suffix that is a prefix of some stop string, found
    /// through failure transitions: "aab" then "c" for "aabd"/"abc".
    #[test]
    fn holdback_follows_failure_links() {
        let mut m = matcher(&["aabd", "abc"]);
        assert_eq!(m.push("xaab").emit, "x");
        assert_eq!(m.held(), 3);
        let o = m.push("c");
        assert_eq!(
            o,
            StopOutcome {
                emit: "a".into(),
                matched: Some(1)
            }
        );
        let mut m = matcher(&["aaab"]);
        assert_eq!(m.push("aaaaa").emit, "aa");
        assert_eq!(m.held(), 3);
    }

    #[test]
    fn limits_are_typed_errors() {
        let many: Vec<String> = (0..MAX_STOP_STRINGS + 1).map(|i| i.to_string()).collect();
        assert_eq!(
            StopMatcher::new(many).unwrap_err(),
            StopError::TooMany { count: 65, max: 64 }
        );
        let long = vec!["a".to_string(), "b".repeat(MAX_STOP_BYTES + 1)];
        assert_eq!(
            validate_stops(&long),
            Err(StopError::TooLong {
                index: 1,
                len: 513,
                max: 512
            })
        );
        let big: Vec<String> = (0..17).map(|_| "c".repeat(MAX_STOP_BYTES)).collect();
        assert_eq!(
            validate_stops(&big),
            Err(StopError::TooLarge {
                total: 17 * 512,
                max: 8192
            })
        );
        let fits: Vec<String> = (0..16).map(|_| "c".repeat(MAX_STOP_BYTES)).collect();
        assert_eq!(validate_stops(&fits), Ok(()));
        assert!(StopError::TooMany { count: 65, max: 64 }
            .to_string()
            .contains("MAX_STOP_STRINGS"));
    }

    #[test]
    fn held_text_is_bounded_by_the_longest_stop() {
        let stop = format!("{}b", "a".repeat(MAX_STOP_BYTES - 1));
        let mut m = StopMatcher::new(vec![stop]).unwrap();
        let mut emitted = 0;
        for _ in 0..2000 {
            emitted += m.push("a").emit.len();
            assert!(m.held() < MAX_STOP_BYTES);
        }
        assert_eq!(m.held(), MAX_STOP_BYTES - 1);
        assert_eq!(emitted, 2000 - (MAX_STOP_BYTES - 1));
        assert_eq!(m.push("b").matched, Some(0));
    }
}
