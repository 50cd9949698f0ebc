//! Cgroup directories reused among the commands of one template, one command at a time.
//!
//! Every command runs in cgroup directories of its own, one per hierarchy (the cgroup2 one
//! for placement and `cgroup.kill`, v1 `pids` and `memory` where the controllers live there).
//! Making them and removing them again costs each command several `mkdir` and `rmdir` calls,
//! the kernel's set-up of each controller's state and files (a memory cgroup's most of all),
//! and a memory cgroup that stays behind, dying, for as long as pages are charged to it: on a
//! busy daemon they pile up by the thousand, and every memory-cgroup walk slows down. So a
//! helper gives its directories back when its command is over, and the fork server names
//! them to the next worker of the same template, which writes its settings again and runs
//! there. What decides:
//!
//! - **Who may reuse**: only workers of a byte-equal template (profile, identity, workspace,
//!   limits: never another client's), one at a time (a name is lent to one worker and taken
//!   back only from its helper), and only templates whose commands run as a uid other than 0
//!   with no capability and no_new_privs under a root daemon, so that no command can write a
//!   file of its cgroup (they are root's): what a command could leave in the directory is
//!   what the kernel counts, checked below.
//! - **When it comes back**: once every process of the command is reaped, if the command
//!   left no process behind (its result's `killed_processes` is 0, however they died: by the
//!   sweep, or by init's exit emptying its pid namespace), the directories hold no process,
//!   the command hit no limit (the counters `limits_hit` reads are all zero,
//!   so the next command's report starts from zero as in a new directory), and at most
//!   [`MAX_CHARGED`] of memory is still charged to it (page cache of files it wrote, counted
//!   against the next command's limit until reclaimed). Anything else, and the helper removes
//!   the directories as before.
//! - **How long**: at most four free per template and sixteen in all; a name unused for 60 s,
//!   every name at a reload of the clients file, and all of them when the daemon goes, have
//!   their directories removed by the fork server.
//!
//! A one-shot `executor run` (there is no next command) and the exec'd helper do not pool:
//! the exec'd helper's directories are named after its pid, and a one-shot's command runs in
//! the run's own (`cgroup::Placement::one_command`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::cgroup;
use crate::plan::Template;

use crate::wire::lease::{CgroupName, MAX_CHARGED};

/// Free names kept per template, and over all templates.
const MAX_FREE_PER_TEMPLATE: usize = 4;
const MAX_FREE: usize = 16;
/// What every name the pool makes starts with (a helper's own directories are `w-<pid>`).
const PREFIX: &str = "c-";
/// What a name made for one worker only starts with ([`Cgroups::name_once`]).
const ONCE: &str = "n-";

/// Whether workers of `template` may run in directories a worker before them used.
pub fn eligible(template: &Template) -> bool {
    !template.cgroups.is_empty()
        && super::unprivileged_identity(&template.sandbox)
        && nix::unistd::geteuid().is_root()
}

struct Free {
    template: Vec<u8>,
    name: String,
    /// The directories, for removing them.
    dirs: Vec<PathBuf>,
    since: Instant,
}

/// The fork server's free cgroup names.
#[derive(Default)]
pub struct Cgroups {
    free: Vec<Free>,
    /// The last name made.
    made: u64,
}

impl Cgroups {
    /// The name for a worker of `template` about to be forked: a free one of the template
    /// if there is one, else a new one; `None` where the template is not eligible.
    pub fn lease(&mut self, template: &[u8], parsed: &Template) -> Option<CgroupName> {
        if !eligible(parsed) {
            return None;
        }
        if let Some(at) = self.free.iter().rposition(|f| f.template == template) {
            let free = self.free.remove(at);
            return Some(CgroupName {
                name: free.name,
                existing: true,
            });
        }
        self.made += 1;
        Some(CgroupName {
            name: format!("{PREFIX}{}", self.made),
            existing: false,
        })
    }

    /// A name for the directories of a worker whose template does not pool them: never lent
    /// again (the pool takes back only what it lent).
    pub fn name_once(&mut self) -> String {
        self.made += 1;
        format!("{ONCE}{}", self.made)
    }

    /// Take back `name`, given back clean for `template`; its directories are removed where
    /// the pool is full or the name is not one of ours.
    pub fn receive(&mut self, template: &[u8], name: &str) {
        let Ok(parsed) = serde_json::from_slice::<Template>(template) else {
            return;
        };
        let dirs: Vec<PathBuf> = parsed.cgroups.iter().map(|c| c.dir(name)).collect();
        self.take_back(template, name, dirs);
    }

    /// [`Self::receive`], with the directories known.
    pub fn take_back(&mut self, template: &[u8], name: &str, dirs: Vec<PathBuf>) {
        let ours = name
            .strip_prefix(PREFIX)
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n <= self.made);
        let known = self.free.iter().any(|f| f.name == name);
        let of_template = self.free.iter().filter(|f| f.template == template).count();
        if !ours || known || of_template >= MAX_FREE_PER_TEMPLATE {
            if ours && !known {
                remove(&dirs);
            }
            return;
        }
        if self.free.len() >= MAX_FREE {
            // The least recently returned goes.
            remove(&self.free.remove(0).dirs);
        }
        self.free.push(Free {
            template: template.to_vec(),
            name: name.to_string(),
            dirs,
            since: Instant::now(),
        });
    }

    /// Remove the directories of names unused for `idle_for`; how long until the next one is.
    pub fn expire(&mut self, idle_for: Duration) -> Option<Duration> {
        super::expire_idle(&mut self.free, idle_for, |f| f.since, |f| remove(&f.dirs))
    }

    /// Remove every free name's directories (a reload of the clients file, or the end).
    pub fn clear(&mut self) {
        for free in self.free.drain(..) {
            remove(&free.dirs);
        }
    }
}

/// Whether directories a command ran in may be lent again, as the kernel sees them: no
/// process in them and at most [`MAX_CHARGED`] of memory still charged (an init checks its
/// counters itself: `wire::verdict`).
pub fn clean(dirs: &[PathBuf]) -> bool {
    let charged = |dir: &std::path::Path| {
        ["memory.current", "memory.usage_in_bytes"]
            .iter()
            .map(|file| cgroup::get(dir, file))
            .find(|v| !v.is_empty())
            .map_or(Some(0), |v| v.parse::<u64>().ok())
    };
    dirs.iter().all(|dir| {
        dir.is_dir()
            && cgroup::procs(dir).is_empty()
            && charged(dir).is_some_and(|c| c <= MAX_CHARGED)
    })
}

/// Remove a free name's directories (empty: nothing runs in them).
fn remove(dirs: &[PathBuf]) {
    for dir in dirs {
        cgroup::remove(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::CgroupDir;

    fn template(uid: u32) -> (Vec<u8>, Template) {
        let parsed = Template {
            cgroups: vec![CgroupDir {
                parent: "/nonexistent-cgroup-parent".into(),
                home: "/nonexistent-cgroup-home".into(),
                settings: vec![],
                kill: true,
                is_parent: false,
            }],
            sandbox: crate::plan::SandboxPlan {
                user: Some((uid, uid)),
                capabilities: Some(vec![]),
                no_new_privs: true,
                ..Default::default()
            },
            layers: vec![],
            missing: vec![],
        };
        (serde_json::to_vec(&parsed).unwrap(), parsed)
    }

    #[test]
    fn a_name_is_lent_to_one_worker_and_again_only_for_its_template_once_given_back() {
        if !nix::unistd::geteuid().is_root() {
            return; // Not eligible without root: nothing is lent (the third test).
        }
        let mut pool = Cgroups::default();
        let (a, parsed_a) = template(65534);
        let (b, parsed_b) = template(65533);
        let first = pool.lease(&a, &parsed_a).unwrap();
        assert!(!first.existing);
        // Not given back yet: the next worker gets a name of its own.
        let second = pool.lease(&a, &parsed_a).unwrap();
        assert_ne!(second.name, first.name);
        pool.receive(&a, &first.name);
        // Another template never gets it; its own next worker does.
        let other = pool.lease(&b, &parsed_b).unwrap();
        assert!(!other.existing && other.name != first.name);
        let again = pool.lease(&a, &parsed_a).unwrap();
        assert_eq!(
            again,
            CgroupName {
                name: first.name.clone(),
                existing: true
            }
        );
        // Taken: lent once.
        assert!(!pool.lease(&a, &parsed_a).unwrap().existing);
    }

    #[test]
    fn a_name_not_made_here_or_given_back_twice_is_not_lent() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let mut pool = Cgroups::default();
        let (a, parsed_a) = template(65534);
        pool.receive(&a, "w-123");
        pool.receive(&a, "c-99");
        assert!(!pool.lease(&a, &parsed_a).unwrap().existing);
        let name = pool.lease(&a, &parsed_a).unwrap().name;
        pool.receive(&a, &name);
        pool.receive(&a, &name);
        assert!(pool.lease(&a, &parsed_a).unwrap().existing);
        assert!(!pool.lease(&a, &parsed_a).unwrap().existing);
    }

    #[test]
    fn root_commands_and_templates_without_cgroups_do_not_pool() {
        let (_, root) = template(0);
        assert!(!eligible(&root));
        let (_, mut none) = template(65534);
        none.cgroups.clear();
        assert!(!eligible(&none));
        let (_, mut capable) = template(65534);
        capable.sandbox.capabilities = None;
        assert!(!eligible(&capable));
    }
}
