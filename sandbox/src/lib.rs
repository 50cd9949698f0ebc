//! The executor's sandbox runtime: everything that turns a command into an isolated process
//! tree, and nothing of the daemon around it. No async runtime: the code here runs in
//! single-threaded processes (the fork server, the helpers it forks, the payload) or is
//! called by the daemon as plain blocking functions.
//!
//! `unsafe` lives in one module, [`sys`], each block with a `// SAFETY:` line.

mod apply;
pub mod cgroup;
pub mod files;
mod helper;
pub mod homes;
pub mod locale;
pub mod plan;
pub mod profile;
pub mod removal;
mod signals;
pub mod spawner;
pub mod sys;
mod wire;

pub use helper::{main as helper_main, HELPER_ARG};
