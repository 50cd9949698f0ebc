//! Roots built once per template (`sandbox/src/spawner/root_pool.rs`): each strict command
//! runs in a copy of its template's mount tree, with a `/tmp`, `/dev/shm` and `/proc` of its
//! own. Checked from the host: the template the fork server holds is kept between commands and
//! made anew when the host changes under it; each command's mount namespace is its own; what
//! a command may write is never the template's, and a file the profile hides stays hidden when
//! it appears, or is replaced, after the template was built.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use executor_tests::{descendants, Client, Daemon, DaemonOptions};

use crate::common::*;

/// The mount namespaces the daemon's fork server holds open (its root templates), opened
/// here too: held, a namespace keeps its inode number, which the kernel would otherwise give
/// the next namespace made once it is freed.
struct Held(Vec<std::fs::File>);

impl Held {
    fn of(daemon: &Daemon) -> Self {
        let server = descendants(daemon.pid() as i32)
            .into_iter()
            .find(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.ends_with(b"__fork-server\0"))
                    && executor_tests::parent_of(*pid) == Some(daemon.pid() as i32)
            })
            .expect("the daemon's fork server");
        let fds = std::fs::read_dir(format!("/proc/{server}/fd")).unwrap();
        Self(
            fds.filter_map(|e| {
                let path = e.ok()?.path();
                let link = std::fs::read_link(&path).ok()?;
                link.display()
                    .to_string()
                    .starts_with("mnt:[")
                    .then(|| std::fs::File::open(&path).ok())?
            })
            .collect(),
        )
    }

    fn inodes(&self) -> HashSet<u64> {
        use std::os::unix::fs::MetadataExt;
        self.0.iter().map(|f| f.metadata().unwrap().ino()).collect()
    }
}

/// A copy of strict that also binds `dir` read-only and hides `dir/secret`.
fn hiding_profile(profiles: &Path, dir: &Path) {
    let mut profile: serde_json::Value =
        serde_json::from_str(include_str!("../../../sandbox-profiles/strict.json")).unwrap();
    profile["name"] = "strict-hiding".into();
    let fs = &mut profile["filesystem"];
    fs["read_only"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"path": dir, "reason": "test"}));
    fs["hidden"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"path": dir.join("secret"), "reason": "test"}));
    std::fs::write(profiles.join("strict-hiding.json"), profile.to_string()).unwrap();
}

/// Run `command` twice under `profile` and return the second output: the first may be served
/// by a worker built before the host changed (as any sandbox built ahead of its command); the
/// second is built after, from the template the fork server checked then.
async fn after_change(client: &mut Client, profile: &str, id: &str, command: &str) -> String {
    let _ = run_in(client, profile, &format!("{id}-first"), command).await;
    run_in(client, profile, id, command).await.output
}

#[tokio::test]
async fn a_template_is_made_anew_when_a_path_it_binds_or_hides_changes_on_the_host() {
    let dir = executor_tests::TempDir::with_prefix_in("escape-template-", "/var/tmp").unwrap();
    let shown = dir.path().join("shown");
    std::fs::create_dir(&shown).unwrap();
    std::fs::write(shown.join("visible"), "v1").unwrap();
    let secret = shown.join("secret");
    let profiles = executor_tests::TempDir::new().unwrap();
    hiding_profile(profiles.path(), &shown);
    let Some(daemon) = profiles_daemon(profiles.path(), &["strict-hiding"]) else {
        return;
    };
    let mut client = daemon.connect().await;
    let profile = "strict-hiding";
    let read = format!(
        "cat {v}; echo; cat {s} 2>/dev/null; echo \" secret_rc=$?\"",
        v = shown.join("visible").display(),
        s = secret.display()
    );

    // Nothing to hide yet; the template is kept from one command to the next.
    let out = after_change(&mut client, profile, "before", &read).await;
    assert!(out.starts_with("v1\n"), "{out}");
    let kept = Held::of(&daemon);
    assert_eq!(kept.inodes().len(), 1, "no template");
    let out = run_in(&mut client, profile, "again", &read).await.output;
    assert!(out.starts_with("v1\n"), "{out}");
    assert_eq!(
        Held::of(&daemon).inodes(),
        kept.inodes(),
        "a template made anew with nothing changed"
    );

    // The hidden file appears: it is covered (empty) for the commands after.
    std::fs::write(&secret, "s1").unwrap();
    let out = after_change(&mut client, profile, "created", &read).await;
    assert!(
        !out.contains("s1"),
        "a hidden file created later is readable: {out}"
    );
    let now = Held::of(&daemon);
    assert!(
        now.inodes().is_disjoint(&kept.inodes()),
        "the template was not made anew"
    );
    // Control: the host's file is there, and trusted (no mount namespace) reads it.
    let trusted = run_in(&mut client, TRUSTED, "trusted", &read).await.output;
    assert!(trusted.contains("s1"), "{trusted}");

    // Replaced by rename (another inode, as an editor or an atomic write does it).
    let kept = now;
    let fresh = shown.join(".secret.new");
    std::fs::write(&fresh, "s2").unwrap();
    std::fs::rename(&fresh, &secret).unwrap();
    let out = after_change(&mut client, profile, "renamed", &read).await;
    assert!(
        !out.contains("s2"),
        "a hidden file replaced later is readable: {out}"
    );
    assert!(Held::of(&daemon).inodes().is_disjoint(&kept.inodes()));

    // The bound directory itself made anew: the commands after see the new one.
    let old = dir.path().join("shown.old");
    std::fs::rename(&shown, &old).unwrap();
    std::fs::create_dir(&shown).unwrap();
    std::fs::write(shown.join("visible"), "v2").unwrap();
    let out = after_change(&mut client, profile, "remade", &read).await;
    assert!(
        out.starts_with("v2\n"),
        "the old directory is still bound: {out}"
    );
}

/// Write a file into each of `dirs` and report the errno of each (0: written).
fn try_writes(dirs: &[&str], tag: &str) -> String {
    dirs.iter()
        .map(|d| {
            format!(
                "(echo x > {d}/w-{tag}) 2>/dev/null; echo \"{key}=$?\"; ",
                key = d.trim_start_matches('/').replace('/', "_")
            )
        })
        .collect()
}

#[tokio::test]
async fn strict_commands_share_only_the_template_parts_they_cannot_write() {
    // State (and so the workspace) under /tmp: the workspace is bound inside each command's
    // own /tmp, from a detached copy of the host's mount.
    let daemon = Daemon::start_opts(DaemonOptions {
        state_parent: Some(PathBuf::from("/tmp")),
        ..Default::default()
    });
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let mut client = daemon.connect().await;
    let tag = executor_tests::marker();
    // The template's namespace, held (its inode stays its own): no command runs in it.
    let _ = run_in(&mut client, STRICT, "first", "true").await;
    let template = Held::of(&daemon);
    assert_eq!(template.inodes().len(), 1, "no template");
    for i in 0..4 {
        let command = format!(
            "readlink /proc/self/ns/mnt; ls /tmp /dev/shm | grep -c left-; \
             touch /tmp/left-{tag}-{i} /dev/shm/left-{tag}-{i} ./ws-{tag}-{i}; \
             {writes} ls /proc | grep -cx '[0-9]*'",
            writes = try_writes(&["/", "/dev", "/usr", "/proc", "/tmp", "/dev/shm"], &tag)
        );
        let out = run_in(&mut client, STRICT, &format!("share-{i}"), &command)
            .await
            .output;
        let mut lines = out.lines();
        let ns = lines.next().unwrap_or_default();
        let ino: u64 = ns
            .strip_prefix("mnt:[")
            .and_then(|n| n.strip_suffix(']')?.parse().ok())
            .unwrap_or_else(|| panic!("{out}"));
        assert!(
            !template.inodes().contains(&ino),
            "a command in the template's own mount namespace: {out}"
        );
        // Nothing the commands before left in /tmp or /dev/shm.
        assert_eq!(lines.next(), Some("0"), "{out}");
        // The template's parts are not writable; the command's own are (the control).
        for (key, written) in [
            ("", false),
            ("dev", false),
            ("usr", false),
            ("proc", false),
            ("tmp", true),
            ("dev_shm", true),
        ] {
            let rc = field(&out, key).unwrap_or_else(|| panic!("{key}: {out}"));
            assert_eq!(rc == "0", written, "{key}: {out}");
        }
        // Its /proc shows its own processes only (bash, ls, grep and init at most).
        let procs: u32 = out.lines().last().unwrap_or_default().parse().unwrap_or(99);
        assert!(procs <= 5, "{out}");
    }
    // The workspace, bound into each command's /tmp, is the host's.
    for i in 0..4 {
        assert!(daemon.workspace.join(format!("ws-{tag}-{i}")).exists());
    }
    // Control: the fork server still holds that template (so the commands above ran in
    // copies of it), and two commands at once have mount namespaces of their own.
    assert_eq!(Held::of(&daemon).inodes(), template.inodes());
    let mut other = daemon.connect().await;
    let hold = "readlink /proc/self/ns/mnt; echo ready; sleep 2";
    let (a, first) = start_until(&mut client, STRICT, "together-1", hold, "ready", 20.0).await;
    let (b, second) = start_until(&mut other, STRICT, "together-2", hold, "ready", 20.0).await;
    assert_ne!(
        first.lines().next(),
        second.lines().next(),
        "{first} {second}"
    );
    client.collect(&a).await.result.unwrap();
    other.collect(&b).await.result.unwrap();
}
