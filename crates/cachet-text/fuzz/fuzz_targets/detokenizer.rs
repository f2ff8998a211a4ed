//! The incremental detokenizer over arbitrary token byte strings: never a panic, a bounded
//! window, valid text reproduced exactly, and invalid bytes only ever turned into U+FFFD.
//!
//! Input: `flags token 0xFF token 0xFF ...`; a token starting with 0xFE starts a new push
//! batch. Flags: bit 0 skip special tokens, bit 1 strip a leading space in decode (as
//! SentencePiece does), bit 2 use the byte tokenizer (each byte its own token, with BOS/EOS
//! for empty tokens).
#![no_main]

use cachet_text::{ByteTokenizer, IncrementalDetokenizer, TextTokenizer, MAX_HELD_TOKENS};
use cachet_text_fuzz::{split, ChunkTokenizer, SEP, SUB};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let skip = flags & 1 != 0;
    let mut batches: Vec<Vec<u32>> = vec![Vec::new()];
    let mut vocab: Vec<Vec<u8>> = Vec::new();
    let mut bytes: Vec<u8> = Vec::new();
    let byte_mode = flags & 4 != 0;
    for tok in split(rest, SEP) {
        let (new_batch, tok) = match tok.split_first() {
            Some((&SUB, t)) => (true, t),
            _ => (false, tok),
        };
        if new_batch {
            batches.push(Vec::new());
        }
        let batch = batches.last_mut().expect("one batch");
        if byte_mode {
            if tok.is_empty() {
                batch.push(ByteTokenizer::BOS + (vocab.len() % 2) as u32);
            }
            batch.extend(tok.iter().map(|&b| b as u32 + ByteTokenizer::OFFSET));
        } else {
            batch.push(vocab.len() as u32);
        }
        bytes.extend_from_slice(tok);
        vocab.push(tok.to_vec());
    }
    let chunk = ChunkTokenizer {
        vocab,
        strip_leading_space: flags & 2 != 0,
    };
    let tok: &dyn TextTokenizer = if byte_mode { &ByteTokenizer } else { &chunk };
    let ids: Vec<u32> = batches.concat();
    let biggest = batches.iter().map(Vec::len).max().unwrap_or(0);
    let mut d = IncrementalDetokenizer::new(tok, skip);
    let mut out = String::new();
    for b in &batches {
        out.push_str(&d.push(b).expect("ids are in the vocabulary"));
        let bound = 2 * MAX_HELD_TOKENS + 3 + 4 * biggest;
        assert!(
            d.window_len() <= bound,
            "window {} > {bound}",
            d.window_len()
        );
    }
    out.push_str(&d.flush().expect("flush"));
    let whole = tok.decode(&ids, skip).expect("decode");
    if std::str::from_utf8(&bytes).is_ok() && ids.len() <= MAX_HELD_TOKENS {
        assert_eq!(out, whole);
    } else {
        let mut want = whole.chars().filter(|&c| c != '\u{FFFD}');
        for c in out.chars().filter(|&c| c != '\u{FFFD}') {
            assert!(want.any(|w| w == c), "{c:?} not in {whole:?} (out {out:?})");
        }
    }
});
