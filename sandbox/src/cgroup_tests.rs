//! Tests of the cgroup hierarchies found in /proc tables, and of the directories made for a command.

use super::*;

#[test]
fn an_open_counter_is_read_again_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pids.events"), "max 0\n").unwrap();
    std::fs::write(dir.path().join("memory.failcnt"), "0\n").unwrap();
    let events = open_counter(dir.path(), "pids.events").unwrap();
    let failcnt = open_counter(dir.path(), "memory.failcnt").unwrap();
    assert_eq!(read_counter(&events, Some("max")), 0);
    assert_eq!(read_counter(&failcnt, None), 0);
    // Rewritten in place, as the kernel's counters change: the same descriptors see it.
    std::fs::write(dir.path().join("pids.events"), "max 3\n").unwrap();
    std::fs::write(dir.path().join("memory.failcnt"), "12\n").unwrap();
    assert_eq!(read_counter(&events, Some("max")), 3);
    assert_eq!(read_counter(&events, Some("oom_kill")), 0);
    assert_eq!(read_counter(&failcnt, None), 12);
}

#[test]
fn finds_cgroup2_and_v1_controller_mounts() {
    let mountinfo = "\
35 24 0:30 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
36 24 0:31 / /sys/fs/cgroup/unified rw,relatime shared:13 - cgroup2 cgroup2 rw
";
    assert_eq!(
        mount_point(mountinfo, Kind::Unified),
        Some(("/sys/fs/cgroup/unified".into(), "/".into()))
    );
    assert_eq!(
        mount_point(mountinfo, Kind::V1("memory")),
        Some(("/sys/fs/cgroup/memory".into(), "/".into()))
    );
    assert_eq!(mount_point(mountinfo, Kind::V1("pids")), None);
    assert_eq!(
        mount_point("1 2 0:3 / /proc rw - proc proc rw\n", Kind::Unified),
        None
    );
}

#[test]
fn only_a_v1_move_on_a_kernel_before_5_5_without_expedited_grace_periods_may_wait() {
    let h = |path: &str| Hierarchy {
        parent: path.into(),
        back: path.into(),
    };
    let v1 = CgroupRoot {
        unified: Some(h("/cg2")),
        pids: Some(Controller::V1(h("/cg1/pids"))),
        memory: Some(Controller::Unified),
        ..CgroupRoot::default()
    };
    let old = "5.4.0-216-generic";
    assert!(v1.attach_may_wait(old, false));
    assert!(!v1.attach_may_wait(old, true));
    for newer in ["5.5.0", "5.10.0-33-amd64", "6.1.0-27-amd64", "6.18.0"] {
        assert!(!v1.attach_may_wait(newer, false), "{newer}");
    }
    assert!(v1.attach_may_wait("4.18.0-553.el8_10.x86_64", false));
    // cgroup v2 alone: commands are placed at birth, nothing moves.
    let v2 = CgroupRoot {
        pids: Some(Controller::Unified),
        ..v1
    };
    assert!(!v2.attach_may_wait(old, false));
}

#[test]
fn reads_unified_and_v1_entries_of_proc_self_cgroup() {
    let text = "12:memory:/user.slice\n0::/system.slice/executor.service\n";
    assert_eq!(
        own_path(text, Kind::Unified).as_deref(),
        Some("/system.slice/executor.service")
    );
    assert_eq!(
        own_path(text, Kind::V1("memory")).as_deref(),
        Some("/user.slice")
    );
    assert_eq!(own_path("4:pids:/\n", Kind::Unified), None);
}

#[test]
fn a_mount_of_a_subtree_is_followed_below_its_root() {
    // podman without a cgroup namespace: the container's own subtree is mounted, and
    // /proc/self/cgroup names the full path.
    let mountinfo =
        "98 90 0:36 /libpod_parent/libpod-1 /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
    let own = "8:pids:/libpod_parent/libpod-1\n";
    assert_eq!(
        own_dir(mountinfo, own, Kind::V1("pids"), "pids").unwrap(),
        PathBuf::from("/sys/fs/cgroup/pids")
    );
    let own = "8:pids:/libpod_parent/libpod-1/sub\n";
    assert_eq!(
        own_dir(mountinfo, own, Kind::V1("pids"), "pids").unwrap(),
        PathBuf::from("/sys/fs/cgroup/pids/sub")
    );
    // A cgroup outside the mounted subtree cannot be reached through it.
    assert!(own_dir(mountinfo, "8:pids:/elsewhere\n", Kind::V1("pids"), "pids").is_err());
}

#[test]
fn daemon_cgroups_are_recognised_with_or_without_the_leaf_suffix() {
    assert_eq!(daemon_of("executor-42-ns7", "-ns7"), Some(42));
    assert_eq!(daemon_of("executor-42-ns7-daemon", "-ns7"), Some(42));
    assert_eq!(daemon_of("executor-42-ns8", "-ns7"), None);
    assert_eq!(daemon_of("cmd-1", "-ns7"), None);
}

#[test]
fn a_parent_that_cannot_be_created_is_reported_with_its_path_and_the_fix() {
    let dir = Path::new("/nonexistent-cgroup-tree/executor-1-ns2");
    let err = create_parent(dir, UNIFIED_FIX).unwrap_err().to_string();
    assert!(err.contains(&dir.display().to_string()), "{err}");
    for fix in ["--cgroup-parent", "Delegate=yes"] {
        assert!(err.contains(fix), "{err}");
    }
    // Control: an existing directory is taken as it is.
    create_parent(&std::env::temp_dir(), UNIFIED_FIX).unwrap();
}

#[test]
fn the_host_shape_is_named_from_what_was_found() {
    let h = Hierarchy {
        parent: "/p".into(),
        back: "/b".into(),
    };
    let mut root = CgroupRoot::default();
    assert_eq!(root.mode(), "none");
    root.unified = Some(h.clone());
    root.pids = Some(Controller::Unified);
    assert_eq!(root.mode(), "v2");
    root.memory = Some(Controller::V1(h));
    assert_eq!(root.mode(), "hybrid");
    assert_eq!(root.facts().memory, "v1");
    assert_eq!(root.facts().pids, "v2");
    root.unified = None;
    assert_eq!(root.mode(), "v1");
}
