//! Our containers as docker (or podman) sees them, below both the deployment that starts them
//! (`docker`, and `k8s` for its labels) and `deploy reap` that removes what a killed agent
//! left: the labels every container of ours carries, the owner they record, and the `docker`
//! command line.

use tokio::process::Command;

use super::config::DockerConfig;

/// Label on every container we start; `agent deploy reap` removes what carries it.
pub const LABEL: &str = "executor-agent";
/// Label naming the run (a batch, or one `deploy up`) that started the container.
pub const RUN_LABEL: &str = "executor-agent.run";
/// Label naming the task (the instance id).
pub const TASK_LABEL: &str = "executor-agent.task";
/// The owner's host name (`/proc/sys/kernel/hostname`).
pub const OWNER_HOST_LABEL: &str = "executor-agent.owner-host";
/// The owner's pid namespace (`/proc/self/ns/pid`'s link, e.g. `pid:[4026531836]`).
pub const OWNER_PIDNS_LABEL: &str = "executor-agent.owner-pidns";
pub const OWNER_PID_LABEL: &str = "executor-agent.owner-pid";
/// The owner's start time in clock ticks since boot: tells a reused pid from the owner.
pub const OWNER_START_LABEL: &str = "executor-agent.owner-start";

/// `docker` (or podman) with the configured global arguments.
pub fn docker_command(config: &DockerConfig) -> Command {
    let mut c = Command::new(&config.executable);
    c.args(&config.global_args);
    c
}

/// Who started a container: this process, as its labels record it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub host: String,
    pub pidns: String,
    pub pid: u32,
    pub start: String,
}

impl Owner {
    /// This process.
    pub fn current() -> Self {
        let pid = std::process::id();
        Self {
            host: hostname(),
            pidns: pidns(),
            pid,
            start: start_time(pid).unwrap_or_default(),
        }
    }

    /// `--label` pairs for `docker run`.
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        vec![
            (OWNER_HOST_LABEL, self.host.clone()),
            (OWNER_PIDNS_LABEL, self.pidns.clone()),
            (OWNER_PID_LABEL, self.pid.to_string()),
            (OWNER_START_LABEL, self.start.clone()),
        ]
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

fn pidns() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Field 22 of `/proc/<pid>/stat` (after the parenthesised command, which may hold spaces).
pub fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    // Fields 3.. follow the command; the start time is field 22.
    after.split_whitespace().nth(19).map(str::to_string)
}
