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
    // 'h' only prints the help text into the kernel log: harmless, and visible from the host.
    let probe = "echo h > /proc/sysrq-trigger; echo sysrq_rc=$?; echo ok > ws-ok; echo ws_rc=$?";
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let before = count_in_dmesg("sysrq: HELP");
        let out = row.output(client, "sysrq", probe).await;
        let after = count_in_dmesg("sysrq: HELP");
        // Control in every profile: the workspace is writable.
        assert_eq!(field(&out, "ws_rc"), Some("0"), "{row} control: {out}");
        match row.expect {
            Denied => {
                assert_ne!(field(&out, "sysrq_rc"), Some("0"), "{row} {out}");
                assert_eq!(after, before, "{row} the kernel log shows a sysrq: {out}");
            }
            Allowed => assert!(after > before, "{row} control: dmesg shows the sysrq"),
        }
    })
    .await;
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
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let value = format!("escape-{}", marker());
        let out = row
            .output(
                client,
                "sysctl",
                &format!("echo {value} > {path}; echo rc=$?"),
            )
            .await;
        let now = std::fs::read_to_string(path).unwrap();
        std::fs::write(path, &original).unwrap();
        match row.expect {
            Denied => {
                assert_eq!(
                    now, original,
                    "{row} changed the host's core_pattern: {out}"
                );
                assert_ne!(field(&out, "rc"), Some("0"), "{row} {out}");
            }
            Allowed => assert_eq!(now.trim(), value, "{row} control: {out}"),
        }
    })
    .await;
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
    each_row(&daemon, &ONLY_TRUSTED_TASK_LEFT_OUT, async |client, row| {
        let out = row
            .output(
                client,
                "sysfs",
                &format!("echo {other} > {path}; echo rc=$?; ls /sys/class/net | wc -l"),
            )
            .await;
        let now = selected(&std::fs::read_to_string(path).unwrap());
        std::fs::write(path, &original).unwrap();
        match row.expect {
            Denied => {
                assert_eq!(now, original, "{row} changed the host's THP setting: {out}");
                assert_ne!(field(&out, "rc"), Some("0"), "{row} {out}");
            }
            Allowed => assert_eq!(now, other, "{row} control: {out}"),
        }
    })
    .await;
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
    each_row(&daemon, &ONLY_TRUSTED_TASK_LEFT_OUT, async |client, row| {
        let m = format!("escape-kmsg-{}", marker());
        let out = row
            .output(client, "kmsg", &format!("echo {m} > /dev/kmsg; echo rc=$?"))
            .await;
        let seen = count_in_dmesg(&m);
        match row.expect {
            Denied => assert_eq!(seen, 0, "{row} wrote the kernel log: {out}"),
            Allowed => assert_eq!(seen, 1, "{row} control: {out}"),
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn device_nodes_cannot_be_created_but_fifos_can() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let out = row
            .output(
                client,
                "mknod",
                &format!(
                    "mknod mem-{m} c 1 1; echo chr_rc=$?; mknod disk-{m} b 254 0; echo blk_rc=$?; \
                 mkfifo fifo-{m}; echo fifo_rc=$?"
                ),
            )
            .await;
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
            "{row} control: fifo on the host: {out}"
        );
        match row.expect {
            Denied => {
                assert!(!chr && !blk, "{row} created a device node: {out}");
            }
            Allowed => assert!(chr && blk, "{row} control: {out}"),
        }
    })
    .await;
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
    let probe = format!(
        "head -c 512 {dev} | od -An -tx1 | head -1 | sed 's/^/bytes=/;s/ //g'; echo read_rc=${{PIPESTATUS[0]}}\n\
         {PY} -c 'open(\"{dev}\", \"r+b\").close()' 2>/dev/null; echo write_open_rc=$?"
    );
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "rawdisk", &probe).await;
        row.check_zero(&out, "read_rc", &format!("read {dev}"));
        if row.denied() {
            assert_ne!(
                field(&out, "write_open_rc"),
                Some("0"),
                "{row} opened {dev} rw: {out}"
            );
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}
