//! The agent binary. The mini-swe-agent loop lands with its own issue; until then this crate
//! only pins the protocol dependency so the workspace layout is final.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    eprintln!(
        "agent {}: not implemented yet (protocol v{}); use `executor run` or `executor serve`",
        env!("CARGO_PKG_VERSION"),
        protocol::PROTOCOL_VERSION
    );
    std::process::ExitCode::from(2)
}
