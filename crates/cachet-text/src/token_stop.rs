//! Stop strings over token ids, for the engine: whether the token just generated completes a
//! stop string, so a request ends at exactly that token (not a step or a speculated run of
//! tokens later, as it would if only the text side looked; its token count, KV and counters
//! are then those of the text the client gets). The text side ([`crate::StopMatcher`]) still
//! cuts the string from the text.
//!
//! A token's text here is its bytes ([`TextTokenizer::token_bytes`]); special tokens have none
//! when they are skipped, and ids that never become text (EOS and stop tokens when special
//! tokens are kept) have none. A decoder that strips the text's leading space (SentencePiece)
//! strips it here too. Where the concatenated bytes and the detokenized text could still differ
//! (bytes that are not UTF-8), the text side's own match ends the request as before.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};

use crate::stop::{validate_stops, StopError};
use crate::tokenizer::TextTokenizer;

/// Every token's bytes, built once per tokenizer and shared by every request's [`TokenStops`].
#[derive(Debug)]
pub struct TokenBytes {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
    /// The decoder drops the first byte of a text that starts with a space.
    strips_leading_space: bool,
}

impl TokenBytes {
    pub fn new(tok: &dyn TextTokenizer) -> Self {
        let n = tok.vocab_size();
        let mut bytes = Vec::with_capacity(n);
        let mut special = Vec::with_capacity(n);
        for id in 0..n as u32 {
            bytes.push(tok.token_bytes(id).unwrap_or_default().into_boxed_slice());
            special.push(tok.is_special(id));
        }
        // A token that is a space and more text: does its decode keep the space?
        let strips_leading_space = (0..n).find_map(|i| {
            let b = &bytes[i];
            let text_after_space =
                b.len() >= 2 && b[0] == b' ' && b[1] != b' ' && std::str::from_utf8(b).is_ok();
            (!special[i] && text_after_space)
                .then(|| tok.decode(&[i as u32], true).ok())
                .flatten()
                .map(|text| text.as_bytes() == &b[1..])
        });
        TokenBytes {
            bytes,
            special,
            strips_leading_space: strips_leading_space.unwrap_or(false),
        }
    }
}

/// One request's stop strings on its generated tokens (see the module documentation).
#[derive(Debug)]
pub struct TokenStops {
    ac: AhoCorasick,
    /// Bytes of the longest stop string.
    longest: usize,
    vocab: Arc<TokenBytes>,
    skip_special_tokens: bool,
    /// Ids that never become text (sorted).
    silent: Vec<u32>,
}

impl TokenStops {
    /// `None` when no stop string is non-empty. `silent`: ids that never become text.
    pub fn new(
        stops: &[String],
        vocab: Arc<TokenBytes>,
        skip_special_tokens: bool,
        silent: &[u32],
    ) -> Result<Option<Self>, StopError> {
        validate_stops(stops)?;
        let pats: Vec<&[u8]> = stops
            .iter()
            .map(|s| s.as_bytes())
            .filter(|s| !s.is_empty())
            .collect();
        let Some(longest) = pats.iter().map(|p| p.len()).max() else {
            return Ok(None);
        };
        // A contiguous NFA, as the text matcher's: its size follows the patterns' bytes (at
        // most MAX_STOP_TOTAL_BYTES), where a DFA's would be that times the byte classes, per
        // request; the window it scans per token is short.
        let ac = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .build(&pats)
            .map_err(|e| StopError::Build(e.to_string()))?;
        let mut silent = silent.to_vec();
        silent.sort_unstable();
        Ok(Some(TokenStops {
            ac,
            longest,
            vocab,
            skip_special_tokens,
            silent,
        }))
    }

    fn text_of(&self, id: u32) -> &[u8] {
        let i = id as usize;
        let skipped =
            self.skip_special_tokens && self.vocab.special.get(i).copied().unwrap_or(false);
        if skipped || self.silent.binary_search(&id).is_ok() {
            return &[];
        }
        self.vocab.bytes.get(i).map_or(&[], |b| b)
    }

    /// Whether the last token of `output` completes a stop string (an occurrence that ends
    /// within its text). Looks at that token and at most the longest stop string's length of
    /// text before it.
    pub fn ends_in_stop(&self, output: &[u32]) -> bool {
        let Some((&last, before)) = output.split_last() else {
            return false;
        };
        let last_len = self.text_of(last).len();
        if last_len == 0 {
            return false;
        }
        let mut start = before.len();
        let mut held = 0;
        while start > 0 && held + 1 < self.longest {
            start -= 1;
            held += self.text_of(before[start]).len();
        }
        let mut w = Vec::with_capacity(held + last_len);
        for &t in &output[start..] {
            w.extend_from_slice(self.text_of(t));
        }
        let mut tail = w.len() - last_len;
        if start == 0 && self.vocab.strips_leading_space && w.first() == Some(&b' ') {
            w.remove(0);
            tail = tail.saturating_sub(1);
        }
        self.ac.find_overlapping_iter(&w).any(|m| m.end() > tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::byte::ByteTokenizer;

    fn ids(s: &str) -> Vec<u32> {
        s.bytes()
            .map(|b| u32::from(b) + ByteTokenizer::OFFSET)
            .collect()
    }

    fn stops(list: &[&str]) -> TokenStops {
        let v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        let vocab = Arc::new(TokenBytes::new(&ByteTokenizer));
        TokenStops::new(&v, vocab, true, &[]).unwrap().unwrap()
    }

    /// The index of the token each prefix of `text` first ends a stop string at.
    fn first_stop(s: &TokenStops, text: &str) -> Option<usize> {
        let t = ids(text);
        (1..=t.len())
            .find(|&n| s.ends_in_stop(&t[..n]))
            .map(|n| n - 1)
    }

    #[test]
    fn the_token_that_completes_the_string_ends_it() {
        let s = stops(&["\n\n", "END"]);
        assert_eq!(first_stop(&s, "ab\n\ncd"), Some(3));
        assert_eq!(first_stop(&s, "xxENDyy"), Some(4));
        assert_eq!(first_stop(&s, "no stop here\n"), None);
        // The string before the last token is not new: only the completing token answers.
        let t = ids("ab\n\ncd");
        assert!(!s.ends_in_stop(&t));
        assert!(!s.ends_in_stop(&[]));
    }

    #[test]
    fn skipped_and_silent_tokens_add_no_text() {
        let vocab = Arc::new(TokenBytes::new(&ByteTokenizer));
        let stop = vec!["ab".to_string()];
        // EOS (a special token) between a and b: skipped, so "ab" is in the text.
        let skip = TokenStops::new(&stop, vocab.clone(), true, &[])
            .unwrap()
            .unwrap();
        let mut t = ids("a");
        t.push(ByteTokenizer::EOS);
        t.extend(ids("b"));
        assert!(skip.ends_in_stop(&t));
        // Kept, it is "</s>" between them; a silent id (a stop token) adds nothing either way.
        let keep = TokenStops::new(&stop, vocab.clone(), false, &[])
            .unwrap()
            .unwrap();
        assert!(!keep.ends_in_stop(&t));
        let silent = TokenStops::new(&stop, vocab, false, &[ByteTokenizer::EOS])
            .unwrap()
            .unwrap();
        assert!(silent.ends_in_stop(&t));
    }

    #[test]
    fn a_long_string_is_found_across_many_tokens() {
        let s = stops(&["needle in the haystack", "k"]);
        let text = "x".repeat(100) + "needle in the haystack";
        assert_eq!(first_stop(&s, &text), Some(text.len() - 1));
    }

    #[test]
    fn empty_stops_check_nothing_and_limits_hold() {
        let vocab = Arc::new(TokenBytes::new(&ByteTokenizer));
        assert!(TokenStops::new(&[String::new()], vocab.clone(), true, &[])
            .unwrap()
            .is_none());
        let too_many: Vec<String> = (0..65).map(|i| i.to_string()).collect();
        assert!(TokenStops::new(&too_many, vocab, true, &[]).is_err());
    }

    /// Against the text-side matcher on random byte streams: the token at which a stop
    /// string first completes is the token after which the stream matcher first reports it.
    #[test]
    fn agrees_with_the_stream_matcher() {
        use crate::stop::StopMatcher;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..300 {
            let list: Vec<String> = (0..1 + next() % 3)
                .map(|_| {
                    (0..1 + next() % 4)
                        .map(|_| (b'a' + (next() % 3) as u8) as char)
                        .collect()
                })
                .collect();
            let text: String = (0..40)
                .map(|_| (b'a' + (next() % 3) as u8) as char)
                .collect();
            let refs: Vec<&str> = list.iter().map(String::as_str).collect();
            let s = stops(&refs);
            let mut m = StopMatcher::new(list.clone()).unwrap();
            let mut want = None;
            for (i, ch) in text.chars().enumerate() {
                if m.push(&ch.to_string()).matched.is_some() {
                    want = Some(i);
                    break;
                }
            }
            assert_eq!(first_stop(&s, &text), want, "{list:?} {text}");
        }
    }
}
