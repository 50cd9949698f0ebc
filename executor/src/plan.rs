//! The sandbox plan: everything the helper needs to run one command, decided by the daemon.
//!
//! Planning is pure: [`plan_command`] turns a validated request and the daemon's settings into a
//! [`Plan`] value, which the daemon writes to the helper's stdin as one JSON line. The helper
//! (`crate::helper`) only applies it. Keeping the decision here means unit tests can compare whole
//! plans, and the helper never parses client input.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::profile::Profile;

/// What the helper applies, in the order `crate::helper::run_plan` documents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Full argv of the payload: interpreter, its flag, the command.
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// The payload's whole environment (the helper starts from an empty one).
    pub env: BTreeMap<String, String>,
    /// Cgroup the payload runs in, killed as a whole at the end; `None` where the host has no
    /// writable cgroup2 hierarchy (the subreaper sweep then does the work alone).
    pub cgroup: Option<CgroupPlan>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupPlan {
    /// Directory to create for this command.
    pub dir: PathBuf,
    /// Cgroup the helper moves back to once the payload is inside `dir`, so that killing `dir`
    /// never kills the helper.
    pub helper_home: PathBuf,
}

/// Line the helper writes on its status pipe (its stderr) before it exits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum HelperReport {
    /// The payload ended (on its own or because the daemon asked) and its tree is gone.
    Finished {
        /// Exit code when the shell exited normally.
        code: Option<i32>,
        /// Signal number when a signal ended the shell.
        signal: Option<i32>,
        /// Processes the helper killed at the end (the shell included if it was still running).
        killed: u32,
        /// Whether the daemon asked for the stop (timeout, cancel, disconnect, shutdown).
        stopped: bool,
        /// Isolation layers that were in force.
        layers: Vec<String>,
    },
    /// A setup step failed; the command never ran.
    SetupFailed { stage: String, message: String },
}

/// Settings of the daemon that shape every plan.
#[derive(Debug, Clone)]
pub struct PlanSettings {
    pub interpreter: Vec<String>,
    pub workspace: PathBuf,
    /// `HOME` of commands unless the profile or the request sets it.
    pub home: PathBuf,
    /// Parent cgroup for commands and the cgroup the helper returns to, if cgroups are usable.
    pub cgroup_parent: Option<(PathBuf, PathBuf)>,
}

/// What the client asked for, already validated by `crate::request`.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandSpec {
    pub command: String,
    pub cwd: Option<PathBuf>,
    pub env: BTreeMap<String, String>,
}

/// Build the plan for one command. `serial` makes the cgroup name unique within the daemon.
pub fn plan_command(
    spec: &CommandSpec,
    profile: &Profile,
    settings: &PlanSettings,
    serial: u64,
) -> Plan {
    let mut argv = settings.interpreter.clone();
    argv.push(spec.command.clone());

    // Cleared environment, then HOME, the profile's defaults, the request: the request wins.
    let mut env = BTreeMap::from([("HOME".to_string(), settings.home.display().to_string())]);
    env.extend(profile.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    Plan {
        argv,
        cwd: spec
            .cwd
            .clone()
            .unwrap_or_else(|| settings.workspace.clone()),
        env,
        cgroup: settings
            .cgroup_parent
            .as_ref()
            .map(|(parent, home)| CgroupPlan {
                dir: parent.join(format!("cmd-{serial}")),
                helper_home: home.clone(),
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> PlanSettings {
        PlanSettings {
            interpreter: vec!["bash".into(), "-c".into()],
            workspace: "/work".into(),
            home: "/root".into(),
            cgroup_parent: Some(("/cg/executor-7".into(), "/cg".into())),
        }
    }

    #[test]
    fn request_env_wins_over_profile_defaults_and_workspace_is_default_cwd() {
        let profile = crate::profile::tests::trusted();
        let spec = CommandSpec {
            command: "echo hi".into(),
            cwd: None,
            env: BTreeMap::from([("PAGER".to_string(), "less".to_string())]),
        };
        let plan = plan_command(&spec, &profile, &settings(), 3);
        let mut env = profile.env.clone();
        env.insert("HOME".into(), "/root".into());
        env.insert("PAGER".into(), "less".into());
        assert_eq!(
            plan,
            Plan {
                argv: vec!["bash".into(), "-c".into(), "echo hi".into()],
                cwd: "/work".into(),
                env,
                cgroup: Some(CgroupPlan {
                    dir: "/cg/executor-7/cmd-3".into(),
                    helper_home: "/cg".into(),
                }),
            }
        );
    }

    #[test]
    fn request_cwd_is_used_and_no_cgroup_without_hierarchy() {
        let profile = crate::profile::tests::trusted();
        let spec = CommandSpec {
            command: "pwd".into(),
            cwd: Some("/tmp".into()),
            env: BTreeMap::new(),
        };
        let mut settings = settings();
        settings.cgroup_parent = None;
        let plan = plan_command(&spec, &profile, &settings, 1);
        assert_eq!(plan.cwd, PathBuf::from("/tmp"));
        assert_eq!(plan.cgroup, None);
        assert_eq!(plan.env.get("HOME").map(String::as_str), Some("/root"));
        assert_eq!(plan.env.len(), profile.env.len() + 1);
    }
}
