//! End-to-end tests of deployments and batch runs: the real `agent` binary runs benchmarks of
//! small git tasks (made by the tests) with the scripted model, against executors it deploys
//! locally, in podman containers, over ssh, or finds in a remote pool; outcomes are read
//! from outside: exit codes, preds.json, trajectories, exit statuses, the log, and what is
//! left on the host (containers by label, processes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod batch_docker;
mod batch_inputs;
mod batch_local;
mod batch_remote;
mod k8s;
mod reap;
mod reverse;
mod ssh;
mod up;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use executor_tests::binary;
use serde_json::{json, Value};

/// Longest a whole batch in these tests may take.
const BATCH_PATIENCE: Duration = Duration::from_secs(240);

/// The scripted model's turns for a task that ends well: look, fix, submit the diff.
pub const FIX_SCRIPT: &str = "\
- thought: look
  command: cat f.txt
- thought: fix
  command: sed -i 's/value=.*/value=fixed/' f.txt
- thought: submit
  command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff
";

/// Turns that take a while (for interrupting), then the fix.
pub fn slow_script(seconds: u32) -> String {
    format!("- thought: wait\n  command: sleep {seconds}\n{FIX_SCRIPT}")
}

/// A model that answers once and then has nothing left: `ModelError`.
pub const SHORT_SCRIPT: &str = "- thought: look\n  command: cat f.txt\n";

/// Each instance makes its own small git repository at start (`run.env_startup_command`),
/// in a workspace it may share with earlier tasks (a remote pool), so it starts clean.
pub const STARTUP: &str = "rm -rf .git f.txt && git init -q . && echo value={{value}} > f.txt && \
git add f.txt && git -c user.email=t@example.com -c user.name=t commit -qm init";

/// A batch's directory: instances, scripts per instance, config, output.
pub struct Bench {
    pub dir: executor_tests::TempDir,
    /// In every instance id, so that what a batch starts can be told from other tests'.
    pub tag: String,
}

impl Bench {
    /// `n` instances `toy__task-<i>`, each with the fix script unless `scripts` says other.
    pub fn new(n: usize, scripts: &[(usize, &str)], extra: &[(usize, Value)]) -> Self {
        let dir = executor_tests::TempDir::with_prefix("agent-batch-e2e-").unwrap();
        let tag = executor_tests::marker();
        std::fs::create_dir(dir.path().join("scripts")).unwrap();
        let mut lines = String::new();
        for i in 0..n {
            let id = format!("toy__{tag}-{i}");
            let mut instance = json!({
                "instance_id": id,
                "problem_statement": format!("Set the value in f.txt to fixed (task {i})."),
                "value": i,
            });
            for (j, fields) in extra {
                if *j == i {
                    for (k, v) in fields.as_object().unwrap() {
                        instance[k] = v.clone();
                    }
                }
            }
            lines.push_str(&format!("{instance}\n"));
            let script = scripts
                .iter()
                .find(|(j, _)| *j == i)
                .map(|(_, s)| s.to_string())
                .unwrap_or_else(|| FIX_SCRIPT.to_string());
            std::fs::write(dir.path().join(format!("scripts/{id}.yaml")), script).unwrap();
        }
        std::fs::write(dir.path().join("instances.jsonl"), lines).unwrap();
        let config = json!({"run": {"env_startup_command": STARTUP}});
        std::fs::write(
            dir.path().join("config.yaml"),
            serde_norway::to_string(&config).unwrap(),
        )
        .unwrap();
        Self { dir, tag }
    }

    pub fn id(&self, i: usize) -> String {
        format!("toy__{}-{i}", self.tag)
    }

    /// Rewrite instance `i`'s script (between runs).
    pub fn script(&self, i: usize, script: &str) {
        let id = self.id(i);
        std::fs::write(self.path().join(format!("scripts/{id}.yaml")), script).unwrap();
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn out(&self) -> PathBuf {
        self.path().join("out")
    }

    /// `agent batch` over the instances with the scripted model, output in `out/`.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(binary("agent"));
        cmd.arg("batch")
            .arg("--subset")
            .arg(self.path().join("instances.jsonl"))
            .arg("-o")
            .arg(self.out())
            .arg("-c")
            .arg(self.path().join("config.yaml"))
            .args(["-m", "scripted", "--script"])
            .arg(self.path().join("scripts/{instance_id}.yaml"))
            .args(args)
            .current_dir(self.path())
            .env_remove("MSWEA_MODEL_NAME")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    pub async fn run(&self, args: &[&str]) -> Finished {
        let child = self.command(args).spawn().unwrap();
        finish(child).await
    }

    pub fn preds(&self) -> BTreeMap<String, Value> {
        let text = std::fs::read_to_string(self.out().join("preds.json")).unwrap_or_default();
        serde_json::from_str(&text).unwrap_or_default()
    }

    pub fn patch(&self, i: usize) -> String {
        self.preds()[&self.id(i)]["model_patch"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// `instances_by_exit_status`, merged over every exit statuses file of the directory.
    pub fn statuses(&self) -> BTreeMap<String, Vec<String>> {
        let mut all: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for entry in std::fs::read_dir(self.out()).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with("exit_statuses_") && name.ends_with(".yaml") {
                let doc: Value =
                    serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                for (status, ids) in doc["instances_by_exit_status"].as_object().unwrap() {
                    let ids = ids
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|i| i.as_str().unwrap().to_string());
                    all.entry(status.clone()).or_default().extend(ids);
                }
            }
        }
        all
    }

    /// The status the last exit statuses file gives instance `i`.
    pub fn status_of(&self, i: usize) -> String {
        let id = self.id(i);
        self.statuses()
            .into_iter()
            .filter(|(_, ids)| ids.contains(&id))
            .map(|(s, _)| s)
            .next_back()
            .unwrap_or_default()
    }

    pub fn trajectory(&self, i: usize) -> Value {
        let id = self.id(i);
        let path = self.out().join(&id).join(format!("{id}.traj.json"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_default())
            .unwrap_or(Value::Null)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.out().join("minisweagent.log")).unwrap_or_default()
    }

    /// How many times the batch started instance `i`, over every run into this directory.
    pub fn starts(&self, i: usize) -> usize {
        let needle = format!(" {}: started", self.id(i));
        self.log().lines().filter(|l| l.contains(&needle)).count()
    }
}

pub struct Finished {
    pub code: i32,
    pub stderr: String,
}

pub async fn finish(child: tokio::process::Child) -> Finished {
    let out = tokio::time::timeout(BATCH_PATIENCE, child.wait_with_output())
        .await
        .expect("the batch did not finish in time")
        .unwrap();
    let finished = Finished {
        code: out.status.code().unwrap_or(-1),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!("--- batch exit {} ---\n{}", finished.code, finished.stderr);
    finished
}

/// A fixed diff turning `value=<i>` into `value=fixed`: what a submitted task's patch holds.
pub fn assert_fixed(patch: &str, i: usize) {
    assert!(
        patch.contains(&format!("-value={i}\n+value=fixed\n")),
        "{patch:?}"
    );
}

/// Host processes whose command line contains `needle` (zombies aside).
pub fn processes_with(needle: &str) -> Vec<String> {
    let out = std::process::Command::new("ps")
        .args(["-eo", "stat=,args="])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim_start().starts_with('Z') && l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// Wait until `check` holds, up to `patience`.
pub async fn wait_for(patience: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + patience;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check()
}

pub fn interrupt(child: &tokio::process::Child) {
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
}
