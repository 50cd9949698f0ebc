//! The network a run's commands ask for (issue 38): `environment.network` in the config, a
//! batch instance's `network` field, and the `--allow-net` / `--deny-net` / `--no-net` flags.
//! Sent as the `network` of every command's request; the executor combines it with what the
//! profile and the client are granted, and it only ever narrows that (docs/profiles.md,
//! "network").
//!
//! Written in the protocol's shape, or as a bare mode:
//!
//! ```yaml
//! network: none                 # or host, or {mode: none}
//! network:
//!   mode: policy
//!   allow: [pypi.org:443, files.pythonhosted.org:443]
//!   deny: [evil.pypi.org]
//! ```
//!
//! The shape is checked here, before anything starts, with an error naming what is wrong; the
//! rules' own syntax is the executor's to check (it refuses a bad rule as `bad_request`,
//! naming it), so that an agent and an executor of different versions agree on what a rule
//! is.

use clap::Args;
use protocol::RequestNetwork;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// What a network may be written as, for error messages.
const SHAPES: &str =
    "none, host, or {mode: policy, allow: [RULE, ...], deny: [RULE, ...]} (rules such as pypi.org:443)";

/// Read a network written as `what` (e.g. `environment.network`) from a YAML or JSON value.
/// `null` is no network setting at all: the client's.
pub fn from_value(value: &Value, what: &str) -> Result<Option<RequestNetwork>, String> {
    let bad = |why: String| format!("{what}: {why}; write {SHAPES}");
    let map = match value {
        Value::Null => return Ok(None),
        Value::String(mode) => return mode_only(mode).map(Some).map_err(bad),
        Value::Object(map) => map,
        other => return Err(bad(format!("expected a mode or a map, got {other}"))),
    };
    if let Some(key) = map
        .keys()
        .find(|k| !["mode", "allow", "deny"].contains(&k.as_str()))
    {
        return Err(bad(format!("unknown key {key:?}")));
    }
    let mode = match map.get("mode") {
        Some(Value::String(mode)) => mode.as_str(),
        Some(other) => return Err(bad(format!("mode must be a string, got {other}"))),
        None => return Err(bad("no mode".into())),
    };
    let rules = |key: &str| -> Result<Vec<String>, String> {
        let items = match map.get(key) {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Array(items)) => items,
            Some(other) => return Err(format!("{key} must be a list of rules, got {other}")),
        };
        items
            .iter()
            .map(|item| match item {
                Value::String(rule) if rule.trim().is_empty() => {
                    Err(format!("{key} holds an empty rule"))
                }
                Value::String(rule) => Ok(rule.trim().to_string()),
                other => Err(format!(
                    "{key} holds {other}, which is not a rule (a string)"
                )),
            })
            .collect()
    };
    match mode {
        "none" | "host" => match ["allow", "deny"].iter().find(|k| map.contains_key(**k)) {
            Some(key) => Err(bad(format!("mode {mode} takes no {key} rules"))),
            None => mode_only(mode).map(Some).map_err(bad),
        },
        "policy" => {
            let allow = rules("allow").map_err(bad)?;
            let deny = rules("deny").map_err(bad)?;
            policy(allow, deny)
                .map(Some)
                .map_err(|why| format!("{what}: {why}"))
        }
        other => Err(bad(format!("unknown mode {other:?}"))),
    }
}

fn mode_only(mode: &str) -> Result<RequestNetwork, String> {
    match mode {
        "none" => Ok(RequestNetwork::None {}),
        "host" => Ok(RequestNetwork::Host {}),
        "policy" => Err("mode policy needs its allow rules".into()),
        other => Err(format!("unknown mode {other:?}")),
    }
}

/// A policy, refused when it allows nothing: that is `none`, and saying so keeps a
/// forgotten `allow` from reading as "everything".
pub fn policy(allow: Vec<String>, deny: Vec<String>) -> Result<RequestNetwork, String> {
    if allow.is_empty() {
        return Err("a policy with no allow rule allows nothing; write none instead".into());
    }
    Ok(RequestNetwork::Policy { allow, deny })
}

/// `environment.network` in the config.
pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Option<RequestNetwork>, D::Error> {
    let value = Value::deserialize(de)?;
    from_value(&value, "environment.network").map_err(serde::de::Error::custom)
}

/// How a network is said in one line (`policy allow pypi.org:443 deny evil.pypi.org`).
pub fn describe(network: &RequestNetwork) -> String {
    match network {
        RequestNetwork::None {} => "none".into(),
        RequestNetwork::Host {} => "host".into(),
        RequestNetwork::Policy { allow, deny } if deny.is_empty() => {
            format!("policy allow {}", allow.join(" "))
        }
        RequestNetwork::Policy { allow, deny } => {
            format!("policy allow {} deny {}", allow.join(" "), deny.join(" "))
        }
    }
}

/// The network flags of `run`, `batch`, `exec` and `shell`; each replaces
/// `environment.network`.
#[derive(Args, Clone, Default, Debug)]
pub struct NetworkArgs {
    /// Let commands connect only to what RULE names (repeatable): `pypi.org:443`,
    /// `*.github.com:443`, `10.0.0.0/8:5432`. Narrows what the executor grants this client,
    /// never widens it (environment.network: {mode: policy, allow: [...]}).
    #[arg(long = "allow-net", value_name = "RULE", conflicts_with = "no_net")]
    pub allow_net: Vec<String>,
    /// Refuse what RULE names even where an --allow-net rule covers it (repeatable; deny
    /// wins).
    #[arg(long = "deny-net", value_name = "RULE", conflicts_with = "no_net")]
    pub deny_net: Vec<String>,
    /// No network for the commands (environment.network: none).
    #[arg(long = "no-net")]
    pub no_net: bool,
}

impl NetworkArgs {
    /// The network the flags ask for; `None` when none was given.
    pub fn network(&self) -> anyhow::Result<Option<RequestNetwork>> {
        if self.no_net {
            return Ok(Some(RequestNetwork::None {}));
        }
        if self.allow_net.is_empty() && self.deny_net.is_empty() {
            return Ok(None);
        }
        if self.allow_net.is_empty() {
            anyhow::bail!("--deny-net narrows what --allow-net allows; give at least one --allow-net (or --no-net)");
        }
        let value = serde_json::json!({
            "mode": "policy",
            "allow": self.allow_net,
            "deny": self.deny_net,
        });
        from_value(&value, "--allow-net/--deny-net").map_err(|e| anyhow::anyhow!(e))
    }

    /// Write the flags into `slot` (`environment.network`) when given: flags win over config
    /// files.
    pub fn apply(&self, slot: &mut Option<RequestNetwork>) -> anyhow::Result<()> {
        if let Some(network) = self.network()? {
            *slot = Some(network);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy_of(allow: &[&str], deny: &[&str]) -> RequestNetwork {
        RequestNetwork::Policy {
            allow: allow.iter().map(|r| r.to_string()).collect(),
            deny: deny.iter().map(|r| r.to_string()).collect(),
        }
    }

    fn yaml(text: &str) -> Result<Option<RequestNetwork>, String> {
        let value: Value = serde_norway::from_str(text).unwrap();
        from_value(&value, "environment.network")
    }

    #[test]
    fn every_written_shape_reads_as_the_protocols() {
        assert_eq!(yaml("none"), Ok(Some(RequestNetwork::None {})));
        assert_eq!(yaml("host"), Ok(Some(RequestNetwork::Host {})));
        assert_eq!(yaml("{mode: none}"), Ok(Some(RequestNetwork::None {})));
        assert_eq!(yaml("{mode: host}"), Ok(Some(RequestNetwork::Host {})));
        assert_eq!(yaml("null"), Ok(None));
        assert_eq!(
            yaml("mode: policy\nallow: [pypi.org:443, '*.github.com']\ndeny: [evil.pypi.org]\n"),
            Ok(Some(policy_of(
                &["pypi.org:443", "*.github.com"],
                &["evil.pypi.org"]
            )))
        );
        assert_eq!(
            yaml("{mode: policy, allow: ['10.0.0.0/8:5432']}"),
            Ok(Some(policy_of(&["10.0.0.0/8:5432"], &[])))
        );
    }

    #[test]
    fn a_bad_shape_is_refused_naming_what_is_wrong() {
        for (text, says) in [
            ("open", "unknown mode \"open\""),
            ("policy", "mode policy needs its allow rules"),
            ("{mode: policy}", "allows nothing"),
            ("{mode: policy, allow: []}", "allows nothing"),
            ("{allow: [pypi.org]}", "no mode"),
            ("{mode: policy, alow: [pypi.org]}", "unknown key \"alow\""),
            (
                "{mode: none, allow: [pypi.org]}",
                "mode none takes no allow rules",
            ),
            (
                "{mode: policy, allow: pypi.org}",
                "allow must be a list of rules",
            ),
            (
                "{mode: policy, allow: [443]}",
                "allow holds 443, which is not a rule",
            ),
            ("{mode: policy, allow: ['']}", "allow holds an empty rule"),
            ("{mode: 1}", "mode must be a string"),
            ("[pypi.org]", "expected a mode or a map"),
            ("true", "expected a mode or a map"),
        ] {
            let err = yaml(text).expect_err(text);
            assert!(err.starts_with("environment.network: "), "{text}: {err}");
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn flags_give_a_policy_none_or_nothing() {
        let flags = |allow: &[&str], deny: &[&str], no_net| NetworkArgs {
            allow_net: allow.iter().map(|r| r.to_string()).collect(),
            deny_net: deny.iter().map(|r| r.to_string()).collect(),
            no_net,
        };
        assert_eq!(flags(&[], &[], false).network().unwrap(), None);
        assert_eq!(
            flags(&[], &[], true).network().unwrap(),
            Some(RequestNetwork::None {})
        );
        assert_eq!(
            flags(&["pypi.org:443"], &["evil.pypi.org"], false)
                .network()
                .unwrap(),
            Some(policy_of(&["pypi.org:443"], &["evil.pypi.org"]))
        );
        let err = flags(&[], &["evil.pypi.org"], false).network().unwrap_err();
        assert!(
            err.to_string().contains("at least one --allow-net"),
            "{err}"
        );
        let err = flags(&[" "], &[], false).network().unwrap_err();
        assert!(err.to_string().contains("empty rule"), "{err}");
        // Flags replace the config's network; without flags it stays.
        let mut slot = Some(RequestNetwork::Host {});
        flags(&["a.org"], &[], false).apply(&mut slot).unwrap();
        assert_eq!(slot, Some(policy_of(&["a.org"], &[])));
        flags(&[], &[], false).apply(&mut slot).unwrap();
        assert_eq!(slot, Some(policy_of(&["a.org"], &[])));
    }

    #[test]
    fn the_config_key_reads_and_writes_the_protocols_shape() {
        let config: crate::config::Config = serde_json::from_value(json!({
            "environment": {"network": {"mode": "policy", "allow": ["pypi.org:443"]}}
        }))
        .unwrap();
        assert_eq!(
            config.environment.network,
            Some(policy_of(&["pypi.org:443"], &[]))
        );
        // The trajectory records it as a request carries it.
        let written = serde_json::to_value(&config.environment).unwrap();
        assert_eq!(
            written["network"],
            json!({"mode": "policy", "allow": ["pypi.org:443"]})
        );
        let config: crate::config::Config =
            serde_json::from_value(json!({"environment": {"network": "none"}})).unwrap();
        assert_eq!(config.environment.network, Some(RequestNetwork::None {}));
        let config: crate::config::Config = serde_json::from_value(json!({})).unwrap();
        assert_eq!(config.environment.network, None);
        assert!(serde_json::to_value(&config.environment)
            .unwrap()
            .get("network")
            .is_none());
        let err = serde_json::from_value::<crate::config::Config>(
            json!({"environment": {"network": {"mode": "policy"}}}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("environment.network: "), "{err}");
    }
}
