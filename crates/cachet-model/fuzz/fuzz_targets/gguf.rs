//! A crafted GGUF file: opening it, reading its config, tensors, weights and tokenizer gives an
//! error or a value, never a panic, an abort on a huge allocation, or a read out of bounds.
#![no_main]

use cachet_model::gguf::GgufFile;
use cachet_model_fuzz::{exercise, scratch_file};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = scratch_file(data);
    if let Ok(f) = GgufFile::open(&path) {
        exercise(&f);
    }
});
