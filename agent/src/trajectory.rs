//! Output files in mini-swe-agent's formats: the trajectory (`trajectory_format`
//! "mini-swe-agent-1.1") and SWE-bench's `preds.json`. Both are replaced atomically and durably (write a
//! sibling temporary file, fsync, rename, fsync the directory) so a crash or Ctrl-C never
//! leaves half a file; `agent batch` writes its outputs with the same functions.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{json, Map, Value};

pub const TRAJECTORY_FORMAT: &str = "mini-swe-agent-1.1";

#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct WriteError {
    path: PathBuf,
    source: std::io::Error,
}

/// Replace `path` with `value` as pretty JSON, atomically and durably.
pub fn write_atomic(path: &Path, value: &Value) -> Result<(), WriteError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| WriteError {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    text.push('\n');
    write_bytes_atomic(path, text.as_bytes())
}

/// Write a sibling temporary file, fsync it, rename it over `path`, fsync the directory. Without
/// the first fsync a crash after the rename can leave an empty or partial file under the final
/// name (ext4's delayed allocation; see rename(2) and fsync(2)); without the second the rename
/// itself may not survive, bringing back the old preds.json and so a rerun of finished work.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    let fail = |source| WriteError {
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(fail)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .map_err(fail)?;
    tmp.write_all(bytes).map_err(fail)?;
    tmp.as_file().sync_all().map_err(fail)?;
    tmp.persist(path).map_err(|e| fail(e.error))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(fail)?;
    Ok(())
}

/// The predictions in `path`: none when it does not exist, an error when it cannot be read or
/// is not a JSON object (so that nothing is written over it).
pub fn read_preds(path: &Path) -> anyhow::Result<Map<String, Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Map::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(preds)) => Ok(preds),
        Ok(_) => anyhow::bail!(
            "{} is not a JSON object of predictions: fix or move it (it was left as it is)",
            path.display()
        ),
        Err(e) => anyhow::bail!(
            "{} is not valid JSON ({e}): fix or move it (it was left as it is)",
            path.display()
        ),
    }
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
) -> anyhow::Result<()> {
    // A file that is not a JSON object is never replaced (it held others' predictions).
    let mut preds = read_preds(path)?;
    preds.insert(
        instance_id.to_string(),
        json!({
            "model_name_or_path": model_name,
            "instance_id": instance_id,
            "model_patch": patch,
        }),
    );
    Ok(write_atomic(path, &Value::Object(preds))?)
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
    fn a_preds_json_that_is_no_object_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("preds.json");
        for spoiled in ["{\"a__b-1\": {\"model_pa", "[1, 2]"] {
            std::fs::write(&path, spoiled).unwrap();
            let err = update_preds(&path, "a__b-2", "m", "diff").unwrap_err();
            assert!(err.to_string().contains("preds.json"), "{err}");
            assert_eq!(std::fs::read_to_string(&path).unwrap(), spoiled);
        }
        // Control: a missing one is made.
        std::fs::remove_file(&path).unwrap();
        update_preds(&path, "a__b-2", "m", "diff").unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("a__b-2"));
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
