//! Policies, how the layers that set one combine, and the decision on one connection.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::address::{canonical, special, SpecialRange};
use super::rules::{Host, Rule};

/// An allowlist with deny rules. A connection is allowed when an allow rule covers its target
/// and port, no deny rule covers it, and every address it resolved to may be reached (see
/// [`Policy::decide`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub allow: Vec<Rule>,
    #[serde(default)]
    pub deny: Vec<Rule>,
}

/// Where a layer of policy comes from, outermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// The command's profile (the operator's sandbox-profiles/*.json).
    Profile,
    /// The client's entry in the clients file.
    Client,
    /// The request that runs the command.
    Request,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Profile => "profile",
            Self::Client => "client",
            Self::Request => "request",
        })
    }
}

/// What one layer says about the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// No network at all.
    None,
    /// The host's network, unfiltered.
    Host,
    /// Only what the policy allows, through the daemon's proxy.
    Policy(Policy),
}

/// The network a command gets once every layer has had its say.
///
/// Layers combine by **conjunction**: a connection is allowed only when every layer that has
/// a policy allows it, `none` in any layer means no network, and `host` leaves the decision
/// to the other layers. So a request (or a client) can narrow what the profile grants but
/// never widen it. Conjunction was chosen over merging the layers into one rule list because
/// it is correct by construction: intersecting rule sets (wildcards against exact names,
/// overlapping port ranges, CIDRs of different lengths, deny rules of one layer against the
/// allow rules of another) would need a rule algebra whose every corner is a way to widen a
/// policy by mistake, while asking each layer in turn cannot allow more than any one of them,
/// and a denial names the layer and rule that made it, which the decision log reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effective {
    None,
    Host,
    /// Every layer with a policy, outermost first (never empty).
    Policy(Vec<(Layer, Policy)>),
}

/// Ask every layer in turn (conjunction): the first refusal, naming its layer; else the
/// innermost layer's allowing decision, the narrowest statement of why.
fn conjoin(layers: &[(Layer, Policy)], judge: impl Fn(&Policy) -> Decision) -> Decision {
    let mut last = None;
    for (layer, policy) in layers {
        let mut decision = judge(policy);
        decision.layer = Some(*layer);
        if !decision.allowed {
            return decision;
        }
        last = Some(decision);
    }
    last.unwrap_or_else(|| Decision::denied(None, None, Reason::NoNetwork))
}

impl Effective {
    /// Combine the layers (see [`Effective`] for how and why).
    pub fn combine<'a>(layers: impl IntoIterator<Item = (Layer, &'a Mode)>) -> Self {
        let mut policies = Vec::new();
        for (layer, mode) in layers {
            match mode {
                Mode::None => return Self::None,
                Mode::Host => {}
                Mode::Policy(policy) => policies.push((layer, policy.clone())),
            }
        }
        if policies.is_empty() {
            Self::Host
        } else {
            Self::Policy(policies)
        }
    }

    /// The decision on one connection (see [`Policy::decide`]); under `none` every connection
    /// is denied and under `host` every one is allowed (no layer filters).
    pub fn decide(
        &self,
        target: &Host,
        port: u16,
        resolved: &[IpAddr],
        own: &[SocketAddr],
    ) -> Decision {
        match self {
            Self::None => Decision::denied(None, None, Reason::NoNetwork),
            Self::Host => Decision {
                allowed: true,
                layer: None,
                rule: None,
                reason: Reason::HostNetwork,
            },
            Self::Policy(layers) => {
                conjoin(layers, |policy| policy.decide(target, port, resolved, own))
            }
        }
    }

    /// Whether `target` may be resolved at all: the decision on the name and port alone (for
    /// an address literal, the whole decision). A name no layer allows is never looked up, so
    /// a command cannot carry data out in the names it asks for. Allowed here is provisional:
    /// call [`Effective::decide`] with the addresses once resolved.
    pub fn decide_before_resolving(
        &self,
        target: &Host,
        port: u16,
        own: &[SocketAddr],
    ) -> Decision {
        match self {
            Self::Policy(layers) => conjoin(layers, |policy| policy.judge(target, port, None, own)),
            other => other.decide(target, port, &[], own),
        }
    }
}

/// Why a connection was allowed or denied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// An allow rule covers it and nothing refuses it.
    Allowed,
    /// The host's network: nothing filters.
    HostNetwork,
    /// The network mode is `none`.
    NoNetwork,
    /// No allow rule covers the target and port.
    NotAllowed,
    /// A deny rule covers the target, or one of its addresses.
    DeniedByRule,
    /// The name resolved to no address.
    NoAddress,
    /// It reaches a special address that no CIDR rule names.
    Special { addr: IpAddr, range: SpecialRange },
    /// It reaches one of the daemon's own listeners.
    OwnListener { addr: SocketAddr },
}

impl Reason {
    /// A short stable name for logs and counters.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::HostNetwork => "host_network",
            Self::NoNetwork => "no_network",
            Self::NotAllowed => "not_allowed",
            Self::DeniedByRule => "denied_by_rule",
            Self::NoAddress => "no_address",
            Self::Special { .. } => "special_address",
            Self::OwnListener { .. } => "own_listener",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Allowed => f.write_str("allowed by rule"),
            Self::HostNetwork => f.write_str("the host's network is not filtered"),
            Self::NoNetwork => f.write_str("the network is off (mode none)"),
            Self::NotAllowed => f.write_str("no allow rule covers this host and port"),
            Self::DeniedByRule => f.write_str("a deny rule covers it"),
            Self::NoAddress => f.write_str("the name resolved to no address"),
            Self::Special { addr, range } => write!(
                f,
                "{addr} is {range}, which only an allow rule naming it by CIDR reaches"
            ),
            Self::OwnListener { addr } => write!(
                f,
                "{addr} is the daemon's own listener, which only an allow rule naming that \
                 address and port reaches"
            ),
        }
    }
}

/// The decision on one connection attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The layer that decided (for a combined policy).
    pub layer: Option<Layer>,
    /// The rule that decided: the allow rule, the deny rule, or `None` when no rule did (no
    /// rule allows it, a special address or the daemon's listener).
    pub rule: Option<Rule>,
    pub reason: Reason,
}

impl Decision {
    fn denied(layer: Option<Layer>, rule: Option<Rule>, reason: Reason) -> Self {
        Self {
            allowed: false,
            layer,
            rule,
            reason,
        }
    }
}

impl Policy {
    /// The decision on a connection to `target`:`port`, which resolved to `resolved` (for an
    /// address literal, the address itself is judged whatever `resolved` holds). `own` are the
    /// daemon's own listeners (an unspecified address, `0.0.0.0:8080`, stands for that port on
    /// every address). In order:
    /// 1. a deny rule covering the name and port denies (deny wins);
    /// 2. an allow rule must cover the target: a name by a name rule, an address by a CIDR
    ///    rule (a CIDR rule never allows a name, whatever it resolves to);
    /// 3. every address (resolved, or the literal), judged in its canonical form (an
    ///    IPv4-mapped address as its IPv4), must pass: no deny CIDR rule covers it with the
    ///    port; if it is special (loopback, private, link-local and metadata, ...: see
    ///    [`special`]) an allow CIDR rule covering it with the port must lie wholly inside that
    ///    special range (`127.0.0.0/8` reaches loopback, `0.0.0.0/0` does not); if it is a
    ///    listener of the daemon, an allow rule must name exactly that address and port.
    ///    One address refused refuses the connection: a name that resolves into private space
    ///    is not dialed at its other addresses either.
    pub fn decide(
        &self,
        target: &Host,
        port: u16,
        resolved: &[IpAddr],
        own: &[SocketAddr],
    ) -> Decision {
        self.judge(target, port, Some(resolved), own)
    }

    /// [`Policy::decide`]; with `resolved` `None`, a name is judged by steps 1 and 2 only.
    fn judge(
        &self,
        target: &Host,
        port: u16,
        resolved: Option<&[IpAddr]>,
        own: &[SocketAddr],
    ) -> Decision {
        let literal;
        let (addrs, allowing) = match target {
            Host::Name(name) => {
                if let Some(rule) = self.deny.iter().find(|r| r.matches_name(name, port)) {
                    return Decision::denied(None, Some(rule.clone()), Reason::DeniedByRule);
                }
                let Some(rule) = self.allow.iter().find(|r| r.matches_name(name, port)) else {
                    return Decision::denied(None, None, Reason::NotAllowed);
                };
                let Some(resolved) = resolved else {
                    return Decision {
                        allowed: true,
                        layer: None,
                        rule: Some(rule.clone()),
                        reason: Reason::Allowed,
                    };
                };
                (resolved, rule)
            }
            Host::Ip(ip) => {
                literal = [*ip];
                let ip = canonical(*ip);
                if let Some(rule) = self.deny.iter().find(|r| r.matches_addr(ip, port)) {
                    return Decision::denied(None, Some(rule.clone()), Reason::DeniedByRule);
                }
                let Some(rule) = self.allow.iter().find(|r| r.matches_addr(ip, port)) else {
                    return Decision::denied(None, None, Reason::NotAllowed);
                };
                (&literal[..], rule)
            }
        };
        if addrs.is_empty() {
            return Decision::denied(None, None, Reason::NoAddress);
        }
        let mut deciding = allowing;
        for &addr in addrs {
            match self.refuse_address(addr, port, own) {
                Err(refusal) => return refusal,
                // An address literal that needed a rule naming it was decided by that rule.
                Ok(Some(naming)) if matches!(target, Host::Ip(_)) => deciding = naming,
                Ok(_) => {}
            }
        }
        Decision {
            allowed: true,
            layer: None,
            rule: Some(deciding.clone()),
            reason: Reason::Allowed,
        }
    }

    /// Why `addr`:`port` may not be dialed, if it may not (step 3 of [`Policy::decide`]);
    /// otherwise the rule that names it, when it needed one (a special address, a listener).
    fn refuse_address(
        &self,
        addr: IpAddr,
        port: u16,
        own: &[SocketAddr],
    ) -> Result<Option<&Rule>, Decision> {
        let ip = canonical(addr);
        if let Some(rule) = self.deny.iter().find(|r| r.matches_addr(ip, port)) {
            return Err(Decision::denied(
                None,
                Some(rule.clone()),
                Reason::DeniedByRule,
            ));
        }
        let mut naming = None;
        let listener = own
            .iter()
            .find(|l| l.port() == port && (l.ip().is_unspecified() || canonical(l.ip()) == ip));
        if listener.is_some() {
            naming = self.allow.iter().find(|r| {
                r.cidr().is_some_and(|c| c.is_single() && c.addr() == ip)
                    && r.ports.is_some_and(|p| p.low == port && p.high == port)
            });
            if naming.is_none() {
                let addr = SocketAddr::new(addr, port);
                return Err(Decision::denied(None, None, Reason::OwnListener { addr }));
            }
        }
        if let Some(range) = special(ip) {
            let covering = self.allow.iter().find(|r| {
                r.matches_addr(ip, port) && r.cidr().is_some_and(|c| range.cidr.covers(c))
            });
            if covering.is_none() {
                return Err(Decision::denied(
                    None,
                    None,
                    Reason::Special { addr, range },
                ));
            }
            naming = naming.or(covering);
        }
        Ok(naming)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy {
            allow: allow.iter().map(|r| r.parse().unwrap()).collect(),
            deny: deny.iter().map(|r| r.parse().unwrap()).collect(),
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn name(text: &str) -> Host {
        Host::parse(text).unwrap()
    }

    const PUBLIC: &str = "93.184.215.14";

    #[track_caller]
    fn check(p: &Policy, host: &str, port: u16, resolved: &[&str]) -> Decision {
        let resolved: Vec<IpAddr> = resolved.iter().map(|a| ip(a)).collect();
        p.decide(&name(host), port, &resolved, &[])
    }

    #[test]
    fn a_name_rule_allows_its_name_on_its_ports_and_nothing_else() {
        let p = policy(&["pypi.org:443", "*.pythonhosted.org"], &[]);
        let d = check(&p, "pypi.org", 443, &[PUBLIC]);
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.rule.unwrap().to_string(), "pypi.org:443");
        let d = check(&p, "pypi.org", 80, &[PUBLIC]);
        assert_eq!((d.allowed, d.reason), (false, Reason::NotAllowed));
        assert!(!check(&p, "evil.org", 443, &[PUBLIC]).allowed);
        assert!(check(&p, "files.pythonhosted.org", 443, &[PUBLIC]).allowed);
        assert!(!check(&p, "pythonhosted.org", 443, &[PUBLIC]).allowed);
    }

    #[test]
    fn deny_wins_over_allow_by_name_and_by_address() {
        let p = policy(&["*.example.org"], &["secret.example.org"]);
        let d = check(&p, "secret.example.org", 443, &[PUBLIC]);
        assert_eq!((d.allowed, d.reason), (false, Reason::DeniedByRule));
        assert_eq!(d.rule.unwrap().to_string(), "secret.example.org");
        assert!(check(&p, "www.example.org", 443, &[PUBLIC]).allowed);
        // A deny CIDR refuses an allowed name that resolves into it, on the ports it names.
        let p = policy(&["*.example.org"], &["93.184.0.0/16:443"]);
        let d = check(&p, "www.example.org", 443, &[PUBLIC]);
        assert_eq!((d.allowed, d.reason), (false, Reason::DeniedByRule));
        assert!(check(&p, "www.example.org", 80, &[PUBLIC]).allowed);
        // And an address literal inside an allowed network.
        let p = policy(&["93.184.0.0/16"], &[&format!("{PUBLIC}/32")]);
        let d = p.decide(&Host::Ip(ip(PUBLIC)), 443, &[], &[]);
        assert_eq!((d.allowed, d.reason), (false, Reason::DeniedByRule));
        assert!(p.decide(&Host::Ip(ip("93.184.0.1")), 443, &[], &[]).allowed);
    }

    #[test]
    fn an_address_literal_needs_a_cidr_rule_and_a_name_needs_a_name_rule() {
        let p = policy(&["pypi.org", "203.0.113.0/24:443"], &[]);
        let literal = |text: &str, port| p.decide(&Host::Ip(ip(text)), port, &[], &[]);
        assert!(literal("203.0.113.9", 443).allowed);
        assert!(!literal("203.0.113.9", 80).allowed);
        assert!(!literal("198.51.100.1", 443).allowed);
        // The name's address is in the CIDR rule, but the name is not allowed by name.
        assert!(!check(&p, "other.org", 443, &["203.0.113.9"]).allowed);
        // IPv6 literals likewise.
        let p = policy(&["[2001:db8::/32]:443"], &[]);
        assert!(
            p.decide(&Host::Ip(ip("2001:db8::1")), 443, &[], &[])
                .allowed
        );
        assert!(
            !p.decide(&Host::Ip(ip("2001:db9::1")), 443, &[], &[])
                .allowed
        );
    }

    #[test]
    fn a_name_that_resolves_nowhere_is_denied() {
        let p = policy(&["pypi.org"], &[]);
        let d = check(&p, "pypi.org", 443, &[]);
        assert_eq!((d.allowed, d.reason), (false, Reason::NoAddress));
    }

    /// Each special range: refused when an allowed name resolves there or when a broad CIDR
    /// covers it, reached by a CIDR rule inside it (the control).
    #[test]
    fn special_addresses_are_reached_only_by_a_cidr_rule_naming_them() {
        for (addr, rule) in [
            ("127.0.0.1", "127.0.0.0/8"),
            ("10.1.2.3", "10.0.0.0/8"),
            ("172.16.5.5", "172.16.0.0/12"),
            ("192.168.1.10", "192.168.1.0/24"),
            ("100.64.0.7", "100.64.0.0/10"),
            ("169.254.169.254", "169.254.169.254/32"),
            ("169.254.3.4", "169.254.0.0/16"),
            ("0.0.0.0", "0.0.0.0/8"),
            ("224.0.0.251", "224.0.0.0/4"),
            ("255.255.255.255", "255.255.255.255/32"),
            ("::1", "::1"),
            ("::", "::/128"),
            ("fd00:ec2::254", "fc00::/7"),
            ("fe80::1", "fe80::/10"),
            ("ff02::1", "ff00::/8"),
        ] {
            let by_name = policy(&["svc.example.org", "0.0.0.0/0", "::/0"], &[]);
            let d = check(&by_name, "svc.example.org", 80, &[addr]);
            assert!(!d.allowed, "{addr} by name: {d:?}");
            assert!(matches!(d.reason, Reason::Special { .. }), "{addr}: {d:?}");
            assert!(d.reason.to_string().contains(addr), "{}", d.reason);
            // A broad CIDR does not name it either.
            let d = by_name.decide(&Host::Ip(ip(addr)), 80, &[], &[]);
            assert!(!d.allowed, "{addr} by 0/0: {d:?}");
            // Control: a CIDR rule inside the special range reaches it, by name and literal.
            let named = policy(&["svc.example.org", rule], &[]);
            assert!(
                check(&named, "svc.example.org", 80, &[addr]).allowed,
                "{addr}"
            );
            assert!(
                named.decide(&Host::Ip(ip(addr)), 80, &[], &[]).allowed,
                "{addr}"
            );
            // ... on its ports only.
            let on_81 = if addr.contains(':') {
                format!("[{rule}]:81")
            } else {
                format!("{rule}:81")
            };
            let scoped = policy(&["svc.example.org", &on_81], &[]);
            assert!(
                !check(&scoped, "svc.example.org", 80, &[addr]).allowed,
                "{addr}"
            );
        }
        // The metadata address is a range of its own: a rule for the rest of link-local
        // space does not name it.
        let p = policy(&["169.254.0.0/16"], &[]);
        assert!(p.decide(&Host::Ip(ip("169.254.3.4")), 80, &[], &[]).allowed);
        assert!(
            !p.decide(&Host::Ip(ip("169.254.169.254")), 80, &[], &[])
                .allowed
        );
    }

    #[test]
    fn ipv4_mapped_and_embedded_addresses_are_judged_as_their_ipv4() {
        let p = policy(&["svc.example.org", "::/0"], &[]);
        for sneaky in [
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
            "::10.0.0.1",
        ] {
            let d = check(&p, "svc.example.org", 80, &[sneaky]);
            assert!(
                matches!(d.reason, Reason::Special { .. }),
                "{sneaky}: {d:?}"
            );
            assert!(
                !p.decide(&Host::Ip(ip(sneaky)), 80, &[], &[]).allowed,
                "{sneaky}"
            );
        }
        // Control: the IPv4 rule reaches the mapped form too, and a deny rule on the IPv4
        // network refuses the mapped form.
        let p = policy(&["svc.example.org", "127.0.0.0/8"], &[]);
        assert!(check(&p, "svc.example.org", 80, &["::ffff:127.0.0.1"]).allowed);
        assert!(
            p.decide(&Host::Ip(ip("::ffff:127.0.0.1")), 80, &[], &[])
                .allowed
        );
        let p = policy(&["svc.example.org"], &["93.184.0.0/16"]);
        let d = check(&p, "svc.example.org", 80, &["::ffff:93.184.215.14"]);
        assert_eq!(d.reason, Reason::DeniedByRule);
        assert!(check(&p, "svc.example.org", 80, &["::ffff:8.8.8.8"]).allowed);
    }

    #[test]
    fn one_refused_address_refuses_the_name() {
        let p = policy(&["svc.example.org"], &[]);
        let d = check(&p, "svc.example.org", 443, &[PUBLIC, "127.0.0.1"]);
        assert!(!d.allowed);
        assert!(check(&p, "svc.example.org", 443, &[PUBLIC, "2606:4700::1"]).allowed);
    }

    #[test]
    fn the_daemons_listeners_are_reached_only_by_a_rule_naming_address_and_port() {
        let own: Vec<SocketAddr> = vec![
            "127.0.0.1:7000".parse().unwrap(),
            "0.0.0.0:7443".parse().unwrap(),
        ];
        let p = policy(&["svc.example.org", "127.0.0.0/8", "203.0.113.0/24"], &[]);
        for (host, port) in [
            ("127.0.0.1", 7000),
            ("127.0.0.2", 7443),
            ("203.0.113.5", 7443),
        ] {
            let d = p.decide(&Host::Ip(ip(host)), port, &[], &own);
            assert!(
                matches!(d.reason, Reason::OwnListener { .. }),
                "{host}:{port} {d:?}"
            );
        }
        let d = p.decide(&name("svc.example.org"), 7000, &[ip("127.0.0.1")], &own);
        assert!(matches!(d.reason, Reason::OwnListener { .. }), "{d:?}");
        // Controls: another port of the same address, and a rule naming the listener exactly.
        assert!(
            p.decide(&Host::Ip(ip("127.0.0.1")), 7001, &[], &own)
                .allowed
        );
        let exact = policy(&["127.0.0.0/8", "127.0.0.1:7000"], &[]);
        let d = exact.decide(&Host::Ip(ip("127.0.0.1")), 7000, &[], &own);
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.rule.unwrap().to_string(), "127.0.0.1:7000");
    }

    #[test]
    fn a_name_no_layer_allows_is_refused_before_it_is_resolved() {
        let profile = Mode::Policy(policy(&["*.example.org"], &[]));
        let request = Mode::Policy(policy(&["a.example.org"], &[]));
        let eff = Effective::combine([(Layer::Profile, &profile), (Layer::Request, &request)]);
        let d = eff.decide_before_resolving(&name("b.example.org"), 443, &[]);
        assert_eq!((d.allowed, d.layer), (false, Some(Layer::Request)));
        // Control: the allowed name may be looked up; its addresses are judged after.
        let d = eff.decide_before_resolving(&name("a.example.org"), 443, &[]);
        assert!(d.allowed, "{d:?}");
        let d = eff.decide(&name("a.example.org"), 443, &[ip("127.0.0.1")], &[]);
        assert!(matches!(d.reason, Reason::Special { .. }), "{d:?}");
        // An address literal is decided whole.
        let d = eff.decide_before_resolving(&Host::Ip(ip("127.0.0.1")), 443, &[]);
        assert_eq!(d.reason, Reason::NotAllowed);
        let none = Effective::None.decide_before_resolving(&name("a.example.org"), 443, &[]);
        assert_eq!(none.reason, Reason::NoNetwork);
    }

    #[test]
    fn layers_combine_by_conjunction_and_none_anywhere_is_none() {
        let profile = Mode::Policy(policy(&["*.example.org", "pypi.org"], &[]));
        let client = Mode::Policy(policy(&["*.example.org"], &["b.example.org"]));
        let request = Mode::Policy(policy(&["a.example.org", "b.example.org", "evil.org"], &[]));
        let eff = Effective::combine([
            (Layer::Profile, &profile),
            (Layer::Client, &client),
            (Layer::Request, &request),
        ]);
        let d = |host: &str| eff.decide(&name(host), 443, &[ip(PUBLIC)], &[]);
        let a = d("a.example.org");
        assert!(a.allowed, "{a:?}");
        assert_eq!(
            (a.layer, a.rule.unwrap().to_string()),
            (Some(Layer::Request), "a.example.org".into())
        );
        // The request cannot widen: evil.org is on its list only.
        let evil = d("evil.org");
        assert_eq!((evil.allowed, evil.layer), (false, Some(Layer::Profile)));
        // The client's deny holds against the request's allow.
        let b = d("b.example.org");
        assert_eq!(
            (b.allowed, b.layer, b.reason),
            (false, Some(Layer::Client), Reason::DeniedByRule)
        );
        // The request narrows: pypi.org is the profile's but not the request's.
        let pypi = d("pypi.org");
        assert_eq!((pypi.allowed, pypi.layer), (false, Some(Layer::Client)));
        // `host` leaves the decision to the others; `none` anywhere is none.
        let host = Effective::combine([(Layer::Profile, &Mode::Host), (Layer::Request, &request)]);
        assert!(
            host.decide(&name("evil.org"), 443, &[ip(PUBLIC)], &[])
                .allowed
        );
        assert!(
            !host
                .decide(&name("other.org"), 443, &[ip(PUBLIC)], &[])
                .allowed
        );
        assert_eq!(
            Effective::combine([(Layer::Profile, &Mode::Host)]),
            Effective::Host
        );
        for layers in [
            vec![(Layer::Profile, &Mode::None), (Layer::Request, &request)],
            vec![(Layer::Profile, &profile), (Layer::Client, &Mode::None)],
            vec![(Layer::Profile, &Mode::Host), (Layer::Request, &Mode::None)],
        ] {
            let eff = Effective::combine(layers);
            assert_eq!(eff, Effective::None);
            let d = eff.decide(&name("a.example.org"), 443, &[ip(PUBLIC)], &[]);
            assert_eq!((d.allowed, d.reason), (false, Reason::NoNetwork));
        }
    }
}
