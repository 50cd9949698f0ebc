//! Rules as a user writes them, and the host a connection asks for.
//!
//! A rule is one string:
//! - `pypi.org`: that name exactly;
//! - `*.example.org`: every name beneath `example.org` (`a.example.org`, `a.b.example.org`),
//!   but not `example.org` itself: write both to allow both. A wildcard stands for whole
//!   leading labels only, and needs at least two labels after it (`*.org` is refused);
//! - `10.0.0.0/8`, `10.1.2.3`, `2001:db8::/32`, `::1`: an IPv4 or IPv6 network, or one
//!   address. Host bits must be clear (`10.0.0.1/8` is refused, with the network meant);
//! - any of them with `:PORT` or `:LOW-HIGH` (an IPv6 network in brackets then:
//!   `[2001:db8::/32]:443`); without one, every port.
//!
//! A bare `*` (or `0.0.0.0/0` spelled as a name) is refused: a policy lists what it allows.
//! `0.0.0.0/0` and `::/0` are accepted and mean every public address by IP (special addresses
//! still need a rule of their own, see [`super::policy`]). Names are compared in lower case
//! without a trailing dot; internationalized names are written in their ASCII (`xn--`) form.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::address::{embeds_ipv4, Cidr, CidrError};

/// Why a rule or a host did not parse. Each message names the text it refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("empty rule")]
    Empty,
    #[error("rule {0:?}: a bare `*` would allow every host; list the hosts instead")]
    Everything(String),
    #[error("rule {rule:?}: {problem}")]
    Name { rule: String, problem: String },
    #[error("rule {rule:?}: {source}")]
    Cidr {
        rule: String,
        #[source]
        source: CidrError,
    },
    #[error("rule {rule:?}: {what} IPv6 addresses carry an IPv4 address; write the IPv4 network")]
    EmbeddedIpv4 { rule: String, what: &'static str },
    #[error("rule {rule:?}: port {ports:?} is not a port (1-65535) or a range LOW-HIGH")]
    Port { rule: String, ports: String },
    #[error("host {host:?}: {problem}")]
    Host { host: String, problem: String },
}

/// Ports a rule covers: one port or an inclusive range, never 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortRange {
    pub low: u16,
    pub high: u16,
}

impl PortRange {
    pub const ALL: PortRange = PortRange {
        low: 1,
        high: u16::MAX,
    };

    pub fn contains(&self, port: u16) -> bool {
        (self.low..=self.high).contains(&port)
    }

    fn parse(text: &str) -> Option<Self> {
        let port = |t: &str| {
            t.parse::<u16>()
                .ok()
                .filter(|p| *p != 0 && p.to_string() == t)
        };
        let (low, high) = match text.split_once('-') {
            Some((l, h)) => (port(l)?, port(h)?),
            None => (port(text)?, port(text)?),
        };
        (low <= high).then_some(Self { low, high })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.low == self.high {
            write!(f, "{}", self.low)
        } else {
            write!(f, "{}-{}", self.low, self.high)
        }
    }
}

/// What a rule names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RuleTarget {
    /// One name, normalized.
    Exact(String),
    /// Names strictly beneath this suffix (stored without the `*.`).
    Subdomains(String),
    /// A network or one address (never in IPv4-embedding IPv6 space).
    Cidr(Cidr),
}

/// One rule: a target and the ports it covers (`None`: every port).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rule {
    pub target: RuleTarget,
    pub ports: Option<PortRange>,
}

impl Rule {
    /// Whether the rule covers `port`.
    pub fn covers_port(&self, port: u16) -> bool {
        self.ports.unwrap_or(PortRange::ALL).contains(port)
    }

    /// Whether the rule covers the name (a normalized one, see [`Host`]) and port.
    pub fn matches_name(&self, name: &str, port: u16) -> bool {
        let named = match &self.target {
            RuleTarget::Exact(exact) => exact == name,
            RuleTarget::Subdomains(suffix) => name
                .strip_suffix(suffix.as_str())
                .and_then(|head| head.strip_suffix('.'))
                .is_some_and(|head| !head.is_empty()),
            RuleTarget::Cidr(_) => false,
        };
        named && self.covers_port(port)
    }

    /// Whether the rule covers the address (canonical, see [`super::address::canonical`])
    /// and port.
    pub fn matches_addr(&self, ip: IpAddr, port: u16) -> bool {
        matches!(&self.target, RuleTarget::Cidr(c) if c.contains(ip)) && self.covers_port(port)
    }

    pub fn cidr(&self) -> Option<&Cidr> {
        match &self.target {
            RuleTarget::Cidr(c) => Some(c),
            _ => None,
        }
    }
}

impl FromStr for Rule {
    type Err = RuleError;

    fn from_str(rule: &str) -> Result<Self, RuleError> {
        let text = rule.trim();
        if text.is_empty() {
            return Err(RuleError::Empty);
        }
        let ports_of = |ports: &str| {
            PortRange::parse(ports).ok_or_else(|| RuleError::Port {
                rule: rule.to_string(),
                ports: ports.to_string(),
            })
        };
        // `[v6net]:ports`, `[v6net]`, an unbracketed IPv6 network (two colons or more, no
        // port), or `target:ports` / `target` for names and IPv4.
        let (target, ports) = if let Some(rest) = text.strip_prefix('[') {
            let (inside, after) = rest.split_once(']').ok_or_else(|| RuleError::Name {
                rule: rule.to_string(),
                problem: "`[` without its `]`".to_string(),
            })?;
            let ports = match after {
                "" => None,
                _ => match after.strip_prefix(':') {
                    Some(p) => Some(ports_of(p)?),
                    None => {
                        return Err(RuleError::Name {
                            rule: rule.to_string(),
                            problem: format!("unexpected {after:?} after `]`"),
                        })
                    }
                },
            };
            if !inside.contains(':') {
                return Err(RuleError::Name {
                    rule: rule.to_string(),
                    problem: "brackets are for IPv6 addresses".to_string(),
                });
            }
            (inside, ports)
        } else if text.matches(':').count() >= 2 {
            (text, None)
        } else {
            match text.split_once(':') {
                Some((target, ports)) => (target, Some(ports_of(ports)?)),
                None => (text, None),
            }
        };
        let target =
            if target.contains(':') || target.contains('/') || target.parse::<IpAddr>().is_ok() {
                let cidr = Cidr::parse(target).map_err(|source| RuleError::Cidr {
                    rule: rule.to_string(),
                    source,
                })?;
                if let Some(what) = embeds_ipv4(&cidr) {
                    return Err(RuleError::EmbeddedIpv4 {
                        rule: rule.to_string(),
                        what,
                    });
                }
                RuleTarget::Cidr(cidr)
            } else if target == "*" {
                return Err(RuleError::Everything(rule.to_string()));
            } else if let Some(suffix) = target.strip_prefix("*.") {
                let name = normalize_name(suffix).map_err(|problem| RuleError::Name {
                    rule: rule.to_string(),
                    problem,
                })?;
                if !name.contains('.') {
                    return Err(RuleError::Name {
                        rule: rule.to_string(),
                        problem: format!(
                        "`*.{name}` would allow a whole top-level domain; name a domain beneath it"
                    ),
                    });
                }
                RuleTarget::Subdomains(name)
            } else {
                let name = normalize_name(target).map_err(|problem| RuleError::Name {
                    rule: rule.to_string(),
                    problem,
                })?;
                RuleTarget::Exact(name)
            };
        Ok(Rule { target, ports })
    }
}

impl TryFrom<String> for Rule {
    type Error = RuleError;

    fn try_from(text: String) -> Result<Self, RuleError> {
        text.parse()
    }
}

impl From<Rule> for String {
    fn from(rule: Rule) -> String {
        rule.to_string()
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bracket = matches!(&self.target, RuleTarget::Cidr(c) if c.addr().is_ipv6())
            && self.ports.is_some();
        let target = match &self.target {
            RuleTarget::Exact(name) => name.clone(),
            RuleTarget::Subdomains(suffix) => format!("*.{suffix}"),
            RuleTarget::Cidr(c) if c.is_single() => c.addr().to_string(),
            RuleTarget::Cidr(c) => c.to_string(),
        };
        match (bracket, self.ports) {
            (true, Some(p)) => write!(f, "[{target}]:{p}"),
            (false, Some(p)) => write!(f, "{target}:{p}"),
            (_, None) => write!(f, "{target}"),
        }
    }
}

/// The host a connection asks for: a name (normalized) or an IP address literal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    Name(String),
    Ip(IpAddr),
}

impl Host {
    /// `pypi.org`, `PyPI.org.` (normalized to `pypi.org`), `10.0.0.1`, `::1` or `[::1]`.
    /// Names that only look like addresses (`2130706433`, `0x7f.1`: forms some resolvers turn
    /// into 127.0.0.1) are refused, as are names that are not host names at all.
    pub fn parse(text: &str) -> Result<Self, RuleError> {
        let bare = text
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or(text);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(Self::Ip(ip));
        }
        normalize_name(text)
            .map(Self::Name)
            .map_err(|problem| RuleError::Host {
                host: text.to_string(),
                problem,
            })
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(name) => write!(f, "{name}"),
            Self::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// A host name in lower case without its trailing dot, or why it is not one (RFC 1123 labels;
/// `_` allowed, as some service names use it).
fn normalize_name(text: &str) -> Result<String, String> {
    if !text.is_ascii() {
        return Err("write internationalized names in their ASCII (xn--) form".to_string());
    }
    let name = text.strip_suffix('.').unwrap_or(text).to_ascii_lowercase();
    if name.is_empty() || name.len() > 253 {
        return Err("a host name has 1 to 253 characters".to_string());
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!("label {label:?}: a label has 1 to 63 characters"));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            let problem = if c == '*' {
                "`*` may only be a whole first label: `*.example.org`".to_string()
            } else {
                format!("{c:?} is not allowed in a host name")
            };
            return Err(problem);
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("label {label:?} starts or ends with `-`"));
        }
    }
    let last = name.rsplit('.').next().unwrap_or_default();
    if last.chars().all(|c| c.is_ascii_digit()) || last.starts_with("0x") {
        return Err("looks like an IP address but is not one".to_string());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(text: &str) -> Rule {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn refused(text: &str) -> String {
        match text.parse::<Rule>() {
            Ok(r) => panic!("{text} parsed as {r:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_rule_form_parses_and_prints_back() {
        for (text, printed) in [
            ("pypi.org", "pypi.org"),
            ("PyPI.org.", "pypi.org"),
            ("pypi.org:443", "pypi.org:443"),
            ("*.example.org", "*.example.org"),
            ("*.example.org:8000-8100", "*.example.org:8000-8100"),
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("10.0.0.0/8:80-90", "10.0.0.0/8:80-90"),
            ("10.1.2.3:22", "10.1.2.3:22"),
            ("0.0.0.0/0:443", "0.0.0.0/0:443"),
            ("2001:db8::/32", "2001:db8::/32"),
            ("[2001:db8::/32]:443", "[2001:db8::/32]:443"),
            ("[2001:db8::/32]", "2001:db8::/32"),
            ("::1", "::1"),
            ("[::1]:8080", "[::1]:8080"),
            ("  git.example.org  ", "git.example.org"),
        ] {
            let parsed = rule(text);
            assert_eq!(parsed.to_string(), printed, "{text}");
            assert_eq!(rule(printed), parsed, "{printed} reads back");
        }
        assert_eq!(rule("pypi.org").ports, None);
        assert_eq!(
            rule("a.b:80-90").ports,
            Some(PortRange { low: 80, high: 90 })
        );
    }

    #[test]
    fn bad_rules_are_refused_with_the_reason() {
        for (text, says) in [
            ("", "empty"),
            ("*", "bare `*`"),
            ("*:443", "bare `*`"),
            ("*.org", "top-level domain"),
            ("a.*.org", "whole first label"),
            ("*example.org", "whole first label"),
            ("pypi.org:0", "port \"0\""),
            ("pypi.org:65536", "port \"65536\""),
            ("pypi.org:90-80", "port \"90-80\""),
            ("pypi.org:https", "port \"https\""),
            ("pypi.org:", "port \"\""),
            ("pypi.org:080", "port \"080\""),
            ("10.0.0.1/8", "did you mean 10.0.0.0/8"),
            ("10.0.0.0/33", "prefix length"),
            ("10.0.0/8", "not an IP address"),
            ("[10.0.0.0/8]:80", "brackets are for IPv6"),
            ("[2001:db8::/32", "without its `]`"),
            ("[2001:db8::/32]443", "after `]`"),
            ("::ffff:10.0.0.0/104", "IPv4-mapped"),
            ("[::ffff:127.0.0.1]:80", "IPv4-mapped"),
            ("64:ff9b::/96", "NAT64"),
            ("bad_label-.org", "starts or ends with `-`"),
            ("ex ample.org", "not allowed"),
            ("a..b", "1 to 63"),
            ("bücher.de", "xn--"),
            ("2130706433", "looks like an IP"),
            ("0x7f.1", "looks like an IP"),
        ] {
            let err = refused(text);
            assert!(err.contains(says), "{text:?}: {err}");
        }
    }

    #[test]
    fn an_exact_rule_matches_its_name_only_and_a_wildcard_only_names_beneath_it() {
        let exact = rule("pypi.org");
        assert!(exact.matches_name("pypi.org", 443));
        assert!(!exact.matches_name("files.pypi.org", 443));
        assert!(!exact.matches_name("evilpypi.org", 443));
        let wild = rule("*.example.org");
        assert!(wild.matches_name("a.example.org", 80));
        assert!(wild.matches_name("a.b.example.org", 80));
        // Not the apex, and not a name that merely ends with the same letters.
        assert!(!wild.matches_name("example.org", 80));
        assert!(!wild.matches_name("badexample.org", 80));
        // A name rule never matches an address, and a CIDR rule never matches a name.
        assert!(!exact.matches_addr("1.2.3.4".parse().unwrap(), 443));
        assert!(!rule("0.0.0.0/0").matches_name("pypi.org", 443));
    }

    #[test]
    fn ports_scope_every_rule_form() {
        let r = rule("pypi.org:443");
        assert!(r.matches_name("pypi.org", 443));
        assert!(!r.matches_name("pypi.org", 80));
        let r = rule("*.example.org:8000-8100");
        assert!(r.matches_name("a.example.org", 8000));
        assert!(r.matches_name("a.example.org", 8100));
        assert!(!r.matches_name("a.example.org", 8101));
        let r = rule("10.0.0.0/8:80-90");
        assert!(r.matches_addr("10.9.9.9".parse().unwrap(), 85));
        assert!(!r.matches_addr("10.9.9.9".parse().unwrap(), 91));
        assert!(!r.matches_addr("11.0.0.1".parse().unwrap(), 85));
        let r = rule("[2001:db8::/32]:443");
        assert!(r.matches_addr("2001:db8::5".parse().unwrap(), 443));
        assert!(!r.matches_addr("2001:db8::5".parse().unwrap(), 80));
        assert!(!r.matches_addr("2001:db9::5".parse().unwrap(), 443));
        // No port: every port.
        assert!(rule("pypi.org").matches_name("pypi.org", 1));
        assert!(rule("pypi.org").matches_name("pypi.org", 65535));
    }

    #[test]
    fn hosts_are_names_or_addresses_and_look_alikes_are_refused() {
        assert_eq!(
            Host::parse("PyPI.org.").unwrap(),
            Host::Name("pypi.org".into())
        );
        assert_eq!(
            Host::parse("10.0.0.1").unwrap(),
            Host::Ip("10.0.0.1".parse().unwrap())
        );
        assert_eq!(
            Host::parse("[::1]").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        assert_eq!(
            Host::parse("::1").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        for bad in [
            "2130706433",
            "127.1",
            "0x7f.0.0.1",
            "a b",
            "",
            "evil.org/x",
            "*.org",
        ] {
            assert!(Host::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rules_round_trip_through_json() {
        let rules: Vec<Rule> =
            serde_json::from_str(r#"["pypi.org:443", "[2001:db8::/32]:443"]"#).unwrap();
        assert_eq!(
            serde_json::to_string(&rules).unwrap(),
            r#"["pypi.org:443","[2001:db8::/32]:443"]"#
        );
        let err = serde_json::from_str::<Vec<Rule>>(r#"["*"]"#).unwrap_err();
        assert!(err.to_string().contains("bare `*`"), "{err}");
    }
}
