//! What a batch shows while it runs. On a terminal: an overall bar with ETA, a table of exit
//! statuses with their counts and most recent ids, and one line per worker saying what its
//! instance is doing. Otherwise: one plain line when an instance starts and when it ends.

use std::collections::{BTreeMap, VecDeque};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Recent ids shown per exit status.
const RECENT: usize = 3;
/// Characters of a worker line.
const LINE: usize = 110;

pub enum Progress {
    Terminal(Box<Terminal>),
    Plain { total: usize, done: Mutex<usize> },
}

pub struct Terminal {
    _multi: MultiProgress,
    overall: ProgressBar,
    table: ProgressBar,
    workers: Vec<ProgressBar>,
    statuses: Mutex<BTreeMap<String, (usize, VecDeque<String>)>>,
}

impl Progress {
    pub fn new(total: usize, workers: usize) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self::Plain {
                total,
                done: Mutex::new(0),
            };
        }
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
        let overall = multi.add(ProgressBar::new(total as u64));
        overall.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} instances, ETA {eta}",
            )
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
                bar.set_style(
                    ProgressStyle::with_template("  {spinner} {msg}")
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
        }))
    }

    /// What worker `slot` is doing now.
    pub fn worker(&self, slot: usize, line: &str) {
        if let Self::Terminal(t) = self {
            if let Some(bar) = t.workers.get(slot) {
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
        match self {
            Self::Terminal(t) => {
                t.overall.inc(1);
                if let Some(bar) = t.workers.get(slot) {
                    bar.set_message("idle");
                }
                if let Ok(mut statuses) = t.statuses.lock() {
                    let entry = statuses.entry(status.to_string()).or_default();
                    entry.0 += 1;
                    entry.1.push_front(id.to_string());
                    entry.1.truncate(RECENT);
                    t.table.set_message(table(&statuses));
                }
            }
            Self::Plain { total, done } => {
                let n = done.lock().map(|mut d| {
                    *d += 1;
                    *d
                });
                super::say(&format!(
                    "batch: [{}/{total}] {id}: {status} ({seconds:.1}s)",
                    n.unwrap_or(0)
                ));
            }
        }
    }

    pub fn finish(&self) {
        if let Self::Terminal(t) = self {
            for bar in &t.workers {
                bar.finish_and_clear();
            }
            t.overall.finish();
            t.table.finish();
        }
    }
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
