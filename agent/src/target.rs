//! Reaching an executor for the one-shot commands (`exec`, `cp`, `shell`): the deployment their
//! shared flags select (without a URL, a local executor started for us with the current
//! directory as its workspace), its TLS settings, and the profile requests name.

use anyhow::Context;

use crate::agent_loop::Interrupts;
use crate::config;
use crate::deploy::flags::ExecutorArgs;
use crate::deploy::{Deployed, TaskSpec};
use crate::executor_client::{profile_line, Client, ClientError, Environment};
use crate::tls::Tls;

/// An executor ready for connections. [`Reached::stop`] tears down what was started for it.
pub struct Reached {
    pub target: Deployed,
    pub tls: Tls,
}

/// Why no executor was reached.
pub enum Unreached {
    /// Ctrl-C or SIGTERM while it was being started.
    Interrupted,
    Failed(anyhow::Error),
}

/// Start or find the executor `executor`'s flags name; `label` names the run (`exec`, `cp`);
/// `network` is what its commands ask for (a local executor is started with it as ceiling).
pub async fn reach(
    executor: &ExecutorArgs,
    label: &str,
    network: Option<protocol::RequestNetwork>,
    interrupts: &mut Interrupts,
) -> Result<Reached, Unreached> {
    let mut environment = config::EnvironmentConfig {
        network,
        ..config::EnvironmentConfig::default()
    };
    executor
        .apply(&mut environment)
        .map_err(Unreached::Failed)?;
    let here = std::env::current_dir()
        .context("cannot read the current directory")
        .map_err(Unreached::Failed)?;
    let (_, deployment) =
        crate::deploy::for_new_run(&environment, label).map_err(Unreached::Failed)?;
    let task = TaskSpec {
        name: label.into(),
        image: environment.image.clone(),
        workspace: if deployment.kind() == "local" {
            Some(here.display().to_string())
        } else {
            None
        },
        network: environment.network.clone(),
    };
    let resolve = crate::deploy::start_within(
        deployment.as_ref(),
        &task,
        crate::deploy::start_timeout(&environment),
    );
    let target = tokio::select! {
        target = resolve => target.map_err(Unreached::Failed)?,
        _ = interrupts.recv() => return Err(Unreached::Interrupted),
    };
    let tls = Tls::new(
        target
            .endpoint
            .tls_fingerprint
            .as_deref()
            .or(environment.tls_fingerprint.as_deref()),
        target
            .endpoint
            .tls_ca
            .as_deref()
            .or(environment.tls_ca.as_deref()),
    );
    match tls {
        Ok(tls) => Ok(Reached { target, tls }),
        Err(e) => {
            target.stop().await;
            Err(Unreached::Failed(e.into()))
        }
    }
}

impl Reached {
    /// The profile requests name, said on stderr with why: `--profile`; for an executor we
    /// started, the strongest whose commands can write here (as `run` chooses, so never
    /// task-container or trusted on this host by itself); else none: the executor's default,
    /// said by [`say_default_profile`] once the command's connection has its hello. The probe
    /// asks for the command's `network`, so that a profile that cannot hold it is passed over
    /// with the executor's reason.
    pub async fn profile(
        &self,
        flag: Option<&str>,
        network: Option<protocol::RequestNetwork>,
    ) -> anyhow::Result<Option<String>> {
        match flag {
            Some(p) => {
                eprintln!("{}", profile_line(p, "named with --profile", &[]));
                Ok(Some(p.to_string()))
            }
            None if self.target.owned => {
                let mut probe = Environment::open_endpoint(
                    &self.target.endpoint,
                    config::EnvironmentConfig {
                        network,
                        ..Default::default()
                    },
                    self.target.profile_choice(),
                )
                .await?;
                probe.close().await;
                eprintln!("{}", probe.profile_line());
                Ok(probe.profile.clone())
            }
            None => Ok(None),
        }
    }

    /// A protocol 1.1 client on a new connection.
    pub async fn client(&self) -> Result<Client, ClientError> {
        Client::connect(
            &self.target.endpoint.url,
            self.target.endpoint.token.as_deref(),
            &self.tls,
        )
        .await
    }

    /// Tear down what was started (nothing for a remote executor). Always completes.
    pub async fn stop(self) {
        self.target.stop().await;
    }
}

/// For a request that names no profile: the executor's default, said on stderr as
/// [`Reached::profile`] says the others.
pub fn say_default_profile(profile: &Option<String>, hello: &protocol::Hello) {
    if profile.is_some() {
        return;
    }
    let layers = hello
        .profiles
        .iter()
        .find(|p| p.name == hello.default_profile)
        .map(|p| p.layers.clone())
        .unwrap_or_default();
    eprintln!(
        "{}",
        profile_line(&hello.default_profile, "the executor's default", &layers)
    );
}
