//! Name resolution on the daemon's side: the proxy looks names up itself, never trusting an
//! address the command chose or a resolver the command controls.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// A lookup in flight.
pub type Lookup<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>>;

/// Turns a host name into addresses. The proxy judges every address returned before it
/// connects to any.
pub trait Resolver: Send + Sync {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Lookup<'a>;
}

/// The host's resolver (getaddrinfo through tokio's `lookup_host`, so `/etc/hosts` counts:
/// its answers are judged like any other), bounded in time.
pub struct SystemResolver {
    pub timeout: Duration,
}

impl Default for SystemResolver {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
        }
    }
}

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Lookup<'a> {
        Box::pin(async move {
            let found = tokio::time::timeout(self.timeout, tokio::net::lookup_host((name, port)))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "name lookup timed out"))??;
            let mut addrs: Vec<IpAddr> = Vec::new();
            for addr in found {
                if !addrs.contains(&addr.ip()) {
                    addrs.push(addr.ip());
                }
            }
            Ok(addrs)
        })
    }
}

/// Fixed answers for some names (like curl's `--resolve`), the others asked of `fallback`,
/// or not found without one (tests: no lookup leaves the machine).
#[derive(Default)]
pub struct OverrideResolver {
    names: HashMap<String, Vec<IpAddr>>,
    fallback: Option<Arc<dyn Resolver>>,
}

impl OverrideResolver {
    pub fn new(fallback: Option<Arc<dyn Resolver>>) -> Self {
        Self {
            names: HashMap::new(),
            fallback,
        }
    }

    /// Answer `name` (compared in lower case, without a trailing dot) with `addrs`.
    pub fn set(&mut self, name: &str, addrs: Vec<IpAddr>) -> &mut Self {
        self.names.insert(normalize(name), addrs);
        self
    }
}

fn normalize(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

impl Resolver for OverrideResolver {
    fn resolve<'a>(&'a self, name: &'a str, port: u16) -> Lookup<'a> {
        Box::pin(async move {
            if let Some(addrs) = self.names.get(&normalize(name)) {
                return Ok(addrs.clone());
            }
            match &self.fallback {
                Some(fallback) => fallback.resolve(name, port).await,
                None => Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{name}: no such name"),
                )),
            }
        })
    }
}
