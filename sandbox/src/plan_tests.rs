//! Tests of the plan: what each built-in profile makes of a command on a given host.

use super::*;
use crate::cgroup::Hierarchy;
use crate::profile::tests::builtin;

fn settings() -> PlanSettings {
    let hierarchy = |base: &str| Hierarchy {
        back: base.into(),
        parent: format!("{base}/executor-7").into(),
    };
    PlanSettings {
        interpreter: vec!["bash".into(), "-c".into()],
        workspace: "/srv/state/workspace".into(),
        home: "/root".into(),
        state_dir: "/srv/state".into(),
        executor_bin: "/usr/local/bin/executor".into(),
        daemon_files: vec!["/srv/state/token".into(), "/var/log/executor.jsonl".into()],
        daemon_uid: 0,
        loader_files: vec!["/usr/lib/x86_64-linux-gnu/libc.so.6".into()],
        cgroups: CgroupRoot {
            unified: Some(hierarchy("/cg2")),
            kill: true,
            swap: false,
            pids: Some(Controller::V1(hierarchy("/cg1/pids"))),
            memory: None,
            one_command: false,
        },
        landlock_abi: 7,
        utf8_locale: true,
    }
}

fn spec(command: &str) -> CommandSpec {
    CommandSpec {
        command: command.into(),
        cwd: None,
        env: BTreeMap::new(),
        ..Default::default()
    }
}

#[test]
fn trusted_plan_only_controls_lifetime() {
    let profile = builtin("trusted");
    let mut request = spec("echo hi");
    request.env.insert("PAGER".into(), "less".into());
    let plan = plan_command(&request, &profile, &settings()).unwrap();
    let mut env = profile.env.clone();
    env.insert("HOME".into(), "/root".into());
    env.insert("PAGER".into(), "less".into());
    assert_eq!(
        plan,
        Plan {
            template: Template {
                cgroups: vec![CgroupDir {
                    parent: "/cg2/executor-7".into(),
                    home: "/cg2".into(),
                    settings: vec![],
                    kill: true,
                    is_parent: false,
                }],
                sandbox: SandboxPlan::default(),
                layers: vec!["session".into(), "subreaper".into(), "cgroup".into()],
                missing: vec![],
            },
            command: CommandPlan {
                argv: vec!["bash".into(), "-c".into(), "echo hi".into()],
                cwd: "/srv/state/workspace".into(),
                env,
                stdin: StdinKind::Null,
                builtin: None,
            },
        }
    );
}

#[test]
fn strict_plan_stacks_every_layer() {
    let plan = plan_command(&spec("ls"), &builtin("strict"), &settings()).unwrap();
    let sandbox = &plan.template.sandbox;
    assert_eq!(sandbox.namespaces.len(), 6);
    assert_eq!(sandbox.user, Some((65534, 65534)));
    assert_eq!(sandbox.capabilities, Some(vec![]));
    assert!(sandbox.no_new_privs && sandbox.seccomp);
    assert_eq!(sandbox.hostname.as_deref(), Some("sandbox"));
    let mounts = sandbox.mounts.as_ref().unwrap();
    assert_eq!(mounts.root, RootMode::Empty);
    assert_eq!(mounts.writable, vec![PathBuf::from("/srv/state/workspace")]);
    assert!(mounts.read_only.contains(&PathBuf::from("/usr")));
    assert!(!mounts
        .read_only
        .iter()
        .any(|p| PathBuf::from("/srv/state/token").starts_with(p)));
    assert_eq!(
        mounts.tmpfs,
        vec![("/tmp".into(), 512 * MIB), ("/dev/shm".into(), 64 * MIB)]
    );
    let landlock = sandbox.landlock.as_ref().unwrap();
    assert!(landlock.deny_tcp);
    assert!(landlock
        .write
        .contains(&PathBuf::from("/srv/state/workspace")));
    assert!(landlock.write.contains(&PathBuf::from("/tmp")));
    assert!(landlock.write.contains(&PathBuf::from("/dev/null")));
    assert!(!landlock.write.contains(&PathBuf::from("/usr")));
    // pids through the cgroup controller; memory has no controller here, so RLIMIT_AS.
    assert_eq!(
        plan.template.cgroups[1].settings,
        vec![("pids.max".to_string(), "512".to_string())]
    );
    let kinds: Vec<RlimitKind> = sandbox.rlimits.iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        [
            RlimitKind::Core,
            RlimitKind::Nofile,
            RlimitKind::Fsize,
            RlimitKind::As
        ]
    );
    assert_eq!(
        plan.template.layers,
        [
            "session",
            "subreaper",
            "cgroup",
            "pids_limit",
            "mount_ns",
            "pid_ns",
            "net_ns",
            "ipc_ns",
            "uts_ns",
            "cgroup_ns",
            "pivot_root",
            "rlimits",
            "uid",
            "caps",
            "no_new_privs",
            "landlock",
            "seccomp"
        ]
    );
}

#[test]
fn landlock_plan_needs_no_namespace_and_keeps_the_daemons_uid() {
    let plan = plan_command(&spec("ls"), &builtin("landlock"), &settings()).unwrap();
    let sandbox = &plan.template.sandbox;
    assert!(sandbox.namespaces.is_empty());
    assert!(sandbox.mounts.is_none());
    // A root daemon runs landlock commands as nobody; no network means no IP sockets, no
    // IPC namespace means no SysV IPC.
    assert_eq!(sandbox.user, Some((65534, 65534)));
    assert!(sandbox.deny_inet && sandbox.deny_sysv_ipc && sandbox.own_process_only);
    assert_eq!(sandbox.capabilities, Some(vec![]));
    let landlock = sandbox.landlock.as_ref().unwrap();
    assert!(landlock.read.contains(&PathBuf::from("/proc")));
    assert!(landlock
        .write
        .contains(&PathBuf::from("/srv/state/workspace")));
    assert!(!landlock
        .read
        .iter()
        .any(|p| PathBuf::from("/srv/state/token").starts_with(p)));
    assert!(!plan.template.layers.contains(&"pivot_root".to_string()));
}

#[test]
fn task_container_hides_the_daemon_and_keeps_root() {
    let plan = plan_command(&spec("ls"), &builtin("task-container"), &settings()).unwrap();
    let sandbox = &plan.template.sandbox;
    assert_eq!(sandbox.user, Some((0, 0)));
    assert!(!sandbox.namespaces.contains(&Namespace::Net));
    let mounts = sandbox.mounts.as_ref().unwrap();
    assert_eq!(mounts.root, RootMode::Host);
    assert_eq!(
        mounts.hidden,
        [
            PathBuf::from("/srv/state"),
            "/usr/local/bin/executor".into(),
            "/sys/fs/cgroup".into(),
            "/srv/state/token".into(),
            "/var/log/executor.jsonl".into(),
        ]
    );
    assert_eq!(
        mounts.read_only,
        [PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6")]
    );
    // Every directory above a covered or read-only path, so none can be renamed away
    // from under its cover.
    assert_eq!(
        mounts.pins,
        [
            PathBuf::from("/srv"),
            "/sys".into(),
            "/usr".into(),
            "/var".into(),
            "/srv/state".into(),
            "/sys/fs".into(),
            "/usr/lib".into(),
            "/usr/local".into(),
            "/var/log".into(),
            "/usr/lib/x86_64-linux-gnu".into(),
            "/usr/local/bin".into(),
        ]
    );
    let caps = sandbox.capabilities.as_ref().unwrap();
    assert!(caps.contains(&"CAP_CHOWN".to_string()));
    assert!(!caps.contains(&"CAP_SYS_ADMIN".to_string()));
    assert!(sandbox.landlock.is_none() && sandbox.seccomp && sandbox.no_new_privs);
}

#[test]
fn landlock_under_an_ordinary_user_refuses_to_open_the_daemons_files() {
    let mut s = settings();
    s.daemon_uid = 1000;
    s.state_dir = "/tmp/executor-state".into();
    s.daemon_files = vec!["/tmp/executor-state/token".into()];
    let err = plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap_err();
    assert!(matches!(err, PlanError::DaemonFilesExposed { .. }), "{err}");
    // Control: the same daemon with its state outside /tmp and the workspace is fine,
    // and keeps its own uid.
    s.state_dir = "/var/lib/executor".into();
    s.daemon_files = vec!["/var/lib/executor/token".into()];
    let plan = plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap();
    assert_eq!(plan.template.sandbox.user, None);
}

#[test]
fn a_private_workspace_beneath_a_landlock_rule_is_refused_but_not_under_a_mount_namespace() {
    let mut s = settings();
    s.state_dir = "/tmp/executor-state".into();
    let mut request = spec("ls");
    request.workspace = Some("/tmp/executor-state/workspaces/client/alice".into());
    request.private_root = Some("/tmp/executor-state/workspaces".into());
    let err = plan_command(&request, &builtin("landlock"), &s).unwrap_err();
    assert!(
        matches!(err, PlanError::PrivateWorkspacesReachable { .. }),
        "{err}"
    );
    // A shared client's command (no workspace of its own) is refused as well.
    let mut shared = spec("ls");
    shared.private_root = request.private_root.clone();
    let err = plan_command(&shared, &builtin("landlock"), &s).unwrap_err();
    assert!(
        matches!(err, PlanError::PrivateWorkspacesReachable { .. }),
        "{err}"
    );
    // Controls: strict covers the siblings with its own root; outside /tmp landlock is fine,
    // and the plan uses the private workspace as the cwd and the writable rule.
    let plan = plan_command(&request, &builtin("strict"), &s).unwrap();
    assert_eq!(
        plan.command.cwd,
        PathBuf::from("/tmp/executor-state/workspaces/client/alice")
    );
    request.workspace = Some("/var/lib/executor/workspaces/client/alice".into());
    request.private_root = Some("/var/lib/executor/workspaces".into());
    let plan = plan_command(&request, &builtin("landlock"), &s).unwrap();
    assert_eq!(
        plan.command.cwd,
        PathBuf::from("/var/lib/executor/workspaces/client/alice")
    );
    let rules = plan.template.sandbox.landlock.unwrap();
    assert!(rules
        .write
        .contains(&PathBuf::from("/var/lib/executor/workspaces/client/alice")));
    assert!(
        !rules.write.contains(&s.workspace),
        "the shared workspace is not opened"
    );
}

#[test]
fn cgroup_v2_controllers_put_every_limit_on_the_one_command_cgroup() {
    let mut s = settings();
    s.cgroups.pids = Some(Controller::Unified);
    s.cgroups.memory = Some(Controller::Unified);
    s.cgroups.swap = true;
    let plan = plan_command(&spec("ls"), &builtin("strict"), &s).unwrap();
    assert_eq!(
        plan.template.cgroups,
        [CgroupDir {
            parent: "/cg2/executor-7".into(),
            home: "/cg2".into(),
            settings: vec![
                ("pids.max".into(), "512".into()),
                ("memory.max".into(), (2048 * MIB).to_string()),
                ("memory.swap.max".into(), "0".into()),
                ("memory.oom.group".into(), "1".into()),
            ],
            kill: true,
            is_parent: false,
        }]
    );
    // No rlimit stands in for a limit a controller enforces.
    let kinds: Vec<RlimitKind> = plan
        .template
        .sandbox
        .rlimits
        .iter()
        .map(|r| r.kind)
        .collect();
    assert!(!kinds.contains(&RlimitKind::Nproc) && !kinds.contains(&RlimitKind::As));
    assert_eq!(
        plan.template.layers[..5],
        [
            "session",
            "subreaper",
            "cgroup",
            "pids_limit",
            "memory_limit"
        ]
    );
    // Without swap accounting there is no swap file to write; without controllers, rlimits.
    s.cgroups.swap = false;
    let plan = plan_command(&spec("ls"), &builtin("strict"), &s).unwrap();
    assert!(!plan.template.cgroups[0]
        .settings
        .iter()
        .any(|(f, _)| f == "memory.swap.max"));
    s.cgroups.pids = None;
    s.cgroups.memory = None;
    let plan = plan_command(&spec("ls"), &builtin("strict"), &s).unwrap();
    assert!(plan.template.cgroups[0].settings.is_empty());
    let kinds: Vec<RlimitKind> = plan
        .template
        .sandbox
        .rlimits
        .iter()
        .map(|r| r.kind)
        .collect();
    assert!(kinds.contains(&RlimitKind::Nproc) && kinds.contains(&RlimitKind::As));
}

#[test]
fn an_older_landlock_is_used_as_far_as_it_goes_and_named_where_it_falls_short() {
    let mut s = settings();
    s.landlock_abi = 2;
    // strict: the namespaces carry the policy; landlock adds what ABI 2 has.
    let plan = plan_command(&spec("ls"), &builtin("strict"), &s).unwrap();
    let rules = plan.template.sandbox.landlock.as_ref().unwrap();
    assert_eq!((rules.abi, rules.scope, rules.deny_tcp), (2, false, false));
    assert_eq!(
        plan.template.missing,
        [
            "landlock_truncate",
            "landlock_tcp",
            "landlock_ioctl_dev",
            "landlock_scope"
        ]
    );
    assert!(plan.template.layers.contains(&"landlock".to_string()));
    // landlock under a root daemon: runs, the same rights missing.
    let plan = plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap();
    assert_eq!(plan.template.missing.len(), 4);
    // Commands of the daemon's own uid need truncate (or they could empty its token).
    s.daemon_uid = 1000;
    s.state_dir = "/var/lib/executor".into();
    s.daemon_files = vec!["/var/lib/executor/token".into()];
    let err = plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::LandlockTooOld {
                feature: "landlock_truncate",
                ..
            }
        ),
        "{err}"
    );
    s.landlock_abi = 3;
    plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap();
    // No landlock at all: strict runs without it and says so; landlock cannot run.
    let mut s = settings();
    s.landlock_abi = 0;
    let plan = plan_command(&spec("ls"), &builtin("strict"), &s).unwrap();
    assert!(plan.template.sandbox.landlock.is_none());
    assert!(plan
        .template
        .missing
        .contains(&"landlock_filesystem".to_string()));
    let err = plan_command(&spec("ls"), &builtin("landlock"), &s).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::LandlockTooOld {
                feature: "landlock_filesystem",
                ..
            }
        ),
        "{err}"
    );
    // The newest kernel misses nothing.
    let plan = plan_command(&spec("ls"), &builtin("strict"), &settings()).unwrap();
    assert!(plan.template.missing.is_empty());
    let rules = plan.template.sandbox.landlock.unwrap();
    assert_eq!((rules.abi, rules.scope, rules.deny_tcp), (6, true, true));
}

#[test]
fn a_process_limit_nothing_enforces_is_named_in_the_report() {
    let mut s = settings();
    s.daemon_uid = 0;
    // With the pids controller every profile's limit binds.
    for name in ["strict", "landlock", "task-container"] {
        let plan = plan_command(&spec("ls"), &builtin(name), &s).unwrap();
        assert!(
            !plan.template.missing.contains(&"process_limit".into()),
            "{name}"
        );
    }
    // Without it, RLIMIT_NPROC binds unprivileged uids but not task-container's root.
    s.cgroups.pids = None;
    let plan = plan_command(&spec("ls"), &builtin("task-container"), &s).unwrap();
    assert!(plan.template.missing.contains(&"process_limit".into()));
    for name in ["strict", "landlock"] {
        let plan = plan_command(&spec("ls"), &builtin(name), &s).unwrap();
        assert!(
            !plan.template.missing.contains(&"process_limit".into()),
            "{name}"
        );
        assert!(plan
            .template
            .sandbox
            .rlimits
            .iter()
            .any(|r| r.kind == RlimitKind::Nproc));
    }
}

#[test]
fn request_cwd_is_used() {
    let mut request = spec("pwd");
    request.cwd = Some("/tmp".into());
    let plan = plan_command(&request, &builtin("trusted"), &settings()).unwrap();
    assert_eq!(plan.command.cwd, PathBuf::from("/tmp"));
}

#[test]
fn a_root_without_the_utf8_locale_gets_c_unless_the_request_names_one() {
    let profile = builtin("strict");
    let with = plan_command(&spec("true"), &profile, &settings()).unwrap();
    assert_eq!(with.command.env["LC_ALL"], "C.UTF-8");
    assert_eq!(with.command.env["LANG"], "C.UTF-8");
    let without = PlanSettings {
        utf8_locale: false,
        ..settings()
    };
    let plan = plan_command(&spec("true"), &profile, &without).unwrap();
    assert_eq!(plan.command.env["LC_ALL"], "C");
    assert_eq!(plan.command.env["LANG"], "C");
    // Only the locale changes.
    let mut rest = plan.command.env.clone();
    let mut before = with.command.env.clone();
    for name in ["LC_ALL", "LANG"] {
        rest.remove(name);
        before.remove(name);
    }
    assert_eq!(rest, before);
    // A locale the request names is the request's business.
    let mut asked = spec("true");
    asked.env.insert("LC_ALL".into(), "C.UTF-8".into());
    let plan = plan_command(&asked, &profile, &without).unwrap();
    assert_eq!(plan.command.env["LC_ALL"], "C.UTF-8");
}

#[test]
fn a_cwd_outside_a_new_root_is_refused_saying_what_the_root_holds() {
    let strict = builtin("strict");
    let mut request = spec("true");
    request.cwd = Some("/testbed".into());
    let err = plan_command(&request, &strict, &settings()).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, PlanError::CwdNotInRoot { profile, cwd, .. }
            if profile == "strict" && cwd == Path::new("/testbed")),
        "{err:?}"
    );
    assert!(
        text.contains("the sandbox's root has no /testbed"),
        "{text}"
    );
    assert!(
        text.contains("the workspace /srv/state/workspace (writable)"),
        "{text}"
    );
    assert!(text.contains("/tmp (private)"), "{text}");
    assert!(text.contains("--workspace /testbed"), "{text}");
    // Controls: what the root holds, beneath it, and the directories on the way to a mount.
    for cwd in [
        "/srv/state/workspace/src",
        "/tmp",
        "/usr/lib",
        "/",
        "/srv",
        "/proc/self",
    ] {
        request.cwd = Some(cwd.into());
        assert!(
            plan_command(&request, &strict, &settings()).is_ok(),
            "{cwd} refused"
        );
    }
    // A directory of the host's /tmp is not in strict's /tmp, a fresh tmpfs; one the
    // workspace puts there is.
    request.cwd = Some("/tmp/build".into());
    let err = plan_command(&request, &strict, &settings()).unwrap_err();
    assert!(
        matches!(&err, PlanError::CwdInFreshTmpfs { tmpfs, .. } if tmpfs == Path::new("/tmp")),
        "{err:?}"
    );
    assert!(err
        .to_string()
        .contains("/tmp in the sandbox is a private tmpfs"));
    let in_tmp = PlanSettings {
        workspace: "/tmp/work".into(),
        ..settings()
    };
    request.cwd = Some("/tmp/work/src".into());
    assert!(plan_command(&request, &strict, &in_tmp).is_ok());
    // A profile that shows the host's root leaves the cwd to the command's `cd`.
    request.cwd = Some("/testbed".into());
    for name in ["landlock", "task-container", "trusted"] {
        assert!(
            plan_command(&request, &builtin(name), &settings()).is_ok(),
            "{name}"
        );
    }
}
