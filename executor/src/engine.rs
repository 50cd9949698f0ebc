//! The execution engine: request in, result out. Shared by the daemon and `executor run`, so a
//! command run locally goes through exactly the path a remote one does.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use protocol::{ErrorCode, ExecResult, Isolation, Limits, ResultExtra};

use crate::request::ValidRequest;
use crate::runner::{Io, RunError, Runner, StopReason};
use sandbox::plan::{plan_command, PlanSettings};
use sandbox::profile::Profile;

/// Limits used when no flag overrides them; the comments give the reason for each value.
pub fn default_limits() -> Limits {
    Limits {
        max_message_bytes: 1 << 20,
        // Linux's MAX_ARG_STRLEN: no single argv string may be longer than 32 pages.
        max_command_bytes: 128 * 1024 - 1,
        max_env_entries: 256,
        max_env_bytes: 128 * 1024,
        max_id_bytes: 128,
        // mini-swe-agent's environments default to 30 s.
        default_timeout: 30.0,
        max_timeout: 24.0 * 3600.0,
        // Far more than mini's 10,000-character observation, small enough for many commands.
        max_output_bytes: 1 << 20,
        max_commands_per_connection: 16,
        max_commands_total: 64,
        // A REPL's or a server's recent output; older bytes fall out (the reply says how many).
        max_process_buffer_bytes: 1 << 20,
        // Data sets and artifacts, not disk images.
        max_upload_bytes: 1 << 30,
    }
}

/// Error returned instead of a result: the command did not run (or its setup broke).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecError {
    pub code: ErrorCode,
    pub message: String,
}

impl ExecError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// The one place that maps internal run errors to wire error codes.
impl From<RunError> for ExecError {
    fn from(err: RunError) -> Self {
        let code = match &err {
            RunError::SpawnHelper { .. } | RunError::Setup { .. } => ErrorCode::EnvironmentError,
            RunError::Plan(_) => ErrorCode::Internal,
        };
        Self::new(code, err.to_string())
    }
}

impl From<crate::network_policy::Refusal> for ExecError {
    fn from(refusal: crate::network_policy::Refusal) -> Self {
        let code = match refusal.layer {
            Some(sandbox::network::Layer::Request) => ErrorCode::BadRequest,
            _ => ErrorCode::EnvironmentError,
        };
        Self::new(code, refusal.message)
    }
}

/// What a probe found a profile applies on this host.
#[derive(Debug, Clone, PartialEq)]
pub struct Probed {
    pub layers: Vec<String>,
    pub missing: Vec<String>,
}

pub struct Engine {
    pub limits: Limits,
    pub plan_settings: PlanSettings,
    pub runner: Runner,
    pub profiles: BTreeMap<String, Profile>,
    pub default_profile: String,
    /// Network policy enforcement (`crate::enforce`); a daemon without one refuses every
    /// command whose network is a policy.
    pub enforcer: Option<crate::enforce::Enforcer>,
}

impl Engine {
    pub fn new(
        limits: Limits,
        plan_settings: PlanSettings,
        helper_exe: PathBuf,
        profiles: BTreeMap<String, Profile>,
        default_profile: String,
    ) -> Self {
        let runner = Runner::new(helper_exe, limits.max_output_bytes);
        Self {
            limits,
            plan_settings,
            runner,
            profiles,
            default_profile,
            enforcer: None,
        }
    }

    /// Resolve the profile a request asks for.
    pub fn profile(&self, asked: Option<&str>) -> Result<&Profile, ExecError> {
        let name = asked.unwrap_or(&self.default_profile);
        if name.is_empty() {
            return Err(ExecError::new(
                ErrorCode::ProfileDenied,
                "this host can run none of the default profiles (see `executor check`); name a profile",
            ));
        }
        self.profiles.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.profiles.keys().map(String::as_str).collect();
            ExecError::new(
                ErrorCode::ProfileDenied,
                format!(
                    "profile {name:?} is not available here; available: {}",
                    known.join(", ")
                ),
            )
        })
    }

    /// Plan and run one validated request.
    pub async fn execute(
        &self,
        req: &ValidRequest,
        io: Io,
        stop: impl Future<Output = StopReason>,
    ) -> Result<ExecResult, ExecError> {
        let profile = self.profile(req.profile.as_deref())?;
        let granted = crate::network_policy::effective_network(
            profile,
            &req.client_network,
            req.network.as_ref(),
        )?;
        let narrowed = crate::network_policy::narrowed_profile(profile, &granted)?;
        let profile = narrowed.as_ref().unwrap_or(profile);
        let mut plan = plan_command(&req.spec, profile, &self.plan_settings)
            .map_err(|err| ExecError::new(ErrorCode::EnvironmentError, err.to_string()))?;
        let network = Arc::new(granted.effective.clone());
        let net = match (&*network, &self.enforcer) {
            (sandbox::network::Effective::Policy(_), None) => {
                return Err(ExecError::new(
                    ErrorCode::EnvironmentError,
                    crate::enforce::EnforceError::NoEngine.to_string(),
                ))
            }
            (sandbox::network::Effective::Policy(_), Some(enforcer)) => {
                crate::enforce::shape_plan(
                    &mut plan,
                    &profile.name,
                    &network,
                    &enforcer.resolv_conf,
                )
                .map_err(|err| ExecError::new(ErrorCode::EnvironmentError, err.to_string()))?;
                Some(crate::runner::NetAttach {
                    enforcer,
                    ctx: Arc::new(crate::egress::CommandContext {
                        client: req.client.clone(),
                        session: req.session.clone(),
                        command: req.id.clone(),
                        policy: network.clone(),
                    }),
                })
            }
            _ => None,
        };
        let outcome = self
            .runner
            .run(&plan, req.warm, req.timeout, io, stop, net)
            .await?;
        let captured = outcome.captured;
        let mut limits_hit = outcome.limits_hit;
        if let Some(volume) = &req.spec.volume {
            limits_hit.extend(crate::workspaces::Volumes::hit(volume));
        }
        Ok(ExecResult {
            id: req.id.clone(),
            output: captured.text,
            returncode: outcome.returncode,
            exception_info: outcome.exception_info,
            extra: ResultExtra {
                ended: outcome.ending,
                timed_out: outcome.ending == protocol::Ending::TimedOut,
                cancelled: outcome.ending == protocol::Ending::Cancelled,
                duration_ms: outcome.duration.as_secs_f64() * 1000.0,
                signal: outcome.signal.map(signal_name),
                output_bytes: captured.total_bytes,
                truncated: captured.elided_bytes > 0,
                elided_bytes: captured.elided_bytes,
                killed_processes: outcome.killed,
                limits_hit,
                isolation: Isolation {
                    profile: profile.name.clone(),
                    layers: outcome.layers,
                    missing: plan.template.missing.clone(),
                    network: Some(protocol::NetworkReport {
                        connections: outcome.network,
                        ..crate::network_policy::report(&granted)
                    }),
                },
            },
        })
    }
}

impl Engine {
    /// Run `true` under every profile, to learn which this host can run and with which
    /// layers. A profile that cannot run says why, naming the layer that failed.
    pub async fn probe(&self) -> BTreeMap<String, Result<Probed, String>> {
        let names: Vec<String> = self.profiles.keys().cloned().collect();
        self.probe_these(&names).await
    }

    /// Probe only the default candidates, strongest first, stopping at the first that runs:
    /// enough to choose a default without paying for every profile (`executor run`).
    pub async fn probe_for_default(&self) -> BTreeMap<String, Result<Probed, String>> {
        let mut found = BTreeMap::new();
        for name in sandbox::profile::DEFAULT_PREFERENCE {
            if !self.profiles.contains_key(*name) {
                continue;
            }
            let outcome = self.probe_these(&[name.to_string()]).await;
            let ok = outcome.values().all(Result::is_ok);
            found.extend(outcome);
            if ok {
                break;
            }
        }
        found
    }

    /// Probe `names` concurrently (start-up waits for the slowest, not for their sum).
    async fn probe_these(&self, names: &[String]) -> BTreeMap<String, Result<Probed, String>> {
        let probes = names.iter().map(|name| async move {
            let req = ValidRequest {
                id: format!("probe-{name}"),
                spec: sandbox::plan::CommandSpec {
                    command: "true".into(),
                    cwd: Some("/".into()),
                    env: BTreeMap::new(),
                    ..Default::default()
                },
                timeout: std::time::Duration::from_secs(10),
                profile: Some(name.clone()),
                stream: false,
                // A probe's sandbox is no client's: keeping one warm would only waste it.
                warm: false,
                network: None,
                client_network: sandbox::network::Mode::Host,
                client: String::new(),
                session: String::new(),
            };
            let outcome = match self
                .execute(&req, Io::Capture(None), std::future::pending())
                .await
            {
                Ok(result) if result.returncode == 0 => Ok(Probed {
                    layers: result.extra.isolation.layers,
                    missing: result.extra.isolation.missing,
                }),
                Ok(result) => Err(format!(
                    "a probe command failed: returncode {} {}",
                    result.returncode, result.output
                )),
                Err(err) => Err(err.message),
            };
            (name.clone(), outcome)
        });
        futures_util::future::join_all(probes)
            .await
            .into_iter()
            .collect()
    }

    /// The strongest of the default profiles this host can run.
    pub fn choose_default(probe: &BTreeMap<String, Result<Probed, String>>) -> String {
        sandbox::profile::DEFAULT_PREFERENCE
            .iter()
            .find(|name| probe.get(**name).is_some_and(Result::is_ok))
            .map(|name| name.to_string())
            .unwrap_or_default()
    }
}

/// `SIGKILL` for 9; `SIG<n>` for numbers nix does not know (real-time signals).
pub fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("SIG{signal}"))
}
