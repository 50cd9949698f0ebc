//! Writes to /proc, /sys and devices: sysrq, sysctls, sysfs, the kernel log, device nodes and
//! the raw disk. Outcomes are read back on the host (kernel log, sysctl values, the workspace).
//! `task-container` is left out where its profile grants the host's root (sysfs, /dev/kmsg):
//! those are the container's to damage by its threat model.

use std::process::Command;

use executor_tests::{is_root, marker, require};

use crate::common::*;

fn host_sh(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn count_in_dmesg(needle: &str) -> usize {
    host_sh("dmesg 2>/dev/null")
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

#[tokio::test]
async fn sysrq_trigger_cannot_be_written() {
    if !require("root (dmesg and a sysrq control)", is_root()) {
        return;
    }
    if !std::path::Path::new("/proc/sysrq-trigger").exists() {
        // Not a missing test precondition but a missing attack surface (CONFIG_MAGIC_SYSRQ=n,
        // as on this VM): there is nothing to defend, so CI must not fail on it either.
        not_applicable("/proc/sysrq-trigger does not exist on this kernel");
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    // 'h' only prints the help text into the kernel log: harmless, and visible from the host.
    let probe = "echo h > /proc/sysrq-trigger; echo sysrq_rc=$?; echo ok > ws-ok; echo ws_rc=$?";
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let before = count_in_dmesg("sysrq: HELP");
        let out = run_in(&mut client, profile, "sysrq", probe).await.output;
        let after = count_in_dmesg("sysrq: HELP");
        // Control in every profile: the workspace is writable.
        assert_eq!(field(&out, "ws_rc"), Some("0"), "{l} control: {out}");
        match expect {
            Denied => {
                assert_ne!(field(&out, "sysrq_rc"), Some("0"), "{l} {out}");
                assert_eq!(after, before, "{l} the kernel log shows a sysrq: {out}");
            }
            Allowed => assert!(after > before, "{l} control: dmesg shows the sysrq"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn kernel_sysctls_cannot_be_written() {
    if !require("root (a sysctl control)", is_root()) {
        return;
    }
    let path = "/proc/sys/kernel/core_pattern";
    let original = std::fs::read_to_string(path).unwrap();
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let value = format!("escape-{}", marker());
        let out = run_in(
            &mut client,
            profile,
            "sysctl",
            &format!("echo {value} > {path}; echo rc=$?"),
        )
        .await
        .output;
        let now = std::fs::read_to_string(path).unwrap();
        std::fs::write(path, &original).unwrap();
        match expect {
            Denied => {
                assert_eq!(now, original, "{l} changed the host's core_pattern: {out}");
                assert_ne!(field(&out, "rc"), Some("0"), "{l} {out}");
            }
            Allowed => assert_eq!(now.trim(), value, "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn sysfs_cannot_be_written() {
    let path = "/sys/kernel/mm/transparent_hugepage/enabled";
    let Ok(original) = std::fs::read_to_string(path) else {
        require("transparent hugepages in sysfs", false);
        return;
    };
    if !require("root (a sysfs control)", is_root()) {
        return;
    }
    // "[madvise]" -> "madvise": the selected value.
    let selected = |text: &str| {
        text.split_whitespace()
            .find(|w| w.starts_with('['))
            .map(|w| w.trim_matches(['[', ']']).to_string())
            .unwrap()
    };
    let original = selected(&original);
    let other = if original == "never" {
        "madvise"
    } else {
        "never"
    };
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for (profile, expect) in [(STRICT, Denied), (LANDLOCK, Denied), (TRUSTED, Allowed)] {
        let l = label(profile, expect);
        let out = run_in(
            &mut client,
            profile,
            "sysfs",
            &format!("echo {other} > {path}; echo rc=$?; ls /sys/class/net | wc -l"),
        )
        .await
        .output;
        let now = selected(&std::fs::read_to_string(path).unwrap());
        std::fs::write(path, &original).unwrap();
        match expect {
            Denied => {
                assert_eq!(now, original, "{l} changed the host's THP setting: {out}");
                assert_ne!(field(&out, "rc"), Some("0"), "{l} {out}");
            }
            Allowed => assert_eq!(now, other, "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn the_kernel_log_cannot_be_written() {
    if !require("root (dmesg)", is_root()) {
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for (profile, expect) in [(STRICT, Denied), (LANDLOCK, Denied), (TRUSTED, Allowed)] {
        let l = label(profile, expect);
        let m = format!("escape-kmsg-{}", marker());
        let out = run_in(
            &mut client,
            profile,
            "kmsg",
            &format!("echo {m} > /dev/kmsg; echo rc=$?"),
        )
        .await
        .output;
        let seen = count_in_dmesg(&m);
        match expect {
            Denied => assert_eq!(seen, 0, "{l} wrote the kernel log: {out}"),
            Allowed => assert_eq!(seen, 1, "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn device_nodes_cannot_be_created_but_fifos_can() {
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let m = marker();
        let out = run_in(
            &mut client,
            profile,
            "mknod",
            &format!(
                "mknod mem-{m} c 1 1; echo chr_rc=$?; mknod disk-{m} b 254 0; echo blk_rc=$?; \
                 mkfifo fifo-{m}; echo fifo_rc=$?"
            ),
        )
        .await
        .output;
        use std::os::unix::fs::FileTypeExt;
        let kind = |name: &str| {
            std::fs::symlink_metadata(daemon.workspace.join(name))
                .ok()
                .map(|m| m.file_type())
        };
        let chr = kind(&format!("mem-{m}")).is_some_and(|t| t.is_char_device());
        let blk = kind(&format!("disk-{m}")).is_some_and(|t| t.is_block_device());
        let _ = std::fs::remove_file(daemon.workspace.join(format!("mem-{m}")));
        let _ = std::fs::remove_file(daemon.workspace.join(format!("disk-{m}")));
        // Control in every profile: a fifo needs no privilege.
        assert!(
            kind(&format!("fifo-{m}")).is_some_and(|t| t.is_fifo()),
            "{l} control: fifo on the host: {out}"
        );
        match expect {
            Denied => {
                assert!(!chr && !blk, "{l} created a device node: {out}");
            }
            Allowed => assert!(chr && blk, "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

/// Block device mounted at `/` on the host, from /proc/self/mounts.
fn root_device() -> Option<String> {
    std::fs::read_to_string("/proc/self/mounts")
        .ok()?
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (dev, at) = (f.next()?, f.next()?);
            (at == "/" && dev.starts_with("/dev/")).then(|| dev.to_string())
        })
}

#[tokio::test]
async fn the_raw_disk_under_the_token_cannot_be_opened() {
    // Reading the block device bypasses every file rule: the token, the audit log and the
    // executor binary are all on it. Landlock's profile grants "read /dev" and task-container's
    // grants the host root; either way the raw disk must stay closed.
    let Some(dev) = root_device() else {
        require("a block device mounted at /", false);
        return;
    };
    // Some hosts (this VM) refuse raw block access even to root: no surface to defend.
    if let Err(e) = std::fs::File::open(&dev) {
        not_applicable(&format!("root on the host cannot open {dev} either ({e})"));
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    let probe = format!(
        "head -c 512 {dev} | od -An -tx1 | head -1 | sed 's/^/bytes=/;s/ //g'; echo read_rc=${{PIPESTATUS[0]}}\n\
         {PY} -c 'open(\"{dev}\", \"r+b\").close()' 2>/dev/null; echo write_open_rc=$?"
    );
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let out = run_in(&mut client, profile, "rawdisk", &probe).await.output;
        match expect {
            Denied => {
                assert_ne!(field(&out, "read_rc"), Some("0"), "{l} read {dev}: {out}");
                assert_ne!(
                    field(&out, "write_open_rc"),
                    Some("0"),
                    "{l} opened {dev} rw: {out}"
                );
            }
            Allowed => assert_eq!(field(&out, "read_rc"), Some("0"), "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}
