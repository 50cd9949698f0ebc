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

/// Path of the static release build of `executor` (x86_64 musl), built once per test process
/// by `.ci/build-static`, the one place that builds it (and checks that it needs no loader or
/// shared library).
pub fn static_executor() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let script =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/build-static");
            let mut build = Command::new(&script);
            crate::without_package_env(&mut build);
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
