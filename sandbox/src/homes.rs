//! The home of one `executor run`: a directory of the run's own, made for the command's
//! identity while the run sets up and removed once the run is over (by its fork server, after
//! the run has exited: `spawner::one_shot`), and the sweep of homes whose run was killed with
//! its fork server.

use anyhow::{bail, Context};

use crate::cgroup;
use crate::removal::{self, RemoveError};
use crate::wire::Leftover;

/// The home directory of one `executor run`: private to the command's identity, removed once
/// the run is over (by its fork server, as one of its leftovers). Made in `homes_dir`, named
/// `executor-home-<pid>-ns<pid namespace>-<random>`, so that a later run can tell when its run
/// died with its fork server without removing it ([`remove_stale`]).
pub struct TempHome {
    pub dir: std::path::PathBuf,
    /// The `homes_dir` it is in; `None` where that could not be trusted.
    pub homes: Option<std::path::PathBuf>,
    /// Handed to another uid (the profile's user): processes of that uid outside the sandbox
    /// may have shaped it too.
    handed: bool,
}

/// What every home's name starts with.
const HOME_PREFIX: &str = "executor-home-";

/// The temporary directory, absolute (`$TMPDIR` may be relative): a home's path goes into the
/// command's plan and to the fork server, neither of which works where we do.
fn temp_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir();
    std::path::absolute(&dir).unwrap_or(dir)
}

/// `$TMPDIR/executor-homes-<euid>`, where this user's runs make their homes: made if missing,
/// mode 0711 (a command of another uid reaches its own home in it, lists nothing, creates
/// nothing). `None` where it is not a directory of ours that only we may write (someone made
/// it first): homes then go straight into `$TMPDIR`, and no killed run's is removed, since
/// only in a directory of ours is every entry one a run made.
fn homes_dir() -> Option<std::path::PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let euid = nix::unistd::geteuid().as_raw();
    let dir = temp_dir().join(format!("executor-homes-{euid}"));
    match std::fs::DirBuilder::new().mode(0o711).create(&dir) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(_) => return None,
    }
    // Checked and given its mode through one descriptor that follows no symlink (the umask
    // may have narrowed the mode at creation).
    let fd = nix::fcntl::open(
        &dir,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    );
    let ours = fd.ok().and_then(|fd| {
        let meta = std::fs::File::from(fd);
        let st = meta.metadata().ok()?;
        (st.uid() == euid && st.mode() & 0o022 == 0)
            .then(|| nix::sys::stat::fchmod(&meta, nix::sys::stat::Mode::from_bits_truncate(0o711)))
            .and_then(Result::ok)
    });
    if ours.is_none() {
        eprintln!(
            "executor: {} is not this user's own directory: the home goes into {} and homes of killed runs are not removed",
            dir.display(),
            temp_dir().display()
        );
        return None;
    }
    Some(dir)
}

impl TempHome {
    pub fn create(owner: Owner) -> anyhow::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let ours = format!(
            "{HOME_PREFIX}{}-ns{}",
            std::process::id(),
            cgroup::pid_namespace()
        );
        let homes = homes_dir();
        let parent = homes.clone().unwrap_or_else(temp_dir);
        for _ in 0..16 {
            let mut bytes = [0u8; 8];
            getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no random bytes: {e}"))?;
            let dir = parent.join(format!("{ours}-{}", hex::encode(bytes)));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(err).with_context(|| format!("cannot create {}", dir.display()))
                }
            }
            let home = Self {
                dir,
                homes: homes.clone(),
                handed: owner.is_some(),
            };
            // `{home}/tmp`: TMPDIR in profiles that use it.
            let tmp = home.dir.join("tmp");
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?;
            if let Some((uid, gid)) = owner {
                for dir in [&home.dir, &tmp] {
                    nix::unistd::chown(
                        dir,
                        Some(nix::unistd::Uid::from_raw(uid)),
                        Some(nix::unistd::Gid::from_raw(gid)),
                    )
                    .with_context(|| format!("cannot hand {} to uid {uid}", dir.display()))?;
                }
            }
            return Ok(home);
        }
        bail!("cannot find a free name for a home directory in the temporary directory")
    }
}

/// Remove the homes in `dir` (our `homes_dir`) of runs of our pid namespace that are gone
/// (a run killed by SIGKILL with its fork server cannot remove its own). Those of other pid
/// namespaces are not ours to judge (their pids mean nothing here), nor names of another
/// shape. A dead command may have shaped its home, so nothing beneath one is unmounted: a home
/// with a mount beneath it stays.
pub fn remove_stale(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let ns = format!("-ns{}-", cgroup::pid_namespace());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| home_run(n, &ns)) else {
            continue;
        };
        // Asked of the kernel, in our pid namespace (a /proc mounted for another namespace
        // would answer for its own pids).
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
        if nix::sys::signal::kill(pid, None) == Err(nix::errno::Errno::ESRCH) {
            let _ = remove(&entry.path(), false);
        }
    }
}

/// The pid of the run a home named `name` is of, when it is of our pid namespace (`ns`:
/// `-ns<inode>-`).
fn home_run(name: &str, ns: &str) -> Option<u32> {
    let (pid, random) = name.strip_prefix(HOME_PREFIX)?.split_once(ns)?;
    let random_ok = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    random_ok.then(|| pid.parse().ok()).flatten()
}

impl TempHome {
    /// The home as one of the run's leftovers, for its fork server (or the run) to remove once
    /// the run is over.
    pub fn leftover(&self) -> Leftover {
        Leftover::Home {
            dir: self.dir.clone(),
            unmount: !self.handed,
        }
    }

    /// No longer removed when dropped: it is among the run's leftovers ([`Self::leftover`]).
    pub fn leave(mut self) {
        self.dir = std::path::PathBuf::new();
    }
}

/// Remove a run's home, `unmount`ing what is mounted beneath it only where no other uid had
/// it: a home handed to another uid is removed as a killed run's is, unmounting nothing. Its
/// command cannot mount, but a process of that uid outside the sandbox might (FUSE), and turn
/// a path into a symlink before the unmount (`removal`).
pub fn remove(dir: &std::path::Path, unmount: bool) -> Result<(), RemoveError> {
    if unmount {
        removal::remove(dir)
    } else {
        removal::remove_unmounting_nothing(dir)
    }
}

impl Drop for TempHome {
    fn drop(&mut self) {
        // Left with the run's leftovers ([`TempHome::leave`]).
        if self.dir.as_os_str().is_empty() {
            return;
        }
        if let Err(err) = remove(&self.dir, !self.handed) {
            eprintln!("executor: cannot remove {}: {err}", self.dir.display());
        }
    }
}

/// Who a home is made for: a uid and gid to hand it to, or ourselves.
pub type Owner = Option<(u32, u32)>;

/// The home being made on a thread of its own while the run sets up, for the identity
/// `owner`. Dropped untaken (the run failed first), it waits for the thread, so that the
/// home is removed, not left half made by a process that exits meanwhile.
pub struct HomeAhead {
    owner: Owner,
    thread: Option<std::thread::JoinHandle<anyhow::Result<TempHome>>>,
}

impl HomeAhead {
    pub fn start(owner: Owner) -> Self {
        let thread = std::thread::Builder::new()
            .name("home".into())
            .spawn(move || TempHome::create(owner))
            .ok();
        Self { owner, thread }
    }

    /// For whom it was made, and what came of it (`None`: the thread did not start or panicked).
    pub fn take(mut self) -> Option<(Owner, Option<anyhow::Result<TempHome>>)> {
        let made = self.thread.take()?.join().ok();
        Some((self.owner, made))
    }
}

impl Drop for HomeAhead {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whose `{home}` a command of `profile` gets: `Some` where the profile gives its commands a
/// home (strict's HOME is its private /tmp), with the owner it needs (the profile's user,
/// when we are root and can hand it over).
pub fn owner(profile: &crate::profile::Profile) -> Option<Owner> {
    profile.uses_home().then(|| {
        profile
            .user
            .as_ref()
            .filter(|_| nix::unistd::geteuid().is_root())
            .map(|u| (u.uid, u.gid))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_names_its_run_only_in_our_pid_namespace_and_in_the_shape_we_make() {
        let ns = "-ns4026531836-";
        let random = "0123456789abcdef";
        assert_eq!(
            home_run(&format!("executor-home-4242-ns4026531836-{random}"), ns),
            Some(4242)
        );
        // Another pid namespace's, an older version's, someone else's files: not ours.
        assert_eq!(
            home_run(&format!("executor-home-4242-ns4026532000-{random}"), ns),
            None
        );
        assert_eq!(home_run(&format!("executor-home-{random}"), ns), None);
        assert_eq!(home_run("executor-home-4242-ns4026531836-x", ns), None);
        assert_eq!(
            home_run(&format!("executor-home-me-ns4026531836-{random}"), ns),
            None
        );
        assert_eq!(home_run("executor-4242-ns4026531836", ns), None);
    }
}
