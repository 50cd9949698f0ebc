//! Sandbox profiles: data files in `sandbox-profiles/`, compiled into the binary and also
//! loadable from a directory.
//!
//! A profile says what a command may see and do. Every field must be present (so a profile reads
//! as a complete statement of its policy), unknown fields are errors (so a typo never silently
//! weakens it), and every grant carries a `reason`.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::network::{self, Rule};

/// Profiles shipped in the binary, by name.
const BUILTIN: &[(&str, &str)] = &[
    ("strict", include_str!("../../sandbox-profiles/strict.json")),
    (
        "landlock",
        include_str!("../../sandbox-profiles/landlock.json"),
    ),
    (
        "task-container",
        include_str!("../../sandbox-profiles/task-container.json"),
    ),
    (
        "trusted",
        include_str!("../../sandbox-profiles/trusted.json"),
    ),
];

/// Profiles that may become the default, strongest first. `trusted` is never a default: it is
/// reachable only by naming it.
pub const DEFAULT_PREFERENCE: &[&str] = &["strict", "landlock"];

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub description: String,
    /// Who the profile protects from whom, and what it does not cover.
    pub threat_model: String,
    /// Namespaces the command gets of its own. Empty: the host's.
    pub namespaces: Vec<Namespace>,
    /// Identity inside; `null` keeps the daemon's.
    pub user: Option<UserGrant>,
    /// What the command sees of the filesystem; `null` is the host's, unrestricted.
    pub filesystem: Option<Filesystem>,
    pub network: Network,
    /// Capabilities kept; `null` keeps the daemon's, `[]` drops them all.
    pub capabilities: Option<Vec<CapabilityGrant>>,
    /// Repeat the filesystem policy (and deny TCP, signals and abstract sockets leaving the
    /// sandbox) with landlock: `false`, `true` (every right required), or which rights a
    /// kernel must have for the profile to run there.
    pub landlock: Landlock,
    /// Deny dangerous syscalls and kill the 32-bit ABIs.
    pub seccomp: bool,
    pub limits: ProfileLimits,
    /// Environment every command starts from (after the cleared one); requests override it.
    pub env: BTreeMap<String, String>,
}

/// How a profile uses landlock. Landlock's rights arrived over several kernel versions (its
/// ABI); each is applied wherever the running kernel has it, and a profile names those it
/// cannot do without.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Landlock {
    /// `false`: no landlock; `true`: every right, all required (a kernel without one makes the
    /// profile unavailable).
    Flag(bool),
    Rights(LandlockRights),
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LandlockRights {
    /// Rights without which the profile does not run. The others are applied where the kernel
    /// has them, and named in the isolation report (`missing`) where it does not.
    pub required: Vec<LandlockFeature>,
    /// Why the others may be missing.
    pub reason: String,
}

/// Landlock's rights, by the ABI that brought them (Documentation/userspace-api/landlock.rst).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LandlockFeature {
    /// ABI 1 (Linux 5.13): read, write, execute, create and remove beneath allowed paths.
    Filesystem,
    /// ABI 2 (5.19): links and renames across directories (without it they are denied).
    Refer,
    /// ABI 3 (6.2): truncating files.
    Truncate,
    /// ABI 4 (6.7): TCP bind and connect.
    Tcp,
    /// ABI 5 (6.10): ioctl on device files.
    IoctlDev,
    /// ABI 6 (6.12): signals and abstract unix sockets leaving the sandbox.
    Scope,
}

impl LandlockFeature {
    pub const ALL: [Self; 6] = [
        Self::Filesystem,
        Self::Refer,
        Self::Truncate,
        Self::Tcp,
        Self::IoctlDev,
        Self::Scope,
    ];

    /// The landlock ABI that brought it.
    pub fn abi(self) -> u32 {
        match self {
            Self::Filesystem => 1,
            Self::Refer => 2,
            Self::Truncate => 3,
            Self::Tcp => 4,
            Self::IoctlDev => 5,
            Self::Scope => 6,
        }
    }

    /// Its name in reports (`landlock_scope`).
    pub fn layer(self) -> &'static str {
        match self {
            Self::Filesystem => "landlock_filesystem",
            Self::Refer => "landlock_refer",
            Self::Truncate => "landlock_truncate",
            Self::Tcp => "landlock_tcp",
            Self::IoctlDev => "landlock_ioctl_dev",
            Self::Scope => "landlock_scope",
        }
    }
}

impl Landlock {
    pub fn enabled(&self) -> bool {
        !matches!(self, Self::Flag(false))
    }

    /// Rights the profile cannot do without.
    pub fn required(&self) -> Vec<LandlockFeature> {
        match self {
            Self::Flag(false) => Vec::new(),
            Self::Flag(true) => LandlockFeature::ALL.to_vec(),
            Self::Rights(r) => r.required.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Namespace {
    Mount,
    Pid,
    Net,
    Ipc,
    Uts,
    Cgroup,
}

impl Namespace {
    pub fn layer(self) -> &'static str {
        match self {
            Self::Mount => "mount_ns",
            Self::Pid => "pid_ns",
            Self::Net => "net_ns",
            Self::Ipc => "ipc_ns",
            Self::Uts => "uts_ns",
            Self::Cgroup => "cgroup_ns",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserGrant {
    pub uid: u32,
    pub gid: u32,
    pub reason: String,
    /// Switch only when the daemon runs as root; a daemon running as an ordinary user runs
    /// commands as itself (it cannot switch, and gives them nothing it does not have).
    #[serde(default)]
    pub only_when_root: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RootMode {
    /// A new, empty root: only the listed paths exist.
    Empty,
    /// The host's root, with the listed changes.
    Host,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Filesystem {
    pub root: RootMode,
    #[serde(default)]
    pub read_only: Vec<PathGrant>,
    #[serde(default)]
    pub writable: Vec<PathGrant>,
    /// Covered by an empty, read-only mount (namespaces) or left out of every rule (landlock).
    #[serde(default)]
    pub hidden: Vec<PathGrant>,
    #[serde(default)]
    pub tmpfs: Vec<TmpfsGrant>,
}

/// A path the profile grants, with why. Paths may use `{workspace}`, `{state_dir}` and
/// `{executor_bin}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathGrant {
    pub path: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TmpfsGrant {
    pub path: String,
    pub size_mb: u64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum Network {
    /// No network: a new network namespace with only loopback, or landlock denying TCP.
    None,
    /// The host's network.
    Host { reason: String },
    /// Only the connections the rules allow (see [`crate::network`]), through the daemon's
    /// egress listeners in the command's own network namespace. A profile without a network
    /// namespace cannot have it (see `check`): it would run with more network than it states.
    Policy {
        allow: Vec<Rule>,
        #[serde(default)]
        deny: Vec<Rule>,
        reason: String,
    },
}

impl Network {
    /// What the profile says, as one layer of a command's policy ([`network::Effective`]).
    pub fn mode(&self) -> network::Mode {
        match self {
            Self::None => network::Mode::None,
            Self::Host { .. } => network::Mode::Host,
            Self::Policy { allow, deny, .. } => network::Mode::Policy(network::Policy {
                allow: allow.clone(),
                deny: deny.clone(),
            }),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapabilityGrant {
    /// e.g. `CAP_CHOWN`.
    pub name: String,
    pub reason: String,
}

/// Per-command resource limits; `null` means none beyond the host's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileLimits {
    pub processes: Option<u64>,
    pub memory_mb: Option<u64>,
    pub file_size_mb: Option<u64>,
    pub open_files: Option<u64>,
    pub cpu_seconds: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {name}: {source}")]
    Parse {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("profile file {file} declares the name {declared}")]
    NameMismatch { file: String, declared: String },
    #[error("profile {profile}: {problem}")]
    Invalid { profile: String, problem: String },
    #[error("cannot read profiles from {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// `path` as this host resolves it (symlinks followed), or as written where it cannot be
/// (missing, or a `{template}`).
fn resolved(path: &str) -> std::path::PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| std::path::PathBuf::from(path))
}

impl Profile {
    /// Whether commands see only the paths the profile lists (by a mount namespace over a
    /// chosen filesystem, or by landlock), so a directory it does not list stays private.
    pub fn confines_filesystem(&self) -> bool {
        self.filesystem.is_some()
            && (self.landlock.enabled() || self.namespaces.contains(&Namespace::Mount))
    }

    /// Whether a command of this profile is given `{home}`: as its HOME (unless the profile's
    /// environment sets one) or through a path or variable that names it. strict's commands
    /// are not (their HOME is their private /tmp), nor task-container's (/root), so a one-shot
    /// makes no home for them.
    pub fn uses_home(&self) -> bool {
        let names = |text: &str| text.contains("{home}");
        let grants = self.filesystem.iter().flat_map(|fs| {
            fs.read_only
                .iter()
                .chain(&fs.writable)
                .chain(&fs.hidden)
                .map(|g| g.path.as_str())
                .chain(fs.tmpfs.iter().map(|t| t.path.as_str()))
        });
        !self.env.contains_key("HOME")
            || self.env.values().any(|v| names(v))
            || grants.into_iter().any(names)
    }

    /// Whether commands see the host's own root in a mount namespace (task-container), where
    /// the loader's files are covered and pinned.
    pub fn shows_host_root(&self) -> bool {
        self.filesystem
            .as_ref()
            .is_some_and(|fs| fs.root == RootMode::Host)
            && self.namespaces.contains(&Namespace::Mount)
    }

    /// Whether a command of this profile can change files that commands of `profiles` (any of
    /// them, this one included) read or execute from the host:
    /// - a profile without a filesystem policy writes everything;
    /// - one that shows the host's root in a mount namespace writes every top-level directory
    ///   (`mounts.rs` makes each a writable mount, whatever the writable list says);
    /// - otherwise, a writable grant at, above or below another profile's read-only grant
    ///   (compared as this host resolves them, symlinks followed), as task-container's `/`
    ///   holds strict's `/usr`.
    ///
    /// Grants made per client (`{workspace}`, `{home}`: `check` allows no other template in a
    /// writable grant, and no `..` anywhere) and private tmpfs mounts do not count.
    pub fn writes_shared_files<'a>(&self, profiles: impl IntoIterator<Item = &'a Profile>) -> bool {
        let Some(fs) = &self.filesystem else {
            return true;
        };
        if self.shows_host_root() {
            return true;
        }
        let read: Vec<std::path::PathBuf> = profiles
            .into_iter()
            .filter_map(|p| p.filesystem.as_ref())
            .flat_map(|f| f.read_only.iter().map(|g| resolved(&g.path)))
            .collect();
        fs.writable
            .iter()
            .filter(|w| !w.path.starts_with('{'))
            .any(|w| {
                let w = resolved(&w.path);
                read.iter().any(|r| r.starts_with(&w) || w.starts_with(r))
            })
    }

    /// Whether the daemon offers this profile without the operator naming it: it confines the
    /// filesystem and writes nothing other profiles run (so not `trusted`, not
    /// `task-container`).
    pub fn offered_by_default<'a>(&self, profiles: impl IntoIterator<Item = &'a Profile>) -> bool {
        self.confines_filesystem() && !self.writes_shared_files(profiles)
    }

    pub fn parse(file_name: &str, text: &str) -> Result<Self, ProfileError> {
        let profile: Profile =
            serde_json::from_str(text).map_err(|source| ProfileError::Parse {
                name: file_name.to_string(),
                source,
            })?;
        if profile.name != file_name {
            return Err(ProfileError::NameMismatch {
                file: file_name.to_string(),
                declared: profile.name,
            });
        }
        profile.check()?;
        Ok(profile)
    }

    /// Whether a command of this profile can be given a network namespace of its own: one
    /// it has, or one made beside its pid namespace (whose init builds the sandbox and can
    /// make it). A network policy is enforced only through one.
    pub fn can_have_network_namespace(&self) -> bool {
        self.namespaces.contains(&Namespace::Net) || self.namespaces.contains(&Namespace::Pid)
    }

    /// Rules a profile must follow beyond its shape.
    fn check(&self) -> Result<(), ProfileError> {
        let invalid = |problem: &str| ProfileError::Invalid {
            profile: self.name.clone(),
            problem: problem.to_string(),
        };
        if self.landlock.enabled() && self.filesystem.is_none() {
            return Err(invalid(
                "landlock needs a filesystem section to build rules from",
            ));
        }
        if let Network::Policy { allow, .. } = &self.network {
            if allow.is_empty() {
                return Err(invalid(
                    "network policy with no allow rule: write {\"mode\": \"none\"}",
                ));
            }
            // A policy is enforced by a network namespace whose only way out is the daemon's
            // egress listeners inside it (ARCHITECTURE.md, "Egress through the daemon's own
            // sockets"). A profile with a pid namespace but the host's network
            // (task-container-like) gets one made for the command. Without namespaces
            // (landlock), nothing would stop a command from connecting around the proxy:
            // refused, never run with more network than the profile states.
            if !self.can_have_network_namespace() {
                return Err(invalid(
                    "network mode \"policy\" needs the network namespace (\"net\" in \
                     namespaces): without one a command could connect around the daemon's \
                     proxy, so the policy could not be enforced",
                ));
            }
        }
        let mount_ns = self.namespaces.contains(&Namespace::Mount);
        if let Some(fs) = &self.filesystem {
            let grants = fs
                .read_only
                .iter()
                .chain(&fs.writable)
                .chain(&fs.hidden)
                .map(|g| g.path.as_str())
                .chain(fs.tmpfs.iter().map(|t| t.path.as_str()));
            for path in grants {
                // A `..` would take a grant anywhere (`{home}/..`, `/tmp/../usr`).
                if Path::new(path)
                    .components()
                    .any(|c| c == std::path::Component::ParentDir)
                {
                    return Err(invalid(&format!("path {path} contains `..`")));
                }
                let template = path.starts_with('{');
                if !template && !path.starts_with('/') {
                    return Err(invalid(&format!("path {path} is not absolute")));
                }
            }
            for grant in &fs.writable {
                // Writable templates are the client's own places only: `{state_dir}` or
                // `{executor_bin}` would hand the daemon's files to commands.
                let own = ["{workspace}", "{home}"]
                    .iter()
                    .any(|t| grant.path == *t || grant.path.starts_with(&format!("{t}/")));
                if grant.path.contains('{') && !own {
                    return Err(invalid(&format!(
                        "writable path {} may use only {{workspace}} or {{home}}, at its start",
                        grant.path
                    )));
                }
            }
            if !mount_ns && !self.landlock.enabled() {
                return Err(invalid(
                    "a filesystem policy needs the mount namespace or landlock to enforce it",
                ));
            }
            if !mount_ns && (!fs.tmpfs.is_empty() || fs.root == RootMode::Empty) {
                return Err(invalid(
                    "tmpfs mounts and an empty root need the mount namespace",
                ));
            }
            if !mount_ns
                && !self
                    .landlock
                    .required()
                    .contains(&LandlockFeature::Filesystem)
            {
                return Err(invalid(
                    "without the mount namespace only landlock confines the filesystem: its \
                     \"filesystem\" right must be required",
                ));
            }
            if !mount_ns {
                // Without a mount namespace, "hidden" can only mean "opened by no rule", and
                // landlock cannot carve a path out of a granted tree. Compared as written and
                // as this host resolves them: landlock's rules follow symlinks, so a hidden
                // `/lib/x` lies beneath a granted `/usr` where `/lib` links to `usr/lib`.
                let granted = fs.read_only.iter().chain(&fs.writable);
                for hidden in &fs.hidden {
                    let beneath = |grant: &PathGrant| {
                        Path::new(&hidden.path).starts_with(&grant.path)
                            || resolved(&hidden.path).starts_with(resolved(&grant.path))
                    };
                    if let Some(grant) = granted.clone().find(|g| beneath(g)) {
                        return Err(invalid(&format!(
                            "hidden path {} lies beneath the granted {}, and without the mount \
                             namespace landlock cannot take it out of that grant",
                            hidden.path, grant.path
                        )));
                    }
                }
            }
        }
        if (self.seccomp || self.landlock.enabled()) && self.limits.processes.is_none() {
            // A filtered profile promises a bounded command: without a process limit one fork
            // loop fills the host's process table.
            return Err(invalid(
                "a profile that filters commands (seccomp or landlock) needs limits.processes",
            ));
        }
        if self.namespaces.contains(&Namespace::Mount) != self.namespaces.contains(&Namespace::Pid)
        {
            // A fresh /proc needs both; a host /proc in a new mount namespace would show the
            // daemon, and a pid namespace without a new /proc shows the host's processes.
            return Err(invalid("mount and pid namespaces go together"));
        }
        for cap in self.capabilities.iter().flatten() {
            caps::Capability::from_str(&cap.name)
                .map_err(|_| invalid(&format!("unknown capability {}", cap.name)))?;
        }
        Ok(())
    }

    /// The shipped profile `name`, parsed, if there is one.
    pub fn builtin(name: &str) -> Option<Result<Self, ProfileError>> {
        BUILTIN
            .iter()
            .find(|(file, _)| *file == name)
            .map(|(file, text)| Self::parse(file, text))
    }

    /// Every shipped profile, parsed.
    pub fn all_builtin() -> Result<Vec<Self>, ProfileError> {
        BUILTIN
            .iter()
            .map(|(file, text)| Self::parse(file, text))
            .collect()
    }

    /// Every `*.json` profile in `dir`; a name there replaces the built-in one.
    pub fn load_dir(dir: &Path) -> Result<Vec<Self>, ProfileError> {
        let read_err = |source| ProfileError::Read {
            path: dir.display().to_string(),
            source,
        };
        let mut profiles = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read_to_string(&path).map_err(read_err)?;
            profiles.push(Self::parse(&name, &text)?);
        }
        Ok(profiles)
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    pub fn builtin(name: &str) -> Profile {
        Profile::all_builtin()
            .unwrap()
            .into_iter()
            .find(|p| p.name == name)
            .unwrap()
    }

    #[test]
    fn every_shipped_profile_parses_and_states_its_threat_model() {
        let all = Profile::all_builtin().unwrap();
        let names: Vec<&str> = all.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["strict", "landlock", "task-container", "trusted"]);
        for profile in &all {
            assert!(profile.threat_model.len() > 100, "{}", profile.name);
            assert_eq!(profile.env.get("PAGER").map(String::as_str), Some("cat"));
        }
    }

    #[test]
    fn a_profile_uses_home_through_its_default_home_or_a_path_or_variable_naming_it() {
        // strict's HOME is its private /tmp, task-container's /root, and neither names {home};
        // landlock names it, trusted's HOME is it.
        let uses = |name: &str| builtin(name).uses_home();
        assert!(!uses("strict"));
        assert!(!uses("task-container"));
        assert!(uses("landlock"));
        assert!(uses("trusted"));
        let mut strict = builtin("strict");
        strict.env.insert("CACHE".into(), "{home}/.cache".into());
        assert!(strict.uses_home());
        let mut strict = builtin("strict");
        if let Some(fs) = strict.filesystem.as_mut() {
            fs.writable.push(PathGrant {
                path: "{home}".into(),
                reason: "test".into(),
            });
        }
        assert!(strict.uses_home());
        let mut strict = builtin("strict");
        strict.env.remove("HOME");
        assert!(strict.uses_home());
    }

    #[test]
    fn only_profiles_that_confine_and_write_nothing_shared_are_offered_by_default() {
        let all = Profile::all_builtin().unwrap();
        let verdict = |name: &str| {
            let p = builtin(name);
            (p.writes_shared_files(&all), p.offered_by_default(&all))
        };
        assert_eq!(verdict("strict"), (false, true));
        assert_eq!(verdict("landlock"), (false, true));
        // `/` writable holds every system directory strict and landlock read.
        assert_eq!(verdict("task-container"), (true, false));
        assert_eq!(verdict("trusted"), (true, false));
    }

    #[test]
    fn a_landlock_only_profile_cannot_hide_a_path_beneath_one_it_grants() {
        let landlock = include_str!("../../sandbox-profiles/landlock.json");
        let mut value: serde_json::Value = serde_json::from_str(landlock).unwrap();
        value["filesystem"]["hidden"] =
            serde_json::json!([{"path": "/etc/ssh", "reason": "host keys"}]);
        let err = Profile::parse("landlock", &value.to_string()).unwrap_err();
        assert!(err.to_string().contains("/etc/ssh"), "{err}");
        // Control: a hidden path no grant opens is what landlock does anyway, and is accepted.
        value["filesystem"]["hidden"] =
            serde_json::json!([{"path": "/srv/secrets", "reason": "not ours"}]);
        Profile::parse("landlock", &value.to_string()).unwrap();
    }

    #[test]
    fn a_hidden_path_reached_through_a_symlink_into_a_grant_is_refused() {
        // landlock's rules follow symlinks: hiding `link/secret` where `link` points into a
        // granted directory hides nothing. (Not under /tmp, which landlock grants.)
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("secret")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let landlock = include_str!("../../sandbox-profiles/landlock.json");
        let mut value: serde_json::Value = serde_json::from_str(landlock).unwrap();
        value["filesystem"]["read_only"] = serde_json::json!([{"path": real, "reason": "r"}]);
        value["filesystem"]["hidden"] =
            serde_json::json!([{"path": dir.path().join("link/secret"), "reason": "h"}]);
        let err = Profile::parse("landlock", &value.to_string()).unwrap_err();
        assert!(err.to_string().contains("beneath"), "{err}");
        // Control: a link to a directory outside every grant hides what it names.
        std::fs::create_dir_all(dir.path().join("other/secret")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("other"), dir.path().join("link2")).unwrap();
        value["filesystem"]["hidden"] =
            serde_json::json!([{"path": dir.path().join("link2/secret"), "reason": "h"}]);
        Profile::parse("landlock", &value.to_string()).unwrap();
    }

    #[test]
    fn a_filtered_profile_must_bound_its_processes() {
        for name in ["landlock", "strict", "task-container"] {
            let text = BUILTIN.iter().find(|(n, _)| *n == name).unwrap().1;
            let mut value: serde_json::Value = serde_json::from_str(text).unwrap();
            value["limits"]["processes"] = serde_json::Value::Null;
            let err = Profile::parse(name, &value.to_string()).unwrap_err();
            assert!(
                err.to_string().contains("limits.processes"),
                "{name}: {err}"
            );
        }
        // Control: trusted filters nothing and promises no bound.
        let trusted = Profile::all_builtin().unwrap();
        let trusted = trusted.iter().find(|p| p.name == "trusted").unwrap();
        assert_eq!(trusted.limits.processes, None);
    }

    #[test]
    fn profiles_that_write_the_host_are_told_whatever_their_writable_list_says() {
        let all = Profile::all_builtin().unwrap();
        // task-container without `/` in its writable list still shows the host's root with
        // every top-level directory writable.
        let mut tc = builtin("task-container");
        if let Some(fs) = tc.filesystem.as_mut() {
            fs.writable.retain(|g| g.path != "/");
        }
        assert!(tc.writes_shared_files(&all) && !tc.offered_by_default(&all));
        // `..` and templates other than the client's own are refused outright.
        let landlock = include_str!("../../sandbox-profiles/landlock.json");
        for path in [
            "{home}/..",
            "/tmp/../usr",
            "{state_dir}",
            "{workspace}x",
            "usr/local",
        ] {
            let mut value: serde_json::Value = serde_json::from_str(landlock).unwrap();
            value["filesystem"]["writable"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"path": path, "reason": "test"}));
            let err = Profile::parse("landlock", &value.to_string()).unwrap_err();
            assert!(err.to_string().contains(path), "{path}: {err}");
        }
        // A literal writable path is compared as resolved on this host.
        let dir = std::env::temp_dir().join(format!("profile-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let link = dir.join("usr-link");
        std::os::unix::fs::symlink("/usr", &link).unwrap();
        let mut value: serde_json::Value = serde_json::from_str(landlock).unwrap();
        value["filesystem"]["writable"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"path": link, "reason": "test"}));
        let sneaky = Profile::parse("landlock", &value.to_string()).unwrap();
        assert!(sneaky.writes_shared_files(&all));
        std::fs::remove_dir_all(&dir).unwrap();
        // Control: the shipped filtered profiles write nothing shared.
        assert!(!builtin("landlock").writes_shared_files(&all));
        assert!(!builtin("strict").writes_shared_files(&all));
    }

    #[test]
    fn strict_is_the_strongest_profile() {
        let strict = builtin("strict");
        assert_eq!(strict.namespaces.len(), 6);
        assert_eq!(strict.user.as_ref().map(|u| u.uid), Some(65534));
        assert_eq!(strict.capabilities, Some(vec![]));
        assert!(strict.landlock.enabled() && strict.seccomp);
        assert_eq!(strict.network, Network::None);
        assert_eq!(
            strict.filesystem.as_ref().map(|f| f.root),
            Some(RootMode::Empty)
        );
    }

    #[test]
    fn unknown_or_missing_profile_fields_are_errors() {
        let trusted = include_str!("../../sandbox-profiles/trusted.json");
        let mut value: serde_json::Value = serde_json::from_str(trusted).unwrap();
        value["netwrok"] = serde_json::json!("host");
        let err = Profile::parse("trusted", &value.to_string()).unwrap_err();
        assert!(err.to_string().contains("netwrok"), "{err}");
        let mut value: serde_json::Value = serde_json::from_str(trusted).unwrap();
        value.as_object_mut().unwrap().remove("seccomp");
        let err = Profile::parse("trusted", &value.to_string()).unwrap_err();
        assert!(err.to_string().contains("seccomp"), "{err}");
    }

    #[test]
    fn a_network_policy_parses_with_clear_errors_and_is_refused_without_a_namespace() {
        let strict = include_str!("../../sandbox-profiles/strict.json");
        let mut value: serde_json::Value = serde_json::from_str(strict).unwrap();
        let with = |value: &mut serde_json::Value, network| {
            value["network"] = network;
            Profile::parse("strict", &value.to_string())
                .unwrap_err()
                .to_string()
        };
        let good = serde_json::json!({
            "mode": "policy",
            "allow": ["pypi.org:443", "*.pythonhosted.org:443", "10.0.0.0/8:80-90"],
            "deny": ["[2001:db8::/32]:443"],
            "reason": "pip installs from PyPI",
        });
        let network: Network = serde_json::from_value(good.clone()).unwrap();
        let network::Mode::Policy(policy) = network.mode() else {
            panic!("{network:?}");
        };
        assert_eq!(policy.allow.len(), 3);
        assert_eq!(policy.deny[0].to_string(), "[2001:db8::/32]:443");
        // Parsed, checked, and accepted where a network namespace enforces it (strict, and
        // task-container, whose commands get one made), refused where none can (landlock).
        value["network"] = good.clone();
        let parsed = Profile::parse("strict", &value.to_string()).unwrap();
        assert_eq!(parsed.network.mode(), network::Mode::Policy(policy.clone()));
        let container = include_str!("../../sandbox-profiles/task-container.json");
        let mut container: serde_json::Value = serde_json::from_str(container).unwrap();
        container["network"] = good.clone();
        Profile::parse("task-container", &container.to_string()).unwrap();
        let landlock = include_str!("../../sandbox-profiles/landlock.json");
        let mut landlock: serde_json::Value = serde_json::from_str(landlock).unwrap();
        landlock["network"] = good.clone();
        let err = Profile::parse("landlock", &landlock.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs the network namespace"), "{err}");
        // A bad rule is named in the profile's error.
        let mut bad = good.clone();
        bad["allow"] = serde_json::json!(["pypi.org", "*"]);
        let err = with(&mut value, bad);
        assert!(err.contains("bare `*`"), "{err}");
        // Unknown fields and a missing reason are errors, as everywhere in a profile.
        let mut bad = good.clone();
        bad["alow"] = serde_json::json!([]);
        assert!(with(&mut value, bad).contains("alow"));
        let mut bad = good.clone();
        bad.as_object_mut().unwrap().remove("reason");
        assert!(with(&mut value, bad).contains("reason"));
        let mut bad = good;
        bad["allow"] = serde_json::json!([]);
        assert!(with(&mut value, bad).contains("no allow rule"));
        // Controls: the shipped modes.
        assert_eq!(builtin("strict").network.mode(), network::Mode::None);
        assert_eq!(
            builtin("task-container").network.mode(),
            network::Mode::Host
        );
    }

    #[test]
    fn grants_without_reasons_and_bad_capabilities_are_errors() {
        let strict = include_str!("../../sandbox-profiles/strict.json");
        let mut value: serde_json::Value = serde_json::from_str(strict).unwrap();
        value["filesystem"]["writable"][0]
            .as_object_mut()
            .unwrap()
            .remove("reason");
        assert!(Profile::parse("strict", &value.to_string()).is_err());
        let mut value: serde_json::Value = serde_json::from_str(strict).unwrap();
        value["capabilities"] = serde_json::json!([{"name": "CAP_WIZARDRY", "reason": "x"}]);
        let err = Profile::parse("strict", &value.to_string()).unwrap_err();
        assert!(err.to_string().contains("CAP_WIZARDRY"), "{err}");
    }
}
