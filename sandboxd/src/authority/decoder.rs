//! A bounded HPACK decoder (RFC 7541) for the `:authority` rewriter.
//!
//! Why not the `hpack` crate's decoder: it decodes a whole block into a list before anyone can
//! count it (a block of one-byte references to one large dynamic-table entry decodes to ~4,000
//! times its size), and it unwraps a truncated dynamic-table size update (a panic per malformed
//! block). This one counts the decoded size of each header as RFC 7540's
//! SETTINGS_MAX_HEADER_LIST_SIZE does (name + value + 32) *before* it produces the header, stops
//! at the bound, keeps its dynamic table within the size the server allows, and returns an
//! error for every malformed input. Huffman-coded strings are decoded by the `hpack` crate's
//! [`HuffmanDecoder`] (table-checked, no panics on any input, output at most 8/5 of the input).

use std::collections::VecDeque;

use hpack::huffman::HuffmanDecoder;

/// Overhead RFC 7541 4.1 adds to each entry's name and value when sizing a table or a list.
const ENTRY_OVERHEAD: usize = 32;
/// Largest integer a block may carry: far above any valid index, length or table size, and far
/// below anything that could overflow while it is decoded.
const MAX_INT: usize = 1 << 24;

/// RFC 7541 Appendix A: the static table, indexes 1 to 61.
const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// Why a header block was refused. Every one is a connection error (COMPRESSION_ERROR): after
/// it the decoder no longer knows what the client's encoder holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    /// The block ends inside a representation.
    #[error("the header block ends inside a field")]
    Truncated,
    /// An integer longer than any valid index, length or size.
    #[error("an integer above 2^24")]
    IntegerTooLarge,
    /// Index 0, or one past the static and dynamic tables.
    #[error("index {0} is in neither table")]
    BadIndex(usize),
    /// A dynamic table size update above what the server allows.
    #[error("dynamic table size update to {requested} bytes, above the {limit} allowed")]
    TableSizeTooLarge { requested: usize, limit: usize },
    /// A dynamic table size update after a header field (RFC 7541 4.2).
    #[error("a dynamic table size update after a header field")]
    LateSizeUpdate,
    /// A Huffman string with bad padding or an EOS inside.
    #[error("a malformed Huffman-coded string")]
    Huffman,
    /// The decoded headers grew past the bound; decoding stopped there.
    #[error("decoded header list over {limit} bytes (name + value + 32 per field)")]
    HeaderListTooLarge { limit: usize },
}

/// One decoded header field, as the decoder hands it out.
pub struct Field<'a> {
    /// The field name.
    pub name: &'a [u8],
    /// The field value.
    pub value: &'a [u8],
    /// Sent as "never indexed" (RFC 7541 6.2.3): a sensitive value to keep out of tables.
    pub never_indexed: bool,
}

/// The client-to-server HPACK decoding context of one connection.
pub struct Decoder {
    /// Newest entry first (dynamic index 62 is `entries[0]`).
    entries: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// Sum of the entries' sizes (RFC 7541 4.1).
    size: usize,
    /// The table size the client's last update chose (at most `table_limit`).
    max_size: usize,
    /// SETTINGS_HEADER_TABLE_SIZE the server advertised: the most an update may choose.
    table_limit: usize,
    /// Bound on one block's decoded header list.
    max_list: usize,
    /// Built on the first Huffman string (a few KiB of tables).
    huffman: Option<HuffmanDecoder>,
}

/// Reads an HPACK integer with a `prefix_bits` prefix from `buf` at `*pos` (RFC 7541 5.1).
fn read_int(buf: &[u8], pos: &mut usize, prefix_bits: u32) -> Result<usize, HpackError> {
    let mask = (1usize << prefix_bits) - 1;
    let first = *buf.get(*pos).ok_or(HpackError::Truncated)?;
    *pos += 1;
    let mut value = usize::from(first) & mask;
    if value < mask {
        return Ok(value);
    }
    let mut shift = 0u32;
    loop {
        let b = *buf.get(*pos).ok_or(HpackError::Truncated)?;
        *pos += 1;
        value += usize::from(b & 0x7f) << shift;
        if value > MAX_INT {
            return Err(HpackError::IntegerTooLarge);
        }
        if b & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
        // MAX_INT fits in 4 continuation bytes; more (even of zero bits) is padding to refuse.
        if shift > 28 {
            return Err(HpackError::IntegerTooLarge);
        }
    }
}

/// A string literal: borrowed when raw, decoded when Huffman-coded.
enum Str<'a> {
    Raw(&'a [u8]),
    Decoded(Vec<u8>),
}

impl Str<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Str::Raw(b) => b,
            Str::Decoded(v) => v,
        }
    }
}

impl Decoder {
    /// A decoder for a connection whose server allows a dynamic table of `table_limit` bytes,
    /// refusing any block that decodes to more than `max_list` bytes.
    pub fn new(table_limit: usize, max_list: usize) -> Self {
        Decoder { entries: VecDeque::new(), size: 0, max_size: table_limit, table_limit, max_list, huffman: None }
    }

    /// Decodes one whole header block, handing each field to `emit` in order. Decoding stops at
    /// the first error; the fields emitted before it must then be discarded with the connection.
    pub fn decode(&mut self, block: &[u8], mut emit: impl FnMut(Field<'_>)) -> Result<(), HpackError> {
        let mut pos = 0;
        let mut decoded = 0usize;
        let mut seen_field = false;
        while pos < block.len() {
            let b = block[pos];
            if b & 0x80 != 0 {
                // Indexed header field (6.1).
                let index = read_int(block, &mut pos, 7)?;
                let (name, value) = self.get(index)?;
                decoded = self.account(decoded, name.len() + value.len())?;
                emit(Field { name, value, never_indexed: false });
                seen_field = true;
            } else if b & 0xe0 == 0x20 {
                // Dynamic table size update (6.3).
                if seen_field {
                    return Err(HpackError::LateSizeUpdate);
                }
                let requested = read_int(block, &mut pos, 5)?;
                if requested > self.table_limit {
                    return Err(HpackError::TableSizeTooLarge { requested, limit: self.table_limit });
                }
                self.max_size = requested;
                self.evict(0);
            } else {
                // Literals (6.2.1 with incremental indexing; 6.2.2 without; 6.2.3 never indexed).
                let (prefix_bits, indexing, never_indexed) = if b & 0xc0 == 0x40 { (6, true, false) } else { (4, false, b & 0x10 != 0) };
                let name_index = read_int(block, &mut pos, prefix_bits)?;
                let name = if name_index == 0 {
                    self.string(block, &mut pos, decoded)?
                } else {
                    let (name, _) = self.get(name_index)?;
                    Str::Decoded(name.to_vec())
                };
                let value = self.string(block, &mut pos, decoded + name.bytes().len())?;
                decoded = self.account(decoded, name.bytes().len() + value.bytes().len())?;
                emit(Field { name: name.bytes(), value: value.bytes(), never_indexed });
                seen_field = true;
                if indexing {
                    let (name, value) = (name.bytes().to_vec(), value.bytes().to_vec());
                    self.insert(name, value);
                }
            }
        }
        Ok(())
    }

    /// Adds one field of `len` name+value bytes to the running total, or refuses the block.
    fn account(&self, decoded: usize, len: usize) -> Result<usize, HpackError> {
        let total = decoded + len + ENTRY_OVERHEAD;
        if total > self.max_list {
            return Err(HpackError::HeaderListTooLarge { limit: self.max_list });
        }
        Ok(total)
    }

    /// A string literal (5.2) at `*pos`; `decoded` is what the block decoded to so far, so a
    /// raw string that alone would pass the bound is refused before it is copied anywhere.
    fn string<'a>(&mut self, block: &'a [u8], pos: &mut usize, decoded: usize) -> Result<Str<'a>, HpackError> {
        let huffman = block.get(*pos).ok_or(HpackError::Truncated)? & 0x80 != 0;
        let len = read_int(block, pos, 7)?;
        let end = pos.checked_add(len).filter(|&e| e <= block.len()).ok_or(HpackError::Truncated)?;
        let raw = &block[*pos..end];
        *pos = end;
        if !huffman {
            self.account(decoded, len)?;
            return Ok(Str::Raw(raw));
        }
        let out = self.huffman.get_or_insert_with(HuffmanDecoder::new).decode(raw).map_err(|_| HpackError::Huffman)?;
        self.account(decoded, out.len())?;
        Ok(Str::Decoded(out))
    }

    /// The entry at HPACK index `index` (2.3.3): static first, then dynamic, newest first.
    fn get(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if index == 0 {
            return Err(HpackError::BadIndex(index));
        }
        if let Some(&(n, v)) = STATIC_TABLE.get(index - 1) {
            return Ok((n, v));
        }
        self.entries.get(index - 1 - STATIC_TABLE.len()).map(|(n, v)| (n.as_slice(), v.as_slice())).ok_or(HpackError::BadIndex(index))
    }

    /// Adds an entry (4.4): older entries are evicted to make room; an entry larger than the
    /// whole table empties it and is not added.
    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.entries.push_front((name, value));
    }

    /// Evicts the oldest entries until `room` more bytes fit within the table size.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            match self.entries.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + ENTRY_OVERHEAD,
                None => {
                    self.size = 0;
                    break;
                }
            }
        }
    }

    /// Bytes the dynamic table holds (RFC 7541 4.1 sizes).
    pub fn table_size(&self) -> usize {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    type List = Vec<(Vec<u8>, Vec<u8>)>;

    fn decode(d: &mut Decoder, block: &[u8]) -> Result<List, HpackError> {
        let mut out = Vec::new();
        d.decode(block, |f| out.push((f.name.to_vec(), f.value.to_vec())))?;
        Ok(out)
    }

    fn list(fields: &[(&str, &str)]) -> List {
        fields.iter().map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec())).collect()
    }

    /// RFC 7541 C.3 (requests, no Huffman) and C.4 (the same requests Huffman-coded): three
    /// blocks on one connection, each referring to the entries the previous ones added.
    #[test]
    fn rfc7541_request_examples_decode_with_their_table_sizes() {
        let expected = [
            list(&[(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")]),
            list(&[(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"), ("cache-control", "no-cache")]),
            list(&[(":method", "GET"), (":scheme", "https"), (":path", "/index.html"), (":authority", "www.example.com"), ("custom-key", "custom-value")]),
        ];
        let sizes = [57, 110, 164];
        let c3 = [
            "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "8286 84be 5808 6e6f 2d63 6163 6865",
            "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
        ];
        let c4 = ["8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff", "8286 84be 5886 a8eb 1064 9cbf", "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"];
        for blocks in [c3, c4] {
            let mut d = Decoder::new(4096, 16 << 10);
            for ((block, want), size) in blocks.iter().zip(&expected).zip(sizes) {
                assert_eq!(&decode(&mut d, &hex(block)).expect("decodes"), want, "{block}");
                assert_eq!(d.table_size(), size, "{block}");
            }
        }
    }

    /// RFC 7541 C.5 (responses, no Huffman) and C.6 (Huffman) with a 256-byte table: entries are
    /// evicted oldest first.
    #[test]
    fn rfc7541_response_examples_evict_as_specified() {
        let date1 = "Mon, 21 Oct 2013 20:13:21 GMT";
        let date2 = "Mon, 21 Oct 2013 20:13:22 GMT";
        let loc = "https://www.example.com";
        let expected = [
            list(&[(":status", "302"), ("cache-control", "private"), ("date", date1), ("location", loc)]),
            list(&[(":status", "307"), ("cache-control", "private"), ("date", date1), ("location", loc)]),
            list(&[
                (":status", "200"),
                ("cache-control", "private"),
                ("date", date2),
                ("location", loc),
                ("content-encoding", "gzip"),
                ("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"),
            ]),
        ];
        let sizes = [222, 222, 215];
        let c5 = [
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "4803 3330 37c1 c0bf",
            "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
        ];
        let c6 = [
            "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
            "4883 640e ffc1 c0bf",
            "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
        ];
        for blocks in [c5, c6] {
            let mut d = Decoder::new(256, 16 << 10);
            for ((block, want), size) in blocks.iter().zip(&expected).zip(sizes) {
                assert_eq!(&decode(&mut d, &hex(block)).expect("decodes"), want, "{block}");
                assert_eq!(d.table_size(), size, "{block}");
            }
        }
    }

    /// RFC 7541 C.2: one field of each literal kind; "never indexed" is reported as such.
    #[test]
    fn rfc7541_field_examples() {
        let mut d = Decoder::new(4096, 16 << 10);
        assert_eq!(decode(&mut d, &hex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")), Ok(list(&[("custom-key", "custom-header")])));
        assert_eq!(d.table_size(), 55);
        let mut d = Decoder::new(4096, 16 << 10);
        assert_eq!(decode(&mut d, &hex("040c 2f73 616d 706c 652f 7061 7468")), Ok(list(&[(":path", "/sample/path")])));
        assert_eq!(d.table_size(), 0);
        let mut never = Vec::new();
        d.decode(&hex("1008 7061 7373 776f 7264 0673 6563 7265 74"), |f| never.push((f.name.to_vec(), f.value.to_vec(), f.never_indexed))).expect("decodes");
        assert_eq!(never, vec![(b"password".to_vec(), b"secret".to_vec(), true)]);
        assert_eq!(decode(&mut d, &[0x82]), Ok(list(&[(":method", "GET")])));
    }

    /// What an encoder with a dynamic table (the `hpack` crate's, as clients use) produces
    /// decodes to the same lists, block after block on one connection.
    #[test]
    fn round_trips_against_an_encoder_with_a_dynamic_table() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7541);
        let mut encoder = ::hpack::Encoder::new();
        let mut d = Decoder::new(4096, 16 << 10);
        let names = [":method", ":path", ":authority", "content-type", "te", "x-custom", "authorization", "grpc-timeout"];
        for _ in 0..500 {
            let n = rng.gen_range(1..12);
            let fields: List = (0..n)
                .map(|_| {
                    let name = names[rng.gen_range(0..names.len())].as_bytes().to_vec();
                    let len = if rng.gen_bool(0.1) { rng.gen_range(0..900) } else { rng.gen_range(0..12) };
                    let value = (0..len).map(|_| rng.gen_range(b'a'..=b'e')).collect();
                    (name, value)
                })
                .collect();
            let block = encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            assert_eq!(decode(&mut d, &block), Ok(fields));
            assert!(d.table_size() <= 4096);
        }
    }

    /// The bomb of issue 20: one large entry, then one-byte references to it. Decoding stops at
    /// the bound, having handed out no more than the bound.
    #[test]
    fn a_block_of_references_stops_at_the_decoded_bound() {
        let mut block = vec![0x40, 0x01, b'x', 0x7f, 0xa1, 0x1e]; // x: <4000 bytes>, with indexing
        block.extend(std::iter::repeat_n(b'v', 4000));
        block.extend(std::iter::repeat_n(0xbe, 1_000_000)); // index 62, a million times
        let mut d = Decoder::new(4096, 16 << 10);
        let mut handed = 0;
        let result = d.decode(&block, |f| handed += f.name.len() + f.value.len() + 32);
        assert_eq!(result, Err(HpackError::HeaderListTooLarge { limit: 16 << 10 }));
        assert!(handed <= 16 << 10, "{handed} bytes handed out");
        // A raw literal over the bound is refused before it is copied.
        let mut big = vec![0x00, 0x01, b'y', 0x7f, 0x81, 0x7f];
        big.extend(std::iter::repeat_n(b'v', 16_384));
        assert_eq!(Decoder::new(4096, 16 << 10).decode(&big, |_| panic!("nothing is emitted")), Err(HpackError::HeaderListTooLarge { limit: 16 << 10 }));
    }

    #[test]
    fn table_size_updates_are_bounded_and_truncation_is_an_error() {
        let mut d = Decoder::new(4096, 16 << 10);
        // 001 11111 and nothing after it: the `hpack` crate's decoder panics here.
        assert_eq!(d.decode(&[0x3f], |_| ()), Err(HpackError::Truncated));
        assert_eq!(d.decode(&[0x3f, 0xe1], |_| ()), Err(HpackError::Truncated));
        // 31 + 97 + (31 << 7) = 4096: allowed; one more is not.
        assert_eq!(d.decode(&[0x3f, 0xe1, 0x1f], |_| ()), Ok(()));
        assert_eq!(d.decode(&[0x3f, 0xe2, 0x1f], |_| ()), Err(HpackError::TableSizeTooLarge { requested: 4097, limit: 4096 }));
        assert_eq!(d.decode(&[0x82, 0x20], |_| ()), Err(HpackError::LateSizeUpdate));
        assert_eq!(d.decode(&[0x3f, 0xff, 0xff, 0xff, 0xff, 0x7f], |_| ()), Err(HpackError::IntegerTooLarge));
        assert_eq!(d.decode(&[0x3f, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00], |_| ()), Err(HpackError::IntegerTooLarge));
        assert_eq!(d.decode(&[0x80], |_| ()), Err(HpackError::BadIndex(0)));
        assert_eq!(d.decode(&[0xbe], |_| ()), Err(HpackError::BadIndex(62)));
        assert_eq!(d.decode(&[0x40, 0x85, 0xff], |_| ()), Err(HpackError::Truncated));
        assert_eq!(d.decode(&[0x40, 0x81, 0xff, 0x00], |_| ()), Err(HpackError::Huffman));
        // Size 0 empties the table; entries added after it are evicted at once.
        let mut d = Decoder::new(4096, 16 << 10);
        decode(&mut d, &hex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")).expect("decodes");
        assert_eq!(d.table_size(), 55);
        assert_eq!(decode(&mut d, &[0x20, 0x82]), Ok(list(&[(":method", "GET")])));
        assert_eq!(d.table_size(), 0);
    }
}
