//! The environment: a WebSocket client of an executor. `execute(command)` returns mini's result
//! dictionary (`output`, `returncode`, `exception_info`, `extra`); a broken environment is an
//! [`EnvError`], which ends the run and is never shown to the model.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ErrorCode, ExecRequest, Hello, ServerMessage};
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::config::EnvironmentConfig;
use crate::tls::{self, Tls};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Profiles from strongest to weakest; a local run takes the first one the executor offers.
pub const PROFILE_PREFERENCE: &[&str] = &["strict", "landlock", "task-container", "trusted"];

/// How long connecting plus the hello may take.
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);
/// Extra time past a command's own timeout before the executor counts as unresponsive.
const RESULT_SLACK: Duration = Duration::from_secs(30);
/// `busy` answers retried before giving up.
const BUSY_RETRIES: u32 = 8;

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct ConnectError {
    pub reason: String,
    /// False when trying again cannot help (the executor's certificate was refused).
    pub retry: bool,
}

impl From<String> for ConnectError {
    fn from(reason: String) -> Self {
        Self {
            reason,
            retry: true,
        }
    }
}

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
    pub config: EnvironmentConfig,
    env: BTreeMap<String, String>,
    /// Set when the configured interpreter differs from the executor's.
    wrap: Option<Vec<String>>,
    next_id: u64,
    /// Id of the last request sent, for [`Environment::cancel_running`].
    last_id: Option<String>,
    /// `uname -v` of the target, for mini's `{{version}}` (the hello does not carry it).
    kernel_version: String,
}

impl Environment {
    /// Connect, read the hello, and settle the profile. `choose_strongest` applies the
    /// preference order when no profile is configured (local executors).
    pub async fn open(
        url: &str,
        token: Option<String>,
        config: EnvironmentConfig,
        choose_strongest: bool,
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
        let mut environment = Self {
            url: url.to_string(),
            token,
            tls,
            ws: Some(ws),
            hello,
            profile,
            config,
            env,
            wrap,
            next_id: 0,
            last_id: None,
            kernel_version: String::new(),
        };
        // An executor may have no default profile (none of its defaults runs on its host):
        // then requests must name one, and we choose as for a local executor.
        let no_default = environment.hello.default_profile.is_empty();
        if environment.profile.is_none() && (choose_strongest || no_default) {
            environment.profile = Some(environment.strongest_usable_profile().await?);
        }
        Ok(environment)
    }

    /// The first profile in [`PROFILE_PREFERENCE`] (then any other offered) that the executor
    /// reports available and under which a probe command can write the executor's workspace.
    /// Only a command shows whether the sandbox's identity may write it (an unprivileged uid
    /// cannot write a directory owned by someone else).
    async fn strongest_usable_profile(&mut self) -> anyhow::Result<String> {
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
                eprintln!(
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
                Ok(_) => eprintln!(
                    "executor: not using profile {name:?}: its commands cannot write {place}"
                ),
                Err(EnvError::Unusable { code, message }) => {
                    eprintln!("executor: not using profile {name:?}: {code}: {message}")
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

    /// Learn `uname -v` and create the configured working directory (through the executor, so
    /// under its identity).
    pub async fn prepare(&mut self) -> Result<(), EnvError> {
        let uname = self.run_raw("uname -v".into(), None, Some(10.0)).await?;
        if uname.returncode == 0 {
            self.kernel_version = uname.output.trim().to_string();
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
    /// Best effort: if the connection is gone, the executor has killed it already.
    pub async fn cancel_running(&mut self) {
        let (Some(id), Some(ws)) = (self.last_id.take(), self.ws.as_mut()) else {
            return;
        };
        let cancel = ClientMessage::Cancel(protocol::CancelRequest { id });
        if let Ok(text) = serde_json::to_string(&cancel) {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), ws.send(Message::text(text))).await;
        }
    }

    async fn exec_once(&mut self, request: &ExecRequest) -> Result<Attempt, EnvError> {
        let text = serde_json::to_string(&ClientMessage::Exec(request.clone())).map_err(|e| {
            EnvError::Unusable {
                code: "client".into(),
                message: format!("cannot encode the request: {e}"),
            }
        })?;
        // A send that fails never reached a running command: reconnect and send again, once.
        let mut sent = false;
        for _ in 0..2 {
            let ws = self.connected().await?;
            if ws.send(Message::text(text.clone())).await.is_ok() {
                sent = true;
                break;
            }
            self.ws = None;
        }
        if !sent {
            return Err(self.lost("the connection failed while sending a command"));
        }
        self.last_id = Some(request.id.clone());
        let wait = Duration::from_secs_f64(
            request
                .timeout
                .unwrap_or(self.hello.limits.default_timeout)
                .max(0.0),
        ) + RESULT_SLACK;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Some(ws) = self.ws.as_mut() else {
                return Err(self.lost("no connection"));
            };
            let frame = match tokio::time::timeout_at(deadline, ws.next()).await {
                Ok(frame) => frame,
                Err(_) => {
                    self.ws = None;
                    return Err(self.lost("the executor sent no result in time"));
                }
            };
            let text = match frame {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    // The executor kills a command whose client disconnects; its result is
                    // gone. If we can reconnect, the model learns the command was cut short.
                    self.ws = None;
                    self.connected().await?;
                    return Ok(Attempt::Done(Output::not_run(
                        "The connection to the executor was lost while this command ran; the \
                         executor killed it, so it may have run partly.",
                    )));
                }
                Some(Ok(_)) => continue,
            };
            let message: ServerMessage = match serde_json::from_str(text.as_str()) {
                Ok(message) => message,
                Err(e) => {
                    return Err(EnvError::Unusable {
                        code: "protocol".into(),
                        message: format!("the executor sent an unreadable message ({e})"),
                    })
                }
            };
            match message {
                ServerMessage::Result(result) if result.id == request.id => {
                    let extra = serde_json::to_value(&result.extra).unwrap_or(Value::Null);
                    return Ok(Attempt::Done(Output {
                        output: result.output,
                        returncode: result.returncode,
                        exception_info: result.exception_info,
                        extra,
                    }));
                }
                ServerMessage::Error(err)
                    if err.id.as_deref() == Some(&request.id) || err.id.is_none() =>
                {
                    return self.map_error(err).await;
                }
                _ => continue,
            }
        }
    }

    async fn map_error(&mut self, err: protocol::ErrorMessage) -> Result<Attempt, EnvError> {
        match err.code {
            // A client quota (commands per minute) refills: wait like for a busy executor.
            ErrorCode::Busy | ErrorCode::QuotaExceeded => Ok(Attempt::Busy(err.message)),
            // The request itself was refused (e.g. a command longer than the executor allows):
            // the model can change it, so it sees this like a failed command.
            ErrorCode::BadRequest => Ok(Attempt::Done(Output::not_run(format!(
                "The executor refused to run this command: {}",
                err.message
            )))),
            ErrorCode::ShuttingDown => {
                self.ws = None;
                Err(self.lost(&format!("the executor is shutting down: {}", err.message)))
            }
            ErrorCode::EnvironmentError
            | ErrorCode::ProfileDenied
            | ErrorCode::Internal
            | ErrorCode::DuplicateId
            | ErrorCode::NotFound => Err(EnvError::Unusable {
                code: err.code.to_string(),
                message: err.message,
            }),
        }
    }

    /// The open connection, reconnecting with bounded backoff if it is gone.
    async fn connected(&mut self) -> Result<&mut Ws, EnvError> {
        if self.ws.is_none() {
            let mut delay = Duration::from_millis(250);
            let mut last = String::from("not attempted");
            for attempt in 0..self.config.reconnect_attempts.max(1) {
                if attempt > 0 {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(4));
                }
                match connect(&self.url, self.token.as_deref(), &self.tls).await {
                    Ok((ws, hello)) => {
                        eprintln!("executor: reconnected to {}", self.url);
                        self.hello = hello;
                        self.ws = Some(ws);
                        break;
                    }
                    Err(err) => {
                        last = err.reason;
                        if !err.retry {
                            break;
                        }
                    }
                }
            }
            if self.ws.is_none() {
                return Err(self.lost(&last));
            }
        }
        self.ws.as_mut().ok_or_else(|| EnvError::Lost {
            url: String::new(),
            reason: "no connection".into(),
        })
    }

    fn lost(&self, reason: &str) -> EnvError {
        EnvError::Lost {
            url: self.url.clone(),
            reason: reason.to_string(),
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

    /// Close the connection politely.
    pub async fn close(&mut self) {
        if let Some(mut ws) = self.ws.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
        }
    }
}

enum Attempt {
    Done(Output),
    Busy(String),
}

/// Open a connection and read the hello.
pub async fn connect(
    url: &str,
    token: Option<&str>,
    tls: &Tls,
) -> Result<(Ws, Hello), ConnectError> {
    let attempt = async {
        let connector = tls.connector(url).map_err(|reason| ConnectError {
            reason,
            retry: false,
        })?;
        let mut request = url.into_client_request().map_err(|e| e.to_string())?;
        if let Some(token) = token {
            let value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| "the token contains characters not allowed in a header".to_string())?;
            request.headers_mut().insert("Authorization", value);
        }
        let connected =
            tokio_tungstenite::connect_async_tls_with_config(request, None, false, connector).await;
        let (mut ws, _) = connected.map_err(|e| match tls::certificate_refused(&e) {
            Some(reason) => ConnectError {
                reason,
                retry: false,
            },
            None => ConnectError::from(e.to_string()),
        })?;
        loop {
            match ws.next().await {
                Some(Ok(Message::Text(text))) => {
                    return match serde_json::from_str::<ServerMessage>(text.as_str()) {
                        Ok(ServerMessage::Hello(hello)) => Ok((ws, hello)),
                        Ok(other) => Err(format!("expected hello, got {other:?}").into()),
                        Err(e) => Err(format!("unreadable hello: {e}").into()),
                    };
                }
                Some(Ok(Message::Close(frame))) => {
                    return Err(format!(
                        "the executor closed the connection{}",
                        frame.map(|f| format!(": {}", f.reason)).unwrap_or_default()
                    )
                    .into())
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.to_string().into()),
                None => return Err("the executor closed the connection".to_string().into()),
            }
        }
    };
    tokio::time::timeout(CONNECT_PATIENCE, attempt)
        .await
        .unwrap_or_else(|_| Err("timed out".to_string().into()))
}

/// Quote a word for POSIX sh.
pub fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
