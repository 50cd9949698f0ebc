//! Network by policy (issue 38): the rules a user writes, the special addresses no name rule
//! reaches, how the layers that set a policy combine, and the decision on one connection.
//! Pure data and functions, no I/O: the daemon's proxy (`executor/src/egress/`) resolves
//! names, asks [`Effective::decide`] about every address before it connects, and logs the
//! [`Decision`].
//!
//! Files, lowest first: `address.rs` (CIDRs, the canonical form of an address, the special
//! ranges), `rules.rs` (a rule's syntax and matching, a requested [`Host`]), `policy.rs`
//! ([`Policy`], the layers, [`Decision`]).

pub mod address;
pub mod policy;
pub mod rules;

pub use address::{canonical, special, Cidr, SpecialRange};
pub use policy::{Decision, Effective, Layer, Mode, Policy, Reason};
pub use rules::{Host, PortRange, Rule, RuleError, RuleTarget};
