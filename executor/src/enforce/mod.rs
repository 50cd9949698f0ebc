//! Network policy enforcement (issue 38): a command whose effective network is a policy runs
//! in a network namespace of its own whose only way out is the daemon's egress engine.
//!
//! The namespace holds nothing but loopback, and the daemon's own sockets, bound inside it
//! before the command starts (`listen::bind_in`):
//! - an HTTP proxy on `127.0.0.1:3128` ([`crate::egress::Engine::serve_proxy`]), named by
//!   the command's `HTTP_PROXY` and friends;
//! - a resolver on `127.0.0.1:53` (UDP and TCP; `/etc/resolv.conf` in the sandbox names it) that
//!   answers an `A` query for a name the policy may allow with a synthetic address of
//!   127.1.0.0/16, one per name for this command ([`dns`]), and nothing else;
//! - capture listeners on `0.0.0.0:PORT` for the ports the policy's allow rules name (at most
//!   [`MAX_CAPTURED_PORTS`]): a connection to a synthetic address is mapped back to its name
//!   and relayed by [`crate::egress::Engine::serve_tcp`], judged like any other.
//!
//! Anything else finds no listener, and nothing leaves the namespace by a route of its own
//! (it has none): that is the enforcement, and it fails closed. The listeners are closed when
//! the command ends ([`listen::Attached`] is dropped); the namespace is never lent to another command
//! (`sandbox::spawner::net_pool::reusable`).
//!
//! Every attempt becomes one JSON line in the decision log ([`log::DecisionLog`]), is counted
//! in `/metrics`, and the command's result names its denials (`isolation.network`).

pub mod dns;
pub mod listen;
pub mod log;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sandbox::network::{Effective, PortRange};
use sandbox::plan::Plan;
use sandbox::profile::Namespace;

use crate::egress;

/// The proxy's address inside the command's namespace.
pub const PROXY_PORT: u16 = 3128;
/// Ports captured for plain connections at most; a policy naming more (a range) reaches the
/// others through the proxy only.
pub const MAX_CAPTURED_PORTS: usize = 32;
/// Where the generated resolver configuration lies, under the state directory.
pub const RESOLV_CONF: &str = "egress/resolv.conf";

/// The daemon's side of enforcement: its egress engine, its decision log, and the
/// resolver configuration bound into every sandbox under a policy.
pub struct Enforcer {
    pub engine: Arc<egress::Engine>,
    pub log: Arc<log::DecisionLog>,
    pub resolv_conf: PathBuf,
}

impl Enforcer {
    /// The daemon's enforcer (or `executor run`'s): decisions logged to `log_path` (without
    /// one, only counted in each result); names resolved by the host's resolver, or by
    /// `overrides` (`NAME=ADDR`, for tests and labs) first; `own` the daemon's listening
    /// addresses, which no policy reaches.
    pub fn new(
        state_dir: &Path,
        log_path: Option<&Path>,
        overrides: &[String],
        own: Vec<std::net::SocketAddr>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let system: Arc<dyn egress::resolve::Resolver> =
            Arc::new(egress::resolve::SystemResolver::default());
        let resolver: Arc<dyn egress::resolve::Resolver> = if overrides.is_empty() {
            system
        } else {
            // A name given more than once gets every address, in order (IPv4 and IPv6).
            let mut by_name: Vec<(&str, Vec<std::net::IpAddr>)> = Vec::new();
            for entry in overrides {
                let (name, addr) = entry
                    .split_once('=')
                    .with_context(|| format!("--egress-resolve {entry:?}: expected NAME=ADDR"))?;
                let addr: std::net::IpAddr = addr
                    .parse()
                    .with_context(|| format!("--egress-resolve {entry:?}: not an address"))?;
                match by_name
                    .iter_mut()
                    .find(|(n, _)| n.eq_ignore_ascii_case(name))
                {
                    Some((_, addrs)) => addrs.push(addr),
                    None => by_name.push((name, vec![addr])),
                }
            }
            let mut fixed = egress::resolve::OverrideResolver::new(Some(system));
            for (name, addrs) in by_name {
                fixed.set(name, addrs);
            }
            Arc::new(fixed)
        };
        let log = Arc::new(
            log::DecisionLog::open(log_path)
                .with_context(|| format!("cannot open the decision log {log_path:?}"))?,
        );
        let resolv_conf = Self::write_resolv_conf(state_dir)
            .with_context(|| format!("cannot write {RESOLV_CONF} in {}", state_dir.display()))?;
        Ok(Self {
            engine: Arc::new(egress::Engine {
                resolver,
                sink: log.clone(),
                own_listeners: own,
                limits: egress::Limits::default(),
            }),
            log,
            resolv_conf,
        })
    }

    /// Write the resolver configuration under `state_dir` (`nameserver 127.0.0.1`: the
    /// resolver in each command's namespace).
    pub fn write_resolv_conf(state_dir: &Path) -> std::io::Result<PathBuf> {
        let path = state_dir.join(RESOLV_CONF);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Written beside and renamed over: a command starting meanwhile (another run's, or
        // the previous daemon's) binds the old file or the new one, never a half-written one.
        let fresh = path.with_extension(format!("conf.{}", std::process::id()));
        std::fs::write(
            &fresh,
            "# Written by the executor: the resolver in this command's network namespace.\n\
             nameserver 127.0.0.1\noptions ndots:1\n",
        )?;
        std::fs::rename(&fresh, &path)?;
        Ok(path)
    }
}

/// Why a policy cannot be enforced for a command (it is refused).
#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error(
        "the network policy cannot be enforced under profile {profile}: it has no pid \
         namespace, so no network namespace can be made for the command"
    )]
    NamespaceImpossible { profile: String },
    #[error(
        "the network policy cannot be enforced under profile {profile}: it has no mount \
         namespace to point /etc/resolv.conf at the command's resolver"
    )]
    ResolverUnreachable { profile: String },
    #[error(
        "the network policy cannot be enforced here: no egress proxy runs beside this engine \
         (`executor serve` and `executor run` run one), so this command was not started"
    )]
    NoEngine,
}

/// Shape `plan` for `effective`: under a policy, a network namespace made for the command
/// alone (`egress`), TCP allowed by landlock (it reaches only the listeners inside), the
/// generated `/etc/resolv.conf`, and the proxy in the environment. Nothing under `none` or
/// `host`.
pub fn shape_plan(
    plan: &mut Plan,
    profile: &str,
    effective: &Effective,
    resolv_conf: &Path,
) -> Result<(), EnforceError> {
    if !matches!(effective, Effective::Policy(_)) {
        return Ok(());
    }
    let sandbox = &mut plan.template.sandbox;
    if !sandbox.namespaces.contains(&Namespace::Pid) {
        return Err(EnforceError::NamespaceImpossible {
            profile: profile.to_string(),
        });
    }
    let Some(mounts) = sandbox.mounts.as_mut() else {
        return Err(EnforceError::ResolverUnreachable {
            profile: profile.to_string(),
        });
    };
    mounts
        .files
        .push((PathBuf::from("/etc/resolv.conf"), resolv_conf.to_path_buf()));
    if !sandbox.namespaces.contains(&Namespace::Net) {
        sandbox.namespaces.push(Namespace::Net);
        // Reported with the other namespaces (before the new root's pivot_root).
        let layers = &mut plan.template.layers;
        let at = layers
            .iter()
            .position(|l| l == "pivot_root")
            .unwrap_or(layers.len());
        layers.insert(at, Namespace::Net.layer().to_string());
    }
    sandbox.egress = true;
    sandbox.deny_inet = false;
    if let Some(landlock) = sandbox.landlock.as_mut() {
        // Inside the namespace TCP reaches only the daemon's listeners.
        landlock.deny_tcp = false;
    }
    plan.command.env.extend(proxy_env());
    Ok(())
}

/// The environment that points programs at the proxy: the usual variables (curl, pip,
/// requests, git and cargo read `http_proxy`/`https_proxy`), and npm's and pip's own.
pub fn proxy_env() -> BTreeMap<String, String> {
    let proxy = format!("http://127.0.0.1:{PROXY_PORT}");
    let mut env = BTreeMap::new();
    for name in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "http_proxy",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
        "PIP_PROXY",
        "npm_config_proxy",
        "npm_config_https_proxy",
    ] {
        env.insert(name.to_string(), proxy.clone());
    }
    for name in ["NO_PROXY", "no_proxy"] {
        env.insert(name.to_string(), "localhost,127.0.0.1".to_string());
    }
    env
}

/// The ports to capture for `effective`: every port the allow rules name, smallest first, as
/// long as a rule's whole range fits under [`MAX_CAPTURED_PORTS`] (the proxy's and the
/// resolver's ports excepted).
pub fn captured_ports(effective: &Effective) -> Vec<u16> {
    let Effective::Policy(layers) = effective else {
        return Vec::new();
    };
    let mut ranges: Vec<PortRange> = layers
        .iter()
        .flat_map(|(_, policy)| &policy.allow)
        .map(|rule| rule.ports.unwrap_or(PortRange::ALL))
        .collect();
    ranges.sort_by_key(|r| (r.high - r.low, r.low));
    let mut ports: Vec<u16> = Vec::new();
    for range in ranges {
        let new: Vec<u16> = (range.low..=range.high)
            .take(MAX_CAPTURED_PORTS + 1)
            .filter(|p| !ports.contains(p) && *p != PROXY_PORT && *p != 53)
            .collect();
        if ports.len() + new.len() <= MAX_CAPTURED_PORTS {
            ports.extend(new);
        }
    }
    ports.sort_unstable();
    ports
}

/// The allow rules of `effective` some of whose ports `captured` lacks: reachable through the
/// proxy only.
pub fn proxy_only(effective: &Effective, captured: &[u16]) -> Vec<String> {
    let Effective::Policy(layers) = effective else {
        return Vec::new();
    };
    layers
        .iter()
        .flat_map(|(_, policy)| &policy.allow)
        .filter(|rule| {
            let range = rule.ports.unwrap_or(PortRange::ALL);
            (range.low..=range.high).any(|p| !captured.contains(&p))
        })
        .map(ToString::to_string)
        .collect()
}

/// Ports a name may be asked for (the resolver's decision): the ends of every allow rule's
/// range.
pub fn candidate_ports(effective: &Effective) -> Vec<u16> {
    let Effective::Policy(layers) = effective else {
        return Vec::new();
    };
    let mut ports: Vec<u16> = layers
        .iter()
        .flat_map(|(_, policy)| &policy.allow)
        .flat_map(|rule| {
            let range = rule.ports.unwrap_or(PortRange::ALL);
            [range.low, range.high]
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox::network::{Layer, Mode, Policy, Rule};

    fn policy(allow: &[&str]) -> Effective {
        let allow: Vec<Rule> = allow.iter().map(|r| r.parse().unwrap()).collect();
        let mode = Mode::Policy(Policy {
            allow,
            deny: vec![],
        });
        Effective::combine([(Layer::Profile, &mode)])
    }

    #[test]
    fn ports_named_by_rules_are_captured_and_wide_ranges_are_left_to_the_proxy() {
        let ports = captured_ports(&policy(&["pypi.org:443", "a.example:80-82", "b.example"]));
        assert_eq!(ports, vec![80, 81, 82, 443]);
        let ports = captured_ports(&policy(&["a.example:8000-8100", "b.example:22"]));
        assert_eq!(ports, vec![22]);
        let wide = policy(&["a.example:8000-8100", "b.example:22"]);
        assert_eq!(proxy_only(&wide, &ports), vec!["a.example:8000-8100"]);
        // The proxy's and the resolver's ports are never captured.
        assert!(captured_ports(&policy(&["a.example:3128", "b.example:53"])).is_empty());
        assert!(captured_ports(&Effective::Host).is_empty());
        assert_eq!(
            candidate_ports(&policy(&["a.example:80-82", "b.example"])),
            vec![1, 80, 82, 65535]
        );
    }

    fn plan(namespaces: Vec<Namespace>, root: Option<sandbox::profile::RootMode>) -> Plan {
        use sandbox::plan::{CommandPlan, LandlockPlan, MountPlan, SandboxPlan, Template};
        Plan {
            template: Template {
                cgroups: vec![],
                sandbox: SandboxPlan {
                    namespaces,
                    mounts: root.map(|root| MountPlan {
                        root,
                        read_only: vec![],
                        writable: vec![],
                        hidden: vec![],
                        pins: vec![],
                        tmpfs: vec![],
                        files: vec![],
                    }),
                    landlock: Some(LandlockPlan {
                        read: vec![],
                        write: vec![],
                        list: vec![],
                        deny_tcp: true,
                        scope: true,
                        abi: 6,
                    }),
                    ..SandboxPlan::default()
                },
                layers: vec!["mount_ns".into(), "pid_ns".into(), "pivot_root".into()],
                missing: vec![],
            },
            command: CommandPlan {
                argv: vec!["bash".into(), "-c".into(), "true".into()],
                cwd: "/".into(),
                env: BTreeMap::from([("HTTP_PROXY".to_string(), "http://elsewhere".to_string())]),
                stdin: Default::default(),
                builtin: None,
            },
        }
    }

    #[test]
    fn a_policy_shapes_the_plan_and_none_or_host_leave_it_alone() {
        use sandbox::profile::RootMode;
        let resolv = Path::new("/state/egress/resolv.conf");
        let filtered = policy(&["pypi.org:443"]);
        // Strict-like: its own namespace, never pooled; TCP open to the listeners inside; the
        // resolver's file; the proxy wins over the request's variable.
        let ns = vec![Namespace::Mount, Namespace::Pid, Namespace::Net];
        let mut strict = plan(ns.clone(), Some(RootMode::Empty));
        shape_plan(&mut strict, "strict", &filtered, resolv).unwrap();
        let sandbox = &strict.template.sandbox;
        assert!(sandbox.egress);
        assert_eq!(sandbox.namespaces, ns);
        assert!(!sandbox.landlock.as_ref().unwrap().deny_tcp);
        assert_eq!(
            sandbox.mounts.as_ref().unwrap().files,
            vec![("/etc/resolv.conf".into(), resolv.to_path_buf())]
        );
        assert_eq!(strict.command.env["HTTP_PROXY"], "http://127.0.0.1:3128");
        assert_eq!(strict.template.layers.len(), 3);
        // Task-container-like: a network namespace made for it, and reported.
        let mut container = plan(vec![Namespace::Mount, Namespace::Pid], Some(RootMode::Host));
        shape_plan(&mut container, "task-container", &filtered, resolv).unwrap();
        assert!(container
            .template
            .sandbox
            .namespaces
            .contains(&Namespace::Net));
        assert_eq!(
            container.template.layers,
            vec!["mount_ns", "pid_ns", "net_ns", "pivot_root"]
        );
        // No pid namespace (landlock-like): refused, never run unfiltered.
        let mut bare = plan(vec![], None);
        let err = shape_plan(&mut bare, "landlock", &filtered, resolv).unwrap_err();
        assert!(err.to_string().contains("cannot be enforced"), "{err}");
        assert!(!bare.template.sandbox.egress);
        // Controls: `none` and `host` change nothing.
        for effective in [Effective::None, Effective::Host] {
            let mut untouched = plan(ns.clone(), Some(RootMode::Empty));
            let before = untouched.clone();
            shape_plan(&mut untouched, "strict", &effective, resolv).unwrap();
            assert_eq!(untouched, before);
        }
    }

    #[tokio::test]
    async fn a_name_given_twice_to_egress_resolve_gets_both_addresses() {
        let dir = std::env::temp_dir().join(format!("enforce-resolve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let overrides = [
            "a.test=203.0.113.2".to_string(),
            "b.test=203.0.113.3".to_string(),
            "A.test=2001:db8::2".to_string(),
        ];
        let enforcer =
            Enforcer::new(&dir, Some(&dir.join("network.jsonl")), &overrides, vec![]).unwrap();
        let a = enforcer
            .engine
            .resolver
            .resolve("a.test", 80)
            .await
            .unwrap();
        let want: Vec<std::net::IpAddr> = vec![
            "203.0.113.2".parse().unwrap(),
            "2001:db8::2".parse().unwrap(),
        ];
        assert_eq!(a, want);
        let b = enforcer
            .engine
            .resolver
            .resolve("b.test", 80)
            .await
            .unwrap();
        assert_eq!(b, vec!["203.0.113.3".parse::<std::net::IpAddr>().unwrap()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_proxy_is_in_every_variable_programs_read() {
        let env = proxy_env();
        assert_eq!(env["https_proxy"], "http://127.0.0.1:3128");
        assert_eq!(env["npm_config_https_proxy"], "http://127.0.0.1:3128");
        assert_eq!(env["NO_PROXY"], "localhost,127.0.0.1");
    }
}
