//! Terminal injection: the daemon runs on a pseudo-terminal (as when started by hand), and a
//! command tries TIOCSTI on every terminal it can name: its stdio, /dev/tty, the daemon's pty
//! by path, and the daemon's stdin through /proc. The host reads the pty's input queue:
//! anything injected shows up there. Control: `trusted` runs as root with CAP_SYS_ADMIN, which
//! TIOCSTI honours on any terminal, so the same probe does inject there.

use std::io::Read;
use std::os::fd::AsRawFd;

use executor_tests::{is_root, marker, require, DaemonOptions};
use nix::fcntl::{fcntl, FcntlArg, OFlag};

use crate::common::*;

fn probe(m: &str, pts: &str, daemon_pid: u32) -> String {
    python(&format!(
        r#"
import fcntl, termios
def inject(fd, tag):
    try:
        for ch in b"INJECTED-{m}\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))
        print(f"{{tag}}=0")
    except OSError as e:
        print(f"{{tag}}={{e.errno}}")
for fd in (0, 1, 2):
    inject(fd, f"fd{{fd}}")
for path, tag in (("/dev/tty", "devtty"), ("{pts}", "pts"), ("/proc/{daemon_pid}/fd/0", "daemonfd")):
    fd = None
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            fd = os.open(path, flags | os.O_NOCTTY)
            break
        except OSError as e:
            print(f"{{tag}}_open={{e.errno}}")
    if fd is not None:
        inject(fd, tag)
"#
    ))
}

#[tokio::test]
async fn tiocsti_cannot_inject_into_the_daemons_terminal() {
    if !require(
        "root (the trusted control injects with CAP_SYS_ADMIN)",
        is_root(),
    ) {
        return;
    }
    let pty = nix::pty::openpty(None, None).unwrap();
    let pts = std::fs::read_link(format!("/proc/self/fd/{}", pty.slave.as_raw_fd()))
        .unwrap()
        .display()
        .to_string();
    let Some(daemon) = daemon_with(DaemonOptions {
        terminal: Some(pty.slave.try_clone().unwrap()),
        ..Default::default()
    }) else {
        return;
    };
    // Control: the daemon really has the terminal as its controlling terminal.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", daemon.pid())).unwrap();
    let tty_nr: i64 = stat[stat.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .nth(4)
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(tty_nr, 0, "control: the daemon has a controlling terminal");

    // Read the pty's input queue from the slave side without blocking.
    let flags = OFlag::from_bits_truncate(fcntl(&pty.slave, FcntlArg::F_GETFL).unwrap());
    fcntl(&pty.slave, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).unwrap();
    let mut reader = std::fs::File::from(pty.slave);
    let mut drain = move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&all).into_owned()
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let out = row
            .output(client, "tiocsti", &probe(&m, &pts, daemon.pid()))
            .await;
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let injected = drain();
        match row.expect {
            Denied => assert!(
                !injected.contains(&format!("INJECTED-{m}")),
                "{row} injected into the daemon's terminal: {out}"
            ),
            Allowed => assert!(
                injected.contains(&format!("INJECTED-{m}")),
                "{row} control: {out} / queue {injected:?}"
            ),
        }
        // No command ever has a terminal of its own on stdio.
        for fd in ["fd0", "fd1", "fd2"] {
            assert_ne!(field(&out, fd), Some("0"), "{row} {fd}: {out}");
        }
    })
    .await;
    drop(pty.master);
    assert_daemon_intact(&daemon).await;
}
