//! The Python package's suite (`python/tests`, pytest), run from `cargo test` so that the
//! README's one test command covers it: a virtualenv under `target/python-venv` is made by
//! `python/dev-venv` (mini-swe-agent and pytest from PyPI on the first run, the package
//! reinstalled from this tree on every run), then pytest drives the binaries built here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use executor_tests::{binary, is_root, require};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn python_package_suite_passes_against_the_built_binaries() {
    if !require("root", is_root())
        || !require(
            "python3 on PATH",
            Command::new("python3").arg("--version").output().is_ok(),
        )
    {
        return;
    }
    let executor = binary("executor");
    let agent = binary("agent");
    let root = repository();
    // target/<profile>/executor -> target/python-venv
    let venv = executor
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("python-venv");
    let made = Command::new(root.join("python/dev-venv"))
        .arg(&venv)
        .output()
        .expect("python/dev-venv runs");
    let installed = require(
        &format!(
            "a virtualenv with the package and its test dependencies from PyPI (python/dev-venv \
             failed: {}{})",
            String::from_utf8_lossy(&made.stdout),
            String::from_utf8_lossy(&made.stderr)
        ),
        made.status.success(),
    );
    if !installed {
        return;
    }
    let python = String::from_utf8_lossy(&made.stdout)
        .lines()
        .last()
        .unwrap()
        .to_string();
    std::fs::create_dir_all(executor_tests::skips::dir()).unwrap();
    // pytest's output goes straight to ours (not captured): its summary line says what ran.
    let status = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .current_dir(root.join("python"))
        .env("EXECUTOR_BIN", &executor)
        .env("EXECUTOR_AGENT_BIN", &agent)
        // pytest's skips (when allowed) join this suite's record.
        .env(
            executor_tests::skips::FILE_ENV,
            executor_tests::skips::file(),
        )
        .status()
        .expect("pytest runs");
    assert!(status.success(), "the Python suite failed: {status}");
}
