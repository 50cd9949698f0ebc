//! The executor that VMs and containers run: one static binary, since those machines have none
//! of the host's shared libraries.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

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

/// Path of the static release build of `executor` (`target/static/executor`, glibc linked
/// statically), built once per test process by `.ci/build-static`, the one place that builds it
/// (and checks that it needs no loader or shared library).
pub fn static_executor() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let script =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/build-static");
            let mut build = Command::new(&script);
            without_package_env(&mut build);
            let out = build
                .stderr(std::process::Stdio::inherit())
                .output()
                .unwrap_or_else(|e| panic!("{} does not run: {e}", script.display()));
            assert!(out.status.success(), "building the static executor failed");
            let paths = String::from_utf8_lossy(&out.stdout);
            let exe = PathBuf::from(paths.lines().next().expect("build-static prints paths"));
            let described = Command::new("file")
                .arg(&exe)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .expect("file(1) runs");
            assert!(
                described.contains("statically linked") || described.contains("static-pie linked"),
                "the static executor is not static: {described}"
            );
            exe
        })
        .clone()
}

/// Remove from `command`'s environment the variables cargo gives a test process about its own
/// package. A build started from a test would inherit them, and ring's build script reruns when
/// CARGO_MANIFEST_DIR changes: ring and everything above it would be rebuilt there, and again
/// by the next build from a shell (`cargo test` itself, `.ci/build-static`).
pub(crate) fn without_package_env(command: &mut Command) {
    const PER_PACKAGE: [&str; 6] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ];
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if PER_PACKAGE.contains(&name.as_ref())
            || name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
        {
            command.env_remove(name.as_ref());
        }
    }
}
