//! The sandbox plan: everything the helper needs to run one command, decided by the daemon.
//!
//! Planning is pure: [`plan_command`] turns a validated request, a profile and the daemon's
//! settings into a [`Plan`] value, which the daemon writes to the helper's stdin as one JSON
//! line. The helper (`crate::helper`) only applies it. Keeping every decision here means unit
//! tests compare whole plans, and the helper never parses client input or profile files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cgroup::{CgroupRoot, Controller};

mod cwd;
use crate::profile::{LandlockFeature, Namespace, Network, Profile, RootMode};

/// What the helper applies, in the order `crate::helper` documents: the sandbox, which can be
/// built before the command is known (a warm worker is prepared from it), and the command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub template: Template,
    pub command: CommandPlan,
}

/// Everything about a command's sandbox: equal templates give interchangeable workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    /// The command's cgroups, one per usable hierarchy; empty where the host has none (the
    /// subreaper sweep then does the killing alone).
    pub cgroups: Vec<CgroupDir>,
    pub sandbox: SandboxPlan,
    /// Layers in force once setup succeeds, reported in every result.
    pub layers: Vec<String>,
    /// Parts of the profile's policy this host cannot apply and the profile does without
    /// (`landlock_scope` on a kernel before 6.12, say), reported in every result.
    pub missing: Vec<String>,
}

/// The command itself, handed to a prepared sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandPlan {
    /// Full argv of the payload: interpreter, its flag, the command.
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// The payload's whole environment (the helper starts from an empty one).
    pub env: BTreeMap<String, String>,
    /// What the payload's stdin is.
    #[serde(default)]
    pub stdin: StdinKind,
    /// A file operation the payload carries out in place of exec'ing `argv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<crate::files::FileOp>,
}

/// A command's stdin. The output descriptor is the payload's stdout and stderr in every case;
/// for a process the client talks to it is the stdin too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdinKind {
    /// `/dev/null` (commands).
    #[default]
    Null,
    /// The output descriptor, a socket whose other end the daemon writes (processes, uploads).
    Socket,
    /// The output descriptor, a terminal: the payload starts a session with it as its
    /// controlling terminal.
    Terminal,
}

/// The name of the cgroup directories of the helper with this pid (the helper knows its
/// pid, and the daemon learns it when the helper starts).
pub fn cgroup_name(helper_pid: u32) -> String {
    format!("w-{helper_pid}")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupDir {
    /// Where the command's directory is made (named by [`cgroup_name`]).
    pub parent: PathBuf,
    /// Cgroup the helper moves back to once the payload is inside `dir`, so that killing `dir`
    /// never kills the helper.
    pub home: PathBuf,
    /// Files to write before joining, e.g. `("pids.max", "512")`.
    pub settings: Vec<(String, String)>,
    /// Whether this is the cgroup2 directory whose `cgroup.kill` ends the command.
    pub kill: bool,
    /// The command's directory is `parent` itself, made before the helper starts and removed
    /// by its caller after the helper is gone (`executor run`: [`crate::cgroup::Placement::one_command`]).
    #[serde(default)]
    pub is_parent: bool,
}

impl CgroupDir {
    /// The command's directory, for the helper whose directories are named `name`.
    pub fn dir(&self, name: &str) -> PathBuf {
        if self.is_parent {
            self.parent.clone()
        } else {
            self.parent.join(name)
        }
    }
}

/// The isolation part of a plan.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxPlan {
    pub namespaces: Vec<Namespace>,
    /// The new root, when the command gets a mount namespace.
    pub mounts: Option<MountPlan>,
    /// Set in a new UTS namespace so the command cannot learn the host's name.
    pub hostname: Option<String>,
    /// uid and gid to switch to; `None` keeps the daemon's.
    pub user: Option<(u32, u32)>,
    /// Capability names kept (bounding, permitted, effective); `None` keeps them all.
    pub capabilities: Option<Vec<String>>,
    pub rlimits: Vec<Rlimit>,
    pub no_new_privs: bool,
    pub landlock: Option<LandlockPlan>,
    pub seccomp: bool,
    /// seccomp also refuses IP sockets (no network and no network namespace to contain it).
    pub deny_inet: bool,
    /// seccomp also refuses SysV IPC (no IPC namespace: its keys would reach the host's).
    pub deny_sysv_ipc: bool,
    /// seccomp allows limits, priorities and scheduling changes on the caller only (no pid
    /// namespace: other processes of the same uid are reachable by pid).
    pub own_process_only: bool,
    /// The command's network namespace is reached only through the daemon's egress
    /// listeners inside it (a network policy): it is made for this command alone, never
    /// lent from the pool nor given back to it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub egress: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountPlan {
    pub root: RootMode,
    pub read_only: Vec<PathBuf>,
    pub writable: Vec<PathBuf>,
    /// Covered with empty read-only mounts.
    pub hidden: Vec<PathBuf>,
    /// Directories bound onto themselves (writable) so they cannot be renamed or replaced.
    pub pins: Vec<PathBuf>,
    /// tmpfs mounts and their sizes in bytes.
    pub tmpfs: Vec<(PathBuf, u64)>,
    /// Files of the host bound read-only over a path of the sandbox: (sandbox path, host
    /// file). The daemon's generated `/etc/resolv.conf` under a network policy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<(PathBuf, PathBuf)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LandlockPlan {
    /// Readable and executable beneath.
    pub read: Vec<PathBuf>,
    /// Readable, writable and executable beneath.
    pub write: Vec<PathBuf>,
    /// Directories may be listed (not read) beneath.
    pub list: Vec<PathBuf>,
    /// Deny every TCP bind and connect.
    pub deny_tcp: bool,
    /// Confine signals and abstract unix sockets to the sandbox.
    pub scope: bool,
    /// The landlock ABI whose filesystem rights are handled (the kernel's, up to the newest
    /// this daemon knows).
    pub abi: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RlimitKind {
    Core,
    Nofile,
    Fsize,
    Cpu,
    Nproc,
    As,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    pub kind: RlimitKind,
    pub value: u64,
}

/// Line the helper writes on its status pipe (its stderr) before it exits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum HelperReport {
    /// The payload ended (on its own or because the daemon asked) and its tree is gone.
    Finished {
        /// Exit code when the shell exited normally.
        code: Option<i32>,
        /// Signal number when a signal ended the shell.
        signal: Option<i32>,
        /// Processes killed at the end (the shell included if it was still running).
        killed: u32,
        /// Whether the daemon asked for the stop (timeout, cancel, disconnect, shutdown).
        stopped: bool,
        /// Isolation layers that were in force.
        layers: Vec<String>,
        /// Limits the command ran into (`processes`, `memory`).
        limits_hit: Vec<String>,
    },
    /// A setup step failed; the command never ran.
    SetupFailed { stage: String, message: String },
    /// Written before the final report, once the payload has exec'd (or begun its file
    /// operation): a process the client talks to is running.
    Started,
}

/// Settings of the daemon that shape every plan.
#[derive(Debug, Clone)]
pub struct PlanSettings {
    pub interpreter: Vec<String>,
    pub workspace: PathBuf,
    /// `{home}` of commands whose request brings none of its own (probes, `executor run`).
    pub home: PathBuf,
    /// Substituted for `{state_dir}` in profiles.
    pub state_dir: PathBuf,
    /// Substituted for `{executor_bin}` in profiles.
    pub executor_bin: PathBuf,
    /// The daemon's token file and audit log, wherever they are: covered in every profile
    /// that shows the host's root, and never opened by landlock rules.
    pub daemon_files: Vec<PathBuf>,
    /// Effective uid of the daemon.
    pub daemon_uid: u32,
    /// What the dynamic loader reads when the daemon starts a helper (its shared libraries,
    /// /etc/ld.so.cache, /etc/ld.so.preload, and the directories holding symlinks on the way
    /// to them): read-only in every profile that shows the host's root writable, with every
    /// directory above them pinned, or a command could run code in the next helper before it
    /// is sandboxed.
    pub loader_files: Vec<PathBuf>,
    pub cgroups: CgroupRoot,
    /// The kernel's landlock ABI (0: none), read once at start.
    pub landlock_abi: u32,
    /// Whether the commands' root has the `C.UTF-8` locale the profiles name; where it does
    /// not, they get `C` (`crate::locale`).
    pub utf8_locale: bool,
}

/// What the client asked for, already validated by the daemon (`executor`'s `request`), and who asks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommandSpec {
    pub command: String,
    pub cwd: Option<PathBuf>,
    pub env: BTreeMap<String, String>,
    /// The client's workspace, when it is not the daemon's shared one.
    pub workspace: Option<PathBuf>,
    /// Where clients' private workspaces live, while any client has one: no command of any
    /// client may reach it (but through its own workspace).
    pub private_root: Option<PathBuf>,
    /// The client's own uid and gid, replacing the unprivileged identity of profiles that
    /// switch to one (so that clients' commands cannot reach each other's files and processes).
    pub identity: Option<(u32, u32)>,
    /// The client's home directory (`{home}` in profiles), writable by its commands only.
    pub home: Option<PathBuf>,
    /// The mount point of the volume holding the client's files, when it has a disk quota:
    /// after the command, whether it is full says which quota the command ran into.
    pub volume: Option<PathBuf>,
    pub stdin: StdinKind,
    pub builtin: Option<crate::files::FileOp>,
}

const MIB: u64 = 1024 * 1024;
/// The newest landlock ABI whose rights this daemon handles.
pub const MAX_LANDLOCK_ABI: u32 = 6;

/// Device nodes a sandbox with a minimal /dev may write: besides the data sinks, the
/// controlling terminal (`/dev/tty`: programs prompt there) and the sandbox's own devpts
/// instance (`/dev/pts`, with `/dev/ptmx` a link into it: `script`, `expect` and editors make
/// terminals there; no other sandbox's or the host's terminal is in it).
const WRITABLE_DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/tty",
    "/dev/pts",
];

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "profile {profile} requires landlock's {feature} right (ABI {needs}), and this kernel \
         has landlock ABI {abi}{why}"
    )]
    LandlockTooOld {
        profile: String,
        feature: &'static str,
        needs: u32,
        abi: u32,
        why: &'static str,
    },
    #[error(
        "profile {profile} would let commands running as the daemon's own user reach {file} \
         (beneath {rule}); move the daemon's state outside the paths the profile opens"
    )]
    DaemonFilesExposed {
        profile: String,
        file: PathBuf,
        rule: PathBuf,
    },
    #[error(
        "profile {profile} hides {path}, but its landlock rule for {rule} opens it (without a \
         mount namespace a path cannot be carved out of a granted tree)"
    )]
    HiddenPathOpened {
        profile: String,
        path: PathBuf,
        rule: PathBuf,
    },
    #[error(
        "profile {profile} would let commands reach other clients' workspaces in {dir} (beneath \
         {rule}); keep the daemon's state directory outside the paths the profile opens"
    )]
    PrivateWorkspacesReachable {
        profile: String,
        dir: PathBuf,
        rule: PathBuf,
    },
    #[error(
        "cannot work in {cwd} under profile {profile}: the sandbox's root has no {cwd}; it \
         holds only {shown}. Work beneath the workspace, or make {cwd} the workspace (start \
         the agent or `executor run` there, or `executor serve --workspace {cwd}`)"
    )]
    CwdNotInRoot {
        profile: String,
        cwd: PathBuf,
        /// What the root holds, in words.
        shown: String,
    },
    #[error(
        "cannot work in {cwd} under profile {profile}: {} in the sandbox is a private tmpfs, \
         empty when each command starts, so {cwd} on the host is not there. Work beneath the \
         workspace, or make {cwd} the workspace (start the agent or `executor run` there, or \
         `executor serve --workspace {cwd}`)",
        tmpfs.display()
    )]
    CwdInFreshTmpfs {
        profile: String,
        cwd: PathBuf,
        tmpfs: PathBuf,
    },
}

/// Build the plan for one command.
pub fn plan_command(
    spec: &CommandSpec,
    profile: &Profile,
    settings: &PlanSettings,
) -> Result<Plan, PlanError> {
    let mut argv = settings.interpreter.clone();
    argv.push(spec.command.clone());

    let workspace = spec.workspace.as_ref().unwrap_or(&settings.workspace);
    let home = spec.home.as_ref().unwrap_or(&settings.home);
    let expand = |text: &str| -> String {
        text.replace("{workspace}", &workspace.display().to_string())
            .replace("{home}", &home.display().to_string())
            .replace("{state_dir}", &settings.state_dir.display().to_string())
            .replace(
                "{executor_bin}",
                &settings.executor_bin.display().to_string(),
            )
    };
    // Cleared environment, then HOME, the profile's defaults, the request: the request wins.
    let mut env = BTreeMap::from([("HOME".to_string(), home.display().to_string())]);
    env.extend(profile.env.iter().map(|(k, v)| {
        let value = expand(v);
        // A locale the root lacks would make every command's shell warn before its output.
        let missing = !settings.utf8_locale
            && (k == "LANG" || k.starts_with("LC_"))
            && value == crate::locale::UTF8;
        (
            k.clone(),
            if missing {
                crate::locale::FALLBACK.to_string()
            } else {
                value
            },
        )
    }));
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));

    let cgroups = plan_cgroups(profile, &settings.cgroups);
    let rights = landlock_rights(profile, settings)?;
    let mut sandbox = plan_sandbox(profile, settings, &expand, &cgroups, &rights);
    // A client of its own identity runs as it wherever the profile would run an unprivileged
    // uid (never in place of root, which the profile asks for, nor of the daemon's own).
    if let (Some((uid, _)), Some(identity)) = (sandbox.user, spec.identity) {
        if uid != 0 {
            sandbox.user = Some(identity);
        }
    }
    reach_made_terminals(&mut sandbox, settings);
    check_daemon_files(profile, settings, &sandbox)?;
    // A landlock-only profile's hidden paths (templates expanded) must stay outside its rules.
    for hidden in profile.filesystem.iter().flat_map(|fs| &fs.hidden) {
        let path = PathBuf::from(expand(&hidden.path));
        if let Some(rule) = landlock_rule_opening(&sandbox, &path) {
            return Err(PlanError::HiddenPathOpened {
                profile: profile.name.clone(),
                path,
                rule: rule.clone(),
            });
        }
    }
    if let Some(root) = &spec.private_root {
        check_private_workspaces(profile, root, &sandbox)?;
    }
    let cwd = spec.cwd.clone().unwrap_or_else(|| workspace.clone());
    if let Some(mounts) = sandbox
        .mounts
        .as_ref()
        .filter(|m| m.root == RootMode::Empty)
    {
        cwd::check_in_root(profile, mounts, workspace, &cwd)?;
    }
    let layers = layers(&cgroups, &sandbox);
    let mut missing: Vec<String> = rights
        .missing
        .iter()
        .map(|f| f.layer().to_string())
        .collect();
    if process_limit_unenforced(profile, &cgroups, &sandbox, settings) {
        missing.push("process_limit".to_string());
    }
    Ok(Plan {
        template: Template {
            cgroups,
            sandbox,
            layers,
            missing,
        },
        command: CommandPlan {
            argv,
            cwd,
            env,
            stdin: spec.stdin,
            builtin: spec.builtin.clone(),
        },
    })
}

/// The landlock rule that opens `path`, for a sandbox that relies on landlock alone (no mount
/// namespace covers anything). Landlock rules are an allow-list: a path beneath an allowed
/// one cannot be carved out.
/// Whether the profile's process limit binds nothing here: without a pids controller it falls
/// back to RLIMIT_NPROC, which the kernel does not apply to root (task-container's commands on
/// a host without the controller, say). Named in the isolation report rather than refused:
/// such a profile is offered only when the operator names it.
fn process_limit_unenforced(
    profile: &Profile,
    cgroups: &[CgroupDir],
    sandbox: &SandboxPlan,
    settings: &PlanSettings,
) -> bool {
    let by_cgroup = cgroups
        .iter()
        .any(|c| c.settings.iter().any(|(f, _)| f == "pids.max"));
    let uid = sandbox.user.map_or(settings.daemon_uid, |(uid, _)| uid);
    profile.limits.processes.is_some() && !by_cgroup && uid == 0
}

/// Without a mount namespace there is no devpts of the command's own: a terminal it makes
/// through a granted `/dev/ptmx` (`script`, editors) is opened in the host's `/dev/pts`, even
/// through TIOCGPTPEER (landlock checks that open too). That directory holds every terminal
/// of the host, closed to other uids by their owner and mode (0620, group tty), so it is
/// granted only to a command that runs under another uid than the daemon's: never to one
/// running as the daemon's own user, whose terminals (the operator's) it would open.
fn reach_made_terminals(sandbox: &mut SandboxPlan, settings: &PlanSettings) {
    let uid = sandbox.user.map_or(settings.daemon_uid, |(uid, _)| uid);
    if sandbox.mounts.is_some() || uid == settings.daemon_uid {
        return;
    }
    if let Some(rules) = &mut sandbox.landlock {
        if rules.write.iter().any(|p| p == Path::new("/dev/ptmx")) {
            rules.write.push(PathBuf::from("/dev/pts"));
        }
    }
}

fn landlock_rule_opening<'a>(sandbox: &'a SandboxPlan, path: &Path) -> Option<&'a PathBuf> {
    let (Some(rules), None) = (&sandbox.landlock, &sandbox.mounts) else {
        return None;
    };
    rules
        .read
        .iter()
        .chain(&rules.write)
        .find(|r| path.starts_with(r))
}

/// When commands would run as the daemon's own user (so file modes do not protect its files
/// either) and only landlock confines them, refuse rather than expose the daemon's files.
fn check_daemon_files(
    profile: &Profile,
    settings: &PlanSettings,
    sandbox: &SandboxPlan,
) -> Result<(), PlanError> {
    let same_user = sandbox
        .user
        .is_none_or(|(uid, _)| uid == settings.daemon_uid);
    if !same_user {
        return Ok(());
    }
    let files = std::iter::once(&settings.state_dir).chain(&settings.daemon_files);
    for file in files {
        if let Some(rule) = landlock_rule_opening(sandbox, file) {
            return Err(PlanError::DaemonFilesExposed {
                profile: profile.name.clone(),
                file: file.clone(),
                rule: rule.clone(),
            });
        }
    }
    Ok(())
}

/// Clients' private workspaces all live under one root. Without a mount namespace to cover
/// it, a landlock rule above it (say `/tmp`, when the daemon's state is there) would open all
/// of them to any client's command, and every client's commands run as the same uid: refuse.
/// (A command's own workspace is beneath the root, so its rule does not match.)
fn check_private_workspaces(
    profile: &Profile,
    root: &Path,
    sandbox: &SandboxPlan,
) -> Result<(), PlanError> {
    match landlock_rule_opening(sandbox, root) {
        Some(rule) => Err(PlanError::PrivateWorkspacesReachable {
            profile: profile.name.clone(),
            dir: root.to_path_buf(),
            rule: rule.clone(),
        }),
        None => Ok(()),
    }
}

/// Landlock's rights for one command on this kernel: what it gets, what it lacks.
struct LandlockRights {
    /// Landlock applies at all (the profile uses it, the kernel has it).
    on: bool,
    deny_tcp: bool,
    scope: bool,
    /// Rights the profile wants and the kernel lacks, none of them required.
    missing: Vec<LandlockFeature>,
}

/// Decide landlock's rights from the profile and the kernel's ABI, or refuse the profile when a
/// right it requires is missing. Besides the profile's own list, truncation is required when
/// commands run as the daemon's own uid: without it (before Linux 6.2) they could truncate the
/// daemon's token and audit log, which file modes would not stop.
fn landlock_rights(
    profile: &Profile,
    settings: &PlanSettings,
) -> Result<LandlockRights, PlanError> {
    let abi = settings.landlock_abi;
    if !profile.landlock.enabled() || profile.filesystem.is_none() {
        return Ok(LandlockRights {
            on: false,
            deny_tcp: false,
            scope: false,
            missing: Vec::new(),
        });
    }
    let wanted: Vec<LandlockFeature> = LandlockFeature::ALL
        .into_iter()
        .filter(|f| *f != LandlockFeature::Tcp || profile.network == Network::None)
        .collect();
    let same_user = profile
        .user
        .as_ref()
        .filter(|u| !u.only_when_root || settings.daemon_uid == 0)
        .is_none_or(|u| u.uid == settings.daemon_uid);
    let mut required = profile.landlock.required();
    if same_user {
        required.push(LandlockFeature::Truncate);
    }
    for feature in wanted.iter().filter(|f| required.contains(f)) {
        if feature.abi() > abi {
            return Err(PlanError::LandlockTooOld {
                profile: profile.name.clone(),
                feature: feature.layer(),
                needs: feature.abi(),
                abi,
                why: if *feature == LandlockFeature::Truncate && same_user {
                    " (required because commands run as the daemon's own uid, which could \
                     otherwise truncate its token and audit log)"
                } else {
                    ""
                },
            });
        }
    }
    let has = |f: LandlockFeature| wanted.contains(&f) && f.abi() <= abi;
    Ok(LandlockRights {
        on: abi >= 1,
        deny_tcp: has(LandlockFeature::Tcp),
        scope: has(LandlockFeature::Scope),
        missing: wanted.into_iter().filter(|f| f.abi() > abi).collect(),
    })
}

fn plan_cgroups(profile: &Profile, root: &CgroupRoot) -> Vec<CgroupDir> {
    let limits = &profile.limits;
    let mut dirs = Vec::new();
    if let Some(h) = &root.unified {
        // The command's cgroup2 directory: placement and kill, and the limits whose controller
        // is enabled there.
        let mut settings = Vec::new();
        if let (Some(Controller::Unified), Some(max)) = (&root.pids, limits.processes) {
            settings.push(("pids.max".into(), max.to_string()));
        }
        if let (Some(Controller::Unified), Some(mb)) = (&root.memory, limits.memory_mb) {
            settings.push(("memory.max".into(), (mb * MIB).to_string()));
            if root.swap {
                // Memory pushed to swap would not count against memory.max.
                settings.push(("memory.swap.max".into(), "0".into()));
            }
            // Out of memory, the whole command goes, not one process picked from it.
            settings.push(("memory.oom.group".into(), "1".into()));
        }
        dirs.push(CgroupDir {
            parent: h.parent.clone(),
            home: h.back.clone(),
            settings,
            kill: true,
            is_parent: root.one_command,
        });
    }
    if let (Some(Controller::V1(h)), Some(max)) = (&root.pids, limits.processes) {
        dirs.push(CgroupDir {
            parent: h.parent.clone(),
            home: h.back.clone(),
            settings: vec![("pids.max".into(), max.to_string())],
            kill: false,
            is_parent: root.one_command,
        });
    }
    if let (Some(Controller::V1(h)), Some(mb)) = (&root.memory, limits.memory_mb) {
        dirs.push(CgroupDir {
            parent: h.parent.clone(),
            home: h.back.clone(),
            settings: vec![("memory.limit_in_bytes".into(), (mb * MIB).to_string())],
            kill: false,
            is_parent: root.one_command,
        });
    }
    dirs
}

fn plan_sandbox(
    profile: &Profile,
    settings: &PlanSettings,
    expand_text: &dyn Fn(&str) -> String,
    cgroups: &[CgroupDir],
    rights: &LandlockRights,
) -> SandboxPlan {
    let expand = |path: &str| PathBuf::from(expand_text(path));
    let mut namespaces = profile.namespaces.clone();
    namespaces.sort();
    let has = |ns: Namespace| namespaces.contains(&ns);

    let mounts = profile
        .filesystem
        .as_ref()
        .filter(|_| has(Namespace::Mount))
        .map(|fs| {
            let host = fs.root == RootMode::Host;
            let hidden: Vec<PathBuf> = fs
                .hidden
                .iter()
                .map(|g| expand(&g.path))
                // The host's root shows the daemon's files wherever they are: cover them.
                .chain(settings.daemon_files.iter().filter(|_| host).cloned())
                .collect();
            MountPlan {
                root: fs.root,
                read_only: fs
                    .read_only
                    .iter()
                    .map(|g| expand(&g.path))
                    .chain(settings.loader_files.iter().filter(|_| host).cloned())
                    .collect(),
                writable: fs.writable.iter().map(|g| expand(&g.path)).collect(),
                // A cover protects a path, not what lies there: renaming a directory above it
                // would move the real file out from under the cover (and a new, empty
                // directory would take its place). Every directory above a covered or
                // read-only file is pinned.
                pins: if host {
                    ancestors(settings.loader_files.iter().chain(&hidden))
                } else {
                    Vec::new()
                },
                hidden,
                // A writable path wins over a tmpfs at the same place (`executor run` in /tmp).
                tmpfs: fs
                    .tmpfs
                    .iter()
                    .map(|t| (expand(&t.path), t.size_mb * MIB))
                    .filter(|(path, _)| !fs.writable.iter().any(|w| expand(&w.path) == *path))
                    .collect(),
                files: Vec::new(),
            }
        });

    let landlock = profile.filesystem.as_ref().filter(|_| rights.on).map(|fs| {
        let mut read: Vec<PathBuf> = fs.read_only.iter().map(|g| expand(&g.path)).collect();
        let mut write: Vec<PathBuf> = fs.writable.iter().map(|g| expand(&g.path)).collect();
        write.extend(fs.tmpfs.iter().map(|t| expand(&t.path)));
        let mut list = Vec::new();
        if has(Namespace::Mount) {
            // Inside the new root, /proc and the minimal /dev exist and are the command's,
            // and every directory is one the policy put there: listing them is harmless.
            read.extend(["/proc", "/dev"].map(PathBuf::from));
            write.extend(WRITABLE_DEVICES.iter().map(PathBuf::from));
            list.push(PathBuf::from("/"));
        }
        LandlockPlan {
            read,
            write,
            list,
            deny_tcp: rights.deny_tcp,
            scope: rights.scope,
            abi: settings.landlock_abi.min(MAX_LANDLOCK_ABI),
        }
    });

    let limits = &profile.limits;
    let sandboxed = profile.capabilities.is_some() || profile.seccomp || profile.landlock.enabled();
    let mut rlimits = Vec::new();
    if sandboxed {
        // Core dumps could leak memory contents into the workspace and fill the disk.
        rlimits.push(Rlimit {
            kind: RlimitKind::Core,
            value: 0,
        });
    }
    let mut push = |kind, value: Option<u64>| {
        if let Some(value) = value {
            rlimits.push(Rlimit { kind, value });
        }
    };
    push(RlimitKind::Nofile, limits.open_files);
    push(RlimitKind::Fsize, limits.file_size_mb.map(|mb| mb * MIB));
    push(RlimitKind::Cpu, limits.cpu_seconds);
    // Without the cgroup controllers, fall back to rlimits: RLIMIT_NPROC counts all processes
    // of the uid (coarser), RLIMIT_AS bounds address space rather than resident memory.
    let has_setting = |file: &str| {
        cgroups
            .iter()
            .any(|c| c.settings.iter().any(|(f, _)| f == file))
    };
    if !has_setting("pids.max") {
        push(RlimitKind::Nproc, limits.processes);
    }
    if !has_setting("memory.max") && !has_setting("memory.limit_in_bytes") {
        push(RlimitKind::As, limits.memory_mb.map(|mb| mb * MIB));
    }

    SandboxPlan {
        hostname: has(Namespace::Uts).then(|| "sandbox".to_string()),
        mounts,
        user: profile
            .user
            .as_ref()
            .filter(|u| !u.only_when_root || settings.daemon_uid == 0)
            .map(|u| (u.uid, u.gid)),
        capabilities: profile
            .capabilities
            .as_ref()
            .map(|keep| keep.iter().map(|c| c.name.clone()).collect()),
        rlimits,
        no_new_privs: sandboxed,
        landlock,
        seccomp: profile.seccomp,
        deny_inet: profile.seccomp && profile.network == Network::None && !has(Namespace::Net),
        deny_sysv_ipc: profile.seccomp && !has(Namespace::Ipc),
        own_process_only: profile.seccomp && !has(Namespace::Pid),
        namespaces,
        egress: false,
    }
}

/// Every directory above `paths`, except the root, parents first, without repeats.
fn ancestors<'a>(paths: impl Iterator<Item = &'a PathBuf>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = paths
        .flat_map(|p| p.ancestors().skip(1))
        .filter(|d| d.parent().is_some())
        .map(PathBuf::from)
        .collect();
    dirs.sort_by_key(|d| (d.components().count(), d.clone()));
    dirs.dedup();
    dirs
}

/// Names of the layers a plan puts in force, in the order they are applied.
fn layers(cgroups: &[CgroupDir], sandbox: &SandboxPlan) -> Vec<String> {
    let mut layers = vec!["session".to_string(), "subreaper".to_string()];
    for cg in cgroups {
        if cg.kill {
            layers.push("cgroup".into());
        }
        for (file, _) in &cg.settings {
            match file.as_str() {
                "pids.max" => layers.push("pids_limit".into()),
                "memory.max" | "memory.limit_in_bytes" => layers.push("memory_limit".into()),
                _ => {}
            }
        }
    }
    layers.extend(sandbox.namespaces.iter().map(|ns| ns.layer().to_string()));
    if sandbox.mounts.is_some() {
        layers.push("pivot_root".into());
    }
    let mut push = |cond: bool, name: &str| {
        if cond {
            layers.push(name.to_string());
        }
    };
    push(!sandbox.rlimits.is_empty(), "rlimits");
    push(sandbox.user.is_some(), "uid");
    push(sandbox.capabilities.is_some(), "caps");
    push(sandbox.no_new_privs, "no_new_privs");
    push(sandbox.landlock.is_some(), "landlock");
    push(sandbox.seccomp, "seccomp");
    layers
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
