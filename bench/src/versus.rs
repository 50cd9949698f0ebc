//! `--versus`: two builds of the executor measured by taking turns on two daemons running side
//! by side: one `echo hi` round trip each, then blocks of commands from 8 connections each.
//!
//! This VM's speed drifts by a fifth and more between runs of minutes (bench/README), so two
//! whole benchmark runs cannot tell apart changes of a few percent. Taking turns command by
//! command puts both builds under the same drift; the median of the per-pair differences
//! says which is faster and by how much. Each round trip comes after a short pause, as an
//! agent's commands do. The machine's CPU per command cannot be told apart command by command
//! (both daemons' work lands in the same /proc/stat), so it is measured over blocks that take
//! turns the same way: [`BLOCK`] commands from [`CONNECTIONS`] connections to one daemon,
//! then as many to the other, [`BLOCK_PAIRS`] times.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::client::Client;
use crate::daemon::{machine_cpu_ms, Daemon};
use crate::phases::echo;
use crate::stats::{summarize, Summary};
use crate::{per_command_machine_ms, warmups, Progress};

/// Between two round trips: long enough for the daemon that just answered to build its next
/// warm worker, so that this build ahead does not land on the other build's command (a
/// one-build loop has it land on its own next command instead, which turns cannot copy).
const PAUSE: Duration = Duration::from_millis(5);

/// Commands per block, connections sending them, pairs of blocks per profile.
const BLOCK: usize = 200;
const CONNECTIONS: usize = 8;
const BLOCK_PAIRS: usize = 10;

/// One profile's figures: each build's round trips and their per-pair differences, and the
/// blocks' CPU per command and throughput.
pub struct Compared {
    pub profile: String,
    base: Summary,
    new: Summary,
    /// Median of `new - base` over the pairs, ms.
    median_diff_ms: f64,
    /// Pairs where `new` was the faster.
    new_faster: usize,
    pairs: usize,
    /// Each build's blocks: the machine's CPU per command (ms) and commands per second.
    blocks: [Vec<(f64, f64)>; 2],
}

/// Both builds from fresh copies (in the directory returned, removed when it drops): a
/// binary written just now runs faster than one whose page cache is older (3-4 % here, two
/// copies of one build measured this way), which would otherwise decide the comparison.
pub fn fresh_copies(
    base: &Path,
    new: &Path,
) -> anyhow::Result<(tempfile::TempDir, PathBuf, PathBuf)> {
    let fresh = tempfile::tempdir().context("a directory for the binaries' copies")?;
    let copy = |from: &Path, name: &str| {
        let to = fresh.path().join(name);
        std::fs::copy(from, &to).with_context(|| format!("cannot copy {}", from.display()))?;
        anyhow::Ok(to)
    };
    let (base, new) = (copy(base, "base")?, copy(new, "new")?);
    Ok((fresh, base, new))
}

/// Take turns between `base`'s daemon and `new`'s, `iterations` pairs per profile (the order
/// inside a pair alternates, so neither build always runs right after the other); each runs
/// from a fresh copy.
pub async fn run(
    base: &Path,
    new: &Path,
    profiles: &[String],
    iterations: usize,
) -> anyhow::Result<Vec<Compared>> {
    let (_fresh, base, new) = fresh_copies(base, new)?;
    let daemons = [Daemon::start(&base, &[])?, Daemon::start(&new, &[])?];
    let (a, hello) = Client::connect(&daemons[0].url, &daemons[0].token).await?;
    let (b, hello_b) = Client::connect(&daemons[1].url, &daemons[1].token).await?;
    let mut clients = [a, b];
    let available =
        |h: &protocol::Hello, name: &str| h.profiles.iter().any(|p| p.name == name && p.available);
    let mut compared = Vec::new();
    for summary in &hello.profiles {
        let name = &summary.name;
        if (!profiles.is_empty() && !profiles.contains(name))
            || !available(&hello, name)
            || !available(&hello_b, name)
        {
            continue;
        }
        for (i, client) in clients.iter_mut().enumerate() {
            for w in 0..warmups(iterations) {
                echo(client, format!("w{i}-{w}"), name)
                    .await
                    .with_context(|| format!("warming up {name}"))?;
            }
        }
        let mut progress = Progress::new(
            format!("[{name}] {iterations} pairs of round trips, taking turns"),
            Some(iterations),
        );
        let mut took: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
        for i in 0..iterations {
            let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                tokio::time::sleep(PAUSE).await;
                let d = echo(&mut clients[side], format!("s{i}"), name).await?;
                took[side].push(d);
            }
            progress.tick(i + 1);
        }
        let ms = |d: &Duration| d.as_secs_f64() * 1e3;
        let mut diffs: Vec<f64> = took[0]
            .iter()
            .zip(&took[1])
            .map(|(a, b)| ms(b) - ms(a))
            .collect();
        diffs.sort_by(f64::total_cmp);
        let (Some(base), Some(new)) = (summarize(&took[0]), summarize(&took[1])) else {
            continue;
        };
        let blocks = blocks(&daemons, name).await?;
        compared.push(Compared {
            profile: name.clone(),
            base,
            new,
            median_diff_ms: diffs.get(diffs.len() / 2).copied().unwrap_or(0.0),
            new_faster: diffs.iter().filter(|d| **d < 0.0).count(),
            pairs: diffs.len(),
            blocks,
        });
    }
    for client in clients {
        client.close().await;
    }
    Ok(compared)
}

/// [`BLOCK_PAIRS`] pairs of blocks taking turns (the order inside a pair alternating): each
/// block [`BLOCK`] `echo hi` commands from [`CONNECTIONS`] connections at once, closed loops;
/// the machine's busy CPU time per command and the commands per second of each.
async fn blocks(daemons: &[Daemon; 2], profile: &str) -> anyhow::Result<[Vec<(f64, f64)>; 2]> {
    let mut clients: [Vec<Client>; 2] = [Vec::new(), Vec::new()];
    for (side, daemon) in daemons.iter().enumerate() {
        for c in 0..CONNECTIONS {
            let (mut client, _) = Client::connect(&daemon.url, &daemon.token).await?;
            echo(&mut client, format!("bw{c}"), profile).await?;
            clients[side].push(client);
        }
    }
    let mut progress = Progress::new(
        format!("[{profile}] {BLOCK_PAIRS} pairs of blocks of {BLOCK} commands from {CONNECTIONS} connections"),
        Some(BLOCK_PAIRS),
    );
    let mut measured: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for pair in 0..BLOCK_PAIRS {
        let order = if pair % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let each = BLOCK / CONNECTIONS;
            let machine0 = machine_cpu_ms();
            let t0 = std::time::Instant::now();
            let runs = clients[side]
                .iter_mut()
                .enumerate()
                .map(|(c, client)| async move {
                    for i in 0..each {
                        echo(client, format!("b{pair}-{c}-{i}"), profile).await?;
                    }
                    anyhow::Ok(())
                });
            for done in futures_util::future::join_all(runs).await {
                done?;
            }
            let count = each * CONNECTIONS;
            let elapsed = t0.elapsed().as_secs_f64();
            if let Some(cpu) = per_command_machine_ms(machine0, count) {
                measured[side].push((cpu, count as f64 / elapsed));
            }
        }
        progress.tick(pair + 1);
    }
    for side in &mut clients {
        for client in side.drain(..) {
            client.close().await;
        }
    }
    Ok(measured)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The comparison as a markdown table.
pub fn markdown(base: &Path, new: &Path, compared: &[Compared]) -> String {
    let mut out = format!(
        "## `echo hi` round trips, taking turns\n\nbase: {}\nnew: {}\n\n\
         | profile | base p50 / p99 ms | new p50 / p99 ms | new / base p50 | median of new - base, ms | pairs new faster |\n\
         |---|---:|---:|---:|---:|---:|\n",
        base.display(),
        new.display()
    );
    for c in compared {
        out.push_str(&format!(
            "| {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.3}x | {:+.3} | {} of {} |\n",
            c.profile,
            c.base.p50_ms,
            c.base.p99_ms,
            c.new.p50_ms,
            c.new.p99_ms,
            c.new.p50_ms / c.base.p50_ms,
            c.median_diff_ms,
            c.new_faster,
            c.pairs,
        ));
    }
    out.push_str(&format!(
        "\n### Blocks of {BLOCK} commands from {CONNECTIONS} connections, taking turns\n\n\
         | profile | base CPU / command ms | new CPU / command ms | median of new - base, ms \
         | blocks new lower | base cmd/s | new cmd/s |\n\
         |---|---:|---:|---:|---:|---:|---:|\n"
    ));
    for c in compared {
        let [base, new] = &c.blocks;
        let cpu = |b: &[(f64, f64)]| median(b.iter().map(|m| m.0).collect());
        let rate = |b: &[(f64, f64)]| median(b.iter().map(|m| m.1).collect());
        let diffs: Vec<f64> = base.iter().zip(new).map(|(b, n)| n.0 - b.0).collect();
        let lower = diffs.iter().filter(|d| **d < 0.0).count();
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:+.2} | {} of {} | {:.0} | {:.0} |\n",
            c.profile,
            cpu(base),
            cpu(new),
            median(diffs.clone()),
            lower,
            diffs.len(),
            rate(base),
            rate(new),
        ));
    }
    out.push_str(
        "\nCPU per command is the whole machine's busy time over a block (both daemons, their \
         workers, the shells and this client) over its commands.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blocks_table_gives_each_builds_median_and_the_median_of_their_differences() {
        let summary = |p50_ms| Summary {
            count: 1,
            min_ms: p50_ms,
            p50_ms,
            p90_ms: p50_ms,
            p99_ms: p50_ms,
            max_ms: p50_ms,
            mean_ms: p50_ms,
        };
        // Three pairs: new is lower in two (by 1.0 and 0.5), higher in one (by 0.25).
        let compared = Compared {
            profile: "strict".into(),
            base: summary(4.0),
            new: summary(3.0),
            median_diff_ms: -1.0,
            new_faster: 2,
            pairs: 3,
            blocks: [
                vec![(5.0, 400.0), (6.0, 380.0), (4.0, 410.0)],
                vec![(4.0, 450.0), (5.5, 420.0), (4.25, 430.0)],
            ],
        };
        let table = markdown(Path::new("a"), Path::new("b"), &[compared]);
        assert!(
            table.contains("| strict | 5.00 | 4.25 | -0.50 | 2 of 3 | 400 | 430 |"),
            "{table}"
        );
        assert!(table.contains("| strict | 4.00 / 4.00 | 3.00 / 3.00 | 0.750x | -1.000 | 2 of 3 |"));
    }
}
