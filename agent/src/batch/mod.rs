//! `agent batch`: a benchmark run with many workers, mirroring `mini-extra swebench` (its
//! flags, its output directory) so that its users feel at home and SWE-bench's evaluation and
//! trajectory viewers keep working. Each instance gets its own executor from the deployment
//! (a container from its image, a free remote executor, ...), always torn down; a failing
//! instance is recorded with its exit status and reason and never stops the batch.

mod instance;
pub mod instances;
mod output;
mod progress;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::agent_loop::INTERRUPTED;
use crate::config::{self, Config};
use crate::deploy::flags::ExecutorArgs;
use crate::model::Kind;
use instance::Ctx;
use instances::Instance;
use output::Outputs;
use progress::Progress;

// clap prints these doc comments as --help, where <placeholders> are meant literally.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args)]
pub struct BatchArgs {
    /// Instances: a JSON or JSONL file, or a datasets-style directory with `<split>.jsonl`.
    #[arg(long, visible_alias = "instances", value_name = "PATH")]
    subset: PathBuf,
    /// Split of a directory (`dev` and `validation` name the same file).
    #[arg(long, default_value = "dev")]
    split: String,
    /// Python slice of the instances, as mini's: 0:5, :5, 5 (the same), 10:, 0:100:2.
    #[arg(long, value_name = "SLICE")]
    slice: Option<String>,
    /// Keep instance ids this regex matches from their start (Python's re.match).
    #[arg(long, value_name = "REGEX")]
    filter: Option<String>,
    /// Shuffle the instances first, as mini does (sorted by id, then Python's random.shuffle
    /// seeded 42): the same order every time, and mini's.
    #[arg(long)]
    shuffle: bool,
    /// Instances run at once.
    #[arg(short = 'w', long, default_value_t = 1)]
    workers: usize,
    /// Output directory: preds.json, <iid>/<iid>.traj.json, exit_statuses_<time>.yaml, a log.
    #[arg(short = 'o', long, value_name = "DIR", default_value = ".")]
    output: PathBuf,
    /// Run instances already in preds.json again.
    #[arg(long)]
    redo_existing: bool,
    /// Config file (mini-swe-agent YAML) or KEY=VALUE override; repeatable, later wins.
    #[arg(short = 'c', long = "config", value_name = "FILE|KEY=VALUE")]
    config: Vec<String>,
    #[arg(short = 'm', long)]
    model: Option<String>,
    #[arg(long)]
    model_class: Option<String>,
    #[arg(long, value_name = "URL")]
    base_url: Option<String>,
    /// Script of the scripted model; `{instance_id}` in the path is replaced per instance.
    #[arg(long, value_name = "PATH")]
    script: Option<PathBuf>,
    #[command(flatten)]
    executor: ExecutorArgs,
    /// The commands' network, for every instance (an instance's own `network` field wins).
    #[command(flatten)]
    network: crate::network::NetworkArgs,
}

pub async fn command(args: BatchArgs) -> anyhow::Result<u8> {
    // Signals first: from here on Ctrl-C stops the batch cleanly instead of killing us.
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    // A closed terminal or ssh session (SIGHUP) would otherwise kill us mid-run and leave
    // containers behind: it stops the batch as SIGTERM does.
    let mut hup = signal(SignalKind::hangup())?;
    let mut config = config::load(&args.config)?;
    apply_flags(&mut config, &args)?;
    let model_name = config
        .model
        .model_name
        .clone()
        .or_else(|| {
            std::env::var("MSWEA_MODEL_NAME")
                .ok()
                .filter(|m| !m.is_empty())
        })
        .with_context(|| crate::run::no_model(config.model.script.is_some(), "agent batch"))?;
    config.model.model_name = Some(model_name.clone());
    let kind = Kind::resolve(config.model.model_class.as_deref(), &model_name)?;
    let templates = crate::run::templates_from(&mut config, kind);

    let all = instances::load(&args.subset, &args.split)?;
    let selected = instances::select(
        all,
        args.shuffle,
        args.filter.as_deref(),
        args.slice.as_deref(),
    )?;
    let outputs = Outputs::create(&args.output)?;
    let done = outputs.done()?;
    let total_selected = selected.len();
    let todo: VecDeque<Instance> = selected
        .into_iter()
        .filter(|i| args.redo_existing || !done.contains(&i.id))
        .collect();
    let skipped = total_selected - todo.len();
    // Said up front too, so that a long batch does not hide them in its exit statuses.
    for instance in &todo {
        if let Some(reason) = &instance.invalid {
            eprintln!("batch: {reason}; recorded as {}", instances::INVALID);
        }
    }
    let (run_id, deployment) = crate::deploy::for_new_run(&config.environment, "b")?;
    let kind_name = deployment.kind();
    let workers = args.workers.max(1).min(todo.len().max(1));
    let profile = match (&config.environment.profile, kind_name) {
        (Some(named), _) => format!("profile {named:?} (named)"),
        (None, "local") => {
            "profile strict, else landlock, per instance (the log says which)".into()
        }
        (None, "remote" | "reverse") => "the executors' default profiles".into(),
        (None, _) => {
            "the strongest profile each executor offers that works (the log says which)".into()
        }
    };
    eprintln!(
        "batch: {} instances ({} selected, {skipped} already in {}), {workers} worker(s), \
         deployment {kind_name}, {profile}, model {model_name}; output in {}",
        todo.len(),
        total_selected,
        outputs.preds_path().display(),
        outputs.dir.display()
    );
    let outputs = Arc::new(outputs);
    {
        let outputs = outputs.clone();
        crate::notes::redirect(move |line| outputs.log(line));
    }
    outputs.log(&format!(
        "batch {run_id}: {} instances, {workers} workers, deployment {kind_name}",
        todo.len()
    ));

    let total = todo.len();
    let progress = Arc::new(Progress::new(total, workers));
    let (stop_tx, stop_rx) = watch::channel(false);
    let ctx = Arc::new(Ctx {
        config,
        kind,
        templates,
        model_name,
        deployment,
        outputs: outputs.clone(),
        progress: progress.clone(),
        stop: stop_rx,
        scratch: tempfile::Builder::new()
            .prefix("agent-batch-")
            .tempdir()
            .context("cannot create a scratch directory")?,
    });
    let queue = Arc::new(Mutex::new(todo));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for slot in 0..workers {
        let ctx = ctx.clone();
        let queue = queue.clone();
        set.spawn(async move {
            loop {
                if *ctx.stop.borrow() {
                    break;
                }
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(instance) = next else { break };
                instance::run(&ctx, slot, instance).await;
            }
        });
    }
    let mut interrupted = false;
    loop {
        tokio::select! {
            joined = set.join_next() => match joined {
                Some(Err(e)) => outputs.log(&format!("a worker failed: {e}")),
                Some(Ok(())) => {}
                None => break,
            },
            _ = int.recv() => interrupted = stop(&stop_tx, &outputs, interrupted),
            _ = term.recv() => interrupted = stop(&stop_tx, &outputs, interrupted),
            _ = hup.recv() => interrupted = stop(&stop_tx, &outputs, interrupted),
        }
    }
    progress.finish(interrupted);
    if kind_name == "docker" {
        // Every container of ours was removed as its instance ended; make sure.
        match crate::deploy::reap::reap(&ctx.config.environment.docker, Some(&run_id)).await {
            Ok(0) => {}
            Ok(n) => outputs.log(&format!("removed {n} leftover container(s)")),
            Err(e) => say(&format!(
                "batch: cannot check for leftover containers: {e:#}"
            )),
        }
    }
    let counts = progress.counts();
    if interrupted {
        let never = total.saturating_sub(counts.done + counts.interrupted);
        say(&format!(
            "batch: interrupted after {:.1}s: {} of {total} instances done, {} interrupted, {never} \
             not started; run the same command again to do the {} left; preds: {}",
            started.elapsed().as_secs_f64(),
            counts.done,
            counts.interrupted,
            counts.interrupted + never,
            outputs.preds_path().display()
        ));
    } else {
        say(&format!(
            "batch: done in {:.1}s: {} of {total} instances; preds: {}",
            started.elapsed().as_secs_f64(),
            counts.done,
            outputs.preds_path().display()
        ));
    }
    Ok(if interrupted { INTERRUPTED } else { 0 })
}

/// A line on stderr that cannot fail: after a hangup stderr may be a dead terminal (EIO), and
/// `eprintln!` would panic there, in the middle of tearing down.
pub(crate) fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The first Ctrl-C, SIGTERM or SIGHUP stops the batch: running instances end as `Interrupted`
/// (trajectory saved, not in preds.json, so a rerun does them), no new one starts, and every
/// executor is torn down before we exit.
fn stop(stop_tx: &watch::Sender<bool>, outputs: &Outputs, already: bool) -> bool {
    if !already {
        say("batch: stopping: running instances are interrupted and torn down");
        outputs.log("interrupted: stopping");
        let _ = stop_tx.send(true);
    }
    true
}

fn apply_flags(config: &mut Config, args: &BatchArgs) -> anyhow::Result<()> {
    let m = &mut config.model;
    if args.model.is_some() {
        m.model_name.clone_from(&args.model);
    }
    if args.model_class.is_some() {
        m.model_class.clone_from(&args.model_class);
    }
    if args.base_url.is_some() {
        m.base_url.clone_from(&args.base_url);
    }
    if args.script.is_some() {
        m.script.clone_from(&args.script);
    }
    args.executor.apply(&mut config.environment)?;
    args.network.apply(&mut config.environment.network)
}
