//! Environment injection into the daemon's own helper: a request's `env` carries LD_PRELOAD of
//! a library the command planted in the workspace. If the helper (root, full capabilities,
//! before any layer) were started with the request's environment, the library's constructor
//! would run unsandboxed. The constructor drops a file outside every sandbox's view whenever
//! it runs without a seccomp filter; the host checks that file.

use std::process::Command;

use executor_tests::{marker, require};

use crate::common::*;

const EVIL_C: &str = r#"
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void escape_probe(void) {
    const char *pwn = getenv("ESCAPE_PWN");
    char buf[8192];
    int fd = open("/proc/self/status", O_RDONLY);
    if (!pwn || fd < 0) return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = 0;
    char *line = strstr(buf, "\nSeccomp:");
    /* Unfiltered: this is not a sandboxed payload. */
    if (line && strtol(line + 9, NULL, 10) == 0) {
        int out = open(pwn, O_CREAT | O_WRONLY | O_APPEND, 0644);
        if (out >= 0) {
            write(out, "x", 1);
            close(out);
        }
    }
}
"#;

#[tokio::test]
async fn ld_preload_in_the_request_env_never_reaches_the_unsandboxed_helper() {
    let Some(daemon) = daemon() else {
        return;
    };
    let dir = executor_tests::TempDir::new().unwrap();
    std::fs::write(dir.path().join("evil.c"), EVIL_C).unwrap();
    let so = daemon.workspace.join(format!("evil-{}.so", marker()));
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(dir.path().join("evil.c"))
        .status()
        .is_ok_and(|s| s.success());
    if !require("a C compiler (cc) to build the preload library", built) {
        return;
    }
    let mut client = daemon.connect().await;

    // Control: the library does fire when loaded by an unfiltered process.
    let pwn = format!("/var/tmp/escape-pwn-{}", marker());
    run_in(
        &mut client,
        TRUSTED,
        "preload-ctl",
        &format!("LD_PRELOAD={} ESCAPE_PWN={pwn} /bin/true", so.display()),
    )
    .await;
    assert!(
        std::path::Path::new(&pwn).exists(),
        "control: the preload library runs its constructor"
    );
    let _ = std::fs::remove_file(&pwn);

    for profile in [STRICT, LANDLOCK, TASK] {
        let pwn = format!("/var/tmp/escape-pwn-{profile}-{}", marker());
        let mut r = preq(profile, &format!("{profile}-preload"), "echo ran", 20.0);
        r.env.insert("LD_PRELOAD".into(), so.display().to_string());
        r.env.insert("ESCAPE_PWN".into(), pwn.clone());
        let got = client.exec(r).await.result;
        let exists = std::path::Path::new(&pwn).exists();
        let _ = std::fs::remove_file(&pwn);
        assert!(
            !exists,
            "[{profile}] the preload library ran without seccomp (in the helper?): {got:?}"
        );
        // Refusing the variable is fine; running the command with it is fine too.
        if let Ok(result) = got {
            assert!(result.output.contains("ran"), "[{profile}] {result:?}");
        }
    }
    assert_daemon_intact(&daemon).await;
}
