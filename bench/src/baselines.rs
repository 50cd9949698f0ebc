//! What the executor is measured against, in the same run: `bash -c 'echo hi'` spawned by the
//! benchmark itself (no daemon, no isolation), the same through bubblewrap with the namespaces
//! strict creates (the sandbox most agent tools use), and one-shot runs of `executor run`
//! beside `bwrap` for the same command.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::daemon::{machine_cpu_ms, CpuTimes};
use crate::report::{BareReport, CpuPerCommand, OneShot, OneShotReport, Settings, Throughput};
use crate::stats::{median, summarize};
use crate::{per_command_machine_ms, warmups, Progress, ALONE_AFTER, ECHO, ECHO_OUTPUT};

/// A way to run `bash -c CMD` with no daemon: directly, or through bubblewrap.
#[derive(Debug, Clone)]
pub struct Spawn {
    pub label: &'static str,
    /// Program and arguments before `bash -c CMD`.
    prefix: Vec<String>,
    /// The environment beyond PATH (none: bash starts in the C locale).
    env: Vec<(String, String)>,
}

impl Spawn {
    pub fn bare() -> Self {
        Self {
            label: "bare spawn",
            prefix: Vec::new(),
            env: Vec::new(),
        }
    }

    /// A bare spawn in the environment the shipped landlock profile gives its commands
    /// (`LANG`/`LC_ALL=C.UTF-8` among it, which makes bash load a dozen locale files), `{home}`
    /// and `{workspace}` naming `dir`: what the same command costs outside the sandbox in the
    /// same environment.
    pub fn bare_in_profile_env(dir: &std::path::Path) -> anyhow::Result<Self> {
        let profile: serde_json::Value =
            serde_json::from_str(include_str!("../../sandbox-profiles/landlock.json"))
                .context("the landlock profile")?;
        let dir = dir.to_string_lossy();
        let env = profile["env"]
            .as_object()
            .context("the landlock profile has no env")?
            .iter()
            .filter_map(|(name, value)| {
                let value = value.as_str()?;
                let value = value.replace("{home}", &dir).replace("{workspace}", &dir);
                Some((name.clone(), value))
            })
            .collect();
        Ok(Self {
            label: "bare spawn, landlock's environment",
            prefix: Vec::new(),
            env,
        })
    }

    /// bubblewrap with the namespaces strict creates (mount, pid, network, IPC, UTS, cgroup,
    /// and the user namespace bwrap needs for them) over read-only system directories, a
    /// fresh /proc, /dev and /tmp, as uid 65534; `None` when bwrap is not installed.
    pub fn bubblewrap() -> Option<Self> {
        let bwrap = ["/usr/bin/bwrap", "/bin/bwrap"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())?;
        let mut prefix: Vec<String> = [
            bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--uid",
            "65534",
            "--gid",
            "65534",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
        ]
        .map(String::from)
        .to_vec();
        for dir in ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"] {
            prefix.extend(["--ro-bind-try".into(), dir.into(), dir.into()]);
        }
        Some(Self {
            label: "bubblewrap",
            prefix,
            env: Vec::new(),
        })
    }

    /// This spawn in `other`'s environment (bubblewrap with the profile's locale).
    pub fn in_env_of(&self, other: &Spawn, label: &'static str) -> Self {
        Self {
            label,
            prefix: self.prefix.clone(),
            env: other.env.clone(),
        }
    }

    fn command(&self, shell_command: &str) -> Command {
        let mut argv: Vec<&str> = self.prefix.iter().map(String::as_str).collect();
        argv.extend(["bash", "-c", shell_command]);
        let mut command = Command::new(argv[0]);
        command
            .args(&argv[1..])
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        command
    }

    /// One `echo hi`: fork/exec, read the pipe, wait.
    fn once(&self) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let out = self
            .command(ECHO)
            .output()
            .with_context(|| format!("cannot spawn {}", self.label))?;
        let took = t0.elapsed();
        if !out.status.success() || out.stdout != ECHO_OUTPUT.as_bytes() {
            bail!("{} gave {:?} {:?}", self.label, out.status, out.stdout);
        }
        Ok(took)
    }
}

/// Sequential `echo hi` spawns, then the same loop on N threads for each concurrency level.
pub fn measure(spawn: &Spawn, settings: &Settings) -> anyhow::Result<BareReport> {
    for _ in 0..warmups(settings.iterations) {
        spawn.once()?;
    }
    let mut progress = Progress::new(
        format!(
            "[{}] {} sequential spawns",
            spawn.label, settings.iterations
        ),
        Some(settings.iterations),
    );
    let mut samples = Vec::with_capacity(settings.iterations);
    let me = std::process::id();
    let cpu0 = CpuTimes::of(me);
    let machine0 = machine_cpu_ms();
    let t0 = Instant::now();
    for i in 0..settings.iterations {
        samples.push(spawn.once()?);
        progress.tick(i + 1);
    }
    let elapsed = t0.elapsed();
    let machine_ms = per_command_machine_ms(machine0, settings.iterations);
    let mut alone = Vec::with_capacity(settings.alone);
    for _ in 0..settings.alone {
        std::thread::sleep(ALONE_AFTER);
        alone.push(spawn.once()?);
    }
    let cpu = match (cpu0, CpuTimes::of(me)) {
        (Some(a), Some(b)) => {
            let per = b.per(a, settings.iterations);
            Some(CpuPerCommand {
                daemon_ms: None,
                children_ms: per.children_ms,
                client_ms: per.own_ms,
                machine_ms,
            })
        }
        _ => None,
    };
    let Some(sequential) = summarize(&samples) else {
        bail!("no samples");
    };
    let mut concurrent = Vec::new();
    for &workers in &settings.concurrency {
        eprintln!(
            "bench: [{}] {workers} threads for {:.1} s ...",
            spawn.label, settings.duration_s
        );
        let deadline = Instant::now() + Duration::from_secs_f64(settings.duration_s);
        let t0 = Instant::now();
        let results: Vec<anyhow::Result<Vec<Duration>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(move || {
                        let mut lat = Vec::new();
                        while Instant::now() < deadline {
                            lat.push(spawn.once()?);
                        }
                        Ok(lat)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("thread panicked")))
                })
                .collect()
        });
        let elapsed = t0.elapsed();
        let mut all = Vec::new();
        for r in results {
            all.extend(r?);
        }
        concurrent.push(Throughput::new(workers, &all, elapsed));
    }
    let report = BareReport {
        cpu,
        seq_cmd_per_s: settings.iterations as f64 / elapsed.as_secs_f64(),
        sequential,
        alone: summarize(&alone),
        concurrent,
    };
    eprintln!(
        "bench: [{}] p50 {:.3} ms p99 {:.3} ms, {:.0} cmd/s sequential",
        spawn.label, report.sequential.p50_ms, report.sequential.p99_ms, report.seq_cmd_per_s
    );
    Ok(report)
}

/// One-shot runs of `true`, start to exit, each `runs` times: `executor run` per profile and
/// binary, and without `--profile` (`executors`: a label and a path; it starts, loads only the
/// profile it is given or chooses, runs the command and cleans up), bwrap (with PATH alone, and in landlock's environment),
/// and a bare `bash -c true`. Each is measured twice
/// per round: in a loop (right after another row's run, as a script's loop runs them) and
/// alone (after [`ALONE_AFTER`] of idleness, as a command typed by hand). The candidates take
/// turns, one run each per round, so that a drift of the machine (this VM's swings by several
/// ms over a minute) falls on all of them alike, and each round starts one row further on, so
/// that no row always follows the same one (a row after an `executor run` finds the kernel's
/// cgroup lock still in its fast mode; bench/README).
pub fn oneshot(
    executors: &[(String, std::path::PathBuf)],
    profiles: &[String],
    bwrap: Option<&Spawn>,
    runs: usize,
) -> anyhow::Result<OneShotReport> {
    struct Candidate<'a> {
        label: String,
        make: Box<dyn Fn() -> Command + 'a>,
        /// bwrap may be unable to run here: then it is left out, not the whole phase.
        optional: bool,
        looped: Vec<f64>,
        alone: Vec<f64>,
    }
    let dir = std::env::temp_dir();
    // bwrap twice: as the latency phase runs it (PATH alone: bash in the C locale), and in
    // landlock's environment, which `executor run`'s command gets (its `C.UTF-8` makes bash
    // load a dozen locale files): the same command as ours, environment and all.
    let profile_env = Spawn::bare_in_profile_env(&dir)?;
    let bwraps: Vec<Spawn> = bwrap
        .into_iter()
        .flat_map(|b| {
            [
                b.in_env_of(b, "bwrap (strict's namespaces)"),
                b.in_env_of(&profile_env, "bwrap, landlock's environment"),
            ]
        })
        .collect();
    let mut candidates: Vec<Candidate> = Vec::new();
    for (name, executor) in executors {
        // Without --profile: the run chooses (strict, else landlock), and must cost no more
        // than naming the profile it chooses.
        let dir_none = dir.clone();
        candidates.push(Candidate {
            label: format!("{name} run (no --profile: chooses strict, else landlock)"),
            make: Box::new(move || {
                let mut c = Command::new(executor);
                c.args(["run", "--cwd"]).arg(&dir_none).args(["--", "true"]);
                c
            }),
            optional: false,
            looped: Vec::with_capacity(runs),
            alone: Vec::with_capacity(runs),
        });
        for profile in profiles {
            let dir = dir.clone();
            candidates.push(Candidate {
                label: format!("{name} run --profile {profile}"),
                make: Box::new(move || {
                    let mut c = Command::new(executor);
                    c.args(["run", "--profile", profile, "--cwd"])
                        .arg(&dir)
                        .args(["--", "true"]);
                    c
                }),
                optional: false,
                looped: Vec::with_capacity(runs),
                alone: Vec::with_capacity(runs),
            });
        }
    }
    for spawn in &bwraps {
        candidates.push(Candidate {
            label: spawn.label.into(),
            make: Box::new(move || spawn.command("true")),
            optional: true,
            looped: Vec::with_capacity(runs),
            alone: Vec::with_capacity(runs),
        });
    }
    candidates.push(Candidate {
        label: "bash -c true, no isolation".into(),
        make: Box::new(|| Spawn::bare().command("true")),
        optional: false,
        looped: Vec::with_capacity(runs),
        alone: Vec::with_capacity(runs),
    });
    let mut progress = Progress::new(format!("[one-shot] {} rounds", runs + 2), Some(runs + 2));
    // The first two rounds warm the page cache.
    for round in 0..runs + 2 {
        for alone in [false, true] {
            let n = candidates.len();
            let mut failed = Vec::new();
            for at in (0..n).map(|i| (i + round) % n) {
                if alone {
                    std::thread::sleep(ALONE_AFTER);
                }
                let candidate = &mut candidates[at];
                match run_once(&candidate.make, &candidate.label) {
                    Ok(ms) if round >= 2 => {
                        if alone {
                            candidate.alone.push(ms);
                        } else {
                            candidate.looped.push(ms);
                        }
                    }
                    Ok(_) => {}
                    Err(err) if candidate.optional => {
                        eprintln!(
                            "bench: [one-shot] {} cannot run here, left out: {err:#}",
                            candidate.label
                        );
                        failed.push(at);
                    }
                    Err(err) => return Err(err),
                }
            }
            // Highest first, so that the indices left are still right.
            failed.sort_unstable();
            for at in failed.into_iter().rev() {
                candidates.remove(at);
            }
        }
        progress.tick(round + 1);
    }
    let rows = candidates
        .into_iter()
        .map(|c| {
            let p50 = median(&c.looped).unwrap_or(0.0);
            let alone_p50 = median(&c.alone).unwrap_or(0.0);
            eprintln!(
                "bench: [one-shot] {}: p50 {p50:.2} ms in a loop, {alone_p50:.2} ms alone",
                c.label
            );
            OneShot {
                label: c.label,
                p50_ms: p50,
                alone_p50_ms: alone_p50,
            }
        })
        .collect();
    Ok(OneShotReport { runs, rows })
}

/// One run, start to exit, in ms; an error when it cannot start or fails.
fn run_once(make: &dyn Fn() -> Command, label: &str) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let status = make()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {label}"))?;
    let elapsed = t0.elapsed();
    if !status.success() {
        bail!("{label} failed: {status}");
    }
    Ok(elapsed.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_environment_baseline_runs_bash_with_landlocks_locale_and_its_own_home() {
        let home = tempfile::tempdir().unwrap();
        let spawn = Spawn::bare_in_profile_env(home.path()).unwrap();
        let out = spawn
            .command("echo \"$LANG $LC_ALL $HOME\"")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("C.UTF-8 C.UTF-8 {}", home.path().display())
        );
        // Another spawn in that environment (bubblewrap's, in the one-shot phase).
        let out = Spawn::bare()
            .in_env_of(&spawn, "again")
            .command("echo \"$LANG $HOME\"")
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("C.UTF-8 {}", home.path().display())
        );
        // The plain bare spawn (the control): no locale, no HOME.
        let out = Spawn::bare()
            .command("echo \"${LANG-none} ${HOME-none}\"")
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "none none");
    }
}
