//! The `:authority` rewriter gets bytes from clients nobody has authenticated yet: whatever they
//! are, it must not panic, and what it holds must stay within its bounds. The first byte picks
//! how the rest is cut into reads; the preface is prepended so most inputs reach the frame and
//! HPACK code. `make test` runs a seeded loop of the same checks (authority::tests::fuzz_loop_*).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandboxd::authority::{Rewriter, MAX_FRAME_SIZE, MAX_HEADER_BLOCK};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else { return };
    let piece = usize::from(cut).max(1) * 64;
    let mut rewriter = Rewriter::default();
    let mut out = bytes::BytesMut::new();
    if rewriter.feed(PREFACE, &mut out).is_err() {
        return;
    }
    for chunk in rest.chunks(piece) {
        let result = rewriter.feed(chunk, &mut out);
        assert!(rewriter.buffered() <= MAX_FRAME_SIZE + 9 + chunk.len() + MAX_HEADER_BLOCK);
        if result.is_err() {
            return;
        }
    }
});
