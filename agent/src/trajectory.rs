//! Output files in mini-swe-agent's formats: the trajectory (`trajectory_format`
//! "mini-swe-agent-1.1") and SWE-bench's `preds.json`. Both are replaced atomically (write a
//! sibling temporary file, fsync, rename) so a crash or Ctrl-C never leaves half a file.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

pub const TRAJECTORY_FORMAT: &str = "mini-swe-agent-1.1";

#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct WriteError {
    path: PathBuf,
    source: std::io::Error,
}

/// Write `value` as pretty JSON to `path` atomically.
pub fn write_atomic(path: &Path, value: &Value) -> Result<(), WriteError> {
    let fail = |source| WriteError {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(fail)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".traj-")
        .tempfile_in(&dir)
        .map_err(fail)?;
    let text = serde_json::to_string_pretty(value).map_err(|e| fail(e.into()))?;
    tmp.write_all(text.as_bytes()).map_err(fail)?;
    tmp.write_all(b"\n").map_err(fail)?;
    tmp.as_file().sync_all().map_err(fail)?;
    tmp.persist(path).map_err(|e| fail(e.error))?;
    Ok(())
}

/// The trajectory document.
pub struct Trajectory<'a> {
    pub messages: &'a [Value],
    pub cost: f64,
    pub api_calls: u64,
    pub exit_status: &'a str,
    pub submission: &'a str,
    pub config: Value,
    pub extra_info: Value,
}

impl Trajectory<'_> {
    pub fn to_json(&self) -> Value {
        let mut info = json!({
            "model_stats": {"instance_cost": self.cost, "api_calls": self.api_calls},
            "config": self.config,
            "agent_version": env!("CARGO_PKG_VERSION"),
            "exit_status": self.exit_status,
            "submission": self.submission,
        });
        if let (Some(info), Value::Object(extra)) = (info.as_object_mut(), &self.extra_info) {
            for (k, v) in extra {
                info.insert(k.clone(), v.clone());
            }
        }
        json!({
            "info": info,
            "messages": self.messages,
            "trajectory_format": TRAJECTORY_FORMAT,
        })
    }
}

/// Add or replace one instance in a SWE-bench `preds.json`.
pub fn update_preds(
    path: &Path,
    instance_id: &str,
    model_name: &str,
    patch: &str,
) -> Result<(), WriteError> {
    let mut preds = std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    preds[instance_id] = json!({
        "model_name_or_path": model_name,
        "instance_id": instance_id,
        "model_patch": patch,
    });
    write_atomic(path, &preds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preds_keep_other_instances() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("preds.json");
        update_preds(&path, "a__b-1", "m", "diff1").unwrap();
        update_preds(&path, "a__b-2", "m", "diff2").unwrap();
        update_preds(&path, "a__b-1", "m", "diff3").unwrap();
        let preds: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(preds["a__b-1"]["model_patch"], "diff3");
        assert_eq!(preds["a__b-2"]["instance_id"], "a__b-2");
        assert_eq!(preds["a__b-2"]["model_name_or_path"], "m");
    }

    #[test]
    fn trajectory_has_mini_shape() {
        let messages = vec![json!({"role": "system", "content": "s"})];
        let doc = Trajectory {
            messages: &messages,
            cost: 0.5,
            api_calls: 2,
            exit_status: "Submitted",
            submission: "diff",
            config: json!({}),
            extra_info: json!({"executor": {"profile": "trusted"}}),
        }
        .to_json();
        assert_eq!(doc["trajectory_format"], "mini-swe-agent-1.1");
        assert_eq!(doc["info"]["model_stats"]["api_calls"], 2);
        assert_eq!(doc["info"]["exit_status"], "Submitted");
        assert_eq!(doc["info"]["executor"]["profile"], "trusted");
    }
}
