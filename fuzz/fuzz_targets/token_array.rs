//! Fuzzes the JSON token-array reader: `parse_token_array` (the AVX-512 paths where the CPU has
//! them: the one-pass extent scan and the 64-byte window reader) must give exactly what the
//! portable reader gives, for any bytes, including `None`.
#![no_main]

use kvroute_service::http::json::{parse_token_array, parse_token_array_portable};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert_eq!(parse_token_array(data), parse_token_array_portable(data));
});
