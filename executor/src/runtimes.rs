//! The tokio runtimes: the daemon's, and the one-thread one of a one-shot command.

use anyhow::Context;

/// The daemon's runtime (`serve`, and `check`'s probes): one worker thread per core.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// The runtime of `executor run`: one command needs one thread, and a multi-thread runtime's
/// workers cost a one-shot about 0.3 ms to start and stop. Nothing of the command's path
/// blocks it for long (stdout is written through tokio's, which writes on its blocking pool).
pub(crate) fn local_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
