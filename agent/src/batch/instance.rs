//! One instance of a batch: its executor deployed, connected and prepared under the start
//! deadline, `run.env_startup_command`, the agent loop, then teardown whatever happened, and
//! the outcome recorded (preds.json, trajectory, exit statuses, log).

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};
use tokio::sync::watch;

use super::instances::{Instance, INVALID};
use super::output::Outputs;
use super::progress::Progress;
use crate::agent_loop::{Agent, ExitStatus, Interrupts, Settings, Status};
use crate::config::{Config, Mode};
use crate::deploy::{Deployed, Deployment, TaskSpec};
use crate::executor_client::Environment;
use crate::model::Kind;
use crate::templates::{render, Templates};

/// Exit status of an instance whose executor never came up (missing image, a start that
/// timed out, an unreachable remote).
const DEPLOYMENT_ERROR: &str = "DeploymentError";
/// mini's for a failing `run.env_startup_command` (its RuntimeError).
const STARTUP_ERROR: &str = "RuntimeError";

/// What every worker shares.
pub struct Ctx {
    pub config: Config,
    pub kind: Kind,
    pub templates: Templates,
    pub model_name: String,
    pub deployment: Box<dyn Deployment>,
    pub outputs: std::sync::Arc<Outputs>,
    pub progress: std::sync::Arc<Progress>,
    pub stop: watch::Receiver<bool>,
    /// Local workspaces live here.
    pub scratch: tempfile::TempDir,
}

struct Finished {
    status: String,
    submission: String,
    reason: String,
}

impl Finished {
    fn failed(status: &str, reason: impl Into<String>) -> Self {
        Self {
            status: status.to_string(),
            submission: String::new(),
            reason: reason.into(),
        }
    }
}

pub async fn run(ctx: &Ctx, slot: usize, instance: Instance) {
    let id = instance.id.clone();
    let began = Instant::now();
    ctx.progress.started(slot, &id);
    ctx.outputs.log(&format!("{id}: started"));
    // Before anything touches a path made of its id. It stays out of preds.json (it was never
    // attempted): once the instances file is fixed, a rerun does it.
    if let Some(reason) = &instance.invalid {
        ctx.outputs.log(&format!("{id:?}: {INVALID}: {reason}"));
        if let Err(e) = ctx.outputs.record_status(&id, INVALID) {
            ctx.outputs.log(&format!("{id:?}: {e:#}"));
        }
        ctx.progress.finished(slot, &id, INVALID, 0.0);
        return;
    }
    if let Err(e) = ctx.outputs.forget(&id) {
        ctx.outputs.log(&format!("{id}: {e:#}"));
    }
    let finished = attempt(ctx, slot, &instance).await;
    if !finished.reason.is_empty() {
        ctx.outputs
            .log(&format!("{id}: {}: {}", finished.status, finished.reason));
    }
    // An interrupted instance is not done: it stays out of preds.json, so a rerun does it.
    if finished.status != ExitStatus::Interrupted.as_str() {
        if let Err(e) = ctx
            .outputs
            .record_pred(&id, &ctx.model_name, &finished.submission)
        {
            ctx.outputs
                .log(&format!("{id}: cannot record the prediction: {e:#}"));
        }
    }
    if let Err(e) = ctx.outputs.record_status(&id, &finished.status) {
        ctx.outputs.log(&format!("{id}: {e:#}"));
    }
    let seconds = began.elapsed().as_secs_f64();
    ctx.outputs
        .log(&format!("{id}: {} in {seconds:.1}s", finished.status));
    ctx.progress.finished(slot, &id, &finished.status, seconds);
}

/// Deploy, run, tear down. Never fails: every failure is an exit status and a reason.
async fn attempt(ctx: &Ctx, slot: usize, instance: &Instance) -> Finished {
    let id = &instance.id;
    let mut environment = ctx.config.environment.clone();
    if let Some(network) = &instance.network {
        environment.network = Some(network.clone());
    }
    let local = ctx.deployment.kind() == "local";
    // A fresh directory per instance, writable by the sandbox's identity (as the demo's),
    // removed when this instance ends however it ends. Its name is made unique on creation:
    // ids that sanitize alike (`a/b`, `a:b`) must not share or delete each other's.
    let mut scratch = None;
    let workspace = if local {
        let dir = match workspace_in(ctx.scratch.path(), id) {
            Ok(dir) => dir,
            Err(e) => {
                return Finished::failed(
                    DEPLOYMENT_ERROR,
                    format!("cannot make a workspace: {e:#}"),
                )
            }
        };
        let path = dir.path().display().to_string();
        scratch = Some(dir);
        environment.cwd = Some(path.clone());
        Some(path)
    } else {
        environment.cwd.clone()
    };
    let spec = TaskSpec {
        name: id.clone(),
        image: Some(instance.image.clone()),
        workspace,
        network: environment.network.clone(),
    };
    let deadline = crate::deploy::start_timeout(&environment);
    let deadline_at = tokio::time::Instant::now() + deadline;
    ctx.progress.worker(
        slot,
        &format!("{id}: starting its executor ({})", ctx.deployment.kind()),
    );
    let mut stop = ctx.stop.clone();
    let deployed = tokio::select! {
        d = crate::deploy::start_within(ctx.deployment.as_ref(), &spec, deadline) => d,
        _ = stopped(&mut stop) => {
            let reason = "interrupted while starting";
            write_failure(ctx, id, ExitStatus::Interrupted.as_str(), reason, &environment);
            return Finished::failed(ExitStatus::Interrupted.as_str(), reason);
        }
    };
    let deployed = match deployed {
        Ok(d) => d,
        Err(e) => {
            let reason = format!("{e:#}");
            write_failure(ctx, id, DEPLOYMENT_ERROR, &reason, &environment);
            return Finished::failed(DEPLOYMENT_ERROR, reason);
        }
    };
    ctx.outputs.log(&format!(
        "{id}: executor {} {} at {}",
        deployed.kind, deployed.id, deployed.endpoint.url
    ));
    let finished = with_executor(ctx, slot, instance, &deployed, environment, deadline_at).await;
    ctx.progress.worker(slot, &format!("{id}: tearing down"));
    if finished.status == DEPLOYMENT_ERROR {
        let log = deployed.log();
        if !log.trim().is_empty() {
            ctx.outputs
                .log(&format!("{id}: executor log:\n{}", log.trim_end()));
        }
    }
    deployed.stop().await;
    drop(scratch);
    finished
}

async fn with_executor(
    ctx: &Ctx,
    slot: usize,
    instance: &Instance,
    deployed: &Deployed,
    environment: crate::config::EnvironmentConfig,
    deadline_at: tokio::time::Instant,
) -> Finished {
    let id = &instance.id;
    let mut stop = ctx.stop.clone();
    ctx.progress.worker(slot, &format!("{id}: connecting"));
    let opened = async {
        let mut env = Environment::open_endpoint(
            &deployed.endpoint,
            environment.clone(),
            deployed.profile_choice(),
        )
        .await?;
        if let Err(e) = env.prepare().await {
            env.close().await;
            anyhow::bail!("{e}");
        }
        anyhow::Ok(env)
    };
    let opened = tokio::select! {
        o = tokio::time::timeout_at(deadline_at, opened) => o,
        _ = stopped(&mut stop) => {
            let reason = "interrupted while connecting";
            write_failure(ctx, id, ExitStatus::Interrupted.as_str(), reason, &environment);
            return Finished::failed(ExitStatus::Interrupted.as_str(), reason);
        }
    };
    let mut env = match opened {
        Ok(Ok(env)) => {
            ctx.outputs.log(&format!("{id}: {}", env.profile_line()));
            env
        }
        Ok(Err(e)) => {
            let reason = format!(
                "the executor at {} is not usable: {e:#}",
                deployed.endpoint.url
            );
            write_failure(ctx, id, DEPLOYMENT_ERROR, &reason, &environment);
            return Finished::failed(DEPLOYMENT_ERROR, reason);
        }
        Err(_) => {
            let reason = format!(
                "the executor at {} did not answer within the start timeout ({:.0}s)",
                deployed.endpoint.url, environment.start_timeout
            );
            write_failure(ctx, id, DEPLOYMENT_ERROR, &reason, &environment);
            return Finished::failed(DEPLOYMENT_ERROR, reason);
        }
    };
    // `run.env_startup_command`, rendered with the instance's fields, as mini runs it.
    if let Some(template) = ctx
        .config
        .other
        .get("run")
        .and_then(|run| run.get("env_startup_command"))
        .and_then(Value::as_str)
    {
        let rendered = match render(
            "env_startup_command",
            template,
            &Value::Object(instance.fields.clone()),
        ) {
            Ok(r) => r,
            Err(e) => {
                env.close().await;
                write_failure(ctx, id, STARTUP_ERROR, &e.to_string(), &environment);
                return Finished::failed(STARTUP_ERROR, e.to_string());
            }
        };
        ctx.progress
            .worker(slot, &format!("{id}: env_startup_command"));
        let out = tokio::select! {
            o = env.execute(&rendered) => o,
            _ = stopped(&mut stop) => {
                env.close().await;
                let reason = "interrupted in env_startup_command";
                write_failure(ctx, id, ExitStatus::Interrupted.as_str(), reason, &environment);
                return Finished::failed(ExitStatus::Interrupted.as_str(), reason);
            }
        };
        let failure = match out {
            Ok(o) if o.returncode == 0 => None,
            Ok(o) => Some(format!(
                "env_startup_command returned {}: {}{}",
                o.returncode, o.output, o.exception_info
            )),
            Err(e) => Some(format!("env_startup_command: {e}")),
        };
        if let Some(reason) = failure {
            env.close().await;
            write_failure(ctx, id, STARTUP_ERROR, &reason, &environment);
            return Finished::failed(STARTUP_ERROR, reason);
        }
    }
    let model = match build_model(ctx, id) {
        Ok(m) => m,
        Err(e) => {
            env.close().await;
            let reason = format!("{e:#}");
            write_failure(
                ctx,
                id,
                ExitStatus::ModelError.as_str(),
                &reason,
                &environment,
            );
            return Finished::failed(ExitStatus::ModelError.as_str(), reason);
        }
    };
    let progress = ctx.progress.clone();
    let prefix = id.clone();
    let status: Status = std::sync::Arc::new(move |line: &str| {
        progress.worker(slot, &format!("{prefix}: {}", line.trim()));
    });
    let c = &ctx.config;
    let settings = Settings {
        templates: ctx.templates.clone(),
        step_limit: c.agent.step_limit,
        cost_limit: c.agent.cost_limit,
        wall_time_limit: c.agent.wall_time_limit,
        format_error_limit: c.agent.format_error_limit,
        mode: Mode::Yolo,
        output: ctx.outputs.trajectory_path(id),
        config: json!({
            "agent": c.agent,
            "agent_type": "agent.agent_loop.Agent",
            "model": c.model,
            "model_type": ctx.kind.type_name(),
            "environment_type": "agent.environment.Environment",
            "deployment": deployed.kind,
        }),
        agent_vars: crate::run::to_map(&c.agent),
        model_vars: crate::run::to_map(&c.model),
        status: Some(status),
    };
    let mut agent = Agent::new(
        model,
        env,
        settings,
        None,
        Interrupts::Stop(ctx.stop.clone()),
    );
    let outcome = agent.run(&instance.problem_statement).await;
    agent.environment().close().await;
    if let Err(e) = ctx.outputs.stamp_trajectory(id) {
        ctx.outputs.log(&format!("{id}: {e:#}"));
    }
    match outcome {
        Ok(o) => Finished {
            status: o.exit_status.as_str().to_string(),
            submission: o.submission,
            reason: if o.exit_status == ExitStatus::Submitted {
                String::new()
            } else {
                o.message
            },
        },
        // Template errors in the first messages: a config error, recorded like mini records
        // an exception (its class name as the status).
        Err(e) => Finished::failed("TemplateError", format!("{e:#}")),
    }
}

/// A fresh model per instance (the scripted model's script may name the instance).
fn build_model(ctx: &Ctx, id: &str) -> anyhow::Result<crate::model::Model> {
    let mut config = ctx.config.clone();
    if let Some(script) = &config.model.script {
        let path = script.display().to_string().replace("{instance_id}", id);
        config.model.script = Some(PathBuf::from(path));
    }
    crate::run::build_model(&config, ctx.kind, &ctx.model_name, false)
}

fn write_failure(
    ctx: &Ctx,
    id: &str,
    status: &str,
    reason: &str,
    environment: &crate::config::EnvironmentConfig,
) {
    let config = json!({
        "agent": ctx.config.agent,
        "model": ctx.config.model,
        "environment": {"config": environment},
    });
    if let Err(e) = ctx
        .outputs
        .write_failure_trajectory(id, status, reason, config)
    {
        ctx.outputs.log(&format!("{id}: {e:#}"));
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A new directory in `scratch` named after `id`, unique even when ids sanitize alike;
/// removed when dropped.
fn workspace_in(scratch: &std::path::Path, id: &str) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix(&format!("{}-", sanitize(id)))
        .tempdir_in(scratch)?;
    crate::deploy::local::make_open_dir(dir.path())?;
    Ok(dir)
}

fn sanitize(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_sanitize_alike_get_workspaces_of_their_own() {
        let scratch = tempfile::tempdir().unwrap();
        assert_eq!(sanitize("a:b"), sanitize("a b"));
        let a = workspace_in(scratch.path(), "a:b").unwrap();
        let b = workspace_in(scratch.path(), "a b").unwrap();
        assert_ne!(a.path(), b.path());
        std::fs::write(b.path().join("work"), "b's").unwrap();
        // One ending removes its own workspace only.
        let a_path = a.path().to_path_buf();
        drop(a);
        assert!(!a_path.exists());
        assert_eq!(
            std::fs::read_to_string(b.path().join("work")).unwrap(),
            "b's"
        );
    }
}
