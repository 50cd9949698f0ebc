//! Validation of exec requests: every field is checked against the daemon's limits before
//! anything is spawned, so a bad request costs a reply and nothing else.

use std::path::PathBuf;
use std::time::Duration;

use protocol::{ExecRequest, Limits};

use sandbox::network::{Mode, RuleError};
use sandbox::plan::CommandSpec;

/// Longest accepted `cwd`, as Linux's PATH_MAX.
const MAX_CWD_BYTES: usize = 4096;

/// A request whose fields are all within bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub id: String,
    pub spec: CommandSpec,
    pub timeout: Duration,
    /// Profile asked for, if any; resolved against the allowed profiles by the engine.
    pub profile: Option<String>,
    pub stream: bool,
    /// Keep a sandbox like this one ready for the client's next command.
    pub warm: bool,
    /// The network the request asks for, parsed; `None`: the client's.
    pub network: Option<Mode>,
    /// The client's network ceiling (its clients-file entry, `executor run --allow-net`);
    /// `host` (no filter of its own) unless the caller sets it.
    pub client_network: Mode,
    /// Who asks, for the network decision log: the client's name and its session (empty
    /// unless the caller sets them).
    pub client: String,
    pub session: String,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("id must be 1 to {max} bytes of printable characters")]
    Id { max: usize },
    #[error("command is {len} bytes; the limit is {max}")]
    CommandTooLong { len: usize, max: usize },
    #[error("command contains a NUL byte, which no process argument can hold")]
    CommandNul,
    #[error("cwd must be an absolute path of at most {MAX_CWD_BYTES} bytes without NUL: {0:?}")]
    Cwd(String),
    #[error("env has {count} entries; the limit is {max}")]
    EnvCount { count: usize, max: usize },
    #[error("env holds {len} bytes; the limit is {max}")]
    EnvTooLarge { len: usize, max: usize },
    #[error("env name {0:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)")]
    EnvName(String),
    #[error("env value of {0} contains a NUL byte")]
    EnvValueNul(String),
    #[error("timeout must be a number of seconds greater than 0 and at most {max}, got {got}")]
    Timeout { got: f64, max: f64 },
    #[error("network: {0}")]
    Network(#[from] RuleError),
    #[error("network: a policy with no allow rule allows nothing; write {{\"mode\": \"none\"}}")]
    EmptyPolicy,
}

/// Check `req` against `limits`.
pub fn validate(req: ExecRequest, limits: &Limits) -> Result<ValidRequest, RequestError> {
    if req.id.is_empty()
        || req.id.len() > limits.max_id_bytes
        || req.id.chars().any(char::is_control)
    {
        return Err(RequestError::Id {
            max: limits.max_id_bytes,
        });
    }
    if req.command.len() > limits.max_command_bytes {
        return Err(RequestError::CommandTooLong {
            len: req.command.len(),
            max: limits.max_command_bytes,
        });
    }
    if req.command.contains('\0') {
        return Err(RequestError::CommandNul);
    }
    let cwd = match req.cwd {
        None => None,
        Some(cwd) if cwd.starts_with('/') && cwd.len() <= MAX_CWD_BYTES && !cwd.contains('\0') => {
            Some(PathBuf::from(cwd))
        }
        Some(cwd) => return Err(RequestError::Cwd(cwd)),
    };
    if req.env.len() > limits.max_env_entries {
        return Err(RequestError::EnvCount {
            count: req.env.len(),
            max: limits.max_env_entries,
        });
    }
    let env_bytes: usize = req.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if env_bytes > limits.max_env_bytes {
        return Err(RequestError::EnvTooLarge {
            len: env_bytes,
            max: limits.max_env_bytes,
        });
    }
    for (name, value) in &req.env {
        if !is_env_name(name) {
            return Err(RequestError::EnvName(name.clone()));
        }
        if value.contains('\0') {
            return Err(RequestError::EnvValueNul(name.clone()));
        }
    }
    let seconds = req.timeout.unwrap_or(limits.default_timeout);
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= limits.max_timeout) {
        return Err(RequestError::Timeout {
            got: seconds,
            max: limits.max_timeout,
        });
    }
    let network = req
        .network
        .as_ref()
        .map(crate::network_policy::parse)
        .transpose()?;
    if matches!(&network, Some(Mode::Policy(p)) if p.allow.is_empty()) {
        return Err(RequestError::EmptyPolicy);
    }
    Ok(ValidRequest {
        id: req.id,
        spec: CommandSpec {
            command: req.command,
            cwd,
            env: req.env,
            ..CommandSpec::default()
        },
        timeout: Duration::from_secs_f64(seconds),
        profile: req.profile,
        stream: req.stream,
        warm: true,
        network,
        client_network: Mode::Host,
        client: String::new(),
        session: String::new(),
    })
}

fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn limits() -> Limits {
        crate::engine::default_limits()
    }

    fn req(command: &str) -> ExecRequest {
        ExecRequest {
            id: "c1".into(),
            command: command.into(),
            cwd: None,
            env: BTreeMap::new(),
            timeout: None,
            profile: None,
            stream: false,
            network: None,
        }
    }

    #[test]
    fn defaults_fill_in_timeout_and_keep_fields() {
        let mut r = req("echo hi");
        r.cwd = Some("/tmp".into());
        r.env.insert("K".into(), "V".into());
        let valid = validate(r, &limits()).unwrap();
        assert_eq!(
            valid,
            ValidRequest {
                id: "c1".into(),
                spec: CommandSpec {
                    command: "echo hi".into(),
                    cwd: Some("/tmp".into()),
                    env: BTreeMap::from([("K".to_string(), "V".to_string())]),
                    ..Default::default()
                },
                timeout: Duration::from_secs_f64(limits().default_timeout),
                profile: None,
                stream: false,
                warm: true,
                network: None,
                client_network: Mode::Host,
                client: String::new(),
                session: String::new(),
            }
        );
    }

    #[test]
    fn fractional_timeout_is_accepted_and_out_of_range_ones_are_not() {
        let mut r = req("true");
        r.timeout = Some(0.25);
        assert_eq!(
            validate(r.clone(), &limits()).unwrap().timeout,
            Duration::from_millis(250)
        );
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            limits().max_timeout + 1.0,
        ] {
            r.timeout = Some(bad);
            assert!(matches!(
                validate(r.clone(), &limits()),
                Err(RequestError::Timeout { .. })
            ));
        }
    }

    #[test]
    fn oversized_and_malformed_fields_are_refused() {
        let l = limits();
        let long = "x".repeat(l.max_command_bytes + 1);
        assert!(matches!(
            validate(req(&long), &l),
            Err(RequestError::CommandTooLong { .. })
        ));
        assert_eq!(validate(req("a\0b"), &l), Err(RequestError::CommandNul));
        let mut r = req("true");
        r.cwd = Some("relative/dir".into());
        assert!(matches!(validate(r, &l), Err(RequestError::Cwd(_))));
        let mut r = req("true");
        r.env.insert("BAD=NAME".into(), "v".into());
        assert!(matches!(validate(r, &l), Err(RequestError::EnvName(_))));
        let mut r = req("true");
        r.id = String::new();
        assert!(matches!(validate(r, &l), Err(RequestError::Id { .. })));
        let mut r = req("true");
        r.id = "a\nb".into();
        assert!(matches!(validate(r, &l), Err(RequestError::Id { .. })));
        let mut r = req("true");
        r.env = (0..=l.max_env_entries)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(matches!(
            validate(r, &l),
            Err(RequestError::EnvCount { .. })
        ));
    }

    #[test]
    fn env_names_follow_posix() {
        assert!(is_env_name("_A1"));
        assert!(is_env_name("path"));
        assert!(!is_env_name("1A"));
        assert!(!is_env_name(""));
        assert!(!is_env_name("A-B"));
    }

    #[test]
    fn a_network_is_parsed_and_a_bad_rule_or_an_empty_policy_refused() {
        use protocol::RequestNetwork;
        let mut r = req("true");
        r.network = Some(RequestNetwork::Policy {
            allow: vec!["pypi.org:443".into()],
            deny: vec!["evil.pypi.org".into()],
        });
        let Some(Mode::Policy(policy)) = validate(r.clone(), &limits()).unwrap().network else {
            panic!("no policy");
        };
        assert_eq!(policy.allow[0].to_string(), "pypi.org:443");
        r.network = Some(RequestNetwork::Policy {
            allow: vec!["pypi.org:443".into(), "*.org".into()],
            deny: Vec::new(),
        });
        let err = validate(r.clone(), &limits()).unwrap_err().to_string();
        assert!(err.starts_with("network: rule \"*.org\""), "{err}");
        r.network = Some(RequestNetwork::Policy {
            allow: Vec::new(),
            deny: Vec::new(),
        });
        assert_eq!(validate(r, &limits()), Err(RequestError::EmptyPolicy));
    }
}
