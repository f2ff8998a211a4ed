//! Property tests: the stop matcher against a naive reference, the detokenizer against a whole
//! decode.

mod common;

use cachet_text::{
    ByteTokenizer, IncrementalDetokenizer, StopMatcher, StopOutcome, TextTokenizer, MAX_HELD_TOKENS,
};
use common::ChunkTokenizer;
use proptest::prelude::*;

/// The matcher cachet had before the automaton: every stop string searched in the pending
/// text on every push, the hold-back found by trying every prefix of every stop string.
struct NaiveStops {
    stops: Vec<String>,
    pending: String,
    done: bool,
}

impl NaiveStops {
    fn new(stops: &[String]) -> Self {
        NaiveStops {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            done: false,
        }
    }

    fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome {
                emit: text.to_string(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        let mut best: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if let Some(pos) = self.pending.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((bpos, bi)) => {
                        pos < bpos || (pos == bpos && stop.len() > self.stops[bi].len())
                    }
                };
                if better {
                    best = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = best {
            let emit = self.pending[..pos].to_string();
            self.pending.clear();
            self.done = true;
            return StopOutcome {
                emit,
                matched: Some(i),
            };
        }
        let mut hold = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.pending.len());
            for k in (hold + 1..=max).rev() {
                if stop.is_char_boundary(k)
                    && self.pending.as_bytes().ends_with(&stop.as_bytes()[..k])
                {
                    hold = k;
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome {
            emit,
            matched: None,
        }
    }

    fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
        self.done = true;
        std::mem::take(&mut self.pending)
    }
}

/// Text over a small alphabet (with multi-byte characters) so that stop strings occur often.
fn small_text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![Just("a"), Just("b"), Just("é"), Just("😀"), Just(" ")],
        0..max,
    )
    .prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn stop_matcher_equals_the_naive_reference(
        stops in proptest::collection::vec(small_text(5), 0..6),
        pieces in proptest::collection::vec(small_text(6), 0..12),
    ) {
        let mut fast = StopMatcher::new(stops.clone()).unwrap();
        let mut slow = NaiveStops::new(&stops);
        let mut out = String::new();
        let mut whole = String::new();
        for p in &pieces {
            whole.push_str(p);
            let (a, b) = (fast.push(p), slow.push(p));
            prop_assert_eq!(&a, &b, "push {:?} of {:?} with stops {:?}", p, pieces, stops);
            out.push_str(&a.emit);
            if a.matched.is_some() {
                break;
            }
        }
        prop_assert_eq!(fast.flush(), slow.flush());
        // Whatever was emitted is a prefix of the text and contains no stop string.
        prop_assert!(whole.starts_with(&out));
        for s in stops.iter().filter(|s| !s.is_empty()) {
            prop_assert!(!out.contains(s.as_str()), "{:?} emitted in {:?}", s, out);
        }
    }

    /// With the stop string kept, the emitted text is the whole text through the end of the
    /// stop occurrence that ends first (found by brute force), or all of it without one; each
    /// piece is emitted as it comes, up to that end.
    #[test]
    fn an_included_stop_ends_the_text_where_the_first_occurrence_ends(
        stops in proptest::collection::vec(small_text(5), 0..6),
        pieces in proptest::collection::vec(small_text(6), 0..12),
    ) {
        let mut m = StopMatcher::new(stops.clone()).unwrap().including_match();
        let whole: String = pieces.concat();
        let end = (1..=whole.len()).find(|&e| {
            stops.iter().any(|s| !s.is_empty() && whole.as_bytes()[..e].ends_with(s.as_bytes()))
        });
        let mut out = String::new();
        let mut seen = 0;
        let mut matched = false;
        for p in &pieces {
            let o = m.push(p);
            seen += p.len();
            // Nothing held: all that arrived, up to the stop's end.
            prop_assert_eq!(out.len() + o.emit.len(), end.map_or(seen, |e| e.min(seen)));
            out.push_str(&o.emit);
            if let Some(i) = o.matched {
                prop_assert!(out.ends_with(m.stops()[i].as_str()));
                matched = true;
                break;
            }
        }
        out.push_str(&m.flush());
        prop_assert_eq!(matched, end.is_some());
        prop_assert_eq!(out.as_str(), &whole[..end.unwrap_or(whole.len())]);
    }
}

/// Splits `v` at the given cut points (taken modulo its length).
fn split_at<T: Clone>(v: &[T], cuts: &[usize]) -> Vec<Vec<T>> {
    let mut cs: Vec<usize> = cuts
        .iter()
        .map(|&c| if v.is_empty() { 0 } else { c % (v.len() + 1) })
        .collect();
    cs.push(0);
    cs.push(v.len());
    cs.sort_unstable();
    cs.dedup();
    cs.windows(2).map(|w| v[w[0]..w[1]].to_vec()).collect()
}

fn stream<T: cachet_text::TokenizerRef>(
    d: &mut IncrementalDetokenizer<T>,
    batches: &[Vec<u32>],
) -> (Vec<String>, String) {
    let deltas: Vec<String> = batches.iter().map(|b| d.push(b).unwrap()).collect();
    let tail = d.flush().unwrap();
    (deltas, tail)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Byte tokens (with BOS/EOS sprinkled in, skipped): the deltas are exactly the text and
    /// never hold a U+FFFD.
    #[test]
    fn byte_detokenizer_streams_valid_text_exactly(
        text in "\\PC{0,40}".prop_filter("no U+FFFD", |s| !s.contains('\u{FFFD}')),
        specials in proptest::collection::vec(any::<usize>(), 0..4),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let tok = ByteTokenizer;
        let mut ids = tok.encode(&text, false).unwrap();
        for (k, &at) in specials.iter().enumerate() {
            let at = at % (ids.len() + 1);
            ids.insert(at, if k % 2 == 0 { ByteTokenizer::BOS } else { ByteTokenizer::EOS });
        }
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let (deltas, tail) = stream(&mut d, &split_at(&ids, &cuts));
        for delta in &deltas {
            prop_assert!(!delta.contains('\u{FFFD}'), "{:?} in {:?}", delta, deltas);
        }
        prop_assert_eq!(tail.as_str(), "");
        prop_assert_eq!(deltas.concat(), tok.decode(&ids, true).unwrap());
        prop_assert_eq!(deltas.concat(), text);
    }

    /// Multi-byte tokens cut anywhere, tokens of no text, with or without a leading-space strip
    /// in decode.
    #[test]
    fn chunk_detokenizer_streams_valid_text_exactly(
        // At most 31 tokens: never more than MAX_HELD_TOKENS boundaries in a row inside characters.
        text in "[ a-zé😀日]{0,30}",
        token_cuts in proptest::collection::vec(any::<usize>(), 0..30),
        batch_cuts in proptest::collection::vec(any::<usize>(), 0..10),
        empties in proptest::collection::vec((any::<usize>(), 1..6usize), 0..3),
        strip in any::<bool>(),
    ) {
        // Tokens that decode to nothing (as skipped special tokens do) anywhere in the stream.
        let mut vocab = split_at(text.as_bytes(), &token_cuts);
        for &(at, run) in &empties {
            let at = at % (vocab.len() + 1);
            vocab.splice(at..at, std::iter::repeat_n(Vec::new(), run));
        }
        let ids: Vec<u32> = (0..vocab.len() as u32).collect();
        let tok = ChunkTokenizer { vocab, strip_leading_space: strip };
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let (deltas, tail) = stream(&mut d, &split_at(&ids, &batch_cuts));
        for delta in &deltas {
            prop_assert!(!delta.contains('\u{FFFD}'), "{:?}", delta);
        }
        prop_assert_eq!(tail.as_str(), "");
        prop_assert_eq!(deltas.concat(), tok.decode(&ids, true).unwrap());
    }

    /// Arbitrary bytes one token at a time: never a panic, and the window stays bounded.
    #[test]
    fn invalid_bytes_keep_the_window_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let tok = ByteTokenizer;
        let ids = tok.encode("", false).unwrap().into_iter()
            .chain(bytes.iter().map(|&b| b as u32 + ByteTokenizer::OFFSET))
            .collect::<Vec<_>>();
        let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(&[id]).unwrap());
            prop_assert!(d.window_len() <= MAX_HELD_TOKENS + 4, "window {}", d.window_len());
        }
        out.push_str(&d.flush().unwrap());
        // Valid input is reproduced exactly. Invalid bytes become U+FFFD, and a tail given up
        // as invalid can cost a character split across the give-up point, but every character
        // emitted is one the whole decode has, in order.
        let whole = tok.decode(&ids, true).unwrap();
        if std::str::from_utf8(&bytes).is_ok() {
            prop_assert_eq!(out, whole);
        } else {
            let mut want = whole.chars().filter(|&c| c != '\u{FFFD}');
            for c in out.chars().filter(|&c| c != '\u{FFFD}') {
                prop_assert!(want.any(|w| w == c), "{:?} not in {:?}", c, whole);
            }
        }
    }
}
