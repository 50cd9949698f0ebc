//! Privilege escalation: setuid binaries and file capabilities planted in the workspace from
//! the host side, nested user namespaces, mounts, and undoing task-container's covers.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use executor_tests::{is_root, marked_sleep, marker, namespace_of, require, sleepers};

use crate::common::*;

fn sh(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test]
async fn setuid_root_binary_planted_in_the_workspace_is_inert() {
    if !require("root (to plant a setuid-root binary)", is_root()) {
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let ws = &daemon.workspace;
    let m = marker();
    let touch = ws.join(format!("suid-touch-{m}"));
    executor_tests::copy_executable("/usr/bin/touch", &touch);
    std::fs::set_permissions(&touch, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let rootonly = ws.join(format!("rootonly-{m}"));
    std::fs::create_dir(&rootonly).unwrap();
    std::fs::set_permissions(&rootonly, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut client = daemon.connect().await;

    // Attack: uid 65534 (strict, and landlock under a root daemon) runs the setuid-root copy
    // to write where only root may.
    for profile in [STRICT, LANDLOCK] {
        let out = run_in(
            &mut client,
            profile,
            "suid",
            &format!("./suid-touch-{m} rootonly-{m}/pwned-{profile}; echo rc=$?; id -u"),
        )
        .await
        .output;
        assert!(
            !rootonly.join(format!("pwned-{profile}")).exists(),
            "[{profile}] the setuid-root binary worked: {out}"
        );
        assert!(out.contains("65534"), "[{profile}] runs as 65534: {out}");
    }
    // Control: the same binary, run by uid 65534 without no_new_privs (trusted + setpriv),
    // does gain root, so the check above can fail.
    let ctl = run_in(
        &mut client,
        TRUSTED,
        "suid-ctl",
        &format!(
            "setpriv --reuid=65534 --regid=65534 --clear-groups ./suid-touch-{m} rootonly-{m}/control; echo rc=$?"
        ),
    )
    .await
    .output;
    assert!(
        rootonly.join("control").exists(),
        "[trusted] control: setuid works outside the sandbox: {ctl}"
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn file_capabilities_planted_in_the_workspace_are_inert() {
    if !require("root (to set file capabilities)", is_root()) {
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let ws = &daemon.workspace;
    let m = marker();
    let capcp = ws.join(format!("capcp-{m}"));
    executor_tests::copy_executable("/usr/bin/cp", &capcp);
    let setcap = sh(&format!(
        "setcap cap_dac_override,cap_dac_read_search+ep {}",
        capcp.display()
    ));
    if !require("setcap and xattrs on the workspace", setcap) {
        return;
    }
    // A secret owned by another user, mode 0600: neither uid 65534 nor a capability-less root
    // may read it.
    let secret = ws.join(format!("secret-{m}"));
    std::fs::write(&secret, format!("filecap-secret-{m}\n")).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    nix::unistd::chown(&secret, Some(12345.into()), Some(12345.into())).unwrap();
    let mut client = daemon.connect().await;
    for profile in [STRICT, LANDLOCK] {
        let stolen = ws.join(format!("stolen-{profile}-{m}"));
        let out = run_in(
            &mut client,
            profile,
            "filecap",
            &format!(
                "./capcp-{m} secret-{m} stolen-{profile}-{m}; echo rc=$?; cat secret-{m}; \
                 grep Cap /proc/self/status"
            ),
        )
        .await
        .output;
        assert!(
            !std::fs::read_to_string(&stolen).is_ok_and(|s| s.contains("filecap-secret")),
            "[{profile}] the file capability read the secret: {out}"
        );
        assert!(!out.contains("filecap-secret"), "[{profile}] {out}");
    }
    // Control: uid 65534 outside the sandbox gains the file capabilities and copies the secret.
    let stolen = ws.join(format!("stolen-ctl-{m}"));
    let ctl = run_in(
        &mut client,
        TRUSTED,
        "filecap-ctl",
        &format!(
            "setpriv --reuid=65534 --regid=65534 --clear-groups ./capcp-{m} secret-{m} stolen-ctl-{m}; echo rc=$?"
        ),
    )
    .await
    .output;
    assert!(
        std::fs::read_to_string(&stolen).is_ok_and(|s| s.contains("filecap-secret")),
        "[trusted] control: file capabilities work outside the sandbox: {ctl}"
    );
    assert_daemon_intact(&daemon).await;
}

/// clone(2), clone3(2) and unshare(2) asking for a new user namespace; each child exits at
/// once through the raw exit syscall.
const CLONE_PROBE: &str = r#"
r, e = sc(56, 0x10000000 | 17, 0, 0, 0, 0)   # clone(CLONE_NEWUSER | SIGCHLD)
if r == 0:
    libc.syscall(ctypes.c_long(60), ctypes.c_long(0))
print(f"sys_clone={r} clone_errno={e}")
if r > 0:
    os.waitpid(r, 0)
args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)   # flags, ..., exit_signal
r, e = sc(435, args, 88)   # clone3
if r == 0:
    libc.syscall(ctypes.c_long(60), ctypes.c_long(0))
print(f"sys_clone3={r} clone3_errno={e}")
if r > 0:
    os.waitpid(r, 0)
# Last: after a successful unshare this process is an unmapped user and could clone no more.
r, e = sc(272, 0x10000000)   # unshare(CLONE_NEWUSER)
print(f"sys_unshare={r} errno={e}")
"#;

#[tokio::test]
async fn nested_user_namespaces_are_denied() {
    let Some(daemon) = daemon() else {
        return;
    };
    let host_userns = namespace_of(std::process::id() as i32, "user").unwrap();
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let probe = format!(
            "unshare -U -r id -u; echo unshare_rc=$?\n\
             unshare -U {s} & sleep 0.5\n\
             {py}\n\
             echo ready; wait",
            s = marked_sleep(&m),
            py = python(CLONE_PROBE)
        );
        let (id, out) = start_until(client, row.profile, "userns", &probe, "ready", 30.0).await;
        let nested: Vec<i32> = sleepers(&m)
            .into_iter()
            .filter(|p| namespace_of(*p, "user").as_deref() != Some(host_userns.as_str()))
            .collect();
        match row.expect {
            Denied => {
                assert_ne!(field(&out, "unshare_rc"), Some("0"), "{row} {out}");
                assert_ne!(field(&out, "sys_unshare"), Some("0"), "{row} {out}");
                assert_eq!(field(&out, "sys_clone"), Some("-1"), "{row} {out}");
                assert_eq!(field(&out, "sys_clone3"), Some("-1"), "{row} {out}");
                assert!(
                    nested.is_empty(),
                    "{row} host sees processes in a nested user namespace: {nested:?}"
                );
            }
            Allowed => {
                assert_eq!(field(&out, "unshare_rc"), Some("0"), "{row} control: {out}");
                assert_eq!(
                    field(&out, "sys_unshare"),
                    Some("0"),
                    "{row} control: {out}"
                );
                let clone: i64 = field(&out, "sys_clone").unwrap().parse().unwrap();
                let clone3: i64 = field(&out, "sys_clone3").unwrap().parse().unwrap();
                assert!(clone > 0 && clone3 > 0, "{row} control: {out}");
                assert_eq!(
                    nested.len(),
                    1,
                    "{row} control: the host sees the nested namespace"
                );
            }
        }
        cancel(client, &id).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

/// Does the host see a mount with source `source` in any of the command's processes?
fn mounted_in(m: &str, source: &str) -> bool {
    sleepers(m).iter().any(|p| {
        std::fs::read_to_string(format!("/proc/{p}/mountinfo")).is_ok_and(|mi| mi.contains(source))
    })
}

#[tokio::test]
async fn mounting_inside_the_sandbox_is_denied() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let src = format!("escape-{m}");
        let s = marked_sleep(&m);
        // Under trusted only the private-namespace variant runs: a plain mount would land on
        // the host's own /mnt.
        let plain = if row.denied() {
            format!("mount -t tmpfs {src} /mnt; echo mount_rc=$?; {s} &\n")
        } else {
            String::new()
        };
        let probe = format!(
            "{plain}unshare -m sh -c 'mount -t tmpfs {src} /mnt && echo nested_mounted; exec {s}' &\n\
             sleep 0.5; echo ready; wait"
        );
        let (id, out) = start_until(client, row.profile, "mount", &probe, "ready", 30.0).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen = mounted_in(&m, &src);
        match row.expect {
            Denied => {
                assert!(!seen, "{row} a tmpfs was mounted: {out}");
                assert_ne!(field(&out, "mount_rc"), Some("0"), "{row} {out}");
                assert!(!out.contains("nested_mounted"), "{row} {out}");
            }
            Allowed => assert!(seen, "{row} control: the host sees the tmpfs: {out}"),
        }
        cancel(client, &id).await;
        // Never leave a stray mount on the host's /mnt.
        if std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|mi| mi.contains(&src)) {
            let _ = sh("umount /mnt");
            panic!("{row} mounted {src} on the host's /mnt");
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn task_container_covers_cannot_be_read_removed_or_written_through() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let s = daemon.state.path().display().to_string();
    let exe = executor_tests::binary("executor");
    let exe_meta = std::fs::metadata(&exe).unwrap();
    let m = marker();
    let ctl_file = format!("/var/tmp/escape-ctl-{m}");
    // Non-destructive: opening the binary for append proves writability without changing it.
    let probe = format!(
        "echo written > {ctl_file}; echo ctl_rc=$?\n\
         cat {s}/token; echo token_rc=$?\n\
         umount {s}; echo umount_state=$?; umount -l {s}; echo umount_lazy=$?\n\
         umount {exe}; echo umount_exe=$?\n\
         cat {s}/token; echo token_after=$?\n\
         head -c 4 {exe} | od -c | head -1; echo exe_read=$?\n\
         {PY} -c 'open(\"{exe}\", \"ab\").close()'; echo exe_append=$?\n\
         ls /sys/fs/cgroup | wc -l | sed 's/^/cgroup_entries=/'\n\
         cat /proc/1/cgroup",
        exe = exe.display()
    );
    let out = run_in(&mut client, TASK, "covers", &probe).await.output;
    // Control: the host root is writable.
    assert_eq!(
        field(&out, "ctl_rc"),
        Some("0"),
        "[task-container] control: {out}"
    );
    assert_eq!(
        std::fs::read_to_string(&ctl_file).ok().as_deref(),
        Some("written\n"),
        "[task-container] control on the host"
    );
    let _ = std::fs::remove_file(&ctl_file);
    assert!(
        !out.contains(&daemon.token),
        "[task-container] read the token: {out}"
    );
    for key in [
        "token_rc",
        "umount_state",
        "umount_lazy",
        "umount_exe",
        "token_after",
        "exe_append",
    ] {
        assert_ne!(field(&out, key), Some("0"), "[task-container] {key}: {out}");
    }
    assert!(
        !out.contains("E   L   F"),
        "[task-container] read the binary: {out}"
    );
    assert_eq!(
        field(&out, "cgroup_entries"),
        Some("0"),
        "[task-container] /sys/fs/cgroup is hidden: {out}"
    );
    let after = std::fs::metadata(&exe).unwrap();
    assert_eq!(after.len(), exe_meta.len());
    assert_eq!(after.modified().unwrap(), exe_meta.modified().unwrap());
    assert!(Path::new(&format!("{s}/token")).exists());
    assert_daemon_intact(&daemon).await;
}

/// What the dynamic loader reads when the daemon starts a helper: /etc/ld.so.preload, its
/// cache, and the libraries of the executor binary (from ldd).
fn loader_files() -> Vec<String> {
    let exe = executor_tests::binary("executor");
    let ldd = Command::new("ldd").arg(&exe).output().unwrap();
    let mut files = vec![
        "/etc/ld.so.preload".to_string(),
        "/etc/ld.so.cache".to_string(),
    ];
    files.extend(
        String::from_utf8_lossy(&ldd.stdout)
            .lines()
            .filter_map(|l| {
                l.split_whitespace()
                    .find(|w| w.starts_with('/'))
                    .map(str::to_string)
            }),
    );
    files
}

#[tokio::test]
async fn task_container_cannot_plant_code_into_the_next_unsandboxed_helper() {
    // Every command starts by exec'ing the executor binary as a helper that runs as root with
    // every capability until it has built the sandbox. That exec goes through the dynamic
    // loader: /etc/ld.so.preload, /etc/ld.so.cache and the helper's shared libraries. If
    // task-container (whose root is the host's, writable) can change any of them, its next
    // command's helper runs the command's code unsandboxed, and the token, the binary and the
    // daemon's processes are all reachable. Checked without changing anything: access(W_OK)
    // (root's DAC override included) and the read-only state of the mount.
    let Some(daemon) = daemon() else {
        return;
    };
    let targets = loader_files();
    let probe = python(&format!(
        r#"
targets = {targets:?}
for t in targets:
    path = t if os.path.exists(t) else os.path.dirname(t)   # a missing file: can it be created?
    print(f"writable[{{t}}]={{int(os.access(path, os.W_OK))}}")
"#
    ));
    let mut client = daemon.connect().await;
    // Control: trusted (the host's root) can write them, so the probe can see a yes.
    let ctl = run_in(&mut client, TRUSTED, "loader", &probe).await.output;
    assert!(
        ctl.contains("writable[/etc/ld.so.preload]=1"),
        "[trusted] control: {ctl}"
    );
    let out = run_in(&mut client, TASK, "loader", &probe).await.output;
    let open: Vec<&str> = out.lines().filter(|l| l.ends_with("=1")).collect();
    assert!(
        open.is_empty(),
        "[task-container] can change what the next helper loads before it is sandboxed: {open:?}"
    );
}

#[tokio::test]
async fn task_container_cannot_replace_the_helper_by_renaming_a_parent_directory() {
    // task-container covers the executor binary with a mount inside its own mount namespace.
    // The daemon lives in the host's namespace and starts every helper by path, as root. A
    // command can rename the directory *above* the covered file (only the covered path itself
    // is a mount point) and put its own `executor` at the old path; the next helper would then
    // be the command's program, unsandboxed. The same move against /etc or /lib (the loader
    // files) would break the shared test host, so only a private copy of the binary is used.
    if !require("root (to run the daemon from a private copy)", is_root()) {
        return;
    }
    let root = executor_tests::TempDir::with_prefix_in("escape-bin-", "/var/tmp").unwrap();
    let bin_dir = root.path().join("bin");
    std::fs::create_dir(&bin_dir).unwrap();
    let exe = bin_dir.join("executor");
    executor_tests::copy_executable(executor_tests::binary("executor"), &exe);
    let Some(daemon) = daemon_with(executor_tests::DaemonOptions {
        binary: Some(exe.clone()),
        ..Default::default()
    }) else {
        return;
    };
    let pwned = root.path().join("pwned");
    let _reaper = Reaper(root.path().display().to_string());
    let mut client = daemon.connect().await;
    // Control: helpers run from that copy, and task-container does see it covered.
    let ok = run_in(&mut client, STRICT, "control", "echo fine").await;
    assert_eq!(ok.output, "fine\n");
    let covered = run_in(
        &mut client,
        TASK,
        "covered",
        &format!("head -c 4 {} | od -c | head -1", exe.display()),
    )
    .await
    .output;
    assert!(
        !covered.contains("E   L   F"),
        "[task-container] reads the binary: {covered}"
    );
    let attack = format!(
        "mv {b} {b}.old; echo mv_rc=$?; mkdir -p {b} && printf '#!/bin/sh\\nid -u > {p}\\n' > {b}/executor \
         && chmod 755 {b}/executor; echo plant_rc=$?",
        b = bin_dir.display(),
        p = pwned.display()
    );
    let out = run_in(&mut client, TASK, "rename", &attack).await.output;
    // The next command of any profile starts a new helper. Its answer is bounded by hand: a
    // hijacked helper never reports back.
    client
        .send(&protocol::ClientMessage::Exec(preq(
            STRICT,
            "after-rename",
            "echo next",
            5.0,
        )))
        .await;
    let next = client.recv_within(Duration::from_secs(15)).await;
    let hijacked = pwned.exists();
    // Put the real binary back where the daemon expects it, whatever happened.
    if bin_dir.with_extension("old").exists() {
        let _ = executor_tests::scratch::remove_tree(&bin_dir);
        let _ = std::fs::rename(bin_dir.with_extension("old"), &bin_dir);
    }
    assert!(
        !hijacked,
        "[task-container] the next helper ran the command's program as uid {}: {out} / next: {next:?}",
        std::fs::read_to_string(&pwned).unwrap_or_default().trim()
    );
}

#[tokio::test]
async fn task_container_cannot_swap_the_directories_the_helper_loads_from() {
    // The read-only binds on the loader files (see the case above) sit inside task-container's
    // own mount namespace. Renaming a directory *above* a bound file is allowed (only the
    // mount point itself is busy), and the rename happens on the host's filesystem, where the
    // daemon's next helper exec reads /etc/ld.so.preload and its libraries by path:
    // `mv /etc /etc.old; mkdir /etc; echo /workspace/evil.so > /etc/ld.so.preload` would run
    // the command's code as root before the sandbox exists.
    // `task_container_cannot_replace_the_helper_by_renaming_a_parent_directory` shows the move
    // itself works; doing it to /etc or /lib here would break the shared host, so this case
    // checks, without changing anything, whether any ancestor of a loader file can be renamed:
    // its parent is writable and it is not itself a mount point in the command's view.
    let Some(daemon) = daemon() else {
        return;
    };
    let targets = loader_files();
    let probe = python(&format!(
        r#"
# os.path.ismount misses bind mounts of directories on the same filesystem: read the
# mount points themselves, and compare resolved paths.
mounts = {{line.split()[4] for line in open("/proc/self/mountinfo")}}
seen = set()
for t in {targets:?}:
    p = os.path.dirname(t)
    while p not in ("/", ""):
        if p not in seen:
            seen.add(p)
            parent = os.path.dirname(p)
            if os.access(parent, os.W_OK) and os.path.realpath(p) not in mounts:
                print(f"renamable={{p}}")
        p = os.path.dirname(p)
"#
    ));
    let mut client = daemon.connect().await;
    // Control: on the host (trusted), /etc's parent is writable and /etc is no mount point.
    let ctl = run_in(&mut client, TRUSTED, "loader-dirs", &probe)
        .await
        .output;
    assert!(ctl.contains("renamable=/etc\n"), "[trusted] control: {ctl}");
    let out = run_in(&mut client, TASK, "loader-dirs", &probe)
        .await
        .output;
    assert!(
        !out.contains("renamable="),
        "[task-container] can swap a directory the next helper loads from:\n{out}"
    );
}

#[tokio::test]
async fn task_container_cannot_rename_a_directory_above_the_daemons_files() {
    // task-container covers the state directory, the token and the binary with mounts in its
    // own namespace; a cover protects a path, not what lies there. Renaming a directory above
    // one moved the real file out from under its cover (`mv /srv/deep /srv/deep.old; mkdir -p
    // /srv/deep/state`: the next command read the token from deep.old), and a new directory
    // with a planted `executor` took the binary's place for the next start. Every directory
    // above a covered file must be pinned (a mount point cannot be renamed).
    if !require("root (to run the daemon from a private copy)", is_root()) {
        return;
    }
    let root = executor_tests::TempDir::with_prefix_in("escape-rename-", "/var/tmp").unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let deep = root.path().join("deep");
    let bin = root.path().join("bin/x");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("executor");
    executor_tests::copy_executable(executor_tests::binary("executor"), &exe);
    let exe_bytes = std::fs::read(&exe).unwrap();
    let free = root.path().join("free");
    std::fs::create_dir(&free).unwrap();
    // The audit log in a tree of its own: every covered file, not only the state directory.
    let logs = root.path().join("logs");
    std::fs::create_dir_all(logs.join("a")).unwrap();
    let Some(daemon) = daemon_with(executor_tests::DaemonOptions {
        binary: Some(exe.clone()),
        state_parent: Some(deep.clone()),
        extra: vec![
            "--audit-log".into(),
            logs.join("a/audit.jsonl").display().to_string(),
        ],
        ..Default::default()
    }) else {
        return;
    };
    let _reaper = Reaper(root.path().display().to_string());
    let state = daemon.state.path().to_path_buf();
    let state_name = state.file_name().unwrap().to_str().unwrap().to_string();
    let mut client = daemon.connect().await;
    let attack = format!(
        "mv {d} {d}.old; echo mv_state=$?; mkdir -p {s}; cat {d}.old/{n}/token; echo token_rc=$?; \
         mv {b} {b}.old; echo mv_bin=$?; mkdir -p {b}; echo trojan > {b}/executor; echo plant=$?; \
         mv {l} {l}.old; echo mv_log=$?; mv {f} {f}.moved; echo mv_free=$?",
        l = logs.display(),
        d = deep.display(),
        s = state.display(),
        n = state_name,
        b = bin.display(),
        f = free.display(),
    );
    let out = run_in(&mut client, TASK, "rename-up", &attack).await.output;
    let moved_state = deep.with_extension("old").exists();
    let moved_bin = bin.with_extension("old").exists();
    let moved_log = logs.with_extension("old").exists();
    if moved_log {
        let _ = std::fs::rename(logs.with_extension("old"), &logs);
    }
    // Put everything back whatever happened, so the daemon and the shared host stay sane.
    if moved_state {
        let _ = executor_tests::scratch::remove_tree(&deep);
        let _ = std::fs::rename(deep.with_extension("old"), &deep);
    }
    if moved_bin {
        let _ = executor_tests::scratch::remove_tree(&bin);
        let _ = std::fs::rename(bin.with_extension("old"), &bin);
    }
    assert!(
        !out.contains(&daemon.token),
        "[task-container] read the token: {out}"
    );
    assert!(
        !moved_state && field(&out, "mv_state") != Some("0"),
        "[task-container] renamed a directory above the state directory: {out}"
    );
    assert!(
        !moved_bin && field(&out, "mv_bin") != Some("0"),
        "[task-container] renamed the directory holding the binary: {out}"
    );
    assert!(
        !moved_log && field(&out, "mv_log") != Some("0"),
        "[task-container] renamed a directory above the audit log: {out}"
    );
    // On the host: the binary and the token are what they were.
    assert_eq!(
        std::fs::read(&exe).unwrap(),
        exe_bytes,
        "the binary was replaced"
    );
    assert_eq!(
        std::fs::read_to_string(state.join("token")).unwrap().trim(),
        daemon.token
    );
    // Control: a directory above none of the daemon's files is the command's to rename.
    assert_eq!(
        field(&out, "mv_free"),
        Some("0"),
        "[task-container] control: {out}"
    );
    assert!(free.with_extension("moved").is_dir() && !free.exists());
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_clients_file_named_through_a_symlink_is_reloaded_from_where_it_resolved() {
    // The covers apply to the resolved clients file; the daemon re-read the path as given on
    // SIGHUP. A task-container client pointed the symlink at a file of its own granting itself
    // `trusted`, and after the reload ran as root on the host.
    if !require("root", is_root()) {
        return;
    }
    const OPS: &str = "ops-token-0123456789abcdef0123456789abcd";
    const BENCH: &str = "bench-token-0123456789abcdef0123456789ab";
    let root = executor_tests::TempDir::with_prefix_in("escape-clients-link-", "/var/tmp").unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let real = root.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let file = real.join("clients.json");
    let clients = serde_json::json!({"clients": [
        {"name": "ops", "token": OPS, "profiles": ["trusted"]},
        {"name": "bench", "token": BENCH, "profiles": ["task-container"]},
    ]});
    std::fs::write(&file, clients.to_string()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = root.path().join("link");
    std::os::unix::fs::symlink("real", &link).unwrap();
    let daemon = executor_tests::Daemon::start_opts(executor_tests::DaemonOptions {
        extra: vec![
            "--clients".into(),
            link.join("clients.json").display().to_string(),
        ]
        .into_iter()
        .chain(executor_tests::ALLOW_ALL_PROFILES.map(String::from))
        .collect(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut bench = executor_tests::Client::connect(&daemon.url, Some(BENCH))
        .await
        .unwrap();
    let evil = serde_json::json!({"clients": [
        {"name": "bench", "token": BENCH},
    ]});
    let attack = format!(
        "mkdir -p {r}/evil && echo '{evil}' > {r}/evil/clients.json && chmod 600 {r}/evil/clients.json \
         && ln -sfn evil {r}/link.new && mv -T {r}/link.new {r}/link; echo swap=$?",
        r = root.path().display()
    );
    let out = run_in(&mut bench, TASK, "swap-link", &attack).await.output;
    let swapped = std::fs::read_link(&link).is_ok_and(|t| t == std::path::Path::new("evil"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.pid() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    assert!(
        executor_tests::eventually(Duration::from_secs(10), || daemon
            .log()
            .contains("clients reloaded"))
        .await,
        "{}",
        daemon.log()
    );
    // The reload read the file the daemon started with: bench still may not use trusted, and
    // ops still connects.
    let mut bench = executor_tests::Client::connect(&daemon.url, Some(BENCH))
        .await
        .unwrap();
    let refused = bench
        .exec(preq(TRUSTED, "root", "id -u", 10.0))
        .await
        .result
        .unwrap_err();
    assert_eq!(
        refused.code,
        protocol::ErrorCode::ProfileDenied,
        "{out} / {refused:?}"
    );
    assert!(executor_tests::Client::connect(&daemon.url, Some(OPS))
        .await
        .is_ok());
    // The attack itself ran (the link is the command's to change): it just changes nothing.
    assert!(swapped, "control: the command swapped the link: {out}");
}
