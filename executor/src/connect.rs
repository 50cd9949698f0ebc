//! `executor connect URL`: for targets that accept no inbound connection (behind NAT, a
//! firewall). The daemon serves as usual, on a loopback port of its own, and dials out to the
//! agent's relay over TLS, pinning the relay's certificate (`dial_out` keeps the connections
//! there). So the client speaks the same protocol (HTTP upgrade, token, WebSocket) over the
//! connection the executor opened. When the relay cannot be reached for `--give-up-after`
//! seconds the daemon drains and exits, as it does when its stdin closes.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use pinning::Fingerprint;

use crate::args::ServeArgs;
use crate::dial_out::Relay;

#[derive(Args)]
pub(crate) struct ConnectArgs {
    /// The relay, `wss://HOST:PORT` (as the agent prints it).
    url: String,
    /// SHA-256 fingerprint of the relay's certificate (`sha256:<hex>`): exactly that
    /// certificate is accepted.
    #[arg(long, value_name = "sha256:HEX")]
    tls_fingerprint: String,
    /// Seconds without reaching the relay after which the daemon drains and exits.
    #[arg(long, default_value_t = 60.0)]
    give_up_after: f64,
    /// Everything `serve` takes; `--token-file` is required (the relay checks it), and the
    /// daemon listens on a loopback port of its own whatever `--listen` says.
    #[command(flatten)]
    serve: ServeArgs,
}

pub(crate) fn run(args: ConnectArgs) -> anyhow::Result<()> {
    let mut serve = args.serve;
    let Some(token_file) = &serve.token_file else {
        bail!("executor connect needs --token-file: the relay checks the token");
    };
    let token = std::fs::read_to_string(token_file)
        .with_context(|| format!("cannot read {}", token_file.display()))?
        .trim()
        .to_string();
    let pin = Fingerprint::parse(&args.tls_fingerprint)
        .map_err(|e| anyhow::anyhow!("--tls-fingerprint: {e}"))?;
    let give_up_after =
        Duration::try_from_secs_f64(args.give_up_after).unwrap_or(Duration::from_secs(60));
    serve.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    serve.dial_out = Some(Relay::resolve(&args.url, pin, token, give_up_after)?);
    crate::serve::serve(serve)
}

#[cfg(test)]
mod tests {
    use pinning::Fingerprint;

    #[test]
    fn pins_are_read_as_the_relay_prints_them() {
        let pin = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(Fingerprint::parse(&pin).unwrap().to_string(), pin);
        assert!(Fingerprint::parse("sha256:abcd").is_err());
    }
}
