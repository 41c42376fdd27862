//! cargo-fuzz target `frame_decoder`: see `fuzz/harness.rs` (shared with `tests/fuzz_corpus.rs`).
#![no_main]

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::frame_decoder(data));
