//! The executor's sandbox runtime: everything that turns a command into an isolated process
//! tree, and nothing of the daemon around it. No async runtime: the code here runs in
//! single-threaded processes (the fork server, the helpers it forks, the payload) or is
//! called by the daemon as plain blocking functions.
//!
//! `unsafe` lives in one module, [`sys`], each block with a `// SAFETY:` line.

pub mod apply;
pub mod cgroup;
pub mod files;
pub mod locale;
pub mod plan;
pub mod profile;
pub mod removal;
pub mod signals;
pub mod sys;
