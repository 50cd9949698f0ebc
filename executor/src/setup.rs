//! What `serve`, `run` and `check` share: loading and choosing profiles, the plan settings, the
//! engine, probing which profiles this host can run, and the files the sandbox protects for
//! the daemon (its binary, what the dynamic loader reads).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use protocol::Limits;

use crate::engine::Engine;
use sandbox::cgroup;
use sandbox::plan::PlanSettings;
use sandbox::profile::Profile;
use sandbox::spawner;

/// Where the executor binary lies, for profiles that hide it.
pub(crate) fn executor_bin() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("cannot locate the executor binary")
}

/// What the daemon executes as the sandbox helper: its own image, through /proc/self/exe in
/// the freshly forked child. Never the path the binary was started from: a command of a profile
/// with a writable host root could replace what lies there (or rename a parent directory), and
/// a rebuild would mix versions.
pub(crate) fn helper_exe() -> PathBuf {
    PathBuf::from("/proc/self/exe")
}

pub(crate) fn builtin_profiles() -> anyhow::Result<BTreeMap<String, Profile>> {
    Ok(Profile::all_builtin()?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect())
}

/// What serve, run and check share: profiles, cgroups, the engine, and which profiles this
/// host can run (found by running `true` under each).
pub(crate) struct Setup {
    pub(crate) engine: Engine,
    pub(crate) probe: BTreeMap<String, Result<crate::engine::Probed, String>>,
    pub(crate) cgroups: cgroup::CgroupRoot,
    /// Profiles loaded but not offered, with the reason (for the hello).
    pub(crate) not_offered: Vec<protocol::NotOffered>,
}

/// Which profiles the engine offers and which one it uses by default.
#[derive(Default)]
pub(crate) struct ProfileChoice<'a> {
    /// Directory of extra profiles.
    pub(crate) dir: Option<&'a std::path::Path>,
    /// Only these may be used (empty: all, or with `safe_default` those offered by default).
    pub(crate) allow: &'a [String],
    /// Without an allow list, offer only the profiles that confine commands and write nothing
    /// other profiles run (`serve`); `run` and `check` are the operator's own and see all.
    pub(crate) safe_default: bool,
    /// Default profile instead of the strongest available.
    pub(crate) default: Option<String>,
    /// Probe every profile (for the hello and `check`), or only what choosing a default needs.
    pub(crate) probe_all: bool,
    /// Load the default profile alone (`executor run --profile`, whose one command uses no
    /// other): what only other profiles need is not gathered.
    pub(crate) only_default: bool,
    /// The default built-in profile, parsed already (`executor run` reads it before anything
    /// else, to prepare what it needs ahead): not parsed again.
    pub(crate) parsed_default: Option<Profile>,
}

/// Where commands work and what the sandbox must keep from them.
pub(crate) struct Paths {
    /// Default working directory.
    pub(crate) workspace: PathBuf,
    /// `{home}` of commands whose client brings none (probes, `executor run`).
    pub(crate) home: PathBuf,
    pub(crate) state_dir: PathBuf,
    /// The daemon's files outside the state directory: covered, and never opened by landlock
    /// rules (see [`PlanSettings::daemon_files`]).
    pub(crate) daemon_files: Vec<PathBuf>,
    /// Network policy enforcement (`executor serve`); without it, commands under a policy
    /// are refused.
    pub(crate) enforcer: Option<crate::enforce::Enforcer>,
}

pub(crate) async fn setup(
    limits: Limits,
    interpreter: Vec<String>,
    paths: Paths,
    cgroups: cgroup::CgroupRoot,
    choice: ProfileChoice<'_>,
    spawner: Option<spawner::Spawner>,
) -> anyhow::Result<Setup> {
    let mut profiles = match (&choice.default, choice.only_default) {
        // The one profile used: parsing all the shipped ones costs a one-shot 0.1 ms.
        (Some(name), true) => match choice.parsed_default.filter(|p| &p.name == name) {
            Some(parsed) => Some(parsed),
            None => Profile::builtin(name).transpose()?,
        }
        .map(|p| (p.name.clone(), p))
        .into_iter()
        .collect(),
        _ => builtin_profiles()?,
    };
    if let Some(dir) = choice.dir {
        for profile in Profile::load_dir(dir)? {
            profiles.insert(profile.name.clone(), profile);
        }
    }
    let mut not_offered = Vec::new();
    if !choice.allow.is_empty() {
        if let Some(unknown) = choice.allow.iter().find(|n| !profiles.contains_key(*n)) {
            bail!("--allow-profile {unknown}: no such profile");
        }
        for name in profiles.keys().filter(|n| !choice.allow.contains(n)) {
            not_offered.push(protocol::NotOffered {
                name: name.clone(),
                reason: "not in the operator's --allow-profile list".into(),
            });
        }
        profiles.retain(|name, _| choice.allow.contains(name));
    } else if choice.safe_default {
        let all: Vec<Profile> = profiles.values().cloned().collect();
        profiles.retain(|name, profile| {
            let offered = profile.offered_by_default(&all);
            if !offered {
                let why = if profile.confines_filesystem() {
                    "it writes files that other profiles' commands run (the host's system directories)"
                } else {
                    "it does not confine the filesystem"
                };
                not_offered.push(protocol::NotOffered {
                    name: name.clone(),
                    reason: format!("offered only when the operator names it with --allow-profile: {why}"),
                });
            }
            offered
        });
    }
    let default_profile = choice.default;
    if let (true, Some(name)) = (choice.only_default, &default_profile) {
        if !profiles.contains_key(name) {
            bail!("no profile named {name:?}");
        }
        profiles.retain(|n, _| n == name);
    }
    // The loader's files matter only where a command sees the host's root (0.3 ms to find,
    // a one-shot's to spare otherwise).
    let loader_files = if profiles.values().any(Profile::shows_host_root) {
        loader_files()
    } else {
        Vec::new()
    };
    let plan_settings = PlanSettings {
        interpreter,
        workspace: paths.workspace,
        home: paths.home,
        state_dir: paths.state_dir,
        executor_bin: executor_bin()?,
        daemon_files: paths.daemon_files,
        daemon_uid: nix::unistd::geteuid().as_raw(),
        loader_files,
        cgroups: cgroups.clone(),
        landlock_abi: sandbox::sys::landlock_abi(),
        // Every profile's root is made of this host's directories.
        utf8_locale: sandbox::locale::root_has(Path::new("/"), sandbox::locale::UTF8),
    };
    let mut engine = Engine::new(limits, plan_settings, helper_exe(), profiles, String::new());
    engine.enforcer = paths.enforcer;
    if let Some(spawner) = spawner {
        engine.runner.use_spawner(spawner);
    }
    let probe = match (&default_profile, choice.probe_all) {
        (_, true) => engine.probe().await,
        (None, false) => engine.probe_for_default().await,
        (Some(_), false) => BTreeMap::new(),
    };
    engine.default_profile = match default_profile {
        Some(name) if !engine.profiles.contains_key(&name) => bail!("no profile named {name:?}"),
        Some(name) => name,
        None => Engine::choose_default(&probe),
    };
    for (name, outcome) in &probe {
        match outcome {
            Ok(probed) => {
                tracing::info!(profile = %name, layers = %probed.layers.join(","), missing = %probed.missing.join(","), "profile available")
            }
            Err(reason) => {
                tracing::warn!(profile = %name, %reason, "profile unavailable on this host")
            }
        }
    }
    Ok(Setup {
        engine,
        probe,
        cgroups,
        not_offered,
    })
}

/// Files the dynamic loader reads when this binary starts: the shared libraries mapped into
/// this process, the loader cache and the preload list, plus every directory that holds a
/// symlink on the way to them (the interpreter is reached through /lib64 -> usr/lib64, a
/// link in a directory). The preload list is created empty (when we may) so that it exists to
/// be made read-only: otherwise a command of a profile with a writable host root could create
/// it and run code in the next helper.
pub(crate) fn loader_files() -> Vec<PathBuf> {
    let preload = PathBuf::from("/etc/ld.so.preload");
    if !preload.exists() && nix::unistd::geteuid().is_root() {
        if let Err(err) = std::fs::File::create(&preload) {
            tracing::warn!(%err, "cannot create an empty /etc/ld.so.preload to protect it");
        }
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapped: Vec<PathBuf> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/') && path.contains(".so"))
        .map(PathBuf::from)
        .collect();
    let mut files = mapped.clone();
    files.extend(["/etc/ld.so.cache".into(), preload]);
    // The paths the loader opens, which may differ from the mapped (resolved) ones.
    let mut opened = vec![PathBuf::from("/lib64/ld-linux-x86-64.so.2")];
    for lib in &mapped {
        if let Some(name) = lib.file_name() {
            opened.push(Path::new("/lib/x86_64-linux-gnu").join(name));
        }
    }
    for path in &opened {
        link_dirs(path, &mut files, 0);
    }
    files.sort();
    files.dedup();
    files.retain(|f| f.exists() && f != Path::new("/"));
    files
}

/// Add to `dirs` every directory (but the root) holding a symlink on the way to `path`.
fn link_dirs(path: &Path, dirs: &mut Vec<PathBuf>, depth: u32) {
    if depth > 16 {
        return;
    }
    let mut current = PathBuf::from("/");
    let mut components = path.components().skip(1);
    while let Some(component) = components.next() {
        let next = current.join(component);
        let Ok(target) = std::fs::read_link(&next) else {
            current = next;
            continue;
        };
        dirs.push(current.clone());
        let resolved = if target.is_absolute() {
            target
        } else {
            current.join(target)
        };
        let rest: PathBuf = components.collect();
        link_dirs(&resolved.join(rest), dirs, depth + 1);
        return;
    }
}

/// Absolute and, where it exists, free of symlinks: sandbox rules and covers compare paths by
/// prefix, so a relative `--tls-key key.pem` or a symlinked certificate directory would slip
/// past them.
pub(crate) fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
}
