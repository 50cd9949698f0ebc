//! The network a command gets (issue 38): the profile's, the client's and the request's say,
//! combined by the rules of docs/profiles.md ("network"), and how the daemon reports them.
//!
//! The layers:
//! - the **profile** gives the default and says how a policy is enforced: `strict` (no
//!   network, a network namespace of its own) through that namespace, `task-container` (the
//!   host's network) through a namespace made for the command, `landlock` (no namespaces)
//!   not at all;
//! - the **client** (its clients-file entry, or `executor run --allow-net`) is the ceiling
//!   the operator sets: `none`, `host` or a policy;
//! - the **request** narrows what the client gets and never widens it.
//!
//! Policies combine by conjunction ([`Effective::combine`]): a connection is allowed only when
//! every layer with a policy allows it. Fail closed: a policy that cannot be enforced for a
//! command refuses the command, naming why; it never runs with more or less network than its
//! result states.

use protocol::{NetworkLayer, NetworkReport, ProfileNetwork, RequestNetwork};
use sandbox::network::{Effective, Layer, Mode, Policy, Rule, RuleError};
use sandbox::profile::{Namespace, Network, Profile};

/// The network a command runs with, and how it came to be that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub effective: Effective,
    /// Why it is not what the request asked for, when it is not (empty otherwise).
    pub note: String,
}

/// Why a command cannot run with the network its layers give it (the engine maps it to an
/// error code: `bad_request` when the request's own policy cannot be had, the client's to
/// fix; `environment_error` otherwise, where every such command would be refused the same
/// and an agent should stop rather than retry).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// The layer whose policy cannot be had; `None`: none in particular (this build, the
    /// profile).
    pub layer: Option<Layer>,
    pub message: String,
}

/// Parse a network as a request (or a clients-file entry) writes it. The error names the rule.
pub fn parse(network: &RequestNetwork) -> Result<Mode, RuleError> {
    Ok(match network {
        RequestNetwork::None {} => Mode::None,
        RequestNetwork::Host {} => Mode::Host,
        RequestNetwork::Policy { allow, deny } => Mode::Policy(parse_policy(allow, deny)?),
    })
}

/// Parse allow and deny rules.
pub fn parse_policy(allow: &[String], deny: &[String]) -> Result<Policy, RuleError> {
    let rules = |texts: &[String]| -> Result<Vec<Rule>, RuleError> {
        texts.iter().map(|text| text.parse()).collect()
    };
    Ok(Policy {
        allow: rules(allow)?,
        deny: rules(deny)?,
    })
}

/// Whether a policy from a client or a request can be enforced under `profile`, and why not.
/// (The daemon's proxy, `crate::enforce`, holds the command to it; a process without the
/// proxy, `executor run`, refuses such a command when it comes.)
pub fn policy_support(profile: &Profile) -> Result<(), String> {
    contained(profile)
}

/// Whether `profile` can ever hold a command to a policy, whatever this build enforces.
///
/// A policy needs a network namespace whose only way out is the daemon's proxy, and a command
/// that cannot leave it: `strict` has one; `task-container` (the host's network, but mount and
/// pid namespaces of its own, so the host's namespaces are out of its reach) is given one for
/// such a command. A profile without namespaces (`landlock`, `trusted`) has no way to hold a
/// command to the proxy: its commands could connect past it.
fn contained(profile: &Profile) -> Result<(), String> {
    let has = |ns| profile.namespaces.contains(&ns);
    let contained = has(Namespace::Net)
        || (matches!(profile.network.mode(), Mode::Host | Mode::Policy(_))
            && has(Namespace::Mount)
            && has(Namespace::Pid));
    if contained {
        Ok(())
    } else {
        Err(format!(
            "profile {:?} has no network namespace to hold a command to the daemon's proxy, so a network policy cannot be enforced under it without a way around it; use strict or task-container",
            profile.name
        ))
    }
}

/// The network a command gets under `profile`, for a client granted `client`, when the
/// request asks for `request` (see the module's comment and docs/profiles.md, "network").
///
/// Refused only where a policy could never be enforced under the profile.
pub fn effective_network(
    profile: &Profile,
    client: &Mode,
    request: Option<&Mode>,
) -> Result<Granted, Refusal> {
    let granted = |effective, note: &str| Granted {
        effective,
        note: note.to_string(),
    };
    // `none` anywhere but the profile is none: narrowing to nothing is always enforceable.
    if matches!(request, Some(Mode::None)) {
        return Ok(granted(Effective::None, ""));
    }
    if matches!(client, Mode::None) {
        let note = if request.is_some() {
            "this client is granted no network; the request cannot widen it"
        } else {
            ""
        };
        return Ok(granted(Effective::None, note));
    }
    let profile_mode = profile.network.mode();
    let policy_layer = match (client, request) {
        (Mode::Policy(_), _) => Some(Layer::Client),
        (_, Some(Mode::Policy(_))) => Some(Layer::Request),
        _ => None,
    };
    if let (Some(layer), Err(why)) = (policy_layer, contained(profile)) {
        return Err(Refusal {
            layer: Some(layer),
            message: format!("network policy of the {layer}: {why}"),
        });
    }
    let request_mode = request.unwrap_or(&Mode::Host);
    let effective = match &profile_mode {
        Mode::None => match client {
            // A namespaced profile without network never gets the host's from a client.
            Mode::Host => {
                let note = match request {
                    Some(Mode::Host) => format!(
                        "profile {:?} has no network and this client is granted none beyond it; the request cannot widen it",
                        profile.name
                    ),
                    Some(Mode::Policy(_)) => format!(
                        "profile {:?} has no network and this client is granted no policy under it; the request's policy cannot widen it",
                        profile.name
                    ),
                    _ => String::new(),
                };
                return Ok(granted(Effective::None, &note));
            }
            // The operator's grant, enforced through the profile's namespace.
            _ => Effective::combine([(Layer::Client, client), (Layer::Request, request_mode)]),
        },
        Mode::Host | Mode::Policy(_) => Effective::combine([
            (Layer::Profile, &profile_mode),
            (Layer::Client, client),
            (Layer::Request, request_mode),
        ]),
    };
    let note = match (&effective, request) {
        (Effective::Policy(_), Some(Mode::Host)) => {
            "the request asked for host; the policy of the layers above it applies"
        }
        _ => "",
    };
    Ok(granted(effective, note))
}

/// The profile a command runs under once its network is decided. A command granted no
/// network under a profile that gives one (`task-container`: a client granted `none`, a
/// request asking for `none`) gets a network namespace of its own with only loopback, as
/// strict's commands do: never the host's network while its result says none. Where the
/// profile has no namespaces to hold it (`trusted`), the command is refused.
pub fn narrowed_profile(profile: &Profile, granted: &Granted) -> Result<Option<Profile>, Refusal> {
    if granted.effective != Effective::None || profile.network == Network::None {
        return Ok(None);
    }
    contained(profile).map_err(|why| Refusal {
        layer: None,
        message: format!("the command is granted no network, but {why}"),
    })?;
    let mut narrowed = profile.clone();
    narrowed.network = Network::None;
    if !narrowed.namespaces.contains(&Namespace::Net) {
        narrowed.namespaces.push(Namespace::Net);
    }
    Ok(Some(narrowed))
}

fn mode_name(effective: &Effective) -> &'static str {
    match effective {
        Effective::None => "none",
        Effective::Host => "host",
        Effective::Policy(_) => "policy",
    }
}

fn strings(rules: &[Rule]) -> Vec<String> {
    rules.iter().map(Rule::to_string).collect()
}

fn layer_report(layer: Layer, policy: &Policy) -> NetworkLayer {
    NetworkLayer {
        layer: layer.to_string(),
        allow: strings(&policy.allow),
        deny: strings(&policy.deny),
    }
}

/// A command's network, for its result's isolation report.
pub fn report(granted: &Granted) -> NetworkReport {
    let layers = match &granted.effective {
        Effective::Policy(layers) => layers
            .iter()
            .map(|(layer, policy)| layer_report(*layer, policy))
            .collect(),
        _ => Vec::new(),
    };
    NetworkReport {
        mode: mode_name(&granted.effective).into(),
        layers,
        note: granted.note.clone(),
        connections: None,
    }
}

/// A client's ceiling, for its hello.
pub fn client_report(client: &Mode) -> NetworkReport {
    let effective = Effective::combine([(Layer::Client, client)]);
    report(&Granted {
        effective,
        note: String::new(),
    })
}

/// What a profile gives by default and whether a policy can be enforced under it, for the
/// hello.
pub fn profile_report(profile: &Profile) -> ProfileNetwork {
    let (mode, allow, deny) = match profile.network.mode() {
        Mode::None => ("none", Vec::new(), Vec::new()),
        Mode::Host => ("host", Vec::new(), Vec::new()),
        Mode::Policy(policy) => ("policy", strings(&policy.allow), strings(&policy.deny)),
    };
    let support = policy_support(profile);
    ProfileNetwork {
        mode: mode.into(),
        allow,
        deny,
        policy_enforceable: support.is_ok(),
        policy_reason: support.err().unwrap_or_default(),
    }
}

#[cfg(test)]
#[path = "network_policy_tests.rs"]
mod tests;
