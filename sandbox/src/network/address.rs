//! Addresses: CIDR blocks, the canonical form an address is judged in, and the special ranges
//! a command never reaches unless a CIDR rule names them.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// An IPv4 or IPv6 network: an address with its host bits clear and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// Why a CIDR did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("{0:?} is not an IP address")]
    Address(String),
    #[error("prefix length {0:?} is not a number from 0 to {1}")]
    Prefix(String, u8),
    #[error("{text} has host bits set (did you mean {network}?)")]
    HostBits { text: String, network: Cidr },
}

impl Cidr {
    /// `addr/prefix`; the host bits of `addr` must be clear.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Self> {
        let cidr = Self { addr, prefix };
        (prefix <= cidr.max_prefix() && cidr.network_address() == addr).then_some(cidr)
    }

    /// The network of one address (`/32` or `/128`).
    pub fn single(addr: IpAddr) -> Self {
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        Self { addr, prefix }
    }

    /// `10.0.0.0/8`, `2001:db8::/32`, or an address alone (one address).
    pub fn parse(text: &str) -> Result<Self, CidrError> {
        let (addr_text, prefix_text) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr_text
            .parse()
            .map_err(|_| CidrError::Address(addr_text.to_string()))?;
        let Some(prefix_text) = prefix_text else {
            return Ok(Self::single(addr));
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = prefix_text
            .parse()
            .ok()
            .filter(|p| *p <= max)
            // `/08` or `/+8` would parse; a prefix is written plainly.
            .filter(|p: &u8| p.to_string() == prefix_text)
            .ok_or_else(|| CidrError::Prefix(prefix_text.to_string(), max))?;
        let network = Self {
            addr: mask(addr, prefix),
            prefix,
        };
        if network.addr != addr {
            return Err(CidrError::HostBits {
                text: text.to_string(),
                network,
            });
        }
        Ok(network)
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn max_prefix(&self) -> u8 {
        if self.addr.is_ipv4() {
            32
        } else {
            128
        }
    }

    fn network_address(&self) -> IpAddr {
        mask(self.addr, self.prefix)
    }

    /// Whether `ip` lies in this network (same family only: judge canonical addresses).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                mask(ip, self.prefix) == self.addr
            }
            _ => false,
        }
    }

    /// Whether every address of `other` lies in this network.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    /// Whether this is a single address (`/32`, `/128`).
    pub fn is_single(&self) -> bool {
        self.prefix == self.max_prefix()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let kept = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(bits & kept))
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let kept = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(bits & kept))
        }
    }
}

/// The address a connection to `ip` reaches, as the rules judge it: an IPv6 address that
/// carries an IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, the deprecated IPv4-compatible
/// `::a.b.c.d`, NAT64's well-known prefix `64:ff9b::/96` (RFC 6052), 6to4's `2002:AABB:CCDD::/48`
/// (RFC 3056)) is judged as that IPv4 address: `::ffff:127.0.0.1` is loopback, and a rule
/// about `10.0.0.0/8` covers `::ffff:10.1.2.3`. `::` and `::1` stay IPv6.
pub fn canonical(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else {
        return ip;
    };
    let bits = u128::from(v6);
    let low32 = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    let mapped = bits >> 32 == 0xffff;
    let compatible = bits >> 32 == 0 && bits > 1;
    let nat64 = bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000;
    if mapped || compatible || nat64 {
        return IpAddr::V4(low32);
    }
    if bits >> 112 == 0x2002 {
        return IpAddr::V4(Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32));
    }
    ip
}

/// The kind of IPv6 space carrying IPv4 addresses (see [`canonical`]) that `cidr` lies in, if
/// any: rules name the IPv4 network instead, so that one network has one spelling. `::` and
/// `::1` are IPv6's own.
pub fn embeds_ipv4(cidr: &Cidr) -> Option<&'static str> {
    if cidr.is_single() && matches!(cidr.addr(), IpAddr::V6(v6) if u128::from(v6) <= 1) {
        return None;
    }
    EMBEDDING.iter().find_map(|(text, what)| {
        Cidr::parse(text)
            .is_ok_and(|space| space.covers(cidr))
            .then_some(*what)
    })
}

const EMBEDDING: &[(&str, &str)] = &[
    ("::ffff:0.0.0.0/96", "IPv4-mapped"),
    ("::/96", "IPv4-compatible"),
    ("64:ff9b::/96", "NAT64"),
    ("2002::/16", "6to4"),
];

/// A range of addresses no rule about names reaches (see [`special`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialRange {
    /// The range, e.g. `127.0.0.0/8`.
    pub cidr: Cidr,
    /// What it is, e.g. `loopback`.
    pub what: &'static str,
}

impl fmt::Display for SpecialRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.what, self.cidr)
    }
}

/// The special ranges, most specific first (so 255.255.255.255 is named "broadcast", not
/// "reserved"). Sources: RFC 6890 (the special-purpose registries), RFC 1918, RFC 6598, RFC
/// 3927, RFC 4193, RFC 4291, RFC 6052.
const SPECIAL: &[(&str, &str)] = &[
    ("169.254.169.254/32", "cloud metadata service (link-local)"),
    ("255.255.255.255/32", "broadcast"),
    ("0.0.0.0/8", "unspecified (\"this network\")"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (CGNAT, RFC 6598)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking (used inside some networks)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("64:ff9b:1::/48", "local-use NAT64 (RFC 8215)"),
    ("100::/64", "discard-only"),
    (
        "2001::/32",
        "Teredo (carries an IPv4 address the rules cannot judge)",
    ),
    ("fc00::/7", "unique local (private)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("ff00::/8", "multicast"),
];

/// The special range `ip` lies in, judged in its [`canonical`] form, if any: loopback,
/// private, shared (CGNAT), link-local (the cloud metadata address 169.254.169.254 among
/// them), unique-local, unspecified, multicast, broadcast and reserved space.
pub fn special(ip: IpAddr) -> Option<SpecialRange> {
    let ip = canonical(ip);
    SPECIAL.iter().find_map(|(text, what)| {
        let cidr = Cidr::parse(text).ok()?;
        cidr.contains(ip).then_some(SpecialRange { cidr, what })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn every_special_range_parses() {
        for (text, _) in SPECIAL.iter().chain(EMBEDDING) {
            Cidr::parse(text).unwrap();
        }
    }

    #[test]
    fn cidrs_parse_with_clear_errors() {
        assert_eq!(Cidr::parse("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(Cidr::parse("10.1.2.3").unwrap().to_string(), "10.1.2.3/32");
        assert_eq!(Cidr::parse("2001:db8::/32").unwrap().prefix(), 32);
        assert_eq!(Cidr::parse("0.0.0.0/0").unwrap().prefix(), 0);
        let err = Cidr::parse("10.0.0.1/8").unwrap_err().to_string();
        assert!(err.contains("did you mean 10.0.0.0/8"), "{err}");
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("10.0.0.0/08").is_err());
        assert!(Cidr::parse("::/129").is_err());
        assert!(Cidr::parse("10.0.0/8").is_err());
        assert!(Cidr::parse("example.org/8").is_err());
    }

    #[test]
    fn containment_is_per_family() {
        let ten = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(ten.contains(ip("10.255.0.1")));
        assert!(!ten.contains(ip("11.0.0.1")));
        assert!(
            !ten.contains(ip("::ffff:10.0.0.1")),
            "judge canonical addresses"
        );
        assert!(ten.covers(&Cidr::parse("10.1.0.0/16").unwrap()));
        assert!(!ten.covers(&Cidr::parse("0.0.0.0/0").unwrap()));
        let all = Cidr::parse("::/0").unwrap();
        assert!(all.contains(ip("2001:db8::1")));
        assert!(!all.contains(ip("1.2.3.4")));
    }

    #[test]
    fn embedded_ipv4_addresses_are_judged_as_ipv4() {
        assert_eq!(canonical(ip("::ffff:127.0.0.1")), ip("127.0.0.1"));
        assert_eq!(canonical(ip("::10.0.0.1")), ip("10.0.0.1"));
        assert_eq!(canonical(ip("64:ff9b::a9fe:a9fe")), ip("169.254.169.254"));
        assert_eq!(canonical(ip("2002:7f00:1::1")), ip("127.0.0.1"));
        // `::` and `::1` are IPv6's own unspecified and loopback addresses.
        assert_eq!(canonical(ip("::1")), ip("::1"));
        assert_eq!(canonical(ip("::")), ip("::"));
        assert_eq!(canonical(ip("2001:db8::1")), ip("2001:db8::1"));
        let embeds = |text: &str| embeds_ipv4(&Cidr::parse(text).unwrap());
        assert_eq!(embeds("::ffff:10.0.0.0/104"), Some("IPv4-mapped"));
        assert_eq!(embeds("64:ff9b::/96"), Some("NAT64"));
        assert_eq!(embeds("2001:db8::/32"), None);
        assert_eq!(embeds("::1"), None);
        assert_eq!(embeds("::/0"), None);
    }

    #[test]
    fn special_ranges_are_named_and_public_addresses_are_not_special() {
        let what = |text: &str| special(ip(text)).map(|s| s.what);
        assert_eq!(what("127.0.0.1"), Some("loopback"));
        assert_eq!(what("127.255.255.254"), Some("loopback"));
        assert_eq!(what("10.1.2.3"), Some("private (RFC 1918)"));
        assert_eq!(what("172.31.0.1"), Some("private (RFC 1918)"));
        assert_eq!(what("192.168.1.1"), Some("private (RFC 1918)"));
        assert_eq!(
            what("100.64.0.1"),
            Some("shared address space (CGNAT, RFC 6598)")
        );
        assert_eq!(
            what("169.254.169.254"),
            Some("cloud metadata service (link-local)")
        );
        assert_eq!(what("169.254.1.1"), Some("link-local"));
        assert_eq!(what("0.0.0.0"), Some("unspecified (\"this network\")"));
        assert_eq!(what("224.0.0.1"), Some("multicast"));
        assert_eq!(what("255.255.255.255"), Some("broadcast"));
        assert_eq!(what("::1"), Some("loopback"));
        assert_eq!(what("::"), Some("unspecified"));
        assert_eq!(what("fd00:ec2::254"), Some("unique local (private)"));
        assert_eq!(what("fe80::1"), Some("link-local"));
        assert_eq!(what("ff02::1"), Some("multicast"));
        assert_eq!(what("::ffff:127.0.0.1"), Some("loopback"));
        assert_eq!(
            what("::ffff:169.254.169.254"),
            Some("cloud metadata service (link-local)")
        );
        assert_eq!(what("64:ff9b::10.0.0.1"), Some("private (RFC 1918)"));
        // Controls: public addresses, in either family and in embedded form.
        for public in [
            "93.184.215.14",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
        ] {
            assert_eq!(what(public), None, "{public}");
        }
        assert_eq!(what("::ffff:93.184.215.14"), None);
    }
}
