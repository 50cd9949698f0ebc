//! The executor's sandbox runtime: everything that turns a command into an isolated process
//! tree, and nothing of the daemon around it. No async runtime: the code here runs in
//! single-threaded processes (the fork server, the helpers it forks, the payload) or is
//! called by the daemon as plain blocking functions, each bounded in time.
//!
//! **A plan in.** [`profile::Profile`] is a profile and its schema (the shipped ones are
//! compiled in); [`plan::plan_command`] turns a profile, a [`plan::CommandSpec`] and the
//! [`plan::PlanSettings`] into a [`plan::Plan`]: its template (what the profile and the client
//! decide, the same for many commands) and its command.
//!
//! **An isolated process tree out.** [`spawner::start`] starts the fork server (our own
//! binary re-run with [`spawner::FORK_SERVER_ARG`]); [`spawner::Spawner::start_helper`] has it
//! start a command's supervisor, wired to fresh pipes, and gives back its pid and the
//! daemon's ends ([`spawner::Started`]): the lifeline (the command line goes in first;
//! closing it kills the command's tree), the output, and the status pipe, which carries
//! `started` and then the verdict, a [`plan::HelperReport`]. Without a fork server the daemon
//! runs our binary with [`HELPER_ARG`] and the same three pipes as its stdio. [`cgroup`] is
//! the host's cgroups as the daemon prepares them and the backstops it uses on a helper that
//! died ([`cgroup::kill`], [`cgroup::remove`]).
//!
//! **Entry points.** The binary that uses this crate checks `argv[1]` before anything else
//! runs and calls [`helper_main`] for [`HELPER_ARG`] or [`spawner::main`] for
//! [`spawner::FORK_SERVER_ARG`].
//!
//! Besides: [`network`] (network policies: rules, special addresses, layers and the decision
//! on one connection, which the daemon's proxy applies), [`files`] (the file operations a
//! payload serves in place of its command, and their framing), [`homes`] (the home of one
//! `executor run`), [`removal`] (removing a tree without reaching outside it), [`locale`],
//! and [`sys`], the one module with `unsafe`, each block with a `// SAFETY:` line. Applying a
//! plan (mounts, landlock, seccomp, identity, rlimits), the supervisors and the payload, the
//! signals they send and the messages between
//! the fork server and the helpers are private.

mod apply;
pub mod cgroup;
pub mod files;
mod helper;
pub mod homes;
pub mod locale;
pub mod network;
pub mod plan;
pub mod profile;
pub mod removal;
mod signals;
pub mod spawner;
pub mod sys;
mod wire;

pub use helper::{main as helper_main, HELPER_ARG};
