//! `--deployments`: what a deployment costs per task, and what a batch gets through.
//!
//! - Overhead: from spawning `agent deploy up --json` to the result of a first `echo hi` sent
//!   over the URL, token and pin it printed (the executor started, reached, authenticated),
//!   and the teardown after stdin closes; median of the repeats, per deployment.
//! - Throughput: `agent batch` over trivial instances (the scripted model submits at its first
//!   turn) with 1, 4 and 8 workers: instances per second, each with an executor of its own.
//!
//! Where each deployment's executors come from is `places.rs`: docker through podman (runc,
//! the lab's ulimits) with the test harness's task image and the static executor from
//! `.ci/build-static`; remote a pool of executors started here; reverse executors dialling
//! the agent's relay; ssh an sshd started here on loopback.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::places::{hang_up, Place};
use crate::stats::median;

pub struct Overhead {
    pub deployment: String,
    pub first_result_ms: f64,
    pub teardown_ms: f64,
}

pub struct Throughput {
    pub deployment: String,
    pub workers: usize,
    pub instances: usize,
    pub seconds: f64,
}

/// `target/release/agent`, built first with the executor beside it (a local deployment
/// starts the executor next to the agent).
pub fn build_agent() -> anyhow::Result<std::path::PathBuf> {
    let me = std::env::current_exe().context("cannot locate the benchmark binary")?;
    let target = me
        .parent()
        .and_then(std::path::Path::parent)
        .context("cannot tell the target directory")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("bench: cargo build --release -p agent -p executor");
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "agent",
            "-p",
            "executor",
        ])
        .env("CARGO_TARGET_DIR", target)
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        bail!("building the agent failed");
    }
    Ok(target.join("release").join("agent"))
}

async fn one_overhead(agent: &std::path::Path, place: &Place) -> anyhow::Result<(f64, f64)> {
    let began = Instant::now();
    let mut child = tokio::process::Command::new(agent)
        .args(["deploy", "up", "--json"])
        .args(&place.flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if place.reverse {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .kill_on_drop(true)
        .spawn()
        .context("cannot run agent deploy up")?;
    // reverse: one executor dials in once the relay says where it listens.
    let dialled = match child.stderr.take() {
        Some(stderr) => place.dial_in(stderr, 1).await?,
        None => Vec::new(),
    };
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = lines
        .next_line()
        .await?
        .context("deploy up printed nothing")?;
    let up: serde_json::Value = serde_json::from_str(&line)?;
    if let Some(e) = up.get("error") {
        bail!("deploy up failed: {e}");
    }
    let url = up["url"].as_str().context("no url")?;
    let token = std::fs::read_to_string(up["token_file"].as_str().context("no token file")?)?;
    let mut client = match up["tls_fingerprint"].as_str() {
        Some(pin) => executor_tests::Client::connect_pinned(url, Some(token.trim()), pin).await,
        None => executor_tests::Client::connect(url, Some(token.trim())).await,
    }
    .map_err(|e| anyhow::anyhow!("cannot connect: {e}"))?;
    let result = client.run("b1", "echo hi").await;
    let first = began.elapsed().as_secs_f64() * 1000.0;
    if result.output != "hi\n" {
        bail!("unexpected first result: {:?}", result.output);
    }
    drop(client);
    let closing = Instant::now();
    drop(child.stdin.take());
    child.wait().await?;
    let teardown = closing.elapsed().as_secs_f64() * 1000.0;
    hang_up(dialled).await;
    Ok((first, teardown))
}

pub async fn overhead(
    agent: &std::path::Path,
    deployments: &[String],
    repeats: usize,
) -> anyhow::Result<Vec<Overhead>> {
    let mut out = Vec::new();
    for deployment in deployments {
        let place = Place::new(deployment, agent)?;
        // One unmeasured start: images, page cache.
        one_overhead(agent, &place).await?;
        let mut firsts = Vec::new();
        let mut teardowns = Vec::new();
        for _ in 0..repeats.max(1) {
            let (first, teardown) = one_overhead(agent, &place).await?;
            firsts.push(first);
            teardowns.push(teardown);
        }
        eprintln!("bench: deployment {deployment}: {firsts:.0?} ms to a first result");
        out.push(Overhead {
            deployment: deployment.clone(),
            first_result_ms: median(&firsts).unwrap_or(0.0),
            teardown_ms: median(&teardowns).unwrap_or(0.0),
        });
    }
    Ok(out)
}

pub async fn throughput(
    agent: &std::path::Path,
    deployments: &[String],
    workers: &[usize],
    instances: usize,
) -> anyhow::Result<Vec<Throughput>> {
    let dir = tempfile::tempdir()?;
    let mut list = String::new();
    let image = if deployments.iter().any(|d| d == "docker") {
        executor_tests::container::task_image().map_err(anyhow::Error::msg)?
    } else {
        String::new()
    };
    for i in 0..instances {
        list.push_str(&format!(
            "{{\"instance_id\": \"bench__trivial-{i}\", \"problem_statement\": \"submit\", \"image_name\": \"{image}\"}}\n"
        ));
    }
    std::fs::write(dir.path().join("instances.jsonl"), list)?;
    std::fs::write(
        dir.path().join("script.yaml"),
        "- thought: done\n  command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
    )?;
    let mut out = Vec::new();
    for deployment in deployments {
        let place = Place::new(deployment, agent)?;
        let mut flags = place.flags.clone();
        if deployment == "docker" {
            // The instances name their image.
            let at = flags
                .iter()
                .position(|f| f == "--image")
                .unwrap_or(flags.len());
            flags.drain(at..(at + 2).min(flags.len()));
        }
        for &w in workers {
            let output = dir.path().join(format!("out-{deployment}-{w}"));
            let began = Instant::now();
            let mut batch = tokio::process::Command::new(agent)
                .arg("batch")
                .arg("--subset")
                .arg(dir.path().join("instances.jsonl"))
                .args(["-m", "scripted", "--script"])
                .arg(dir.path().join("script.yaml"))
                .arg("-o")
                .arg(&output)
                .args(["-w", &w.to_string()])
                .args(&flags)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(if place.reverse {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .kill_on_drop(true)
                .spawn()
                .context("cannot run agent batch")?;
            // reverse: as many executors dial in as there are workers.
            let dialled = match batch.stderr.take() {
                Some(stderr) => place.dial_in(stderr, w).await?,
                None => Vec::new(),
            };
            let status = tokio::time::timeout(Duration::from_secs(1800), batch.wait())
                .await
                .context("the batch took too long")??;
            let seconds = began.elapsed().as_secs_f64();
            hang_up(dialled).await;
            let preds = std::fs::read_to_string(output.join("preds.json"))?;
            let submitted = serde_json::from_str::<serde_json::Value>(&preds)?
                .as_object()
                .map(|m| m.len())
                .unwrap_or(0);
            if !status.success() || submitted != instances {
                bail!(
                    "batch {deployment} -w {w}: {status}, {submitted} of {instances} in preds.json"
                );
            }
            eprintln!("bench: batch {deployment} -w {w}: {instances} instances in {seconds:.1}s");
            out.push(Throughput {
                deployment: deployment.clone(),
                workers: w,
                instances,
                seconds,
            });
        }
    }
    Ok(out)
}

pub fn markdown(overheads: &[Overhead], throughputs: &[Throughput]) -> String {
    let mut s = String::from(
        "| deployment | start to first result (p50) | teardown after stdin closes (p50) |\n|---|---:|---:|\n",
    );
    for o in overheads {
        s.push_str(&format!(
            "| {} | {:.0} ms | {:.0} ms |\n",
            o.deployment, o.first_result_ms, o.teardown_ms
        ));
    }
    s.push_str("\n| deployment | workers | instances | seconds | instances/s |\n|---|---:|---:|---:|---:|\n");
    for t in throughputs {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.2} |\n",
            t.deployment,
            t.workers,
            t.instances,
            t.seconds,
            t.instances as f64 / t.seconds
        ));
    }
    s
}
