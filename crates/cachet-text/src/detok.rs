//! Token ids in, text deltas out, never splitting a character.
//!
//! The detokenizer keeps a window of ids: the ids of the last emitted delta (decoding context:
//! SentencePiece decoders strip a leading space, so a token's text depends on what precedes it)
//! and the ids not yet emitted. Each push decodes that window twice (with and without the new
//! ids) and emits the difference unless it ends in U+FFFD (an incomplete UTF-8 sequence split
//! across tokens); then it emits up to the latest of the last three token boundaries that
//! decodes cleanly, and holds the rest back until the character completes.
//!
//! The cost of a push is bounded by the window, not by the length of the output: after an
//! emission the window shrinks to the emitted ids, and a tail that stays U+FFFD for more than
//! [`MAX_HELD_TOKENS`] further tokens (bytes that will never form a character) is emitted as
//! U+FFFD and the window restarts. So the window holds at most `2 * MAX_HELD_TOKENS + 3` ids
//! plus four of the largest pushes (71 ids when tokens come one at a time); the whole delta is
//! kept as context because a shorter one can decode to nothing (skipped special tokens) and
//! let a SentencePiece decoder strip the next token's leading space. For valid UTF-8 output, the concatenated deltas plus
//! [`IncrementalDetokenizer::flush`] equal the decode of all ids.

use std::sync::Arc;

use crate::tokenizer::{TextTokenizer, TokenizerError};

/// Tokens a held-back tail may grow by before it is given up as invalid UTF-8 and emitted as
/// U+FFFD. Valid text needs more only where more than this many token boundaries in a row fall
/// inside characters (tokens that each end mid-character); byte tokens need at most 3.
pub const MAX_HELD_TOKENS: usize = 32;

/// Token boundaries tried, newest first, when the tail is incomplete (a character's
/// incomplete start is at most 3 bytes).
const CUT_TRIES: usize = 3;

/// Something that lends a tokenizer: `Arc<dyn TextTokenizer>` or `&dyn TextTokenizer`.
pub trait TokenizerRef {
    fn tokenizer(&self) -> &dyn TextTokenizer;
}

impl TokenizerRef for Arc<dyn TextTokenizer> {
    fn tokenizer(&self) -> &dyn TextTokenizer {
        &**self
    }
}

impl TokenizerRef for &dyn TextTokenizer {
    fn tokenizer(&self) -> &dyn TextTokenizer {
        *self
    }
}

/// Streams text out of token ids (see the module documentation).
pub struct IncrementalDetokenizer<T: TokenizerRef = Arc<dyn TextTokenizer>> {
    tok: T,
    skip_special_tokens: bool,
    /// Ids from the start of the last emitted delta on.
    window: Vec<u32>,
    /// How many ids of `window` are already emitted.
    read: usize,
    /// Whether the last push held text back.
    holding: bool,
    /// Ids pushed since the hold began (not counting the push that began it).
    held_more: usize,
    seen: usize,
}

impl<T: TokenizerRef> std::fmt::Debug for IncrementalDetokenizer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncrementalDetokenizer")
            .field("skip_special_tokens", &self.skip_special_tokens)
            .field("window", &self.window)
            .field("read", &self.read)
            .field("seen", &self.seen)
            .finish()
    }
}

impl<T: TokenizerRef> IncrementalDetokenizer<T> {
    pub fn new(tok: T, skip_special_tokens: bool) -> Self {
        IncrementalDetokenizer {
            tok,
            skip_special_tokens,
            window: Vec::new(),
            read: 0,
            holding: false,
            held_more: 0,
            seen: 0,
        }
    }

    /// Number of ids pushed so far.
    pub fn tokens_seen(&self) -> usize {
        self.seen
    }

    /// Ids currently decoded on each push (bounded; see the module documentation).
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// Adds ids; returns the newly completed text (possibly empty). An id outside the
    /// vocabulary is an error and leaves the detokenizer as it was.
    pub fn push(&mut self, ids: &[u32]) -> Result<String, TokenizerError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        let tok = self.tok.tokenizer();
        let vocab_size = tok.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(TokenizerError::UnknownToken { id, vocab_size });
        }
        let before = self.window.len();
        if self.skip_special_tokens {
            // Skipped special ids decode to nothing: keeping them out of the window keeps an
            // incomplete character within the last CUT_TRIES ids even when a special id falls
            // between its bytes.
            self.window
                .extend(ids.iter().copied().filter(|&id| !tok.is_special(id)));
        } else {
            self.window.extend_from_slice(ids);
        }
        let decoded = tok
            .decode(&self.window[..self.read], self.skip_special_tokens)
            .and_then(|p| {
                tok.decode(&self.window, self.skip_special_tokens)
                    .map(|f| (p, f))
            });
        let (prefix, full) = match decoded {
            Ok(x) => x,
            Err(e) => {
                self.window.truncate(before);
                return Err(e);
            }
        };
        self.seen += ids.len();
        let skip = self.skip_special_tokens;
        if let Some(out) = clean(new_text(&prefix, &full)) {
            self.advance(self.window.len());
            return Ok(out);
        }
        // The tail is an incomplete character (or no text yet). An incomplete character is at
        // most 3 bytes, so with byte-sized or larger tokens the latest clean boundary before it
        // is among the last CUT_TRIES: emit up to there and hold the rest.
        let len = self.window.len();
        let lowest = (self.read + 1).max(len.saturating_sub(CUT_TRIES));
        for cut in (lowest..len).rev() {
            let Ok(part) = tok.decode(&self.window[..cut], skip) else {
                break;
            };
            if let Some(out) = clean(new_text(&prefix, &part)) {
                self.advance(cut);
                self.holding = true;
                return Ok(out);
            }
        }
        if self.holding {
            self.held_more += ids.len();
        }
        self.holding = true;
        if self.held_more > MAX_HELD_TOKENS {
            // The tail will not become text: give it up and restart the window.
            let out = new_text(&prefix, &full).unwrap_or("").to_string();
            self.window.clear();
            self.read = 0;
            self.holding = false;
            self.held_more = 0;
            return Ok(out);
        }
        Ok(String::new())
    }

    /// Marks `window[..cut]` emitted: the ids of this delta become the decoding context.
    fn advance(&mut self, cut: usize) {
        self.window.drain(..self.read);
        self.read = cut - self.read;
        self.holding = false;
        self.held_more = 0;
    }

    /// Whatever is still held back (U+FFFD for an incomplete character), at the end of a
    /// stream. The detokenizer starts afresh afterwards.
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        let tok = self.tok.tokenizer();
        let prefix = tok.decode(&self.window[..self.read], self.skip_special_tokens)?;
        let full = tok.decode(&self.window, self.skip_special_tokens)?;
        self.window.clear();
        self.read = 0;
        self.holding = false;
        self.held_more = 0;
        Ok(new_text(&prefix, &full).unwrap_or("").to_string())
    }
}

/// Text that can be emitted: some, and not ending in an incomplete character.
fn clean(new: Option<&str>) -> Option<String> {
    new.filter(|n| !n.is_empty() && !n.ends_with('\u{FFFD}'))
        .map(str::to_string)
}

/// What `full` adds after `prefix`: by prefix match, else (a decoder that rewrote the prefix)
/// by length where that falls on a character boundary.
fn new_text<'a>(prefix: &str, full: &'a str) -> Option<&'a str> {
    full.strip_prefix(prefix)
        .or_else(|| full.get(prefix.len()..))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ByteTokenizer;

    fn ids(s: &[u8]) -> Vec<u32> {
        s.iter()
            .map(|&b| b as u32 + ByteTokenizer::OFFSET)
            .collect()
    }

    #[test]
    fn holds_a_split_character_until_it_completes() {
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let e = ids("é😀".as_bytes());
        assert_eq!(d.push(&e[..1]).unwrap(), "");
        assert_eq!(d.push(&e[1..2]).unwrap(), "é");
        assert_eq!(d.push(&e[2..4]).unwrap(), "");
        assert_eq!(d.push(&e[4..5]).unwrap(), "");
        assert_eq!(d.push(&e[5..]).unwrap(), "😀");
        assert_eq!(d.flush().unwrap(), "");
        assert_eq!(d.tokens_seen(), 6);
    }

    #[test]
    fn a_skipped_special_between_a_characters_bytes_changes_nothing() {
        // 𝕒 is F0 9D 95 92: three of its bytes and a BOS between them are four ids, one more
        // than the cut search looks back; a skipped special must not count (found by
        // `byte_detokenizer_streams_valid_text_exactly`, which printed "0 \u{FFFD}" then
        // "\u{FFFD}b").
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let mut e = ids("0 𝕒b".as_bytes());
        e.insert(3, ByteTokenizer::BOS);
        assert_eq!(d.push(&e[..6]).unwrap(), "0 ");
        assert_eq!(d.push(&e[6..]).unwrap(), "𝕒b");
        assert_eq!(d.flush().unwrap(), "");
        assert_eq!(d.tokens_seen(), 8);
    }

    #[test]
    fn flush_releases_an_incomplete_tail_lossily() {
        let tok: Arc<dyn TextTokenizer> = Arc::new(ByteTokenizer);
        let mut d = IncrementalDetokenizer::new(Arc::clone(&tok), true);
        assert_eq!(d.push(&ids(b"ab\xF0\x9F")).unwrap(), "ab");
        assert_eq!(d.flush().unwrap(), "\u{FFFD}");
        assert_eq!(d.push(&ids(b"c")).unwrap(), "c");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        assert_eq!(d.push(&[ByteTokenizer::BOS]).unwrap(), "");
        assert_eq!(d.push(&ids(b"hi")).unwrap(), "hi");
        assert_eq!(d.push(&[ByteTokenizer::EOS]).unwrap(), "");
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, false);
        assert_eq!(d.push(&[ByteTokenizer::BOS]).unwrap(), "<s>");
        assert_eq!(d.push(&ids(b"hi")).unwrap(), "hi");
        assert_eq!(d.push(&[ByteTokenizer::EOS]).unwrap(), "</s>");
    }

    #[test]
    fn unknown_ids_are_errors_that_change_nothing() {
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        assert_eq!(d.push(&ids(b"a")).unwrap(), "a");
        assert_eq!(d.push(&ids(b"\xC3")).unwrap(), "");
        assert_eq!(
            d.push(&[ByteTokenizer::VOCAB_SIZE as u32]),
            Err(TokenizerError::UnknownToken {
                id: 259,
                vocab_size: 259
            })
        );
        assert_eq!(d.push(&ids(b"\xA9")).unwrap(), "é");
    }

    /// A stream of lone continuation bytes never becomes text: it is given up after
    /// MAX_HELD_TOKENS more tokens, so the window (and the cost of a push) stays bounded.
    #[test]
    fn invalid_bytes_do_not_grow_the_window() {
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let mut out = String::new();
        let mut max_window = 0;
        for _ in 0..1000 {
            out.push_str(&d.push(&ids(b"\x80")).unwrap());
            max_window = max_window.max(d.window_len());
        }
        out.push_str(&d.flush().unwrap());
        assert!(
            max_window <= MAX_HELD_TOKENS + 2,
            "window grew to {max_window}"
        );
        assert!(out.chars().all(|c| c == '\u{FFFD}'));
        // Every 34th push gives up a tail of 34 bytes; from_utf8_lossy makes each lone
        // continuation byte one U+FFFD.
        assert_eq!(out.chars().count(), 1000);
        // Valid text after the garbage streams normally again.
        assert_eq!(d.push(&ids(b"ok")).unwrap(), "ok");
    }

    #[test]
    fn a_batch_ending_mid_character_is_held_not_given_up() {
        let tok = ByteTokenizer;
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let text = "0123456789abcdef😀";
        let all = ids(text.as_bytes());
        let cut = all.len() - 2;
        // A batch whose end splits a character emits up to the character and holds the rest.
        assert_eq!(d.push(&all[..cut]).unwrap(), "0123456789abcdef");
        assert_eq!(d.push(&all[cut..cut + 1]).unwrap(), "");
        assert_eq!(d.push(&all[cut + 1..]).unwrap(), "😀");
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        assert_eq!(d.push(&all[..all.len() - 1]).unwrap(), "0123456789abcdef");
        // The 16 emitted ids stay as context, plus the 3 held.
        assert_eq!(d.window_len(), 19);
        assert_eq!(d.push(&all[all.len() - 1..]).unwrap(), "😀");
        assert_eq!(d.window_len(), 4);
    }
}
