//! `agent run`: one task, from the command line, through one executor.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Map, Value};

use crate::agent_loop::{Agent, Interrupts, Settings, INTERRUPTED};
use crate::config::{self, Config, Mode};
use crate::console::Console;
use crate::deploy::flags::ExecutorArgs;
use crate::deploy::{Deployed, TaskSpec};
use crate::executor_client::Environment;
use crate::model::{self, Kind, Model};
use crate::templates::Templates;
use crate::{demo, trajectory};

#[derive(Args)]
pub struct RunArgs {
    /// The task, as text.
    #[arg(long, conflicts_with_all = ["task_file", "demo"])]
    task: Option<String>,
    /// The task, from a file.
    #[arg(long, value_name = "PATH", conflicts_with = "demo")]
    task_file: Option<PathBuf>,
    /// Demo: fix a toy repository with a failing test, using the built-in scripted model
    /// (no API key) unless --model is given.
    #[arg(long)]
    demo: bool,
    /// Config file (mini-swe-agent YAML) or KEY=VALUE override, e.g. agent.step_limit=20.
    /// Repeatable; later ones win.
    #[arg(short = 'c', long = "config", value_name = "FILE|KEY=VALUE")]
    config: Vec<String>,
    /// Model name, e.g. gpt-4.1, anthropic/claude-sonnet-4-5, or `scripted`.
    #[arg(short = 'm', long)]
    model: Option<String>,
    /// Model client: openai (tool calls), text, anthropic, scripted.
    #[arg(long)]
    model_class: Option<String>,
    /// API base URL of an OpenAI-compatible or Anthropic server.
    #[arg(long, value_name = "URL")]
    base_url: Option<String>,
    /// Script of responses for the scripted model.
    #[arg(long, value_name = "PATH")]
    script: Option<PathBuf>,
    #[command(flatten)]
    executor: ExecutorArgs,
    #[command(flatten)]
    network: crate::network::NetworkArgs,
    /// Working directory of the commands (created if missing).
    #[arg(long, value_name = "DIR")]
    cwd: Option<String>,
    /// Seconds each command may run.
    #[arg(long)]
    timeout: Option<f64>,
    /// confirm, yolo or human (default: confirm on a terminal, yolo otherwise).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Shorthand for --mode yolo.
    #[arg(short = 'y', long, conflicts_with = "mode")]
    yolo: bool,
    #[arg(long)]
    step_limit: Option<u64>,
    #[arg(long)]
    cost_limit: Option<f64>,
    /// Trajectory file.
    #[arg(short = 'o', long, value_name = "PATH")]
    output: Option<PathBuf>,
    /// SWE-bench instance id: also write the submission to preds.json.
    #[arg(long)]
    instance_id: Option<String>,
    /// preds.json to update (default: next to the trajectory).
    #[arg(long, value_name = "PATH")]
    preds: Option<PathBuf>,
}

pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    let mut interrupts = Interrupts::install()?;
    let mut config = config::load(&args.config)?;
    apply_flags(&mut config, &args)?;
    let ignored = config.ignored_keys();
    if !ignored.is_empty() {
        eprintln!(
            "config: ignoring keys this agent does not use: {}",
            ignored.join(", ")
        );
    }

    // The task, and for the demo its toy repository.
    let demo_dir = if args.demo {
        Some(demo::directory()?)
    } else {
        None
    };
    let task = match (&args.task, &args.task_file, &demo_dir) {
        (Some(task), _, _) => task.clone(),
        (None, Some(path), _) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the task file {}", path.display()))?,
        (None, None, Some(_)) => demo::TASK.to_string(),
        (None, None, None) => {
            bail!("give a task with --task TEXT or --task-file PATH (or try --demo)")
        }
    };
    if let Some(dir) = &demo_dir {
        config.environment.cwd = Some(dir.join("repo").display().to_string());
    }

    // The model.
    let model_name = config
        .model
        .model_name
        .clone()
        .or_else(|| {
            std::env::var("MSWEA_MODEL_NAME")
                .ok()
                .filter(|m| !m.is_empty())
        })
        .or_else(|| args.demo.then(|| "scripted".to_string()))
        .with_context(|| no_model(config.model.script.is_some(), "agent run"))?;
    config.model.model_name = Some(model_name.clone());
    let kind = Kind::resolve(config.model.model_class.as_deref(), &model_name)?;
    let model = build_model(&config, kind, &model_name, args.demo)?;

    let templates = templates_from(&mut config, kind);

    let mode = resolve_mode(&args, &config)?;
    config.agent.mode = Some(mode);
    // On a terminal the console is there in every mode: Ctrl-C opens its interrupt menu.
    let console = Console::open();

    // The executor.
    let (_, deployment) = crate::deploy::for_new_run(&config.environment, "run")?;
    let local = deployment.kind() == "local";
    let workspace = if local {
        let dir = match (&demo_dir, &config.environment.cwd) {
            (Some(dir), _) => dir.clone(),
            (None, Some(cwd)) => std::path::absolute(cwd).unwrap_or_else(|_| PathBuf::from(cwd)),
            (None, None) => std::env::current_dir().context("cannot read the current directory")?,
        };
        if demo_dir.is_none() {
            // A local executor's workspace is the working directory itself (made absolute
            // here, since the executor does not share our current directory).
            config.environment.cwd = Some(dir.display().to_string());
        }
        Some(dir.display().to_string())
    } else {
        config.environment.cwd.clone()
    };
    let task_spec = TaskSpec {
        name: args.instance_id.clone().unwrap_or_else(|| "run".into()),
        image: config.environment.image.clone(),
        workspace,
        network: config.environment.network.clone(),
    };
    let deadline = crate::deploy::start_timeout(&config.environment);
    let target = tokio::select! {
        target = crate::deploy::start_within(deployment.as_ref(), &task_spec, deadline) => target?,
        _ = interrupts.recv() => {
            eprintln!("agent: interrupted while starting");
            return Ok(INTERRUPTED);
        }
    };
    let result = run_with(
        interrupts, config, model, kind, templates, mode, console, &target, &task, &args, demo_dir,
    )
    .await;
    if result.is_err() {
        let log = target.log();
        if !log.trim().is_empty() {
            eprintln!("executor log:\n{}", log.trim_end());
        }
    }
    target.stop().await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_with(
    mut interrupts: Interrupts,
    config: Config,
    model: Model,
    kind: Kind,
    templates: Templates,
    mode: Mode,
    console: Option<Console>,
    target: &Deployed,
    task: &str,
    args: &RunArgs,
    demo_dir: Option<PathBuf>,
) -> anyhow::Result<u8> {
    let setup = start_environment(&config, target, demo_dir.as_deref());
    let env = tokio::select! {
        env = setup => env?,
        _ = interrupts.recv() => {
            eprintln!("agent: interrupted while starting");
            return Ok(INTERRUPTED);
        }
    };

    let output = args
        .output
        .clone()
        .or_else(|| config.agent.output_path.clone())
        .unwrap_or_else(|| match &demo_dir {
            Some(dir) => dir.join("demo.traj.json"),
            None => PathBuf::from(format!("agent-{}.traj.json", unix_seconds())),
        });
    let model_name = config.model.model_name.clone().unwrap_or_default();
    let agent_vars = to_map(&config.agent);
    let model_vars = to_map(&config.model);
    let settings = Settings {
        templates,
        step_limit: config.agent.step_limit,
        cost_limit: config.agent.cost_limit,
        wall_time_limit: config.agent.wall_time_limit,
        format_error_limit: config.agent.format_error_limit,
        mode,
        output: output.clone(),
        config: json!({
            "agent": config.agent,
            "agent_type": "agent.agent_loop.Agent",
            "model": config.model,
            "model_type": kind.type_name(),
            "environment_type": "agent.environment.Environment",
        }),
        agent_vars,
        model_vars,
        status: None,
    };
    eprintln!("trajectory: {}", output.display());
    let mut agent = Agent::new(model, env, settings, console, interrupts);
    let outcome = agent.run(task).await;
    // However the run ended: the close frame makes the executor end our session at once.
    agent.environment().close().await;
    let outcome = outcome?;
    let (calls, cost) = agent.stats();
    let demo_repo = demo_dir
        .as_ref()
        .and(agent.environment().config.cwd.clone());

    if let Some(instance_id) = &args.instance_id {
        let preds = args.preds.clone().unwrap_or_else(|| {
            output
                .parent()
                .map(|p| p.join("preds.json"))
                .unwrap_or_else(|| PathBuf::from("preds.json"))
        });
        trajectory::update_preds(&preds, instance_id, &model_name, &outcome.submission)?;
        eprintln!("preds: {}", preds.display());
    }

    let mut out = std::io::stdout();
    let _ = writeln!(out, "Exit status: {}", outcome.exit_status.as_str());
    if !outcome.submission.is_empty() {
        let _ = writeln!(out, "Submission:\n{}", outcome.submission.trim_end());
    } else if !outcome.message.is_empty() {
        let _ = writeln!(out, "Reason: {}", outcome.message);
    }
    let scripted = if kind == Kind::Scripted {
        " (SCRIPTED: canned responses replayed, no language model)"
    } else {
        ""
    };
    let _ = writeln!(out, "Model: {model_name}{scripted}");
    let _ = writeln!(out, "Model calls: {calls}, cost: ${cost:.4}");
    if let Some(repo) = &demo_repo {
        let where_ = if target.local_fs {
            ""
        } else {
            " (on the executor's machine)"
        };
        let _ = writeln!(out, "Demo repository: {repo}{where_}");
    }
    let _ = writeln!(out, "Trajectory: {}", output.display());
    Ok(outcome.exit_status.exit_code())
}

/// Connect, settle the profile, and prepare the working directory (and the demo repository).
async fn start_environment(
    config: &Config,
    target: &Deployed,
    demo_dir: Option<&Path>,
) -> anyhow::Result<Environment> {
    let local = target.local_fs;
    let mut env = Environment::open_endpoint(
        &target.endpoint,
        config.environment.clone(),
        target.profile_choice(),
    )
    .await?;
    if !local {
        eprintln!("executor: {} at {}", env.hello.server, target.endpoint.url);
    }
    eprintln!("{}", env.profile_line());
    let prepared = async {
        if let Some(dir) = demo_dir {
            // A local executor shares our filesystem: the repository goes in the demo
            // directory. A remote one does not: it goes in the executor's workspace (not its
            // /tmp, which strict makes private to each command).
            let repo = if local {
                dir.join("repo")
            } else {
                let name = dir.file_name().unwrap_or_default();
                Path::new(&env.hello.workspace).join(name).join("repo")
            };
            env.config.cwd = Some(repo.display().to_string());
            demo::setup(&mut env, &repo).await?;
        }
        env.prepare().await.map_err(|e| anyhow::anyhow!("{e}"))
    }
    .await;
    if let Err(e) = prepared {
        env.close().await;
        return Err(e);
    }
    Ok(env)
}

/// The templates in effect: the config's, else the defaults of the model's style. The config
/// then records them, so the trajectory shows what was rendered, as mini's does.
pub fn templates_from(config: &mut Config, kind: Kind) -> Templates {
    let mut templates = Templates::defaults(kind.style());
    let c = &*config;
    if let Some(t) = &c.agent.system_template {
        templates.system_template = t.clone();
    }
    if let Some(t) = &c.agent.instance_template {
        templates.instance_template = t.clone();
    }
    if let Some(t) = c
        .model
        .observation_template
        .as_ref()
        .or(c.agent.action_observation_template.as_ref())
    {
        templates.observation_template = t.clone();
    }
    if let Some(t) = c
        .model
        .format_error_template
        .as_ref()
        .or(c.agent.format_error_template.as_ref())
    {
        templates.format_error_template = t.clone();
    }

    // The trajectory records the templates in effect, as mini's does.
    config.agent.system_template = Some(templates.system_template.clone());
    config.agent.instance_template = Some(templates.instance_template.clone());
    config.model.observation_template = Some(templates.observation_template.clone());
    config.model.format_error_template = Some(templates.format_error_template.clone());

    templates
}

fn apply_flags(config: &mut Config, args: &RunArgs) -> anyhow::Result<()> {
    let m = &mut config.model;
    if args.model.is_some() {
        m.model_name = args.model.clone();
    }
    if args.model_class.is_some() {
        m.model_class = args.model_class.clone();
    }
    if args.base_url.is_some() {
        m.base_url = args.base_url.clone();
    }
    if args.script.is_some() {
        m.script = args.script.clone();
    }
    args.executor.apply(&mut config.environment)?;
    args.network.apply(&mut config.environment.network)?;
    let e = &mut config.environment;
    if args.cwd.is_some() {
        e.cwd = args.cwd.clone();
    }
    if let Some(t) = args.timeout {
        e.timeout = t;
    }
    let a = &mut config.agent;
    if let Some(n) = args.step_limit {
        a.step_limit = n;
    }
    if let Some(c) = args.cost_limit {
        a.cost_limit = c;
    }
    Ok(())
}

fn resolve_mode(args: &RunArgs, config: &Config) -> anyhow::Result<Mode> {
    let terminal = std::io::stdin().is_terminal();
    let flag = if args.yolo {
        Some(Mode::Yolo)
    } else {
        args.mode
    };
    if let Some(mode) = flag {
        if mode != Mode::Yolo && !terminal {
            bail!("--mode {mode:?} needs a terminal on stdin; use --mode yolo for batch runs");
        }
        return Ok(mode);
    }
    if args.demo {
        return Ok(Mode::Yolo);
    }
    match config.agent.mode {
        Some(mode) if mode != Mode::Yolo && !terminal => {
            eprintln!("mode: the config asks for {mode:?} but stdin is not a terminal; running in yolo mode");
            Ok(Mode::Yolo)
        }
        Some(mode) => Ok(mode),
        None if terminal => Ok(Mode::Confirm),
        None => Ok(Mode::Yolo),
    }
}

/// Why a run has no model, and what to pass. `script`: a script was given, which only the
/// scripted model reads.
pub fn no_model(script: bool, command: &str) -> String {
    if script {
        format!(
            "no model: --script FILE (model.script) is read by the scripted model, which is \
             named like any other: add `-m scripted` to `{command}` (or name a language model \
             with --model NAME, or MSWEA_MODEL_NAME)"
        )
    } else {
        format!(
            "no model: pass --model NAME to `{command}` (or set model.model_name, or \
             MSWEA_MODEL_NAME); without a language model: `-m scripted --script FILE`, or \
             `agent run --demo`"
        )
    }
}

pub fn build_model(
    config: &Config,
    kind: Kind,
    model_name: &str,
    demo: bool,
) -> anyhow::Result<Model> {
    let m = &config.model;
    let model = match kind {
        Kind::Scripted => {
            let scripted = match (&m.script, demo) {
                (Some(path), _) => model::scripted::ScriptedModel::from_file(path)?,
                (None, true) => model::scripted::ScriptedModel::from_yaml(
                    demo::SCRIPT,
                    "the built-in demo script".into(),
                )?,
                (None, false) => bail!("the scripted model needs --script FILE (or model.script)"),
            };
            crate::notes::note!(
                "model: SCRIPTED: replaying {} canned responses from {}; no language model is called",
                scripted.len(),
                scripted.source
            );
            Model::Scripted(scripted)
        }
        Kind::OpenAi | Kind::Text => {
            let parser = match kind {
                Kind::Text => Some(model::text::TextParser::new(m.action_regex.as_deref())?),
                _ => None,
            };
            let client = model::openai::OpenAiModel::new(m, model_name, parser)?;
            warn_prices(client.prices(), model_name);
            crate::notes::note!(
                "model: {model_name} (OpenAI-compatible chat completions, {})",
                if kind == Kind::Text {
                    "text mode"
                } else {
                    "tool calls"
                }
            );
            Model::OpenAi(client)
        }
        Kind::Anthropic => {
            let client = model::anthropic::AnthropicModel::new(m, model_name)?;
            warn_prices(client.prices(), model_name);
            crate::notes::note!("model: {model_name} (Anthropic Messages API, tool use)");
            Model::Anthropic(client)
        }
    };
    Ok(model)
}

fn warn_prices(prices: model::Prices, model_name: &str) {
    if !prices.known {
        crate::notes::note!(
            "model: no token prices configured for {model_name}; cost counts as $0 and cost_limit \
             cannot stop the run (set model.input_cost_per_token / output_cost_per_token)"
        );
    }
}

pub fn to_map<T: serde::Serialize>(value: &T) -> Map<String, Value> {
    match serde_json::to_value(value) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
