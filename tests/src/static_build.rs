//! The executor that VMs and containers run: one static binary, since those machines have none
//! of the host's shared libraries.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The target and flags of the static build. musl does not compile yet (glibc-only calls in
/// `executor/src/sys.rs`); until it does, glibc linked statically. Switching to musl is this
/// line: `("x86_64-unknown-linux-musl", "")`.
const STATIC_BUILD: (&str, &str) = ("x86_64-unknown-linux-gnu", "-C target-feature=+crt-static");

/// The workspace's target directory, from this binary's own path: test binaries live in
/// `target/<profile>/deps/`, other binaries (the benchmark) in `target/<profile>/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let profile_dir = if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().unwrap()
    } else {
        dir
    };
    profile_dir.parent().unwrap().to_path_buf()
}

/// Path of a static release build of `executor`, built once per test process (into its own
/// target directory, `target/static`, so it never invalidates the normal build) and checked
/// with file(1).
pub fn static_executor() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let (triple, rustflags) = STATIC_BUILD;
            let dir = target_dir().join("static");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let status = Command::new(cargo)
                .args([
                    "build",
                    "--quiet",
                    "--release",
                    "-p",
                    "executor",
                    "--target",
                ])
                .arg(triple)
                .arg("--target-dir")
                .arg(&dir)
                // With --target, RUSTFLAGS reach only the target's crates, not build scripts
                // and proc macros (which must stay dynamic).
                .env("RUSTFLAGS", rustflags)
                .env_remove("CARGO_ENCODED_RUSTFLAGS")
                .status()
                .expect("cargo build runs");
            assert!(status.success(), "building the static executor failed");
            let exe = dir.join(triple).join("release").join("executor");
            let file = Command::new("file")
                .arg(&exe)
                .output()
                .expect("file(1) runs");
            let described = String::from_utf8_lossy(&file.stdout);
            assert!(
                described.contains("statically linked") || described.contains("static-pie linked"),
                "the static executor is not static: {described}"
            );
            exe
        })
        .clone()
}
