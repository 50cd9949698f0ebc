//! The executor benchmark (placeholder; see issue 5).
#![forbid(unsafe_code)]

fn main() {
    eprintln!("executor-bench: not implemented yet (protocol v{})", protocol::PROTOCOL_VERSION);
}
