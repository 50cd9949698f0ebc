//! The environment: a WebSocket client of an executor. `execute(command)` returns mini's result
//! dictionary (`output`, `returncode`, `exception_info`, `extra`); a broken environment is an
//! [`EnvError`], which ends the run and is never shown to the model.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use protocol::{
    CancelRequest, ClientMessage, ErrorCode, ExecRequest, Hello, ResumeRequest, ServerMessage,
};
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::config::EnvironmentConfig;
use crate::tls::{self, Tls};

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Profiles from strongest to weakest; a local run takes the first one the executor offers.
pub const PROFILE_PREFERENCE: &[&str] = &["strict", "landlock", "task-container", "trusted"];

/// How long connecting plus the hello may take.
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);
/// Extra time past a command's own timeout before the executor counts as unresponsive.
const RESULT_SLACK: Duration = Duration::from_secs(30);
/// `busy` answers retried before giving up.
const BUSY_RETRIES: u32 = 8;
/// Times one request is sent before the connection counts as unusable.
const SEND_ATTEMPTS: u32 = 3;
/// After a resume, time granted for the result the executor replays, even if the command's
/// own deadline passed while we were reconnecting.
const REPLAY_PATIENCE: Duration = Duration::from_secs(10);
/// How long a deliberate end (closing, cancelling) may spend taking back a session that a
/// lost connection left running on the executor.
const TAKE_BACK_PATIENCE: Duration = Duration::from_secs(5);

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
            session: String::new(),
            resume_grace: Duration::ZERO,
            lost_at: None,
        };
        environment.adopt_session();
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

    async fn exec_once(&mut self, request: &ExecRequest) -> Result<Attempt, EnvError> {
        let text = serde_json::to_string(&ClientMessage::Exec(request.clone())).map_err(|e| {
            EnvError::Unusable {
                code: "client".into(),
                message: format!("cannot encode the request: {e}"),
            }
        })?;
        let wait = Duration::from_secs_f64(
            request
                .timeout
                .unwrap_or(self.hello.limits.default_timeout)
                .max(0.0),
        ) + RESULT_SLACK;
        let mut deadline = tokio::time::Instant::now() + wait;
        let mut sends = 0;
        let mut must_send = true;
        // After a resume in which the request was not running: the id of a sync message whose
        // answer comes after everything the executor replayed (see `Environment::recover`).
        let mut sync: Option<String> = None;
        // Whether the deadline already sent us to a new connection for the result.
        let mut asked_again = false;
        loop {
            if must_send {
                sends += 1;
                if sends > SEND_ATTEMPTS {
                    return Err(self.lost("the connection failed while sending a command"));
                }
                let ws = self.connected().await?;
                let sent = ws.send(Message::text(text.clone())).await.is_ok();
                self.last_id = Some(request.id.clone());
                deadline = tokio::time::Instant::now() + wait;
                if sent {
                    must_send = false;
                    continue;
                }
                // The request may or may not have reached the executor before the break.
                self.connection_lost();
                match self.recover(&request.id).await? {
                    // A new session never saw the request (the old one killed it if it did).
                    Standing::Gone => {}
                    Standing::Running => must_send = false,
                    Standing::Unsure(id) => {
                        must_send = false;
                        sync = Some(id);
                    }
                }
                continue;
            }
            let Some(ws) = self.ws.as_mut() else {
                return Err(self.lost("no connection"));
            };
            let frame = match tokio::time::timeout_at(deadline, ws.next()).await {
                Ok(frame) => frame,
                Err(_) if !asked_again && !self.resume_grace.is_zero() => {
                    // The connection may have died silently (an outage that delivers no FIN
                    // or RST is noticed by neither side) with the result written into it:
                    // ask for the session on a new connection, whose replay has the result.
                    asked_again = true;
                    None
                }
                Err(_) => {
                    // Unresponsive: end the session (a close frame kills its commands) rather
                    // than leave it running for a resume nobody will ask for.
                    self.close_connection().await;
                    return Err(self.lost("the executor sent no result in time"));
                }
            };
            let text = match frame {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) => {
                    // The executor closed the connection deliberately (shutdown, revoked
                    // client): that ends the session and its commands; no resume.
                    self.session_over();
                    self.connected().await?;
                    return Ok(Attempt::Done(Output::not_run(CUT_SHORT)));
                }
                Some(Err(_)) | None => {
                    self.connection_lost();
                    match self.recover(&request.id).await? {
                        // The executor killed the command with the old session; its result
                        // is gone. We are connected again: the model learns it was cut short.
                        Standing::Gone => return Ok(Attempt::Done(Output::not_run(CUT_SHORT))),
                        Standing::Running => {}
                        Standing::Unsure(id) => sync = Some(id),
                    }
                    // Its result comes on the new connection, from the replay or live.
                    deadline = deadline.max(tokio::time::Instant::now() + REPLAY_PATIENCE);
                    continue;
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
                    if sync.is_some() && err.id.as_deref() == sync.as_deref() =>
                {
                    // Everything replayed came before this answer, and no result of ours was
                    // among it: the request never reached the executor. Send it again.
                    sync = None;
                    must_send = true;
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

    /// After the connection broke while `id` was being sent or run: reconnect, taking our
    /// session back if the executor may still keep it, and find out where `id` stands.
    async fn recover(&mut self, id: &str) -> Result<Standing, EnvError> {
        let awaiting = [id.to_string()];
        for _ in 0..SEND_ATTEMPTS {
            let running = match self.reconnect(&awaiting).await? {
                Reconnected::Fresh => return Ok(Standing::Gone),
                Reconnected::Resumed { running } => running,
            };
            if running.iter().any(|r| r == id) {
                return Ok(Standing::Running);
            }
            // Not running: its result (or error) is among what the executor replays right
            // after `resumed`, or the request never reached it. The executor answers messages
            // in order and replays before it reads the next one, so its answer to a cancel of
            // an id nobody uses (not_found) comes after the whole replay: if our result has
            // not come by then, it never will.
            self.next_id += 1;
            let sync = format!("sync{}", self.next_id);
            let cancel = ClientMessage::Cancel(CancelRequest { id: sync.clone() });
            let sent = match (serde_json::to_string(&cancel), self.ws.as_mut()) {
                (Ok(text), Some(ws)) => ws.send(Message::text(text)).await.is_ok(),
                _ => false,
            };
            if sent {
                return Ok(Standing::Unsure(sync));
            }
            self.connection_lost();
        }
        Err(self.lost("the connection kept failing right after a resume"))
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
                self.session_over();
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

    /// The open connection, reconnecting with bounded backoff if it is gone (and resuming our
    /// session if the executor may still keep it).
    async fn connected(&mut self) -> Result<&mut Ws, EnvError> {
        if self.ws.is_none() {
            self.reconnect(&[]).await?;
        }
        self.ws.as_mut().ok_or_else(|| EnvError::Lost {
            url: String::new(),
            reason: "no connection".into(),
        })
    }

    /// Connect again with bounded backoff. If the session may still be waiting for us (the
    /// connection broke less than its grace period ago), ask for it back with `resume`,
    /// listing in `awaiting` the ids we have no result for; otherwise, or if the executor no
    /// longer has it, the new connection starts a fresh session.
    ///
    /// At least `reconnect_attempts` attempts are made, and while a resume is possible they go
    /// on (backoff capped at 4 s) until the grace period ends: a network outage shorter than
    /// the grace period then costs nothing.
    async fn reconnect(&mut self, awaiting: &[String]) -> Result<Reconnected, EnvError> {
        let mut delay = Duration::from_millis(250);
        let mut last = String::from("not attempted");
        let mut attempt = 0;
        loop {
            if attempt > 0 {
                let grace_left = self
                    .lost_at
                    .is_some_and(|t| t.elapsed() + delay < self.resume_grace);
                if attempt >= self.config.reconnect_attempts.max(1) && !grace_left {
                    return Err(self.lost(&last));
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(4));
            }
            attempt += 1;
            let (mut ws, hello) = match connect(&self.url, self.token.as_deref(), &self.tls).await {
                Ok(connection) => connection,
                Err(err) => {
                    // A refused certificate will be refused again: stop at once.
                    if !err.retry {
                        return Err(self.lost(&err.reason));
                    }
                    last = err.reason;
                    continue;
                }
            };
            if !self.may_resume() {
                eprintln!("executor: reconnected to {}", self.url);
                self.start_fresh(ws, hello);
                return Ok(Reconnected::Fresh);
            }
            match resume(&mut ws, &self.session, awaiting).await {
                Ok(Resume::Resumed(running)) => {
                    eprintln!(
                        "executor: reconnected to {} and resumed session {} ({} of its commands \
                         still running)",
                        self.url,
                        self.session,
                        running.len()
                    );
                    // The new hello's own session (and its workspace, for per-connection
                    // clients) was discarded by the executor: ours goes on.
                    self.hello = Hello {
                        session: self.session.clone(),
                        workspace: self.hello.workspace.clone(),
                        ..hello
                    };
                    self.ws = Some(ws);
                    self.lost_at = None;
                    return Ok(Reconnected::Resumed { running });
                }
                Ok(Resume::Refused(reason)) => {
                    // Expired (the executor killed its commands) or unknown: the connection
                    // goes on as the fresh session its hello announced.
                    eprintln!(
                        "executor: reconnected to {}, but session {} could not be resumed: {reason}",
                        self.url, self.session
                    );
                    self.start_fresh(ws, hello);
                    return Ok(Reconnected::Fresh);
                }
                // The new connection failed too (the resume may have reached the executor;
                // then the session is detached again, with a new grace period): retry.
                Err(reason) => last = reason,
            }
        }
    }

    /// Use a new connection as a new session.
    fn start_fresh(&mut self, ws: Ws, hello: Hello) {
        self.hello = hello;
        self.ws = Some(ws);
        self.lost_at = None;
        self.adopt_session();
    }

    /// Take the session and its grace period from the current hello.
    fn adopt_session(&mut self) {
        self.session = self.hello.session.clone();
        self.resume_grace =
            Duration::try_from_secs_f64(self.hello.resume_grace).unwrap_or(Duration::ZERO);
    }

    /// Whether the executor may still keep the session of the connection we lost.
    /// Whether to ask for the session back. Only the executor knows whether its grace period
    /// is over (it starts when the executor notices the drop, which may be much later than we
    /// did), so we always ask when there is one, and its `not_found` decides.
    fn may_resume(&self) -> bool {
        !self.session.is_empty() && !self.resume_grace.is_zero() && self.lost_at.is_some()
    }

    /// The connection broke (no close frame either way): the executor keeps the session for
    /// its grace period.
    fn connection_lost(&mut self) {
        self.ws = None;
        self.lost_at.get_or_insert_with(Instant::now);
    }

    /// The session ended on the executor's side (it sent a close frame): nothing to resume.
    fn session_over(&mut self) {
        self.ws = None;
        self.lost_at = None;
    }

    /// A deliberate end needs a connection to say so: if a lost connection left the session
    /// (and maybe a command) running on the executor, take it back, briefly.
    async fn take_back(&mut self) {
        if self.ws.is_none() && self.may_resume() {
            let _ = tokio::time::timeout(TAKE_BACK_PATIENCE, self.reconnect(&[])).await;
        }
    }

    /// Send a close frame: the executor ends the session and kills its commands at once.
    async fn close_connection(&mut self) {
        if let Some(mut ws) = self.ws.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
        }
        self.lost_at = None;
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

    /// End the session: a close frame makes the executor kill whatever still runs at once
    /// (a connection that merely drops would leave it running for the grace period).
    pub async fn close(&mut self) {
        self.take_back().await;
        self.close_connection().await;
    }
}

/// What the model learns of a command whose connection broke and whose session is gone.
const CUT_SHORT: &str = "The connection to the executor was lost while this command ran; the \
                         executor killed it, so it may have run partly.";

enum Attempt {
    Done(Output),
    Busy(String),
}

enum Reconnected {
    /// The old session is back, with the ids of its commands still running.
    Resumed { running: Vec<String> },
    /// A new session: whatever the old one ran was killed.
    Fresh,
}

/// Where a request stands after a reconnection.
enum Standing {
    /// In a session that is gone (killed if it ran at all).
    Gone,
    /// Running in the resumed session; its result will come.
    Running,
    /// Not running in the resumed session: its result is in the replay, or it never reached
    /// the executor. The answer to the sync message with this id tells which.
    Unsure(String),
}

/// The executor's answer to `resume`.
enum Resume {
    /// The ids of the session's commands still running.
    Resumed(Vec<String>),
    /// Why not (the session expired or is unknown); the connection is a fresh session.
    Refused(String),
}

/// Ask for `session` back as the first message on a new connection. `Err`: the connection
/// failed.
async fn resume(ws: &mut Ws, session: &str, awaiting: &[String]) -> Result<Resume, String> {
    let request = ClientMessage::Resume(ResumeRequest {
        session: session.to_string(),
        awaiting: awaiting.to_vec(),
    });
    let text = serde_json::to_string(&request).map_err(|e| e.to_string())?;
    let exchange = async {
        ws.send(Message::text(text))
            .await
            .map_err(|e| e.to_string())?;
        loop {
            let text = match ws.next().await {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) | None => {
                    return Err("the executor closed the connection".to_string())
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.to_string()),
            };
            match serde_json::from_str::<ServerMessage>(text.as_str()) {
                Ok(ServerMessage::Resumed(resumed)) if resumed.session == session => {
                    return Ok(Resume::Resumed(resumed.running))
                }
                // `not_found`, or an executor that does not know `resume` (`bad_request`):
                // errors about no request carry no id.
                Ok(ServerMessage::Error(err)) if err.id.is_none() => {
                    return Ok(Resume::Refused(format!("{}: {}", err.code, err.message)))
                }
                Ok(_) => continue,
                Err(e) => return Err(format!("unreadable answer to resume: {e}")),
            }
        }
    };
    tokio::time::timeout(CONNECT_PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| Err("no answer to resume in time".into()))
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
                        Ok(ServerMessage::Hello(hello)) => Ok((ws, *hello)),
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

    use std::sync::{Arc, Mutex};

    use protocol::{
        Ending, ErrorMessage, ExecResult, Isolation, Limits, ProfileSummary, ResultExtra, Resumed,
    };
    use tokio::net::TcpListener;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("it's"), r"'it'\''s'");
    }

    /// Builds the answer to a client message.
    type Answerer = Box<dyn FnOnce(&ClientMessage) -> Vec<ServerMessage> + Send>;

    /// One step of a fake executor's connection.
    enum Step {
        Send(Box<ServerMessage>),
        /// Read the client's next message and answer it.
        Answer(Answerer),
        /// Drop the connection without a close frame, as a network failure does.
        Drop,
    }

    fn answer(f: impl FnOnce(&ClientMessage) -> Vec<ServerMessage> + Send + 'static) -> Step {
        Step::Answer(Box::new(f))
    }

    fn hello(session: &str, resume_grace: f64) -> Step {
        Step::Send(Box::new(ServerMessage::Hello(Box::new(Hello {
            protocol: protocol::PROTOCOL_VERSION,
            profiles: vec![ProfileSummary {
                name: "trusted".into(),
                description: String::new(),
                available: true,
                layers: vec!["session".into()],
                missing: vec![],
                unavailable_reason: None,
            }],
            default_profile: "trusted".into(),
            limits: Limits {
                default_timeout: 30.0,
                max_timeout: 60.0,
                max_env_entries: 8,
                max_env_bytes: 1024,
                ..Limits::default()
            },
            session: session.into(),
            resume_grace,
            ..Hello::default()
        }))))
    }

    fn result(id: &str, output: &str) -> ServerMessage {
        ServerMessage::Result(ExecResult {
            id: id.into(),
            output: output.into(),
            returncode: 0,
            exception_info: String::new(),
            extra: ResultExtra {
                ended: Ending::Exited,
                timed_out: false,
                cancelled: false,
                duration_ms: 1.0,
                signal: None,
                output_bytes: output.len() as u64,
                truncated: false,
                elided_bytes: 0,
                killed_processes: 0,
                limits_hit: Vec::new(),
                isolation: Isolation {
                    profile: "trusted".into(),
                    layers: Vec::new(),
                    missing: Vec::new(),
                },
            },
        })
    }

    fn not_found(id: Option<String>) -> ServerMessage {
        ServerMessage::Error(ErrorMessage {
            id,
            code: ErrorCode::NotFound,
            message: "nothing by that name".into(),
        })
    }

    fn exec_id(msg: &ClientMessage) -> String {
        match msg {
            ClientMessage::Exec(req) => req.id.clone(),
            other => panic!("expected exec, got {other:?}"),
        }
    }

    /// A fake executor that serves `connections` one after another, each by its steps, and
    /// records every message the client sends.
    async fn fake_executor(
        connections: Vec<Vec<Step>>,
    ) -> (String, Arc<Mutex<Vec<ClientMessage>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "ws://{}{}",
            listener.local_addr().unwrap(),
            protocol::WS_PATH
        );
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            for steps in connections {
                let (tcp, _) = listener.accept().await.unwrap();
                let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
                let mut dropped = false;
                for step in steps {
                    let replies = match step {
                        Step::Send(msg) => vec![*msg],
                        Step::Answer(answer) => {
                            let Some(msg) = next_client_message(&mut ws).await else {
                                panic!("the client left early");
                            };
                            log.lock().unwrap().push(msg.clone());
                            answer(&msg)
                        }
                        Step::Drop => {
                            dropped = true;
                            break;
                        }
                    };
                    for reply in replies {
                        let text = serde_json::to_string(&reply).unwrap();
                        ws.send(Message::text(text)).await.unwrap();
                    }
                }
                if dropped {
                    continue;
                }
                // Record whatever else the client sends until it closes.
                while let Some(msg) = next_client_message(&mut ws).await {
                    log.lock().unwrap().push(msg);
                }
            }
        });
        (url, seen)
    }

    async fn next_client_message(ws: &mut WebSocketStream<TcpStream>) -> Option<ClientMessage> {
        loop {
            match ws.next().await? {
                Ok(Message::Text(text)) => {
                    return Some(serde_json::from_str(text.as_str()).unwrap())
                }
                Ok(Message::Close(_)) | Err(_) => return None,
                Ok(_) => continue,
            }
        }
    }

    async fn open(url: &str) -> Environment {
        Environment::open(url, None, EnvironmentConfig::default(), false)
            .await
            .unwrap()
    }

    async fn execute(env: &mut Environment, command: &str) -> Output {
        tokio::time::timeout(Duration::from_secs(20), env.execute(command))
            .await
            .expect("no answer in time")
            .unwrap()
    }

    fn resume_of(msg: &ClientMessage) -> (String, Vec<String>) {
        match msg {
            ClientMessage::Resume(r) => (r.session.clone(), r.awaiting.clone()),
            other => panic!("expected resume, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_command_still_running_after_the_break_is_waited_for_in_the_resumed_session() {
        let (url, seen) = fake_executor(vec![
            vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
            vec![
                hello("s2", 30.0),
                answer(|_| {
                    vec![ServerMessage::Resumed(Resumed {
                        session: "s1".into(),
                        running: vec!["a1".into()],
                    })]
                }),
                Step::Send(Box::new(result("a1", "finished\n"))),
            ],
        ])
        .await;
        let mut env = open(&url).await;
        let out = execute(&mut env, "sleep 1; echo finished").await;
        assert_eq!((out.output.as_str(), out.returncode), ("finished\n", 0));
        env.close().await;
        let seen = seen.lock().unwrap().clone();
        assert_eq!(exec_id(&seen[0]), "a1");
        assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
        assert_eq!(seen.len(), 2, "{seen:?}");
    }

    #[tokio::test]
    async fn a_request_lost_in_the_break_is_sent_again_in_the_resumed_session() {
        let (url, seen) = fake_executor(vec![
            // The request arrives, but as far as the executor knows it never did.
            vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
            vec![
                hello("s2", 30.0),
                answer(|_| {
                    vec![ServerMessage::Resumed(Resumed {
                        session: "s1".into(),
                        running: Vec::new(),
                    })]
                }),
                answer(|sync| match sync {
                    ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                    other => panic!("expected the sync cancel, got {other:?}"),
                }),
                answer(|exec| vec![result(&exec_id(exec), "ran\n")]),
            ],
        ])
        .await;
        let mut env = open(&url).await;
        let out = execute(&mut env, "echo ran").await;
        assert_eq!((out.output.as_str(), out.returncode), ("ran\n", 0));
        env.close().await;
        let seen = seen.lock().unwrap().clone();
        assert_eq!(exec_id(&seen[0]), "a1");
        assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
        assert!(matches!(&seen[2], ClientMessage::Cancel(_)), "{seen:?}");
        assert_eq!(exec_id(&seen[3]), "a1");
        assert_eq!(seen.len(), 4, "{seen:?}");
    }

    #[tokio::test]
    async fn a_result_in_the_replay_is_taken_and_the_command_is_not_run_again() {
        let (url, seen) = fake_executor(vec![
            vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
            vec![
                hello("s2", 30.0),
                answer(|_| {
                    vec![
                        ServerMessage::Resumed(Resumed {
                            session: "s1".into(),
                            running: Vec::new(),
                        }),
                        result("a1", "done while you were away\n"),
                    ]
                }),
                answer(|sync| match sync {
                    ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                    other => panic!("expected the sync cancel, got {other:?}"),
                }),
            ],
        ])
        .await;
        let mut env = open(&url).await;
        let out = execute(&mut env, "true").await;
        assert_eq!(out.output, "done while you were away\n");
        env.close().await;
        let seen = seen.lock().unwrap().clone();
        assert!(
            seen.iter()
                .filter(|m| matches!(m, ClientMessage::Exec(_)))
                .count()
                == 1,
            "the command was sent again: {seen:?}"
        );
    }

    #[tokio::test]
    async fn an_expired_session_cuts_the_command_short_and_the_new_session_goes_on() {
        let (url, seen) = fake_executor(vec![
            vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
            vec![
                hello("s2", 30.0),
                answer(|_| vec![not_found(None)]),
                answer(|exec| vec![result(&exec_id(exec), "second\n")]),
                Step::Drop,
            ],
            // The session now is the second connection's own.
            vec![
                hello("s3", 30.0),
                answer(|_| {
                    vec![ServerMessage::Resumed(Resumed {
                        session: "s2".into(),
                        running: Vec::new(),
                    })]
                }),
                answer(|sync| match sync {
                    ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                    other => panic!("expected the sync cancel, got {other:?}"),
                }),
                answer(|exec| vec![result(&exec_id(exec), "third\n")]),
            ],
        ])
        .await;
        let mut env = open(&url).await;
        let out = execute(&mut env, "sleep 9").await;
        assert_eq!(out.returncode, protocol::RETURNCODE_NOT_FINISHED);
        assert_eq!(out.exception_info, CUT_SHORT);
        assert_eq!(execute(&mut env, "echo second").await.output, "second\n");
        // Dropped while idle: the agent notices when it sends the next command, resumes the
        // second session, learns the command never arrived there, and sends it again.
        assert_eq!(execute(&mut env, "echo third").await.output, "third\n");
        env.close().await;
        let seen = seen.lock().unwrap().clone();
        assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
        assert_eq!(exec_id(&seen[2]), "a2");
        assert_eq!(resume_of(&seen[3]), ("s2".into(), vec!["a3".into()]));
        assert!(matches!(&seen[4], ClientMessage::Cancel(_)), "{seen:?}");
        assert_eq!(exec_id(&seen[5]), "a3");
        assert_eq!(seen.len(), 6, "{seen:?}");
    }

    #[tokio::test]
    async fn without_a_grace_period_no_resume_is_asked_for() {
        let (url, seen) = fake_executor(vec![
            vec![hello("s1", 0.0), answer(|_| Vec::new()), Step::Drop],
            vec![
                hello("s2", 0.0),
                answer(|exec| vec![result(&exec_id(exec), "fresh\n")]),
            ],
        ])
        .await;
        let mut env = open(&url).await;
        let out = execute(&mut env, "sleep 9").await;
        assert_eq!(out.exception_info, CUT_SHORT);
        assert_eq!(execute(&mut env, "echo fresh").await.output, "fresh\n");
        env.close().await;
        let seen = seen.lock().unwrap().clone();
        assert!(
            !seen.iter().any(|m| matches!(m, ClientMessage::Resume(_))),
            "{seen:?}"
        );
    }
}
