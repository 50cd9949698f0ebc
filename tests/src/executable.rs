//! Executables a test writes on the host and then runs (a private copy of the executor, a
//! setuid copy of touch, an ELF of its own).
//!
//! A file open for writing cannot be executed (execve fails with ETXTBSY, "Text file busy").
//! A descriptor the test process opens to write one is inherited by every child that another
//! test thread forks meanwhile, and stays open there until that child's execve closes it
//! (O_CLOEXEC): the copy could then not be run, and the escape suite failed starting a daemon
//! from its copy. [`write_executable`] writes in a child process of its own (`cat`), so the only
//! descriptor open for writing is in a process that no test thread forks; when it returns the
//! writer has exited and the file can be executed.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// Write `contents` to `to` (created or truncated) with permission bits `mode`, ready to be
/// executed: no descriptor open for writing remains anywhere when this returns.
pub fn write_executable(to: impl AsRef<Path>, contents: impl AsRef<[u8]>, mode: u32) {
    let (to, contents) = (to.as_ref(), contents.as_ref());
    let mut writer = Command::new("sh")
        .args(["-c", "exec cat > \"$1\"", "sh"])
        .arg(to)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start sh to write {}: {e}", to.display()));
    // The pipe's write end is ours: a fork holding it only delays the writer's end of file.
    let mut pipe = writer.stdin.take().expect("piped stdin");
    pipe.write_all(contents)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", to.display()));
    drop(pipe);
    let status = writer.wait().unwrap();
    assert!(
        status.success(),
        "writing {} failed: {status}",
        to.display()
    );
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).unwrap();
    let written = std::fs::metadata(to).unwrap().len();
    assert_eq!(
        written,
        contents.len() as u64,
        "{} written short",
        to.display()
    );
}

/// Copy the executable `from` to `to`, with its permission bits, through [`write_executable`].
pub fn copy_executable(from: impl AsRef<Path>, to: impl AsRef<Path>) {
    let from = from.as_ref();
    let contents =
        std::fs::read(from).unwrap_or_else(|e| panic!("cannot read {}: {e}", from.display()));
    let mode = std::fs::metadata(from).unwrap().permissions().mode() & 0o7777;
    write_executable(to, &contents, mode);
}
