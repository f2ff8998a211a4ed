//! Stop strings over a stream of deltas: the automaton-based matcher must equal the naive
//! reference push for push, never hold back as much as a whole stop string, and never emit a
//! stop string; and the engine's check on token bytes (`TokenStops`, one byte one token) must
//! fire first at a byte of the piece the matcher matched in, and never when it did not match.
//!
//! Input: `stops (0xFE-separated) 0xFF piece 0xFF piece ...`.
#![no_main]

use std::sync::Arc;

use cachet_text::{ByteTokenizer, StopMatcher, TokenBytes, TokenStops, MAX_STOP_BYTES};
use cachet_text_fuzz::{split, text, NaiveStops, SEP, SUB};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let segs = split(data, SEP);
    let stops: Vec<String> = split(segs[0], SUB).into_iter().map(text).collect();
    let Ok(mut fast) = StopMatcher::new(stops.clone()) else {
        return;
    };
    let mut slow = NaiveStops::new(&stops);
    let vocab = Arc::new(TokenBytes::new(&ByteTokenizer));
    let tokens = TokenStops::new(&stops, vocab, true, &[]).expect("valid stops");
    let mut ids: Vec<u32> = Vec::new();
    let mut fired = false;
    let mut whole = String::new();
    let mut out = String::new();
    for piece in segs.iter().skip(1).map(|p| text(p)) {
        whole.push_str(&piece);
        let mut fired_here = false;
        for b in piece.bytes() {
            ids.push(u32::from(b) + ByteTokenizer::OFFSET);
            if !fired && tokens.as_ref().is_some_and(|t| t.ends_in_stop(&ids)) {
                fired = true;
                fired_here = true;
            }
        }
        let (a, b) = (fast.push(&piece), slow.push(&piece));
        assert_eq!(a.matched.is_some(), fired_here, "stops {stops:?} piece {piece:?}");
        assert_eq!(a, b, "stops {stops:?}");
        assert!(fast.held() < MAX_STOP_BYTES);
        out.push_str(&a.emit);
        if a.matched.is_some() {
            break;
        }
    }
    let (a, b) = (fast.flush(), slow.flush());
    assert_eq!(a, b);
    out.push_str(&a);
    assert!(whole.starts_with(&out));
    for s in stops.iter().filter(|s| !s.is_empty()) {
        assert!(!out.contains(s.as_str()), "{s:?} emitted");
    }
});
