//! `--versus`: two builds of the executor measured by taking turns, one `echo hi` round trip
//! each, on two daemons running side by side.
//!
//! This VM's speed drifts by a fifth and more between runs of minutes (bench/README), so two
//! whole benchmark runs cannot tell apart changes of a few percent. Taking turns command by
//! command puts both builds under the same drift; the median of the per-pair differences
//! says which is faster and by how much. Each round trip comes after a short pause, as an
//! agent's commands do.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use crate::client::Client;
use crate::daemon::Daemon;
use crate::stats::{summarize, Summary};
use crate::{echo, warmups, Progress};

/// Between two round trips: long enough for the daemon that just answered to build its next
/// warm worker, so that this build ahead does not land on the other build's command (a
/// one-build loop has it land on its own next command instead, which turns cannot copy).
const PAUSE: Duration = Duration::from_millis(5);

/// One profile's figures: each build's round trips and their per-pair differences.
pub struct Compared {
    profile: String,
    base: Summary,
    new: Summary,
    /// Median of `new - base` over the pairs, ms.
    median_diff_ms: f64,
    /// Pairs where `new` was the faster.
    new_faster: usize,
    pairs: usize,
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
    // Both from fresh copies: a binary written just now runs faster than one whose page cache
    // is older (3-4 % here, two copies of one build measured this way), which would otherwise
    // decide the comparison.
    let fresh = tempfile::tempdir().context("a directory for the binaries' copies")?;
    let copy = |from: &Path, name: &str| {
        let to = fresh.path().join(name);
        std::fs::copy(from, &to).with_context(|| format!("cannot copy {}", from.display()))?;
        anyhow::Ok(to)
    };
    let (base, new) = (copy(base, "base")?, copy(new, "new")?);
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
        compared.push(Compared {
            profile: name.clone(),
            base,
            new,
            median_diff_ms: diffs.get(diffs.len() / 2).copied().unwrap_or(0.0),
            new_faster: diffs.iter().filter(|d| **d < 0.0).count(),
            pairs: diffs.len(),
        });
    }
    for client in clients {
        client.close().await;
    }
    Ok(compared)
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
    out
}
