//! Landlock rules: read and execute beneath the read list, everything beneath the write list,
//! nothing elsewhere; optionally no TCP at all; signals and abstract unix sockets confined to
//! the sandbox's own processes.
//!
//! The ABI is a hard requirement (V6: filesystem, TCP and scopes): on an older kernel the layer
//! fails and the command is refused, rather than running with part of its policy.

use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

use crate::plan::LandlockPlan;

const TARGET_ABI: ABI = ABI::V6;

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("landlock: {0}")]
    Ruleset(#[from] landlock::RulesetError),
    #[error("landlock was only {0:?} by this kernel")]
    NotEnforced(RulesetStatus),
}

pub fn restrict(plan: &LandlockPlan) -> Result<(), LandlockError> {
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(TARGET_ABI))?
        .scope(Scope::from_all(TARGET_ABI))?;
    if plan.deny_tcp {
        // Handled with no rule allowing any port: every bind and connect is denied.
        ruleset = ruleset.handle_access(AccessNet::from_all(ABI::V4))?;
    }
    let status = ruleset
        .create()?
        .add_rules(path_beneath_rules(
            &plan.read,
            AccessFs::from_read(TARGET_ABI),
        ))?
        .add_rules(path_beneath_rules(
            &plan.write,
            AccessFs::from_all(TARGET_ABI),
        ))?
        .add_rules(path_beneath_rules(&plan.list, AccessFs::ReadDir))?
        .restrict_self()?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(()),
        other => Err(LandlockError::NotEnforced(other)),
    }
}
