//! The environment: a WebSocket client of an executor. `execute(command)` returns mini's result
//! dictionary (`output`, `returncode`, `exception_info`, `extra`); a broken environment is an
//! [`EnvError`], which ends the run and is never shown to the model.

mod chunks;
mod client;
#[cfg(test)]
mod client_tests;
mod connection;
mod profile;
mod session;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::SinkExt;
use protocol::{ClientMessage, ErrorCode, ExecRequest, Hello};
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio_tungstenite::tungstenite::Message;

pub use client::{
    decode_output, list_processes_message, resize_message, signal_message, wait_message, Client,
    ClientError,
};
pub use connection::{connect, Endpoint, Ws};
pub use profile::{profile_line, Choice, PROFILE_PREFERENCE};
use session::Attempt;

use crate::config::EnvironmentConfig;
use crate::shell::quote;
use crate::tls::Tls;

/// `busy` answers retried before giving up.
const BUSY_RETRIES: u32 = 8;

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("the executor reports the environment is unusable ({code}): {message}")]
    Unusable { code: String, message: String },
    #[error("lost the connection to the executor at {url} and could not reconnect: {reason}")]
    Lost { url: String, reason: String },
}

/// One command's result, shaped like mini-swe-agent's.
#[derive(Debug, Clone, Serialize)]
pub struct Output {
    pub output: String,
    pub returncode: i32,
    pub exception_info: String,
    pub extra: Value,
}

impl Output {
    /// A command that did not run (rejected, lost), as mini pads unexecuted actions.
    pub fn not_run(exception_info: impl Into<String>) -> Self {
        Self {
            output: String::new(),
            returncode: protocol::RETURNCODE_NOT_FINISHED,
            exception_info: exception_info.into(),
            extra: json!({}),
        }
    }
}

pub struct Environment {
    url: String,
    token: Option<String>,
    tls: Tls,
    ws: Option<Ws>,
    pub hello: Hello,
    /// The profile sent with every request; `None` leaves it to the executor's default.
    pub profile: Option<String>,
    /// Why it is the one (named, the executor's default, chosen), for [`Environment::profile_line`].
    pub profile_why: String,
    pub config: EnvironmentConfig,
    env: BTreeMap<String, String>,
    /// Set when the configured interpreter differs from the executor's.
    wrap: Option<Vec<String>>,
    next_id: u64,
    /// Id of the last request sent, for [`Environment::cancel_running`].
    last_id: Option<String>,
    /// `uname -v` of the target, for mini's `{{version}}`: from the hello, or asked of an
    /// older executor whose hello does not carry it.
    kernel_version: String,
    /// The executor session our commands belong to, from the hello of the connection that
    /// started it. A resume keeps it (the new connection's hello names a session of its own,
    /// which the resume discards).
    session: String,
    /// How long the executor keeps the session's commands running after its connection drops
    /// (zero: it kills them at once, and there is nothing to resume).
    resume_grace: Duration,
    /// When the connection broke, while the session may still be waiting for us on the
    /// executor; `None` when connected, or when the session is known to be over.
    lost_at: Option<Instant>,
}

impl Environment {
    /// [`Environment::open`] on a deployed executor: its URL, token and certificate pin.
    pub async fn open_endpoint(
        endpoint: &Endpoint,
        mut config: EnvironmentConfig,
        choice: Choice,
    ) -> anyhow::Result<Self> {
        if endpoint.tls_fingerprint.is_some() || endpoint.tls_ca.is_some() {
            config.tls_fingerprint.clone_from(&endpoint.tls_fingerprint);
            config.tls_ca.clone_from(&endpoint.tls_ca);
        }
        Self::open(&endpoint.url, endpoint.token.clone(), config, choice).await
    }

    /// Connect, read the hello, and settle the profile: the configured one, else as `choice`
    /// says (the executor's default, or the strongest that works of those we may choose).
    pub async fn open(
        url: &str,
        token: Option<String>,
        config: EnvironmentConfig,
        choice: Choice,
    ) -> anyhow::Result<Self> {
        let tls = Tls::new(config.tls_fingerprint.as_deref(), config.tls_ca.as_deref())?;
        let (ws, hello) = connect(url, token.as_deref(), &tls)
            .await
            .map_err(|reason| {
                anyhow::anyhow!("cannot connect to the executor at {url}: {reason}")
            })?;
        if hello.protocol != protocol::PROTOCOL_VERSION {
            anyhow::bail!(
                "the executor at {url} speaks protocol {}, this agent speaks {}",
                hello.protocol,
                protocol::PROTOCOL_VERSION
            );
        }
        let offered: Vec<&str> = hello.profiles.iter().map(|p| p.name.as_str()).collect();
        let profile = match &config.profile {
            Some(name) => match hello.profiles.iter().find(|p| &p.name == name) {
                Some(p) if p.available => Some(name.clone()),
                Some(p) => anyhow::bail!(
                    "profile {name:?} cannot run on the executor's host: {}",
                    p.unavailable_reason.as_deref().unwrap_or("no reason given")
                ),
                None => anyhow::bail!(
                    "the executor offers no profile {name:?} (it has: {})",
                    offered.join(", ")
                ),
            },
            None => None,
        };
        if config.timeout <= 0.0 || config.timeout > hello.limits.max_timeout {
            anyhow::bail!(
                "environment.timeout {}s is outside the executor's range (0, {}]",
                config.timeout,
                hello.limits.max_timeout
            );
        }
        let mut env = BTreeMap::new();
        for name in &config.forward_env {
            if let Ok(value) = std::env::var(name) {
                env.insert(name.clone(), value);
            }
        }
        env.extend(config.env.clone());
        // Requests over the executor's bounds would be refused on every command: refuse now.
        let env_bytes: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        if env.len() > hello.limits.max_env_entries || env_bytes > hello.limits.max_env_bytes {
            anyhow::bail!(
                "environment.env and forward_env give {} variables ({env_bytes} bytes); the executor \
                 accepts at most {} ({} bytes)",
                env.len(),
                hello.limits.max_env_entries,
                hello.limits.max_env_bytes
            );
        }
        let wrap = config
            .interpreter
            .clone()
            .filter(|argv| !argv.is_empty() && *argv != hello.interpreter);
        let kernel_version = hello.host.version.clone();
        let mut environment = Self {
            url: url.to_string(),
            token,
            tls,
            ws: Some(ws),
            profile_why: if profile.is_some() {
                "named with --profile or environment.profile".to_string()
            } else {
                "the executor's default".to_string()
            },
            hello,
            profile,
            config,
            env,
            wrap,
            next_id: 0,
            last_id: None,
            kernel_version,
            session: String::new(),
            resume_grace: Duration::ZERO,
            lost_at: None,
        };
        environment.adopt_session();
        // An executor may have no default profile (none of its defaults runs on its host):
        // then requests must name one, and we choose as for a local executor.
        let no_default = environment.hello.default_profile.is_empty();
        if environment.profile.is_none() && (choice != Choice::Default || no_default) {
            environment.profile = Some(environment.strongest_usable_profile(choice).await?);
        }
        Ok(environment)
    }

    /// Learn `uname -v` where the hello lacked it and create the configured working directory
    /// (through the executor, so under its identity).
    pub async fn prepare(&mut self) -> Result<(), EnvError> {
        if self.kernel_version.is_empty() {
            let uname = self.run_raw("uname -v".into(), None, Some(10.0)).await?;
            if uname.returncode == 0 {
                self.kernel_version = uname.output.trim().to_string();
            }
        }
        let Some(cwd) = self.config.cwd.clone() else {
            return Ok(());
        };
        if !self.config.create_cwd {
            return Ok(());
        }
        let out = self
            .run_raw(format!("mkdir -p -- {}", quote(&cwd)), None, None)
            .await?;
        if out.returncode != 0 {
            return Err(EnvError::Unusable {
                code: "cwd".into(),
                message: format!("cannot create the working directory {cwd}: {}", out.output),
            });
        }
        Ok(())
    }

    /// Run one action in the configured cwd with the configured env and timeout.
    pub async fn execute(&mut self, command: &str) -> Result<Output, EnvError> {
        let command = match &self.wrap {
            Some(argv) => {
                let mut words: Vec<String> = argv.iter().map(|a| quote(a)).collect();
                words.push(quote(command));
                format!("exec {}", words.join(" "))
            }
            None => command.to_string(),
        };
        let cwd = self.config.cwd.clone();
        let timeout = Some(self.config.timeout);
        self.run_raw(command, cwd, timeout).await
    }

    /// Run `command` as given, with an explicit cwd and timeout (for setup steps).
    pub async fn run_raw(
        &mut self,
        command: String,
        cwd: Option<String>,
        timeout: Option<f64>,
    ) -> Result<Output, EnvError> {
        let mut busy = 0;
        let mut backoff = Duration::from_millis(100);
        loop {
            self.next_id += 1;
            let request = ExecRequest {
                id: format!("a{}", self.next_id),
                command: command.clone(),
                cwd: cwd.clone(),
                env: self.env.clone(),
                timeout,
                profile: self.profile.clone(),
                stream: false,
                network: self.config.network.clone(),
            };
            match self.exec_once(&request).await? {
                Attempt::Done(output) => return Ok(output),
                Attempt::Busy(message) => {
                    busy += 1;
                    if busy > BUSY_RETRIES {
                        return Err(EnvError::Unusable {
                            code: ErrorCode::Busy.to_string(),
                            message,
                        });
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Ask the executor to kill the command whose result we stopped waiting for (Ctrl-C).
    /// Best effort. If the connection is gone, the executor has killed the command already,
    /// unless it keeps our session for a resume: then we take the session back first.
    pub async fn cancel_running(&mut self) {
        let Some(id) = self.last_id.take() else {
            return;
        };
        self.take_back().await;
        let Some(ws) = self.ws.as_mut() else {
            return;
        };
        let cancel = ClientMessage::Cancel(protocol::CancelRequest { id });
        if let Ok(text) = serde_json::to_string(&cancel) {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), ws.send(Message::text(text))).await;
        }
    }

    /// Variables templates can use, like mini's `platform.uname()` plus the config.
    pub fn template_vars(&self) -> Map<String, Value> {
        let mut vars = match serde_json::to_value(&self.config) {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        };
        let host = &self.hello.host;
        let (system, release) = host
            .kernel
            .split_once(' ')
            .unwrap_or((host.kernel.as_str(), ""));
        vars.insert("system".into(), json!(system));
        vars.insert("node".into(), json!(host.hostname));
        vars.insert("release".into(), json!(release));
        vars.insert("version".into(), json!(self.kernel_version));
        vars.insert("machine".into(), json!(host.arch));
        vars.insert("processor".into(), json!(host.arch));
        vars.insert("cores".into(), json!(host.cores));
        vars.insert("hostname".into(), json!(host.hostname));
        vars.insert("executor_server".into(), json!(self.hello.server));
        vars.insert("workspace".into(), json!(self.hello.workspace));
        vars.insert("profile".into(), json!(self.effective_profile()));
        vars.insert("profile_layers".into(), json!(self.profile_layers()));
        vars
    }

    /// What the trajectory records about the environment (no token).
    pub fn serialize(&self) -> Value {
        json!({
            "config": self.config,
            "executor_url": self.url,
            "executor": self.hello.server,
            "host": self.hello.host,
            "profile": self.effective_profile(),
            "profile_layers": self.profile_layers(),
            "workspace": self.hello.workspace,
            "interpreter": self.hello.interpreter,
        })
    }

    /// End the session: a close frame makes the executor kill whatever still runs at once
    /// (a connection that merely drops would leave it running for the grace period).
    pub async fn close(&mut self) {
        self.take_back().await;
        self.close_connection().await;
    }
}
