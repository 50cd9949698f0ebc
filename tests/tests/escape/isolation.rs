//! What each profile applies, observed from the host (/proc/<pid>/status and ns links of a
//! running command) and from inside; the write policy; leaked descriptors; the default
//! profile; failing closed when layers cannot be applied; `executor check`.

use std::process::Command;

use executor_tests::{binary, marked_sleep, marker, namespace_of, proc_status, sleepers, Daemon};

use crate::common::*;

const STRICT_LAYERS: &[&str] = &[
    "mount_ns",
    "pid_ns",
    "net_ns",
    "ipc_ns",
    "uts_ns",
    "cgroup_ns",
    "pivot_root",
    "uid",
    "caps",
    "no_new_privs",
    "landlock",
    "seccomp",
    "rlimits",
];
const LANDLOCK_LAYERS: &[&str] = &["caps", "no_new_privs", "landlock", "seccomp", "rlimits"];
const TASK_LAYERS: &[&str] = &[
    "mount_ns",
    "pid_ns",
    "ipc_ns",
    "uts_ns",
    "cgroup_ns",
    "caps",
    "no_new_privs",
    "seccomp",
];

fn required_layers(profile: &str) -> &'static [&'static str] {
    match profile {
        STRICT => STRICT_LAYERS,
        LANDLOCK => LANDLOCK_LAYERS,
        TASK => TASK_LAYERS,
        _ => &[],
    }
}

/// task-container's capability set (sandbox-profiles/task-container.json) as a mask.
fn task_caps_mask() -> String {
    let bits = [0u32, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31];
    format!("{:016x}", bits.iter().fold(0u64, |m, b| m | (1 << b)))
}

const NS: [&str; 7] = ["mnt", "pid", "net", "ipc", "uts", "cgroup", "user"];

#[tokio::test]
async fn each_profile_applies_its_layers_as_seen_from_the_host() {
    let Some(daemon) = daemon() else {
        return;
    };
    let d = daemon.pid() as i32;
    let mut client = daemon.connect().await;
    let zero = "0000000000000000".to_string();
    for profile in ALL_PROFILES {
        let m = marker();
        let (id, p) = start_sleeper(&mut client, profile, "view", &m, "", 30.0).await;
        let status = |f: &str| proc_status(p, f).unwrap_or_default();
        let own_ns: Vec<&str> = NS
            .iter()
            .copied()
            .filter(|k| namespace_of(p, k) != namespace_of(d, k))
            .collect();
        let (uid, caps, bnd, nnp, seccomp, ns): (&str, String, String, &str, &str, Vec<&str>) =
            match profile {
                STRICT => (
                    "65534",
                    zero.clone(),
                    zero.clone(),
                    "1",
                    "2",
                    vec!["mnt", "pid", "net", "ipc", "uts", "cgroup"],
                ),
                // 65534 when the daemon is root (these tests' daemon), per the profile.
                LANDLOCK => ("65534", zero.clone(), zero.clone(), "1", "2", vec![]),
                TASK => (
                    "0",
                    task_caps_mask(),
                    task_caps_mask(),
                    "1",
                    "2",
                    vec!["mnt", "pid", "ipc", "uts", "cgroup"],
                ),
                _ => (
                    "0",
                    proc_status(d, "CapEff:").unwrap(),
                    proc_status(d, "CapBnd:").unwrap(),
                    "0",
                    "0",
                    vec![],
                ),
            };
        let got_uid = status("Uid:");
        assert!(
            got_uid.split_whitespace().all(|u| u == uid),
            "[{profile}] Uid {got_uid}"
        );
        assert_eq!(status("CapEff:"), caps, "[{profile}] CapEff");
        assert_eq!(status("CapPrm:"), caps, "[{profile}] CapPrm");
        assert_eq!(status("CapBnd:"), bnd, "[{profile}] CapBnd");
        assert_eq!(status("CapAmb:"), zero, "[{profile}] CapAmb");
        assert_eq!(status("NoNewPrivs:"), nnp, "[{profile}] NoNewPrivs");
        assert_eq!(status("Seccomp:"), seccomp, "[{profile}] Seccomp");
        assert_eq!(own_ns, ns, "[{profile}] namespaces of its own");
        let result = cancel(&mut client, &id).await;
        let layers = &result.extra.isolation.layers;
        for layer in required_layers(profile) {
            assert!(
                layers.iter().any(|l| l == layer),
                "[{profile}] layer {layer} in {layers:?}"
            );
        }
        if profile == TRUSTED {
            for layer in layers {
                assert!(
                    !layer.ends_with("_ns") && layer != "landlock" && layer != "seccomp",
                    "[trusted] reports {layer}: {layers:?}"
                );
            }
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn strict_sees_a_fresh_root_proc_dev_and_hostname() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let probe = "echo host=$(hostname); echo procs=$(ls /proc | grep -c '^[0-9]*$'); \
                 echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline | cut -c1-40 | tr ' ' _); \
                 echo dev=$(ls /dev | tr '\\n' ,); \
                 echo rootfs=$(stat -f -c %T /); echo tmpfs=$(stat -f -c %T /tmp); \
                 touch /usr/escape-probe 2>/dev/null; echo usr_rc=$?; \
                 touch /escape-probe 2>/dev/null; echo root_rc=$?; \
                 touch ws-probe-$(id -u); echo ws_rc=$?; \
                 for t in bash python3 perl cat dd; do command -v $t >/dev/null || echo missing=$t; done";
    let host_name = nix::unistd::gethostname()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    // Control: trusted sees the host's view.
    // (Only the hostname line: the rest of the probe writes /usr and /, which trusted may.)
    let ctl = run_in(&mut client, TRUSTED, "view", "echo host=$(hostname)")
        .await
        .output;
    assert_eq!(
        field(&ctl, "host"),
        Some(host_name.as_str()),
        "[trusted] control: {ctl}"
    );
    let out = run_in(&mut client, STRICT, "view", probe).await.output;
    assert_ne!(
        field(&out, "host"),
        Some(host_name.as_str()),
        "[strict] hostname: {out}"
    );
    let procs: usize = field(&out, "procs").unwrap().parse().unwrap();
    assert!(procs <= 6, "[strict] sees {procs} processes: {out}");
    // pid 1 is the sandbox's own init (a fork of the fork server), never the daemon (whose
    // command line is `executor serve ...`).
    let pid1 = field(&out, "pid1").unwrap_or_default();
    assert!(
        !pid1.contains("_serve_") && !pid1.contains("--state-dir"),
        "[strict] pid 1 is the daemon: {out}"
    );
    let dev: Vec<&str> = field(&out, "dev")
        .unwrap()
        .split(',')
        .filter(|s| !s.is_empty())
        .collect();
    // `tty` opens only the caller's own controlling terminal (none here: the command has no
    // terminal, e2e `processes::terminal` opens it from a PTY process); `pts` is a devpts
    // of the command's own, `ptmx` a link into it (issue 35).
    for needed in [
        "null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx",
    ] {
        assert!(dev.contains(&needed), "[strict] /dev lacks {needed}: {out}");
    }
    for absent in [
        "tty0", "tty1", "vda", "kmsg", "mem", "console", "fuse", "kvm",
    ] {
        assert!(!dev.contains(&absent), "[strict] /dev has {absent}: {out}");
    }
    assert_eq!(field(&out, "tmpfs"), Some("tmpfs"), "[strict] {out}");
    assert_ne!(
        field(&out, "usr_rc"),
        Some("0"),
        "[strict] wrote /usr: {out}"
    );
    assert_ne!(field(&out, "root_rc"), Some("0"), "[strict] wrote /: {out}");
    assert_eq!(
        field(&out, "ws_rc"),
        Some("0"),
        "[strict] control: workspace: {out}"
    );
    assert!(
        daemon.workspace.join("ws-probe-65534").exists(),
        "[strict] control on the host"
    );
    for path in ["/usr/escape-probe", "/escape-probe"] {
        let exists = std::path::Path::new(path).exists();
        let _ = std::fs::remove_file(path);
        assert!(!exists, "[strict] wrote the host's {path}");
    }
    assert!(
        !out.contains("missing="),
        "[strict] tools the suite relies on: {out}"
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn tools_exist_in_every_profile() {
    // The probes of this suite run bash, coreutils, python3 and perl inside the sandbox. If
    // these fail, the other cases' denials could be a missing tool, not a working sandbox.
    let Some((_daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let probe = format!(
        "for t in bash python3 perl cat dd stat od head setsid nohup unshare mount mknod mkfifo ps; do \
         command -v $t >/dev/null || echo missing=$t; done; {PY} -c 'import ctypes; print(\"py-ok\")'; \
         perl -e 'print \"perl-ok\\n\"'"
    );
    for profile in ALL_PROFILES {
        let out = run_in(&mut client, profile, "tools", &probe).await.output;
        assert!(!out.contains("missing="), "[{profile}] {out}");
        assert!(
            out.contains("py-ok") && out.contains("perl-ok"),
            "[{profile}] {out}"
        );
    }
}

#[tokio::test]
async fn writes_land_only_where_the_profile_allows() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    // Targets that do not exist yet, so nothing is overwritten; cleaned up after.
    let targets = ["/etc", "/usr", "/var/tmp", "/root", "/opt"];
    for (profile, allowed) in [
        (STRICT, &[][..]),
        (LANDLOCK, &[][..]),
        (TASK, &targets[..]),
        (TRUSTED, &targets[..]),
    ] {
        let m = marker();
        let mut probe =
            format!("echo x > ws-{m}; echo ws=$?; echo x > /tmp/tmp-{m}; echo tmp=$?; ");
        for dir in targets {
            probe.push_str(&format!("echo x > {dir}/escape-{m}; "));
        }
        let out = run_in(&mut client, profile, "writes", &probe).await.output;
        // Control: workspace and /tmp are writable in every profile.
        assert_eq!(field(&out, "ws"), Some("0"), "[{profile}] workspace: {out}");
        assert_eq!(field(&out, "tmp"), Some("0"), "[{profile}] /tmp: {out}");
        assert!(
            daemon.workspace.join(format!("ws-{m}")).exists(),
            "[{profile}]"
        );
        for dir in targets {
            let path = format!("{dir}/escape-{m}");
            let exists = std::path::Path::new(&path).exists();
            let _ = std::fs::remove_file(&path);
            assert_eq!(
                exists,
                allowed.contains(&dir),
                "[{profile}] {path} written: {exists}: {out}"
            );
        }
        let _ = std::fs::remove_file(format!("/tmp/tmp-{m}"));
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn only_stdio_descriptors_reach_a_sandboxed_command() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for profile in ALL_PROFILES {
        let m = marker();
        let (id, out) = start_until(
            &mut client,
            profile,
            "fds",
            &format!(
                "ls /proc/self/fd | tr '\\n' ' '; echo; exec {}",
                marked_sleep(&m)
            ),
            "\n",
            30.0,
        )
        .await;
        assert!(
            executor_tests::eventually(executor_tests::PATIENCE, || sleepers(&m).len() == 1).await,
            "[{profile}]"
        );
        let pid = sleepers(&m)[0];
        let fds = || {
            let mut fds: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            fds.sort_unstable();
            fds
        };
        // The new command line shows before execve(2) has closed the close-on-exec
        // descriptors, so give the exec a moment (a loaded machine may take seconds); a real
        // leak stays.
        executor_tests::eventually(executor_tests::PATIENCE, || fds() == vec![0, 1, 2]).await;
        assert_eq!(fds(), vec![0, 1, 2], "[{profile}] host view; inside: {out}");
        // Inside, `ls` sees its own 0-2 plus the directory it reads.
        assert_eq!(out.trim(), "0 1 2 3", "[{profile}] inside view");
        cancel(&mut client, &id).await;
    }
    // Control: the daemon holds many more.
    assert!(executor_tests::fd_count(daemon.pid() as i32) > 4);
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn strict_is_the_default_and_trusted_is_only_used_when_named() {
    let Some((_daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    assert_eq!(client.hello.default_profile, STRICT, "{:?}", client.hello);
    let names: Vec<&str> = client
        .hello
        .profiles
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    for p in ALL_PROFILES {
        assert!(names.contains(&p), "hello lists {p}: {names:?}");
    }
    let unnamed = client.run("unnamed", "id -u").await;
    assert_eq!(unnamed.extra.isolation.profile, STRICT);
    assert_eq!(unnamed.output, "65534\n");
    // Control: naming trusted gets it.
    let named = run_in(&mut client, TRUSTED, "named", "id -u").await;
    assert_eq!(named.output, "0\n");
}

#[tokio::test]
async fn an_unprivileged_daemon_fails_closed_instead_of_downgrading() {
    if !executor_tests::require(
        "root (to start the daemon as uid 65534)",
        executor_tests::is_root(),
    ) {
        return;
    }
    let daemon = Daemon::start_as_user(65534, &executor_tests::ALLOW_ALL_PROFILES);
    let mut client = daemon.connect().await;
    assert_ne!(
        client.hello.default_profile, TRUSTED,
        "trusted became the default"
    );
    for profile in [STRICT, LANDLOCK, TASK] {
        let m = marker();
        let file = format!("ran-{m}");
        let got = client
            .exec(preq(
                profile,
                &format!("{profile}-fc"),
                &format!("touch {file}"),
                10.0,
            ))
            .await
            .result;
        match got {
            Ok(result) => {
                // It ran: then with every layer the profile requires.
                let layers = &result.extra.isolation.layers;
                for layer in required_layers(profile) {
                    assert!(
                        layers.iter().any(|l| l == layer),
                        "[{profile}] ran without {layer}: {layers:?}"
                    );
                }
            }
            Err(err) => {
                assert!(
                    matches!(
                        err.code,
                        protocol::ErrorCode::EnvironmentError | protocol::ErrorCode::ProfileDenied
                    ),
                    "[{profile}] {err:?}"
                );
                assert!(!err.message.is_empty());
                assert!(
                    !daemon.workspace.join(&file).exists(),
                    "[{profile}] refused, yet the command ran"
                );
            }
        }
    }
    // A request naming no profile gets the default, which is never a silent trusted: it runs
    // sandboxed, or is refused with a reason (this daemon's state directory lies under /tmp,
    // which landlock's profile opens, so landlock refuses it).
    let m = marker();
    match client
        .exec(executor_tests::req("default", &format!("touch ran-{m}")))
        .await
        .result
    {
        Ok(r) => assert_ne!(r.extra.isolation.profile, TRUSTED, "{r:?}"),
        Err(err) => {
            assert!(
                matches!(
                    err.code,
                    protocol::ErrorCode::EnvironmentError | protocol::ErrorCode::ProfileDenied
                ),
                "{err:?}"
            );
            assert!(!daemon.workspace.join(format!("ran-{m}")).exists());
        }
    }
    // Control: the daemon does run commands, when trusted is named explicitly.
    let r = run_in(&mut client, TRUSTED, "named", "id -u").await;
    assert_eq!(r.output, "65534\n");
}

#[tokio::test]
async fn executor_check_reports_layers_and_profiles() {
    let out = Command::new(binary("executor"))
        .arg("check")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "executor check failed: {text}");
    for word in [
        STRICT, LANDLOCK, TASK, TRUSTED, "landlock", "seccomp", "pid",
    ] {
        assert!(text.contains(word), "check output lacks {word}: {text}");
    }
}

#[tokio::test]
async fn task_container_runs_in_the_default_layout_without_exposing_the_token() {
    // The daemon's default layout puts the workspace inside the state directory, which
    // task-container covers. The command must still get its workspace, and still not the token.
    if !executor_tests::require("root (task-container needs it)", executor_tests::is_root()) {
        return;
    }
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    assert!(daemon.workspace.starts_with(daemon.state.path()));
    let mut client = daemon.connect().await;
    let s = daemon.state.path().display();
    let out = run_in(
        &mut client,
        TASK,
        "layout",
        &format!("echo x > in-ws; echo ws=$?; cat {s}/token; echo token_rc=$?"),
    )
    .await
    .output;
    assert_eq!(
        field(&out, "ws"),
        Some("0"),
        "[task-container] workspace: {out}"
    );
    assert!(
        daemon.workspace.join("in-ws").exists(),
        "[task-container] on the host"
    );
    assert!(
        !out.contains(&daemon.token),
        "[task-container] read the token: {out}"
    );
    // Control: landlock and strict get the same workspace in this layout.
    let out = run_in(
        &mut client,
        STRICT,
        "layout",
        "echo x > in-ws-strict; echo ws=$?",
    )
    .await
    .output;
    assert_eq!(field(&out, "ws"), Some("0"), "[strict] control: {out}");
}

#[tokio::test]
async fn landlock_can_write_the_workspace_a_strict_command_also_writes() {
    // The workspace is shared by every profile of a daemon: strict runs as 65534, landlock as
    // the daemon's uid without CAP_DAC_OVERRIDE. Both must be able to write it.
    let Some((_daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for profile in ALL_PROFILES {
        let out = run_in(
            &mut client,
            profile,
            "ws",
            &format!("echo {profile} > by-{profile}; echo ws=$?; mkdir -p d-{profile}/sub && echo x > d-{profile}/sub/f; echo sub=$?"),
        )
        .await
        .output;
        assert_eq!(field(&out, "ws"), Some("0"), "[{profile}] {out}");
        assert_eq!(field(&out, "sub"), Some("0"), "[{profile}] {out}");
    }
}

#[tokio::test]
async fn strict_system_mounts_are_read_only_by_mount_flags_not_only_by_file_modes() {
    // uid 65534 cannot write /etc or /usr anyway, so the write attempts above do not prove the
    // binds are read-only. The mount table does: any world-writable file below a read-write
    // bind would otherwise be open.
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let out = run_in(
        &mut client,
        STRICT,
        "mounts",
        "awk '{print $5, $6}' /proc/self/mountinfo",
    )
    .await
    .output;
    let options = |at: &str| {
        out.lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(point, _)| *point == at)
            .map(|(_, opts)| opts.to_string())
            .next_back()
    };
    for dir in ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt"] {
        // Directories that are symlinks on this host (usrmerge) are not mount points.
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            let opts = options(dir).unwrap_or_else(|| panic!("[strict] {dir} not mounted: {out}"));
            assert!(
                opts.split(',').any(|o| o == "ro"),
                "[strict] {dir} is mounted {opts}"
            );
        }
    }
    let ws = daemon.workspace.display().to_string();
    let ws_opts = options(&ws).unwrap_or_else(|| panic!("[strict] workspace not mounted: {out}"));
    // Control: the workspace is a read-write mount.
    assert!(
        ws_opts.split(',').any(|o| o == "rw"),
        "[strict] workspace {ws_opts}"
    );
    for dir in ["/tmp", "/dev/shm", ws.as_str()] {
        let opts = options(dir).unwrap_or_default();
        assert!(
            opts.split(',').any(|o| o == "nosuid") && opts.split(',').any(|o| o == "nodev"),
            "[strict] {dir} is mounted {opts}"
        );
    }
}

#[tokio::test]
async fn landlock_reaches_its_workspace_inside_the_state_directory_by_path() {
    // The default layout: the workspace inside a state directory the daemon created 0700.
    // landlock commands (uid 65534) could neither list nor write it: their uid could not pass
    // through the state directory, and the rule for the workspace was opened after the uid
    // switch, failed, and was silently left out of a ruleset still "fully enforced".
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        state_parent: Some("/var/tmp".into()),
        // As `executor serve` makes a state directory it creates (/var/lib/executor).
        prepare: Some(Box::new(|state| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(state, std::fs::Permissions::from_mode(0o700)).unwrap();
        })),
        ..Default::default()
    });
    let state = daemon.state.path().to_path_buf();
    let ws = daemon.workspace.display().to_string();
    let mut client = daemon.connect().await;
    let out = run_in(
        &mut client,
        LANDLOCK,
        "ws-by-path",
        &format!(
            "ls -d {ws} >/dev/null; echo list=$?; echo x > {ws}/by-path; echo write=$?; \
             ls {s} >/dev/null; echo state_list=$?; cat {s}/token; echo token=$?",
            s = state.display()
        ),
    )
    .await
    .output;
    assert_eq!(field(&out, "list"), Some("0"), "{out}");
    assert_eq!(field(&out, "write"), Some("0"), "{out}");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(daemon.workspace.join("by-path"))
            .unwrap()
            .uid(),
        65534
    );
    // Denials beside it: the state directory can be passed through, not listed, and the token
    // stays unreadable.
    assert_ne!(field(&out, "state_list"), Some("0"), "{out}");
    assert_ne!(field(&out, "token"), Some("0"), "{out}");
    assert!(!out.contains(&daemon.token));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o777;
    assert_eq!(mode(&state), 0o711);
    assert_eq!(mode(&state.join("token")), 0o600);
}

#[tokio::test]
async fn a_landlock_rule_that_cannot_be_made_refuses_the_command() {
    // Fail closed: a writable grant whose path exists but cannot be opened (here a symlink
    // loop) must not be dropped from the ruleset. Control: a grant whose path does not exist is
    // skipped (profiles list toolchain directories only some hosts have).
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let dir = executor_tests::TempDir::with_prefix_in("escape-rules-", "/var/tmp").unwrap();
    let looping = dir.path().join("loop");
    std::os::unix::fs::symlink(&looping, &looping).unwrap();
    let profiles = executor_tests::TempDir::new().unwrap();
    let base: serde_json::Value =
        serde_json::from_str(include_str!("../../../sandbox-profiles/landlock.json")).unwrap();
    for (name, path) in [
        ("looping", looping.clone()),
        ("missing", dir.path().join("missing")),
    ] {
        let mut profile = base.clone();
        profile["name"] = name.into();
        profile["filesystem"]["writable"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"path": path, "reason": "test"}));
        std::fs::write(
            profiles.path().join(format!("{name}.json")),
            profile.to_string(),
        )
        .unwrap();
    }
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: [
            "--profiles-dir",
            profiles.path().to_str().unwrap(),
            "--allow-profile",
            "looping",
            "--allow-profile",
            "missing",
        ]
        .map(String::from)
        .to_vec(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut client = daemon.connect().await;
    let hello = client.hello.clone();
    let summary = |name: &str| {
        hello
            .profiles
            .iter()
            .find(|p| p.name == name)
            .cloned()
            .unwrap()
    };
    let looping_summary = summary("looping");
    assert!(!looping_summary.available);
    let reason = looping_summary.unavailable_reason.unwrap_or_default();
    assert!(reason.contains("landlock rule for"), "{reason}");
    let refused = client
        .exec(preq("looping", "l", "echo ran", 10.0))
        .await
        .result
        .unwrap_err();
    assert_eq!(
        refused.code,
        protocol::ErrorCode::EnvironmentError,
        "{refused:?}"
    );
    assert!(refused.message.contains("stage landlock"), "{refused:?}");
    // Control.
    assert!(summary("missing").available);
    let ran = client
        .exec(preq("missing", "m", "echo ran", 10.0))
        .await
        .result
        .unwrap();
    assert_eq!(ran.output, "ran\n");
}
