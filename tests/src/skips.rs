//! Tests that cannot run here: failed by default, skipped only when allowed, and then recorded.
//!
//! `cargo test` counts a test that returns early as passed: without qemu the `vm` suite once
//! printed "16 passed" in 0.01 s. So a missing prerequisite fails the test unless
//! [`ALLOW_ENV`]`=1` (a machine without qemu or podman, by choice); a skip is then appended to
//! `target/test-skips/<suite>.tsv` (test, then what is missing), and `tests/run` lists them
//! per suite at the end. [`STRICT_ENV`]`=1` (CI) forbids skips even when allowed.

use std::io::Write;
use std::path::PathBuf;

/// Set to `1` to let tests whose prerequisites this machine lacks skip (recorded) instead of
/// failing.
pub const ALLOW_ENV: &str = "EXECUTOR_TESTS_ALLOW_SKIPS";
/// Set to `1` (CI) so that no test ever skips, whatever [`ALLOW_ENV`] says.
pub const STRICT_ENV: &str = "EXECUTOR_TESTS_STRICT";
/// The file a suite outside Rust (pytest, run by the `python` suite) appends its skips to, in
/// the same format; set by the harness for the programs it starts.
pub const FILE_ENV: &str = "EXECUTOR_TESTS_SKIPS_FILE";

fn set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Directory of the skip records: `target/test-skips`.
pub fn dir() -> PathBuf {
    crate::static_build::target_dir().join("test-skips")
}

/// This test binary's suite: its file name without cargo's hash (`escape-1a2b...` -> `escape`).
pub fn suite() -> String {
    let exe = std::env::current_exe().unwrap_or_default();
    let name = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.rsplit_once('-') {
        Some((suite, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => suite.to_string(),
        _ => name,
    }
}

/// The file this suite's skips go to.
pub fn file() -> PathBuf {
    dir().join(format!("{}.tsv", suite()))
}

/// Fail the current test for the missing `what`, or (when allowed) record it as skipped.
pub fn skip_or_fail(what: &str) {
    if set(STRICT_ENV) {
        panic!("required for this test but missing: {what} ({STRICT_ENV}=1: nothing may skip)");
    }
    if !set(ALLOW_ENV) {
        panic!(
            "required for this test but missing: {what} (tests/setup installs what the suites \
             need; {ALLOW_ENV}=1 lets such tests skip, listed at the end of tests/run)"
        );
    }
    // libtest names each test's thread after the test.
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed thread)")
        .to_string();
    record(&test, what);
    eprintln!("SKIPPED: {test}: missing {what}");
}

/// Append one skip to this suite's record, in one write (lines from parallel tests never mix).
fn record(test: &str, what: &str) {
    let line = format!("{}\t{}\n", test, what.replace(['\t', '\n'], " "));
    let written = std::fs::create_dir_all(dir()).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file())?
            .write_all(line.as_bytes())
    });
    if let Err(err) = written {
        panic!(
            "cannot record the skip of {test} in {}: {err}",
            file().display()
        );
    }
}
