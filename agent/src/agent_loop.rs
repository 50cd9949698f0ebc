//! The mini-swe-agent loop: render the system and instance messages, then query the model,
//! run each action in order, render each result with the observation template, and append,
//! until an exit. The trajectory is written after every step and at the end.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Map, Value};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::config::Mode;
use crate::console::{Console, Decision, Resume};
use crate::executor_client::{EnvError, Environment, Output};
use crate::model::openai::action_json;
use crate::model::{timestamp, Action, Model, ModelError};
use crate::templates::{render, Templates};
use crate::trajectory::{write_atomic, Trajectory};

/// Exit code when interrupted before the loop started (and of `agent exec` on Ctrl-C).
pub const INTERRUPTED: u8 = 130;

/// First line of a command's output that submits the rest.
pub const SUBMIT_SENTINEL: &str = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT";

/// How a run ended. The names are mini-swe-agent's `exit_status` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Submitted,
    LimitsExceeded,
    TimeExceeded,
    RepeatedFormatError,
    EnvironmentError,
    Interrupted,
    /// The model provider failed past its retries, or the script ran out.
    ModelError,
}

impl ExitStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Submitted => "Submitted",
            Self::LimitsExceeded => "LimitsExceeded",
            Self::TimeExceeded => "TimeExceeded",
            Self::RepeatedFormatError => "RepeatedFormatError",
            Self::EnvironmentError => "EnvironmentError",
            Self::Interrupted => "Interrupted",
            Self::ModelError => "ModelError",
        }
    }

    /// Process exit code of `agent run`.
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Submitted => 0,
            Self::LimitsExceeded => 3,
            Self::TimeExceeded => 4,
            Self::RepeatedFormatError => 5,
            Self::EnvironmentError => 6,
            Self::ModelError => 7,
            Self::Interrupted => 130,
        }
    }
}

#[derive(Debug)]
pub struct Outcome {
    pub exit_status: ExitStatus,
    pub submission: String,
    /// Why the run ended, for people (the exit message's content).
    pub message: String,
}

pub struct Settings {
    pub templates: Templates,
    pub step_limit: u64,
    pub cost_limit: f64,
    pub wall_time_limit: f64,
    pub format_error_limit: u64,
    pub mode: Mode,
    pub output: PathBuf,
    /// `info.config` of the trajectory.
    pub config: Value,
    /// Agent-config values offered to templates (mini exposes its config to them).
    pub agent_vars: Map<String, Value>,
    pub model_vars: Map<String, Value>,
    /// Progress lines go here when set, else to stderr.
    pub status: Option<Status>,
}

/// Ctrl-C and SIGTERM both end the run as `Interrupted`, after saving. Installed before
/// anything is started, so a signal never kills the agent while it owns a local executor.
pub enum Interrupts {
    Signals {
        int: Signal,
        term: Signal,
    },
    /// A batch worker: its run stops when the batch does (the batch holds the signals).
    Stop(tokio::sync::watch::Receiver<bool>),
}

impl Interrupts {
    pub fn install() -> std::io::Result<Self> {
        Ok(Self::Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    pub async fn recv(&mut self) -> Caught {
        match self {
            Self::Signals { int, term } => tokio::select! {
                _ = int.recv() => Caught::Interrupt,
                _ = term.recv() => Caught::Terminate,
            },
            Self::Stop(stop) => {
                if stop.wait_for(|stopped| *stopped).await.is_err() {
                    // The batch is gone without saying stop: nothing will interrupt us.
                    std::future::pending::<()>().await;
                }
                Caught::Terminate
            }
        }
    }
}

/// Where a run's progress lines go instead of stderr (a batch worker's status line).
pub type Status = std::sync::Arc<dyn Fn(&str) + Send + Sync>;

/// Which signal arrived: Ctrl-C at a terminal opens the interrupt menu, SIGTERM always stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caught {
    Interrupt,
    Terminate,
}

enum Step {
    Continue,
    Exit(Outcome),
}

pub struct Agent {
    model: Model,
    env: Environment,
    settings: Settings,
    console: Option<Console>,
    interrupts: Interrupts,
    messages: Vec<Value>,
    n_calls: u64,
    cost: f64,
    started: Instant,
    deadline: Option<tokio::time::Instant>,
    format_errors: u64,
    task_vars: Map<String, Value>,
    /// What the person typed at the interrupt menu, for the model after this step's results.
    note: Option<String>,
}

impl Agent {
    pub fn new(
        model: Model,
        env: Environment,
        settings: Settings,
        console: Option<Console>,
        interrupts: Interrupts,
    ) -> Self {
        let deadline = (settings.wall_time_limit > 0.0).then(|| {
            tokio::time::Instant::now()
                + std::time::Duration::from_secs_f64(settings.wall_time_limit)
        });
        Self {
            model,
            env,
            settings,
            console,
            interrupts,
            messages: Vec::new(),
            n_calls: 0,
            cost: 0.0,
            started: Instant::now(),
            deadline,
            format_errors: 0,
            task_vars: Map::new(),
            note: None,
        }
    }

    pub fn environment(&mut self) -> &mut Environment {
        &mut self.env
    }

    /// Template variables, merged like mini's: agent config, environment, model, counters, task.
    fn vars(&self) -> Map<String, Value> {
        let mut vars = self.settings.agent_vars.clone();
        vars.extend(self.env.template_vars());
        vars.extend(self.settings.model_vars.clone());
        vars.insert("n_model_calls".into(), json!(self.n_calls));
        vars.insert("model_cost".into(), json!(self.cost));
        vars.insert("step".into(), json!(self.n_calls));
        vars.extend(self.task_vars.clone());
        vars
    }

    /// Run the task to an exit. Template errors in the first two messages are config errors.
    pub async fn run(&mut self, task: &str) -> anyhow::Result<Outcome> {
        self.task_vars.insert("task".into(), json!(task));
        let vars = Value::Object(self.vars());
        let system = render("system", &self.settings.templates.system_template, &vars)?;
        let instance = render(
            "instance",
            &self.settings.templates.instance_template,
            &vars,
        )?;
        self.messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": instance}),
        ];
        self.save(None);
        let outcome = loop {
            let step = self.step().await;
            match step {
                Step::Continue => self.save(None),
                Step::Exit(outcome) => break outcome,
            }
        };
        self.messages.push(json!({
            "role": "exit",
            "content": if outcome.exit_status == ExitStatus::Submitted { &outcome.submission } else { &outcome.message },
            "extra": {
                "exit_status": outcome.exit_status.as_str(),
                "submission": outcome.submission,
                "timestamp": timestamp(),
            },
        }));
        self.save(Some(&outcome));
        Ok(outcome)
    }

    fn exit(status: ExitStatus, message: impl Into<String>) -> Step {
        Step::Exit(Outcome {
            exit_status: status,
            submission: String::new(),
            message: message.into(),
        })
    }

    async fn step(&mut self) -> Step {
        let limits = &self.settings;
        if limits.step_limit > 0 && self.n_calls >= limits.step_limit {
            return Self::exit(
                ExitStatus::LimitsExceeded,
                format!("step limit of {} model calls reached", limits.step_limit),
            );
        }
        if limits.cost_limit > 0.0 && self.cost >= limits.cost_limit {
            return Self::exit(
                ExitStatus::LimitsExceeded,
                format!(
                    "cost limit of ${} reached (${:.4})",
                    limits.cost_limit, self.cost
                ),
            );
        }
        if self
            .deadline
            .is_some_and(|d| tokio::time::Instant::now() >= d)
        {
            return self.time_exceeded();
        }

        let actions = if self.settings.mode == Mode::Human {
            match self.human_turn().await {
                Ok(Some(actions)) => actions,
                Ok(None) => return Step::Continue,
                Err(step) => return step,
            }
        } else {
            match self.model_turn().await {
                Ok(Some(actions)) => actions,
                Ok(None) => return Step::Continue,
                Err(step) => return step,
            }
        };

        for action in actions {
            if let Some(exit) = self.act(action).await {
                return exit;
            }
        }
        self.push_note();
        Step::Continue
    }

    /// Ctrl-C at a terminal: ask whether to stop, switch mode, or tell the model something.
    /// `Some(exit)` to stop; `None` to carry on (any note is kept in `self.note`).
    async fn interrupt_menu(&mut self, caught: Caught, what: &str) -> Option<Step> {
        let stop = || {
            Some(Self::exit(
                ExitStatus::Interrupted,
                format!("interrupted {what}"),
            ))
        };
        let console = match (caught, self.console.as_mut()) {
            (Caught::Interrupt, Some(console)) => console,
            _ => return stop(),
        };
        let mut mode = self.settings.mode;
        let answer = tokio::select! {
            a = console.after_interrupt(&mut mode) => a,
            _ = self.interrupts.recv() => return stop(),
        };
        self.settings.mode = mode;
        match answer {
            Resume::Stop => stop(),
            Resume::Continue(note) => {
                self.note = note;
                None
            }
        }
    }

    /// Append what the person typed at the interrupt menu as a user message.
    fn push_note(&mut self) {
        if let Some(note) = self.note.take() {
            self.messages.push(json!({
                "role": "user",
                "content": note,
                "extra": {"source": "human", "interrupt_type": "UserInterruption", "timestamp": timestamp()},
            }));
        }
    }

    fn time_exceeded(&self) -> Step {
        Self::exit(
            ExitStatus::TimeExceeded,
            format!(
                "wall-time limit of {}s reached",
                self.settings.wall_time_limit
            ),
        )
    }

    /// Query the model; `Ok(None)` after a format error that was fed back.
    async fn model_turn(&mut self) -> Result<Option<Vec<Action>>, Step> {
        self.n_calls += 1;
        let step_no = self.n_calls;
        let deadline = self.deadline;
        // A batch worker's line says what the worker waits for (its timer then counts the
        // model's time, not the last command's); stderr of a single run needs no such line.
        if let Some(status) = &self.settings.status {
            status(&format!("[step {step_no}] waiting for the model"));
        }
        let result = tokio::select! {
            r = self.model.query(&self.messages) => r,
            caught = self.interrupts.recv() => {
                return match self.interrupt_menu(caught, "while waiting for the model").await {
                    Some(exit) => Err(exit),
                    None => {
                        self.push_note();
                        Ok(None)
                    }
                };
            }
            _ = sleep_until(deadline) => return Err(self.time_exceeded()),
        };
        match result {
            Ok(reply) => {
                self.cost += reply.cost;
                self.format_errors = 0;
                if let Some(text) = reply.message["content"]
                    .as_str()
                    .filter(|t| !t.trim().is_empty())
                {
                    self.progress(&format!("[step {step_no}] {}", first_line(text, 160)));
                }
                self.messages.push(reply.message);
                Ok(Some(reply.actions))
            }
            Err(ModelError::Format {
                error,
                actions,
                response,
                cost,
            }) => {
                self.cost += cost;
                self.format_errors += 1;
                self.progress(&format!("[step {step_no}] format error: {error}"));
                let mut vars = self.vars();
                vars.insert("error".into(), json!(error));
                vars.insert("actions".into(), json!(actions));
                let content = match render(
                    "format_error",
                    &self.settings.templates.format_error_template,
                    &Value::Object(vars),
                ) {
                    Ok(content) => content,
                    Err(e) => return Err(Self::exit(ExitStatus::ModelError, e.to_string())),
                };
                self.messages.push(json!({
                    "role": "user",
                    "content": content,
                    "extra": {
                        "interrupt_type": "FormatError",
                        "error": error,
                        "n_actions": actions.len(),
                        "model_response": response,
                        "cost": cost,
                        "timestamp": timestamp(),
                    },
                }));
                if self.format_errors >= self.settings.format_error_limit.max(1) {
                    return Err(Self::exit(
                        ExitStatus::RepeatedFormatError,
                        format!(
                            "{} consecutive format errors; last: {error}",
                            self.format_errors
                        ),
                    ));
                }
                Ok(None)
            }
            Err(ModelError::Fatal(message)) => Err(Self::exit(ExitStatus::ModelError, message)),
        }
    }

    /// Human mode: the person types a command. `Ok(None)` after a mode switch.
    async fn human_turn(&mut self) -> Result<Option<Vec<Action>>, Step> {
        let Some(console) = self.console.as_mut() else {
            return Err(Self::exit(
                ExitStatus::Interrupted,
                "human mode needs a terminal",
            ));
        };
        let mut mode = self.settings.mode;
        let answer = tokio::select! {
            a = console.human_command(&mut mode) => a,
            _ = self.interrupts.recv() => return Err(Self::exit(ExitStatus::Interrupted, "interrupted at the prompt")),
        };
        self.settings.mode = mode;
        match answer {
            Err(()) => Err(Self::exit(ExitStatus::Interrupted, "stdin closed")),
            Ok(None) => Ok(None),
            Ok(Some(command)) => {
                self.messages.push(json!({
                    "role": "user",
                    "content": format!("User command: \n```bash\n{command}\n```"),
                    "extra": {"actions": [{"command": command}], "source": "human", "timestamp": timestamp()},
                }));
                Ok(Some(vec![Action {
                    command,
                    tool_call_id: None,
                }]))
            }
        }
    }

    /// Run one action (after confirmation if asked) and append its observation.
    async fn act(&mut self, action: Action) -> Option<Step> {
        let mut command = action.command.clone();
        let mut edited_from = None;
        if self.settings.mode == Mode::Confirm {
            if let Some(console) = self.console.as_mut() {
                let mut mode = self.settings.mode;
                let decision = tokio::select! {
                    d = console.confirm(&command, &mut mode) => d,
                    _ = self.interrupts.recv() => return Some(Self::exit(ExitStatus::Interrupted, "interrupted at the confirmation prompt")),
                };
                self.settings.mode = mode;
                match decision {
                    None => return Some(Self::exit(ExitStatus::Interrupted, "stdin closed")),
                    Some(Decision::Run { command: c, edited }) => {
                        if edited {
                            edited_from = Some(command.clone());
                        }
                        command = c;
                    }
                    Some(Decision::Reject(reason)) => {
                        let output = Output::not_run(format!(
                            "Command not executed. The user rejected your command with the following message: {reason}"
                        ));
                        return self.observe(&action, &command, output, json!({"rejected": true}));
                    }
                }
            }
        }

        self.progress(&format!(
            "[step {} | ${:.4} | {:.1}s] $ {}",
            self.n_calls,
            self.cost,
            self.started.elapsed().as_secs_f64(),
            first_line(&command, 200)
        ));
        let deadline = self.deadline;
        let result = tokio::select! {
            r = self.env.execute(&command) => r,
            caught = self.interrupts.recv() => {
                // The command goes on in the executor until told otherwise.
                self.env.cancel_running().await;
                if let Some(exit) = self.interrupt_menu(caught, "while a command ran").await {
                    return Some(exit);
                }
                let output = Output::not_run("The user interrupted this command; it was killed.");
                return self.observe(&action, &command, output, json!({"interrupted": true}));
            }
            _ = sleep_until(deadline) => return Some(self.time_exceeded()),
        };
        let output = match result {
            Ok(output) => output,
            Err(err @ (EnvError::Unusable { .. } | EnvError::Lost { .. })) => {
                return Some(Self::exit(ExitStatus::EnvironmentError, err.to_string()))
            }
        };
        self.progress(&format!(
            "    -> returncode {}{}, {} characters",
            output.returncode,
            if output.exception_info.is_empty() {
                String::new()
            } else {
                format!(" ({})", first_line(&output.exception_info, 120))
            },
            output.output.chars().count()
        ));
        if let Some(submission) = submission(&output) {
            return Some(Step::Exit(Outcome {
                exit_status: ExitStatus::Submitted,
                submission,
                message: "submitted".into(),
            }));
        }
        let note = match edited_from {
            Some(original) => json!({"edited_from": original}),
            None => json!({}),
        };
        self.observe(&action, &command, output, note)
    }

    /// Append the observation message for `action`.
    fn observe(
        &mut self,
        action: &Action,
        command: &str,
        output: Output,
        note: Value,
    ) -> Option<Step> {
        let mut vars = self.vars();
        vars.insert(
            "output".into(),
            serde_json::to_value(&output).unwrap_or(Value::Null),
        );
        vars.insert("action".into(), action_json(action));
        let content = match render(
            "observation",
            &self.settings.templates.observation_template,
            &Value::Object(vars),
        ) {
            Ok(content) => content,
            Err(e) => return Some(Self::exit(ExitStatus::ModelError, e.to_string())),
        };
        let mut extra = json!({
            "raw_output": output.output,
            "returncode": output.returncode,
            "timestamp": timestamp(),
            "command": command,
            "executor": output.extra,
        });
        if !output.exception_info.is_empty() {
            extra["exception_info"] = json!(output.exception_info);
        }
        if let (Some(extra), Value::Object(note)) = (extra.as_object_mut(), note) {
            extra.extend(note);
        }
        let mut message = json!({"content": content, "extra": extra});
        match &action.tool_call_id {
            Some(id) => {
                message["role"] = json!("tool");
                message["tool_call_id"] = json!(id);
            }
            None => message["role"] = json!("user"),
        }
        self.messages.push(message);
        None
    }

    fn save(&self, outcome: Option<&Outcome>) {
        let (status, submission) = match outcome {
            Some(o) => (o.exit_status.as_str(), o.submission.as_str()),
            None => ("", ""),
        };
        let mut config = self.settings.config.clone();
        config["environment"] = self.env.serialize();
        let doc = Trajectory {
            messages: &self.messages,
            cost: self.cost,
            api_calls: self.n_calls,
            exit_status: status,
            submission,
            config,
            extra_info: json!({
                "elapsed_seconds": self.started.elapsed().as_secs_f64(),
                "mode": format!("{:?}", self.settings.mode).to_lowercase(),
            }),
        }
        .to_json();
        if let Err(e) = write_atomic(&self.settings.output, &doc) {
            crate::notes::note!("agent: {e}");
        }
    }

    fn progress(&self, line: &str) {
        match &self.settings.status {
            Some(status) => status(line),
            None => eprintln!("{line}"),
        }
    }

    pub fn stats(&self) -> (u64, f64) {
        (self.n_calls, self.cost)
    }
}

/// mini's rule: the first line (after leading whitespace) is exactly the sentinel and the
/// command succeeded; the rest of the output is the submission.
pub fn submission(output: &Output) -> Option<String> {
    if output.returncode != 0 {
        return None;
    }
    let text = output.output.trim_start();
    let (first, rest) = match text.find('\n') {
        Some(i) => (&text[..i], &text[i + 1..]),
        None => (text, ""),
    };
    (first.trim() == SUBMIT_SENTINEL).then(|| rest.to_string())
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn first_line(text: &str, max: usize) -> String {
    let line = text.trim().lines().next().unwrap_or_default();
    let more = text.trim().lines().nth(1).is_some();
    let mut out: String = line.chars().take(max).collect();
    if more || line.chars().count() > max {
        out.push_str(" ...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(text: &str, rc: i32) -> Output {
        Output {
            output: text.into(),
            returncode: rc,
            exception_info: String::new(),
            extra: json!({}),
        }
    }

    #[test]
    fn sentinel_on_the_first_line_with_returncode_0_submits_the_rest() {
        let o = out(
            "\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/x b/x\n",
            0,
        );
        assert_eq!(submission(&o).as_deref(), Some("diff --git a/x b/x\n"));
        assert_eq!(
            submission(&out("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", 0)).as_deref(),
            Some("")
        );
    }

    #[test]
    fn sentinel_elsewhere_or_with_failure_does_not_submit() {
        assert_eq!(
            submission(&out("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\nx", 1)),
            None
        );
        assert_eq!(
            submission(&out("x\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", 0)),
            None
        );
        assert_eq!(
            submission(&out("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT now", 0)),
            None
        );
    }
}
