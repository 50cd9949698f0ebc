//! A batch's output directory, in mini's layout: `preds.json` (rewritten atomically under a
//! lock after each instance), `<iid>/<iid>.traj.json`, `exit_statuses_<time>.yaml`
//! (`instances_by_exit_status`) and a log file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use serde_json::{json, Value};

use crate::trajectory::{read_preds, write_atomic, write_bytes_atomic, Trajectory};

/// mini's log file name, so tools that look for it find it.
pub const LOG_FILE: &str = "minisweagent.log";

pub struct Outputs {
    pub dir: PathBuf,
    preds_lock: Mutex<()>,
    statuses: Mutex<BTreeMap<String, Vec<String>>>,
    statuses_file: PathBuf,
    log: Mutex<std::fs::File>,
}

impl Outputs {
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the output directory {}", dir.display()))?;
        let log_path = dir.join(LOG_FILE);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            preds_lock: Mutex::new(()),
            statuses: Mutex::new(BTreeMap::new()),
            statuses_file: dir.join(format!("exit_statuses_{}.yaml", python_float(unix_time()))),
            log: Mutex::new(log),
        })
    }

    pub fn preds_path(&self) -> PathBuf {
        self.dir.join("preds.json")
    }

    pub fn trajectory_path(&self, id: &str) -> PathBuf {
        self.dir.join(id).join(format!("{id}.traj.json"))
    }

    /// Instance ids already in preds.json (done: a rerun skips them). A preds.json that is not
    /// a JSON object is an error: mini would crash on it, and treating it as empty would
    /// overwrite every prediction it held with the first one of this run.
    pub fn done(&self) -> anyhow::Result<Vec<String>> {
        Ok(read_preds(&self.preds_path())?.keys().cloned().collect())
    }

    /// Before (re)running an instance, as mini does: out of preds.json, old trajectory gone.
    pub fn forget(&self, id: &str) -> anyhow::Result<()> {
        let _held = self
            .preds_lock
            .lock()
            .map_err(|_| anyhow::anyhow!("preds lock poisoned"))?;
        let path = self.preds_path();
        let mut preds = read_preds(&path)?;
        if preds.remove(id).is_some() {
            write_atomic(&path, &Value::Object(preds))?;
        }
        let _ = std::fs::remove_file(self.trajectory_path(id));
        Ok(())
    }

    /// Record a finished instance in preds.json (under the lock: one writer at a time, each
    /// rewrite atomic). A preds.json spoiled since the start is left alone, not replaced.
    pub fn record_pred(&self, id: &str, model: &str, patch: &str) -> anyhow::Result<()> {
        let _held = self
            .preds_lock
            .lock()
            .map_err(|_| anyhow::anyhow!("preds lock poisoned"))?;
        let path = self.preds_path();
        let mut preds = read_preds(&path)?;
        preds.insert(
            id.to_string(),
            json!({
                "model_name_or_path": model,
                "instance_id": id,
                "model_patch": patch,
            }),
        );
        write_atomic(&path, &Value::Object(preds))?;
        Ok(())
    }

    /// Add `id` under `status` and rewrite the exit statuses file.
    pub fn record_status(&self, id: &str, status: &str) -> anyhow::Result<()> {
        let doc = {
            let mut statuses = self
                .statuses
                .lock()
                .map_err(|_| anyhow::anyhow!("statuses lock poisoned"))?;
            statuses
                .entry(status.to_string())
                .or_default()
                .push(id.to_string());
            json!({ "instances_by_exit_status": *statuses })
        };
        let text = serde_norway::to_string(&doc).context("cannot write YAML")?;
        Ok(write_bytes_atomic(&self.statuses_file, text.as_bytes())?)
    }

    /// The trajectory of an instance that failed before its agent ran (mini saves one for
    /// every instance it got that far with; ours says why in `info.traceback`).
    pub fn write_failure_trajectory(
        &self,
        id: &str,
        status: &str,
        reason: &str,
        config: Value,
    ) -> anyhow::Result<()> {
        let mut doc = Trajectory {
            messages: &[],
            cost: 0.0,
            api_calls: 0,
            exit_status: status,
            submission: "",
            config,
            extra_info: json!({ "traceback": reason, "instance_id": id }),
        }
        .to_json();
        doc["instance_id"] = json!(id);
        write_atomic(&self.trajectory_path(id), &doc)?;
        Ok(())
    }

    /// Give the trajectory the agent loop wrote mini's top-level `instance_id` (mini's batch
    /// run saves it beside `info`, and tools that gather trajectories key them by it).
    pub fn stamp_trajectory(&self, id: &str) -> anyhow::Result<()> {
        let path = self.trajectory_path(id);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            // The loop could not write it: it said so in the log.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let mut doc: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let Some(map) = doc.as_object_mut() else {
            anyhow::bail!("{} is not a JSON object", path.display());
        };
        map.insert("instance_id".to_string(), json!(id));
        write_atomic(&path, &doc)?;
        Ok(())
    }

    /// One line in the log file, with the time.
    pub fn log(&self, line: &str) {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if let Ok(mut log) = self.log.lock() {
            let _ = writeln!(log, "{stamp:.3} {line}");
        }
    }
}

/// Now, in seconds since the epoch with the fraction: Python's `time.time()`.
fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `x` as Python's `repr(float)` writes it, which mini's `exit_statuses_{time.time()}.yaml`
/// uses: the shortest digits that read back as the same float (what Rust's `{}` and `{:e}`
/// give too), an integral value with `.0`, and exponent form (`1e+16`, `1.5e-05`) below 1e-4
/// and from 1e16 on (CPython's `float_repr_style` "short", `Python/pystrtod.c`).
fn python_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".to_string()
        } else if x > 0.0 {
            "inf".to_string()
        } else {
            "-inf".to_string()
        };
    }
    let magnitude = x.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        // Rust: `1.5e-5`; Python: `1.5e-05`, a sign and at least two exponent digits.
        let text = format!("{x:e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(digits) => ('-', digits),
            None => ('+', exponent),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let text = format!("{x}");
    if text.contains('.') {
        text
    } else {
        format!("{text}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_files_are_named_with_pythons_float_repr_of_the_time() {
        // What Python 3 prints for each (`repr(x)`).
        for (x, python) in [
            (1764570000.1234567, "1764570000.1234567"),
            (1764570000.5, "1764570000.5"),
            (1764570000.0, "1764570000.0"),
            (1764570000.1, "1764570000.1"),
            (0.0, "0.0"),
            (-2.0, "-2.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (9999999999999998.0, "9999999999999998.0"),
            (1e100, "1e+100"),
        ] {
            assert_eq!(python_float(x), python, "{x:?}");
        }
        // The file a batch writes: `exit_statuses_<seconds>.<fraction>.yaml`, read back as a
        // time within this test's run.
        let before = unix_time();
        let dir = tempfile::tempdir().unwrap();
        let out = Outputs::create(dir.path()).unwrap();
        out.record_status("a", "Submitted").unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("exit_statuses_"))
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let stamp = names[0]
            .strip_prefix("exit_statuses_")
            .and_then(|n| n.strip_suffix(".yaml"))
            .unwrap();
        assert!(stamp.contains('.'), "{stamp}");
        let time: f64 = stamp.parse().unwrap();
        assert!(time >= before && time <= unix_time(), "{stamp}");
        assert_eq!(python_float(time), stamp);
    }

    #[test]
    fn statuses_are_mini_yaml_and_preds_forget_reruns() {
        let dir = tempfile::tempdir().unwrap();
        let out = Outputs::create(dir.path()).unwrap();
        out.record_status("a", "Submitted").unwrap();
        out.record_status("b", "Submitted").unwrap();
        out.record_status("c", "DeploymentError").unwrap();
        let text = std::fs::read_to_string(&out.statuses_file).unwrap();
        let yaml: Value = serde_norway::from_str(&text).unwrap();
        assert_eq!(
            yaml["instances_by_exit_status"]["Submitted"],
            json!(["a", "b"])
        );
        out.record_pred("a", "m", "diff").unwrap();
        out.record_pred("b", "m", "").unwrap();
        assert_eq!(out.done().unwrap(), ["a", "b"]);
        out.forget("a").unwrap();
        assert_eq!(out.done().unwrap(), ["b"]);
    }

    #[test]
    fn a_spoiled_preds_json_is_an_error_and_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let out = Outputs::create(dir.path()).unwrap();
        for spoiled in ["{\"a\": {\"model_patch\": \"di", "[1, 2]", ""] {
            std::fs::write(out.preds_path(), spoiled).unwrap();
            let e = out.done().unwrap_err().to_string();
            assert!(e.contains("preds.json is not"), "{e}");
            assert!(out.record_pred("b", "m", "diff").is_err());
            assert!(out.forget("a").is_err());
            assert_eq!(std::fs::read_to_string(out.preds_path()).unwrap(), spoiled);
        }
        // The control: no preds.json at all is an empty one.
        std::fs::remove_file(out.preds_path()).unwrap();
        assert!(out.done().unwrap().is_empty());
        out.record_pred("b", "m", "diff").unwrap();
        assert_eq!(out.done().unwrap(), ["b"]);
    }

    #[test]
    fn atomic_writes_replace_whole_and_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = Outputs::create(dir.path()).unwrap();
        out.record_pred("a", "m", "one").unwrap();
        out.record_pred("a", "m", "two").unwrap();
        out.record_status("a", "Submitted").unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.starts_with(".tmp-")), "{names:?}");
        let preds: Value =
            serde_json::from_str(&std::fs::read_to_string(out.preds_path()).unwrap()).unwrap();
        assert_eq!(preds["a"]["model_patch"], "two");
        // A path we cannot write (its "directory" is a file): an error naming it.
        let blocked = dir.path().join("preds.json/sub.json");
        let e = write_atomic(&blocked, &json!({})).unwrap_err();
        assert!(format!("{e:#}").contains("sub.json"), "{e:#}");
    }

    #[test]
    fn trajectories_carry_minis_top_level_instance_id() {
        let dir = tempfile::tempdir().unwrap();
        let out = Outputs::create(dir.path()).unwrap();
        let read = |id: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(out.trajectory_path(id)).unwrap())
                .unwrap()
        };
        out.write_failure_trajectory("a__b-1", "RuntimeError", "why", json!({}))
            .unwrap();
        assert_eq!(read("a__b-1")["instance_id"], "a__b-1");
        // One the loop wrote: stamped, the rest kept.
        let path = out.trajectory_path("a__b-2");
        write_atomic(
            &path,
            &json!({"info": {"exit_status": "Submitted"}, "messages": []}),
        )
        .unwrap();
        out.stamp_trajectory("a__b-2").unwrap();
        let doc = read("a__b-2");
        assert_eq!(doc["instance_id"], "a__b-2");
        assert_eq!(doc["info"]["exit_status"], "Submitted");
        // None written (the loop failed to): nothing made up.
        out.stamp_trajectory("a__b-3").unwrap();
        assert!(!out.trajectory_path("a__b-3").exists());
    }
}
