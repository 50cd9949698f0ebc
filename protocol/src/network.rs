//! Network by policy (issue 38): what a request asks for, and how the daemon reports the
//! network of a profile, of a client and of a command.
//!
//! Rules travel as strings (`pypi.org:443`, `*.github.com`, `10.0.0.0/8:5432`, `[::1]:8080`);
//! the daemon parses them and answers a rule it cannot read with `bad_request` naming it
//! (the syntax is in docs/profiles.md, "network").

use serde::{Deserialize, Serialize};

/// The network a request asks for. It narrows what the client is granted and never widens
/// it: `host` under a client policy is that policy, and a policy under `none` is `none` (the
/// result's [`NetworkReport::note`] says so).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum RequestNetwork {
    // `{}`: a unit variant of an internally tagged enum would ignore fields beside its tag
    // (`{"mode": "none", "allow": [...]}`), where a misspelt request must be an error.
    /// No network.
    None {},
    /// Whatever the client is granted, unnarrowed.
    Host {},
    /// Only connections these rules allow (and every other layer too); deny wins.
    Policy {
        allow: Vec<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        deny: Vec<String>,
    },
}

/// A network as the daemon states it: this client's ceiling in the hello, a command's in its
/// result's isolation report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkReport {
    /// `none`, `host` or `policy`.
    pub mode: String,
    /// Under `policy`, every layer that filters, outermost first: a connection is allowed only
    /// when each of them allows it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<NetworkLayer>,
    /// How the layers came to this when it is not what the request asked for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// In a command's result under `policy`: what the policy let through and refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<NetworkUse>,
}

/// What a network policy let through for one command, and what it refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkUse {
    /// Connection attempts (and name lookups) the policy allowed, and refused.
    pub allowed: u64,
    pub denied: u64,
    /// The first refused targets, `host:port (code)`, in the order they came (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub denied_first: Vec<String>,
    /// Ports reachable by a plain connection to a resolved name (captured in the command's
    /// namespace); every other allowed port is reachable through the proxy only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub captured_ports: Vec<u16>,
    /// Allow rules whose ports were not all captured (a range too wide): what they allow is
    /// reachable through the proxy (`HTTP_PROXY`, `CONNECT`) only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_only: Vec<String>,
}

/// One layer of a policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkLayer {
    /// `profile`, `client` or `request`.
    pub layer: String,
    pub allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

/// What a profile gives by default, and whether a client's or a request's policy can be
/// enforced under it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileNetwork {
    /// `none`, `host` or `policy` (then `allow` and `deny` are the profile's rules).
    pub mode: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
    /// Whether a command under this profile can run with a policy.
    pub policy_enforceable: bool,
    /// Why not, when it cannot (e.g. `landlock`: no network namespace).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub policy_reason: String,
}
