//! Which sandbox profile commands run under: the configured one, or the strongest that works.

use super::{EnvError, Environment};

/// Profiles from strongest to weakest; a local run takes the first one the executor offers.
pub const PROFILE_PREFERENCE: &[&str] = &["strict", "landlock", "task-container", "trusted"];

impl Environment {
    /// The first profile in [`PROFILE_PREFERENCE`] (then any other offered) that the executor
    /// reports available and under which a probe command can write the executor's workspace.
    /// Only a command shows whether the sandbox's identity may write it (an unprivileged uid
    /// cannot write a directory owned by someone else).
    pub(super) async fn strongest_usable_profile(&mut self) -> anyhow::Result<String> {
        let offered: Vec<String> = self.hello.profiles.iter().map(|p| p.name.clone()).collect();
        let mut candidates: Vec<String> = PROFILE_PREFERENCE
            .iter()
            .filter(|p| offered.iter().any(|o| o == *p))
            .map(|p| p.to_string())
            .collect();
        let others: Vec<String> = offered
            .iter()
            .filter(|o| !candidates.contains(o))
            .cloned()
            .collect();
        candidates.extend(others);
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
                Ok(out) if out.returncode == 0 => return Ok(name),
                Ok(_) => {
                    crate::notes::note!(
                        "executor: not using profile {name:?}: its commands cannot write {place}"
                    );
                    refused.push(format!("{name}: its commands cannot write {place}"));
                }
                Err(EnvError::Unusable { code, message }) => {
                    crate::notes::note!("executor: not using profile {name:?}: {code}: {message}");
                    refused.push(format!("{name}: {code}: {message}"));
                }
                Err(lost @ EnvError::Lost { .. }) => return Err(lost.into()),
            }
        }
        self.profile = None;
        anyhow::bail!("{}", no_usable_profile(&place, &refused))
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
}

/// The error when no offered profile can run commands in the workspace: what each profile
/// lacked, and the ways out, the unsafe one last and named as such.
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
        crate::deploy::NAMESPACE_RUN_ARGS
    )
}
