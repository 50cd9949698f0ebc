//! `agent run --demo`: a toy repository with a failing test, fixed by the built-in scripted
//! model (or by a real one with `--model`), with no API key needed.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::executor_client::Environment;

pub const TASK: &str = "The test suite of this repository fails: `bash test.sh` reports that \
`add 2 3` is not 5. Fix the bug in the library (do not change the test), check that the test \
passes, and submit your change as a git diff (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff`).";

/// Responses of the built-in scripted model.
pub const SCRIPT: &str = include_str!("../demo/script.yaml");

/// Shell script that creates the toy repository in the current directory.
const SETUP: &str = include_str!("../demo/setup.sh");

/// A new directory for this demo run (kept afterwards so it can be inspected).
pub fn directory() -> anyhow::Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("agent-demo-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the demo directory {}", dir.display()))?;
    // Sandboxes may run commands as an unprivileged uid: let whoever they run as create the
    // toy repository here (so git sees its own repository), and the demo can use the
    // strongest profile.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
        .with_context(|| format!("cannot open up {}", dir.display()))?;
    Ok(dir)
}

/// Create the toy repository at `repo` (a path on the executor's machine) through the
/// executor, so its files belong to whoever the sandbox runs commands as.
pub async fn setup(env: &mut Environment, repo: &Path) -> anyhow::Result<()> {
    let repo = repo.display().to_string();
    let command = format!(
        "mkdir -p {repo} && cd {repo} && {SETUP}",
        repo = crate::shell::quote(&repo)
    );
    let out = env
        .run_raw(command, None, Some(60.0))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if out.returncode != 0 {
        anyhow::bail!(
            "setting up the demo repository failed (returncode {}): {}{}",
            out.returncode,
            out.output,
            out.exception_info
        );
    }
    eprint!("demo: {}", out.output);
    Ok(())
}
