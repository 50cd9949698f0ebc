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
        for name in candidates {
            let summary = self.hello.profiles.iter().find(|p| p.name == name);
            if let Some(p) = summary.filter(|p| !p.available) {
                crate::notes::note!(
                    "executor: not using profile {name:?}: unavailable on this host ({})",
                    p.unavailable_reason.as_deref().unwrap_or("no reason given")
                );
                continue;
            }
            self.profile = Some(name.clone());
            let probe = self
                .run_raw("test -w . && test -x .".into(), None, Some(10.0))
                .await;
            match probe {
                Ok(out) if out.returncode == 0 => return Ok(name),
                Ok(_) => crate::notes::note!(
                    "executor: not using profile {name:?}: its commands cannot write {place}"
                ),
                Err(EnvError::Unusable { code, message }) => {
                    crate::notes::note!("executor: not using profile {name:?}: {code}: {message}")
                }
                Err(lost @ EnvError::Lost { .. }) => return Err(lost.into()),
            }
        }
        anyhow::bail!(
            "no profile of the executor can run commands that write {place}; make it writable \
             for the sandbox or choose one with --profile"
        )
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
