//! Which sandbox profile commands run under: the one named, the executor's default, or, for an
//! executor started for us, the strongest of those the agent may choose by itself under which
//! commands can work in the workspace.

use super::{EnvError, Environment};

/// Profiles from strongest to weakest.
pub const PROFILE_PREFERENCE: &[&str] = &["strict", "landlock", "task-container", "trusted"];

/// What the agent chooses from by itself for an executor it started on this host: the profiles
/// that confine commands to the workspace. `task-container` (root, the host's system
/// directories writable) and `trusted` (no sandbox) would write this host itself, so they run
/// only when named: a directory strict and landlock cannot write is an error with its ways
/// out, never a silent step down to a profile that writes `/usr`.
pub const LOCAL_CHOICES: &[&str] = &["strict", "landlock"];

/// The `docker run` arguments under which the executor in a container can build namespaces
/// (tested with rootful podman and runc, the default seccomp profile: `executor check` shows
/// `strict` and `task-container` ok). Docker's default seccomp profile opens the namespace
/// syscalls to a container holding CAP_SYS_ADMIN as podman's does; on a host with AppArmor,
/// docker's default profile also denies mount, hence `--security-opt apparmor=unconfined`
/// there (not tested here).
pub const NAMESPACE_RUN_ARGS: &str =
    "--docker-run-arg=--cap-add=SYS_ADMIN --docker-run-arg=--cap-add=NET_ADMIN";

/// How the profile is settled when the configuration names none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The executor's default: a shared executor's operator decides.
    Default,
    /// An executor started for us on this host: the strongest of [`LOCAL_CHOICES`] that works.
    Local,
    /// An executor started for us in a container or on another machine (the task's own): the
    /// strongest it offers that works (what it offers is the deployment's decision).
    Offered,
}

impl Choice {
    /// The choice for an executor `kind` (`local`, `docker`, ...) that we started (`owned`)
    /// or not.
    pub fn for_deployment(kind: &str, owned: bool) -> Self {
        match (kind, owned) {
            ("local", _) => Self::Local,
            (_, true) => Self::Offered,
            (_, false) => Self::Default,
        }
    }
}

impl Environment {
    /// The first of `choice`'s profiles (strongest first) that the executor reports available
    /// and under which a probe command can write the workspace. Only a command shows whether
    /// the sandbox's identity may write it (an unprivileged uid cannot write a directory
    /// owned by someone else).
    pub(super) async fn strongest_usable_profile(
        &mut self,
        choice: Choice,
    ) -> anyhow::Result<String> {
        let offered: Vec<String> = self.hello.profiles.iter().map(|p| p.name.clone()).collect();
        let allowed: &[&str] = match choice {
            Choice::Local => LOCAL_CHOICES,
            Choice::Default | Choice::Offered => PROFILE_PREFERENCE,
        };
        let mut candidates: Vec<String> = allowed
            .iter()
            .filter(|p| offered.iter().any(|o| o == *p))
            .map(|p| p.to_string())
            .collect();
        if choice != Choice::Local {
            // Profiles of the executor's own beyond the built-in ones, weakest of all.
            let others: Vec<String> = offered
                .iter()
                .filter(|o| !PROFILE_PREFERENCE.contains(&o.as_str()))
                .cloned()
                .collect();
            candidates.extend(others);
        }
        let place = self.hello.workspace.clone();
        // Why each profile was passed over, for the error when none is left.
        let mut refused: Vec<String> = Vec::new();
        for name in candidates {
            let summary = self.hello.profiles.iter().find(|p| p.name == name);
            if let Some(p) = summary.filter(|p| !p.available) {
                let why = format!(
                    "unavailable on this host ({})",
                    p.unavailable_reason.as_deref().unwrap_or("no reason given")
                );
                crate::notes::note!("executor: not using profile {name:?}: {why}");
                refused.push(format!("{name}: {why}"));
                continue;
            }
            self.profile = Some(name.clone());
            let probe = self
                .run_raw("test -w . && test -x .".into(), None, Some(10.0))
                .await;
            match probe {
                Ok(out) if out.returncode == 0 => {
                    self.profile_why = match choice {
                        Choice::Local => format!(
                            "the strongest of {} whose commands can write {place}; \
                             task-container and trusted run only when named",
                            LOCAL_CHOICES.join(" > ")
                        ),
                        Choice::Offered => format!(
                            "the strongest the executor we started offers whose commands can \
                             write {place}"
                        ),
                        Choice::Default => format!(
                            "the executor has no default profile: the strongest it offers \
                             whose commands can write {place}"
                        ),
                    };
                    return Ok(name);
                }
                // Refused before it ran (e.g. a network policy the profile cannot hold):
                // the executor's reason, not a guess about the workspace.
                Ok(out)
                    if out.returncode == protocol::RETURNCODE_NOT_FINISHED
                        && !out.exception_info.is_empty() =>
                {
                    crate::notes::note!(
                        "executor: not using profile {name:?}: {}",
                        out.exception_info
                    );
                    refused.push(format!("{name}: {}", out.exception_info));
                }
                Ok(_) => {
                    let why = format!("its commands cannot write {place}");
                    crate::notes::note!("executor: not using profile {name:?}: {why}");
                    refused.push(format!("{name}: {why}"));
                }
                Err(EnvError::Unusable { code, message }) => {
                    crate::notes::note!("executor: not using profile {name:?}: {code}: {message}");
                    refused.push(format!("{name}: {code}: {message}"));
                }
                Err(lost @ EnvError::Lost { .. }) => return Err(lost.into()),
            }
        }
        self.profile = None;
        match choice {
            Choice::Local => anyhow::bail!("{}", no_local_profile(&place, &refused)),
            Choice::Default | Choice::Offered => {
                anyhow::bail!("{}", no_usable_profile(&place, &refused))
            }
        }
    }

    /// The profile commands run under, as the executor will apply it.
    pub fn effective_profile(&self) -> &str {
        self.profile
            .as_deref()
            .unwrap_or(&self.hello.default_profile)
    }

    pub fn profile_layers(&self) -> Vec<String> {
        let name = self.effective_profile();
        self.hello
            .profiles
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.layers.clone())
            .unwrap_or_default()
    }

    /// The line every entry point prints on stderr: the profile and why it is the one, and
    /// the network the commands ask for (with the executor's word on whether it can hold a
    /// policy under that profile).
    pub fn profile_line(&self) -> String {
        let mut line = profile_line(
            self.effective_profile(),
            &self.profile_why,
            &self.profile_layers(),
        );
        if let Some(network) = &self.config.network {
            line.push_str("; network asked: ");
            line.push_str(&crate::network::describe(network));
            let name = self.effective_profile();
            let held = self
                .hello
                .profiles
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.network.as_ref());
            if let (protocol::RequestNetwork::Policy { .. }, Some(held)) = (network, held) {
                if !held.policy_enforceable && !held.policy_reason.is_empty() {
                    line.push_str(&format!(" (the executor says: {})", held.policy_reason));
                }
            }
        }
        line
    }
}

/// `executor: profile "strict" (WHY); layers: ...`.
pub fn profile_line(name: &str, why: &str, layers: &[String]) -> String {
    let mut line = format!("executor: profile {name:?} ({why})");
    if !layers.is_empty() {
        line.push_str(&format!("; layers: {}", layers.join(", ")));
    }
    line
}

/// The error when neither strict nor landlock can work in the directory of a local executor:
/// what each lacked, who owns the directory, and the ways out. The agent never steps down to
/// task-container by itself: on this host, its commands would write `/usr` as root.
pub fn no_local_profile(workspace: &str, refused: &[String]) -> String {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(workspace).ok();
    let owner = meta.as_ref().map(|m| m.uid());
    let described = match &meta {
        Some(m) => format!(
            "owned by {}, mode {:04o}",
            user_name(m.uid()),
            m.mode() & 0o7777
        ),
        None => "which cannot be read".to_string(),
    };
    let mut ways = vec![format!(
        "work in a directory uid 65534 (the identity of strict and landlock) may write, or \
         make this one so (`chown -R 65534:65534 {workspace}`, or `chmod -R o+w {workspace}`)"
    )];
    if let Some(uid) = owner.filter(|&uid| uid != 0) {
        if nix::unistd::geteuid().is_root() {
            ways.push(format!(
                "run the agent as the directory's owner (`sudo -u {} agent ...`): a local \
                 executor of an ordinary user runs landlock's commands as that user",
                user_name(uid)
            ));
        }
    }
    ways.push(
        "only in a disposable task container (a SWE-bench image's /testbed), name \
         `--profile task-container` (environment.profile: task-container): its commands run \
         as root and can write this machine's system directories"
            .to_string(),
    );
    format!(
        "neither strict nor landlock can run commands that write {workspace} ({described}): {}. \
         The agent chooses only between those two by itself; task-container and trusted \
         write the host and run only when named. Ways out: {}",
        if refused.is_empty() {
            "the executor offers neither".to_string()
        } else {
            refused.join("; ")
        },
        ways.join("; or ")
    )
}

/// The error when no offered profile can run commands in the workspace of an executor in a
/// container or elsewhere: what each profile lacked, and the ways out, the unsafe one last and
/// named as such.
pub fn no_usable_profile(workspace: &str, refused: &[String]) -> String {
    format!(
        "no sandbox profile the executor offers can run commands that write its workspace \
         {workspace} ({}). Options: make {workspace} writable by uid 65534 (the identity of \
         strict and landlock), e.g. chown it in the image; or let the executor build \
         namespaces so that task-container (root inside its own namespaces, without the \
         executor's files) or strict can run: for a docker/podman deployment add {} (tested \
         with podman; on an AppArmor host also --docker-run-arg=--security-opt=apparmor=unconfined); \
         or, only for commands you trust, --profile trusted (environment.profile: trusted): \
         commands then run unsandboxed as the executor's user and can read the executor's token",
        if refused.is_empty() {
            "it offers none".to_string()
        } else {
            refused.join("; ")
        },
        NAMESPACE_RUN_ARGS
    )
}

/// `root`, `alice (uid 1000)`, or `uid 1000` when the host names no such user.
fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) if uid == 0 => user.name,
        Ok(Some(user)) => format!("{} (uid {uid})", user.name),
        _ => format!("uid {uid}"),
    }
}
