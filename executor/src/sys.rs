//! The executor's only `unsafe` code: thin wrappers over syscalls that nix does not expose
//! safely. Each block states why it is sound and checks errno at once.
#![allow(unsafe_code)]

use std::io;

/// Mark every descriptor above stderr close-on-exec, so nothing the daemon or the helper holds
/// can leak into a command (the class of bug behind runc's CVE-2024-21626).
pub fn cloexec_fds_above_stderr() -> io::Result<()> {
    // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors in the
    // range; it reads and writes no memory of ours and closes nothing that Rust code owns.
    let rc = unsafe {
        libc::close_range(
            3,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_int,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
