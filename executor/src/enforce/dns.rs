//! The resolver inside a command's namespace. It never looks a name up: an `A` query for a
//! name the policy may allow (on some port, [`sandbox::network::Effective::decide_before_resolving`]) is
//! answered with a synthetic address of 127.1.0.0/16, the same one for the same name for as
//! long as the command runs; the capture listeners map that address back to the name, and the
//! egress engine resolves and judges it when the command connects. `AAAA` gets no record (so
//! programs fall back to `A`), a name the policy refuses `NXDOMAIN` (and a record in the
//! decision log), anything else `REFUSED`. The command's own host names, `localhost` and the
//! sandbox's host name ([`OWN_NAMES`]), are answered with 127.0.0.1 and judged by no policy:
//! programs look them up for themselves (git does on every clone) and connect to nothing
//! outside by them. Messages are parsed and built by `simple-dns`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sandbox::network::Host;
use simple_dns::rdata::{RData, A};
use simple_dns::{Packet, PacketFlag, ResourceRecord, CLASS, QTYPE, RCODE, TYPE};

use crate::egress::record::{DecisionRecord, DecisionSink};
use crate::egress::CommandContext;

/// Time to live of a synthetic answer: the mapping lasts as long as the command.
const TTL: u32 = 300;

/// Names that are the command's own host: `localhost`, and the host name its UTS namespace
/// gives it (`sandbox`, what `uname -n` says inside; `sandbox::plan`). Answered with
/// 127.0.0.1, the namespace's own loopback, where nothing of the outside listens.
pub const OWN_NAMES: [&str; 2] = ["localhost", "sandbox"];

/// Names and their synthetic addresses, for one command.
#[derive(Default)]
pub struct Synthetic {
    by_name: HashMap<String, Ipv4Addr>,
    by_addr: HashMap<Ipv4Addr, String>,
}

impl Synthetic {
    /// The address of `name`, allocated on first use (127.1.0.1 upward); `None` once the
    /// /16 is used up.
    pub fn address_of(&mut self, name: &str) -> Option<Ipv4Addr> {
        if let Some(addr) = self.by_name.get(name) {
            return Some(*addr);
        }
        let n = u32::try_from(self.by_name.len()).ok()? + 1;
        if n >= 0xffff {
            return None;
        }
        let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 1, 0, 0)) + n);
        self.by_name.insert(name.to_string(), addr);
        self.by_addr.insert(addr, name.to_string());
        Some(addr)
    }

    /// The name a synthetic address stands for.
    pub fn name_of(&self, addr: Ipv4Addr) -> Option<String> {
        self.by_addr.get(&addr).cloned()
    }
}

/// What the resolver needs of its command.
pub struct Resolver {
    pub ctx: Arc<CommandContext>,
    pub names: Arc<Mutex<Synthetic>>,
    /// Ports a name may be asked for (`super::candidate_ports`).
    pub ports: Vec<u16>,
    pub own: Vec<SocketAddr>,
    pub sink: Arc<dyn DecisionSink>,
}

impl Resolver {
    /// The answer to one query message, or `None` for one that does not parse (dropped).
    pub fn answer(&self, query: &[u8]) -> Option<Vec<u8>> {
        let query = Packet::parse(query).ok()?;
        if query.has_flags(PacketFlag::RESPONSE) {
            return None;
        }
        let mut reply = Packet::new_reply(query.id());
        reply.set_flags(PacketFlag::RECURSION_AVAILABLE);
        if query.has_flags(PacketFlag::RECURSION_DESIRED) {
            reply.set_flags(PacketFlag::RECURSION_DESIRED);
        }
        let Some(question) = query.questions.first() else {
            *reply.rcode_mut() = RCODE::FormatError;
            return reply.build_bytes_vec().ok();
        };
        reply.questions.push(question.clone());
        let name = question.qname.to_string();
        let bare = name.strip_suffix('.').unwrap_or(&name);
        if OWN_NAMES.iter().any(|own| own.eq_ignore_ascii_case(bare)) {
            match question.qtype {
                QTYPE::TYPE(TYPE::A) => reply.answers.push(ResourceRecord::new(
                    question.qname.clone(),
                    CLASS::IN,
                    TTL,
                    RData::A(A {
                        address: u32::from(Ipv4Addr::LOCALHOST),
                    }),
                )),
                // AAAA: no record (NOERROR, empty), as for every name: the A answer serves.
                QTYPE::TYPE(TYPE::AAAA) => {}
                _ => *reply.rcode_mut() = RCODE::Refused,
            }
            return reply.build_bytes_vec().ok();
        }
        let allowed = match question.qtype {
            QTYPE::TYPE(TYPE::A) | QTYPE::TYPE(TYPE::AAAA) => self.judge(&name),
            _ => {
                *reply.rcode_mut() = RCODE::Refused;
                return reply.build_bytes_vec().ok();
            }
        };
        match allowed {
            None => *reply.rcode_mut() = RCODE::NameError,
            Some(normalized) => {
                if question.qtype == QTYPE::TYPE(TYPE::A) {
                    let mut names = match self.names.lock() {
                        Ok(names) => names,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    match names.address_of(&normalized) {
                        Some(addr) => reply.answers.push(ResourceRecord::new(
                            question.qname.clone(),
                            CLASS::IN,
                            TTL,
                            RData::A(A {
                                address: u32::from(addr),
                            }),
                        )),
                        None => *reply.rcode_mut() = RCODE::ServerFailure,
                    }
                }
                // AAAA: no record (NOERROR, empty): programs use the A answer.
            }
        }
        reply.build_bytes_vec().ok()
    }

    /// The normalized name when the policy may allow it on some port; `None` (recorded as a
    /// denial) when it allows it on none, or it is no host name.
    fn judge(&self, name: &str) -> Option<String> {
        let started = Instant::now();
        let mut record = DecisionRecord {
            ts: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            client: self.ctx.client.clone(),
            session: self.ctx.session.clone(),
            command: self.ctx.command.clone(),
            kind: "dns",
            host: name.to_string(),
            port: 0,
            address: None,
            layer: None,
            rule: None,
            allowed: false,
            code: "bad_host",
            reason: String::new(),
            error: None,
            bytes_up: 0,
            bytes_down: 0,
            duration_ms: 0.0,
        };
        let host = match Host::parse(name) {
            Ok(host @ Host::Name(_)) => host,
            Ok(Host::Ip(_)) => {
                record.reason = "an address literal is not a name to look up".into();
                self.sink.record(&record);
                return None;
            }
            Err(err) => {
                record.reason = err.to_string();
                self.sink.record(&record);
                return None;
            }
        };
        record.host = host.to_string();
        let mut decision = None;
        for port in &self.ports {
            let d = self
                .ctx
                .policy
                .decide_before_resolving(&host, *port, &self.own);
            let allowed = d.allowed;
            if decision.is_none() || allowed {
                record.port = *port;
                decision = Some(d);
            }
            if allowed {
                break;
            }
        }
        if let Some(d) = &decision {
            record.allowed = d.allowed;
            record.layer = d.layer;
            record.rule = d.rule.as_ref().map(ToString::to_string);
            record.code = d.reason.code();
            record.reason = d.reason.to_string();
        } else {
            record.code = "not_allowed";
            record.reason = "no allow rule names a port".into();
        }
        record.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        self.sink.record(&record);
        record.allowed.then(|| host.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::record::DecisionRecord;
    use sandbox::network::{Effective, Layer, Mode, Policy};
    use simple_dns::{Name, Question, QCLASS};

    #[derive(Default)]
    struct Kept(Mutex<Vec<DecisionRecord>>);
    impl DecisionSink for Kept {
        fn record(&self, record: &DecisionRecord) {
            self.0.lock().unwrap().push(record.clone());
        }
    }

    fn resolver(sink: Arc<Kept>) -> Resolver {
        let mode = Mode::Policy(Policy {
            allow: vec!["pypi.org:443".parse().unwrap()],
            deny: vec![],
        });
        let policy = Arc::new(Effective::combine([(Layer::Profile, &mode)]));
        Resolver {
            ctx: Arc::new(CommandContext {
                client: "c".into(),
                session: "s".into(),
                command: "x".into(),
                policy: policy.clone(),
            }),
            names: Arc::default(),
            ports: super::super::candidate_ports(&policy),
            own: vec![],
            sink,
        }
    }

    fn ask(resolver: &Resolver, name: &str, qtype: TYPE) -> Vec<u8> {
        let mut query = Packet::new_query(7);
        query.set_flags(PacketFlag::RECURSION_DESIRED);
        query.questions.push(Question::new(
            Name::new_unchecked(name),
            QTYPE::TYPE(qtype),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        let bytes = query.build_bytes_vec().unwrap();
        resolver.answer(&bytes).unwrap()
    }

    #[test]
    fn an_allowed_name_gets_a_stable_synthetic_address_and_others_nothing() {
        let sink = Arc::new(Kept::default());
        let resolver = resolver(sink.clone());
        let reply_bytes = ask(&resolver, "PyPI.org", TYPE::A);
        let reply = Packet::parse(&reply_bytes).unwrap();
        assert_eq!(reply.id(), 7);
        assert_eq!(reply.rcode(), RCODE::NoError);
        let RData::A(a) = &reply.answers[0].rdata else {
            panic!("{reply:?}")
        };
        let addr = Ipv4Addr::from(a.address);
        assert_eq!(addr, Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(
            resolver.names.lock().unwrap().name_of(addr).as_deref(),
            Some("pypi.org")
        );
        // The same name, the same address.
        let again_bytes = ask(&resolver, "pypi.org", TYPE::A);
        let again = Packet::parse(&again_bytes).unwrap();
        assert_eq!(again.answers[0].rdata, reply.answers[0].rdata);
        // AAAA: no record, no error.
        let v6_bytes = ask(&resolver, "pypi.org", TYPE::AAAA);
        let v6 = Packet::parse(&v6_bytes).unwrap();
        assert_eq!(v6.rcode(), RCODE::NoError);
        assert!(v6.answers.is_empty());
        // Another name: NXDOMAIN, recorded.
        let other_bytes = ask(&resolver, "evil.example", TYPE::A);
        let other = Packet::parse(&other_bytes).unwrap();
        assert_eq!(other.rcode(), RCODE::NameError);
        assert!(other.answers.is_empty());
        let kept = sink.0.lock().unwrap();
        let denied: Vec<_> = kept.iter().filter(|r| !r.allowed).collect();
        assert_eq!(denied.len(), 1);
        assert_eq!(denied[0].host, "evil.example");
        assert_eq!(denied[0].kind, "dns");
        assert_eq!(denied[0].code, "not_allowed");
        drop(kept);
        // Other types are refused.
        let mx_bytes = ask(&resolver, "pypi.org", TYPE::MX);
        let mx = Packet::parse(&mx_bytes).unwrap();
        assert_eq!(mx.rcode(), RCODE::Refused);
    }

    #[test]
    fn the_commands_own_host_names_get_loopback_unjudged_beside_a_name_refused() {
        let sink = Arc::new(Kept::default());
        let resolver = resolver(sink.clone());
        for name in ["localhost", "sandbox", "Sandbox.", "LOCALHOST"] {
            let bytes = ask(&resolver, name, TYPE::A);
            let reply = Packet::parse(&bytes).unwrap();
            assert_eq!(reply.rcode(), RCODE::NoError, "{name}");
            assert_eq!(reply.answers.len(), 1, "{name}: {reply:?}");
            let RData::A(a) = &reply.answers[0].rdata else {
                panic!("{reply:?}")
            };
            assert_eq!(Ipv4Addr::from(a.address), Ipv4Addr::LOCALHOST, "{name}");
            let v6_bytes = ask(&resolver, name, TYPE::AAAA);
            let v6 = Packet::parse(&v6_bytes).unwrap();
            assert_eq!(v6.rcode(), RCODE::NoError, "{name}");
            assert!(v6.answers.is_empty(), "{name}: {v6:?}");
        }
        // Not the policy's to judge: no decision recorded, and no synthetic address taken.
        assert!(sink.0.lock().unwrap().is_empty());
        assert!(resolver.names.lock().unwrap().by_name.is_empty());
        // Control: a name merely like them is judged, and refused.
        for name in ["sandbox.example", "localhost.evil.example"] {
            let bytes = ask(&resolver, name, TYPE::A);
            let reply = Packet::parse(&bytes).unwrap();
            assert_eq!(reply.rcode(), RCODE::NameError, "{name}");
        }
        let kept = sink.0.lock().unwrap();
        let hosts: Vec<&str> = kept.iter().map(|r| r.host.as_str()).collect();
        assert_eq!(hosts, ["sandbox.example", "localhost.evil.example"]);
        assert!(kept.iter().all(|r| !r.allowed));
    }
}
