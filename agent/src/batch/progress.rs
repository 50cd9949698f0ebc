//! What a batch shows while it runs. On a terminal: an overall bar of the instances done with
//! the ETA (none until one is done), a table of exit statuses with their counts and most
//! recent ids, and one line per worker saying what its instance is doing and for how long.
//! Otherwise: one plain line when an instance starts and when it ends. An interrupted instance
//! is not done (a rerun does it): it is counted apart, never as done.

use std::collections::{BTreeMap, VecDeque};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// Recent ids shown per exit status.
const RECENT: usize = 3;
/// Characters of a worker line.
const LINE: usize = 110;
/// The exit status of an instance a stop cut short.
const INTERRUPTED: &str = "Interrupted";

pub enum Progress {
    Terminal(Box<Terminal>),
    Plain { total: usize, counts: Mutex<Counts> },
}

/// Instances that ended, as done (any exit status but `Interrupted`) or interrupted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub done: usize,
    pub interrupted: usize,
}

pub struct Terminal {
    _multi: MultiProgress,
    overall: ProgressBar,
    table: ProgressBar,
    workers: Vec<ProgressBar>,
    statuses: Mutex<BTreeMap<String, (usize, VecDeque<String>)>>,
    counts: Mutex<Counts>,
}

/// `{eta}` of the overall bar: the time left at the pace so far (elapsed per instance done,
/// times the instances left, the workers' overlap included); nothing to say before the first
/// instance is done (indicatif's own says `0s` there).
fn eta(state: &ProgressState, w: &mut dyn std::fmt::Write) {
    let _ = write!(w, "{}", eta_text(state.pos(), state.len(), state.elapsed()));
}

fn eta_text(done: u64, total: Option<u64>, elapsed: Duration) -> String {
    let Some(total) = total else {
        return String::new();
    };
    if done >= total {
        return String::new();
    }
    if done == 0 {
        return ", ETA after the first instance".into();
    }
    let left = elapsed.as_secs_f64() / done as f64 * (total - done) as f64;
    format!(
        ", ETA {}",
        indicatif::HumanDuration(Duration::from_secs_f64(left.round()))
    )
}

impl Progress {
    pub fn new(total: usize, workers: usize) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self::Plain {
                total,
                counts: Mutex::new(Counts::default()),
            };
        }
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
        let overall = multi.add(ProgressBar::new(total as u64));
        overall.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} instances done{eta_left} {msg}",
            )
            .map(|style| style.with_key("eta_left", eta))
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        overall.enable_steady_tick(Duration::from_secs(1));
        let plain = || {
            ProgressStyle::with_template("{msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner())
        };
        let table = multi.add(ProgressBar::new_spinner());
        table.set_style(plain());
        let workers = (0..workers)
            .map(|_| {
                let bar = multi.add(ProgressBar::new_spinner());
                // The timer is the current line's: how long the worker has been at it.
                bar.set_style(
                    ProgressStyle::with_template("  {spinner} {elapsed:>4} {msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                bar.enable_steady_tick(Duration::from_millis(250));
                bar.set_message("idle");
                bar
            })
            .collect();
        Self::Terminal(Box::new(Terminal {
            _multi: multi,
            overall,
            table,
            workers,
            statuses: Mutex::new(BTreeMap::new()),
            counts: Mutex::new(Counts::default()),
        }))
    }

    /// What worker `slot` is doing now; its timer starts again with each new line.
    pub fn worker(&self, slot: usize, line: &str) {
        if let Self::Terminal(t) = self {
            if let Some(bar) = t.workers.get(slot) {
                bar.reset_elapsed();
                bar.set_message(cut(line, LINE));
            }
        }
    }

    pub fn started(&self, slot: usize, id: &str) {
        match self {
            Self::Terminal(_) => self.worker(slot, &format!("{id}: starting")),
            Self::Plain { .. } => super::say(&format!("batch: {id}: started")),
        }
    }

    pub fn finished(&self, slot: usize, id: &str, status: &str, seconds: f64) {
        let interrupted = status == INTERRUPTED;
        match self {
            Self::Terminal(t) => {
                count(&t.counts, interrupted);
                if !interrupted {
                    t.overall.inc(1);
                }
                self.worker(slot, "idle");
                if let Ok(mut statuses) = t.statuses.lock() {
                    let entry = statuses.entry(status.to_string()).or_default();
                    entry.0 += 1;
                    entry.1.push_front(id.to_string());
                    entry.1.truncate(RECENT);
                    t.table.set_message(table(&statuses));
                }
            }
            Self::Plain { total, counts } => {
                let now = count(counts, interrupted);
                if interrupted {
                    super::say(&format!(
                        "batch: {id}: {status} after {seconds:.1}s (not done: a rerun does it)"
                    ));
                } else {
                    super::say(&format!(
                        "batch: [{}/{total}] {id}: {status} ({seconds:.1}s)",
                        now.done
                    ));
                }
            }
        }
    }

    /// Instances done and interrupted so far.
    pub fn counts(&self) -> Counts {
        let counts = match self {
            Self::Terminal(t) => &t.counts,
            Self::Plain { counts, .. } => counts,
        };
        counts.lock().map(|c| *c).unwrap_or_default()
    }

    /// The bars' last state: a stopped batch's bar stays where it was (indicatif's `finish`
    /// would fill it), with what was left undone.
    pub fn finish(&self, stopped: bool) {
        if let Self::Terminal(t) = self {
            for bar in &t.workers {
                bar.finish_and_clear();
            }
            if stopped {
                let counts = self.counts();
                let left = t.overall.length().unwrap_or(0) as usize
                    - counts.done.min(t.overall.length().unwrap_or(0) as usize);
                t.overall
                    .abandon_with_message(format!("(stopped: {left} not done)"));
            } else {
                t.overall.finish();
            }
            t.table.finish();
        }
    }
}

/// Count one more ended instance; the counts after it.
fn count(counts: &Mutex<Counts>, interrupted: bool) -> Counts {
    let mut c = counts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if interrupted {
        c.interrupted += 1;
    } else {
        c.done += 1;
    }
    *c
}

fn table(statuses: &BTreeMap<String, (usize, VecDeque<String>)>) -> String {
    let width = statuses.keys().map(String::len).max().unwrap_or(0).max(11);
    let mut out = format!("  {:width$}  count  recent", "exit status");
    for (status, (count, recent)) in statuses {
        let recent: Vec<&str> = recent.iter().map(String::as_str).collect();
        out.push_str(&format!(
            "\n  {status:width$}  {count:>5}  {}",
            recent.join(", ")
        ));
    }
    out
}

fn cut(line: &str, max: usize) -> String {
    let line = line.lines().next().unwrap_or_default();
    if line.chars().count() <= max {
        return line.to_string();
    }
    let mut out: String = line.chars().take(max).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eta_waits_for_a_first_instance_and_then_follows_the_pace_so_far() {
        let total = Some(3);
        assert_eq!(
            eta_text(0, total, Duration::from_secs(40)),
            ", ETA after the first instance"
        );
        assert_eq!(
            eta_text(1, total, Duration::from_secs(40)),
            ", ETA 80 seconds"
        );
        assert_eq!(
            eta_text(2, total, Duration::from_secs(40)),
            ", ETA 20 seconds"
        );
        assert_eq!(eta_text(3, total, Duration::from_secs(40)), "");
    }

    #[test]
    fn interrupted_instances_are_counted_apart_from_those_done() {
        let progress = Progress::Plain {
            total: 3,
            counts: Mutex::new(Counts::default()),
        };
        progress.finished(0, "a", "Submitted", 1.0);
        progress.finished(1, "b", INTERRUPTED, 1.0);
        assert_eq!(
            progress.counts(),
            Counts {
                done: 1,
                interrupted: 1
            }
        );
    }
}
