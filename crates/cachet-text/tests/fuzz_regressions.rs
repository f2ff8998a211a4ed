//! One test per failure the fuzz targets (`fuzz/`, run by `fuzz/smoke.sh`) found, replaying
//! the input that found it (the inputs are kept in `fuzz/seeds/`).

mod common;

use cachet_text::{ByteTokenizer, IncrementalDetokenizer, TextTokenizer, MAX_HELD_TOKENS};
use common::ChunkTokenizer;

fn byte(b: u8) -> u32 {
    b as u32 + ByteTokenizer::OFFSET
}

/// fuzz/seeds/detokenizer/regression-held-context: an invalid byte, then a long run of skipped
/// special tokens, then text. The window stays within the documented bound and the text is
/// right (the skipped specials used to widen the window to about twice MAX_HELD_TOKENS).
#[test]
fn held_tokens_keep_the_window_within_its_bound() {
    let tok = ByteTokenizer;
    let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, true);
    let bound = 2 * MAX_HELD_TOKENS + 3 + 4;
    let mut out = String::new();
    let mut widest = 0;
    for _ in 0..3 {
        out.push_str(&d.push(&[byte(0xFD)]).unwrap());
        for _ in 0..30 {
            out.push_str(&d.push(&[ByteTokenizer::BOS]).unwrap());
            widest = widest.max(d.window_len());
        }
        out.push_str(&d.push(&[byte(b'a')]).unwrap());
        widest = widest.max(d.window_len());
    }
    out.push_str(&d.flush().unwrap());
    assert_eq!(out, "\u{FFFD}a\u{FFFD}a\u{FFFD}a");
    // Skipped special ids never enter the window: the last delta's two ids as context and the
    // held invalid byte (63 while the skipped BOS ids were kept in it).
    assert_eq!(widest, 3);
    assert!(widest <= bound);
}

/// fuzz/seeds/detokenizer/regression-empty-context: with a SentencePiece-style decoder (strip
/// one leading space), a delta `" h"` followed by tokens that decode to nothing. Keeping only
/// the last few ids of a delta as context left a context that decodes to nothing, and the
/// decoder then stripped the space of the next token: "h\0" instead of "h \0".
#[test]
fn context_that_decodes_to_nothing_keeps_the_next_space() {
    let vocab: Vec<Vec<u8>> = vec![b" h".to_vec(), Vec::new(), b" ".to_vec(), b"\0".to_vec()];
    let tok = ChunkTokenizer {
        vocab,
        strip_leading_space: true,
    };
    let mut d = IncrementalDetokenizer::new(&tok as &dyn TextTokenizer, false);
    let mut out = d.push(&[0, 1, 1, 1, 1, 1, 1]).unwrap();
    assert_eq!(out, "h");
    out.push_str(&d.push(&[2, 1]).unwrap());
    out.push_str(&d.push(&[3]).unwrap());
    out.push_str(&d.flush().unwrap());
    assert_eq!(out, "h \0");
    assert_eq!(
        out,
        tok.decode(&[0, 1, 1, 1, 1, 1, 1, 2, 1, 3], false).unwrap()
    );
}
