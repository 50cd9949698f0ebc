//! Processes attached to the agent's stdin and stdout (protocol 1.1 processes): `agent exec
//! --stdin` through pipes, and `agent shell` on a pseudo-terminal the test types into, as a
//! person would, and without a terminal.

use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use executor_tests::{binary, eventually, Daemon, Target, PATIENCE};

use crate::copies::every_byte;
use crate::{agent_against, RUN_PATIENCE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_stdin_feeds_the_command_and_streams_back_its_output() {
    let daemon = Daemon::start();
    // Several chunks of every byte value: binary-safe both ways.
    let bytes = every_byte(1_100_000);
    let cat = agent_against(&daemon, "exec", &["--stdin", "--", "cat"], &bytes).await;
    assert_eq!(cat.code, 0, "{}", cat.stderr);
    assert!(
        cat.stdout == bytes,
        "cat gave {} bytes back",
        cat.stdout.len()
    );
    let sum: u64 = bytes.iter().map(|b| u64::from(*b)).sum();
    let python = agent_against(
        &daemon,
        "exec",
        &[
            "--stdin",
            "--",
            "python3 -c 'import sys; d = sys.stdin.buffer.read(); print(len(d), sum(d)); sys.exit(4)'",
        ],
        &bytes,
    )
    .await;
    assert_eq!(python.code, 4, "{}", python.stderr);
    assert_eq!(
        String::from_utf8_lossy(&python.stdout),
        format!("{} {sum}\n", bytes.len())
    );
    // A command that stops reading early does not hang the agent.
    let head = agent_against(&daemon, "exec", &["--stdin", "--", "head -c 5"], &bytes).await;
    assert_eq!((head.code, head.stdout.as_slice()), (0, &bytes[..5]));
    // Without --stdin, `agent exec` is unchanged: the command's stdin is empty.
    let plain = agent_against(&daemon, "exec", &["--", "cat; echo end"], b"not read").await;
    assert_eq!(plain.code, 0, "{}", plain.stderr);
    assert_eq!(plain.stdout, b"end\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_stdin_waits_for_a_program_that_reads_late_and_loses_nothing() {
    use sha2::Digest;
    let daemon = Daemon::start();
    // More than the executor queues for a program that is not reading (64 writes of at most
    // 512 KiB), in a pattern where a lost, repeated or reordered chunk shows.
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let bytes: Vec<u8> = (0..40_000_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let late = agent_against(
        &daemon,
        "exec",
        &["--stdin", "--", "sleep 3; sha256sum | cut -d' ' -f1"],
        &bytes,
    )
    .await;
    assert_eq!(late.code, 0, "{}", late.stderr);
    assert_eq!(
        String::from_utf8_lossy(&late.stdout).trim(),
        hex::encode(sha2::Sha256::digest(&bytes))
    );
}

/// What the test's side of a terminal has shown so far, read by a thread until the last
/// holder of the other side closes it (then a read fails with EIO).
fn screen_of(master: &std::fs::File) -> Arc<Mutex<Vec<u8>>> {
    let screen = Arc::new(Mutex::new(Vec::new()));
    let mut reader = master.try_clone().unwrap();
    let shown = screen.clone();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buffer) {
            if n == 0 {
                break;
            }
            shown.lock().unwrap().extend_from_slice(&buffer[..n]);
        }
    });
    screen
}

fn shows(screen: &Arc<Mutex<Vec<u8>>>, text: &str) -> bool {
    String::from_utf8_lossy(&screen.lock().unwrap()).contains(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_on_a_terminal_runs_bash_follows_resizes_and_exits_with_its_code() {
    let daemon = Daemon::start();
    let size = nix::pty::Winsize {
        ws_row: 30,
        ws_col: 100,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None).unwrap();
    let slave = std::fs::File::from(pty.slave);
    let slave_path = nix::unistd::ttyname(&slave).unwrap();
    let child = tokio::process::Command::new(binary("agent"))
        .arg("shell")
        .args(daemon.agent_args())
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let agent_pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    let mut keyboard = std::fs::File::from(pty.master);
    let screen = screen_of(&keyboard);
    // The remote terminal starts at our size.
    keyboard.write_all(b"stty size\n").unwrap();
    assert!(
        eventually(PATIENCE, || shows(&screen, "30 100")).await,
        "{}",
        String::from_utf8_lossy(&screen.lock().unwrap())
    );
    // A resize of ours (SIGWINCH) reaches it.
    let stty = std::process::Command::new("stty")
        .arg("-F")
        .arg(&slave_path)
        .args(["rows", "40", "cols", "120"])
        .status()
        .unwrap();
    assert!(stty.success());
    nix::sys::signal::kill(agent_pid, nix::sys::signal::Signal::SIGWINCH).unwrap();
    let mut resized = false;
    for _ in 0..20 {
        keyboard.write_all(b"stty size\n").unwrap();
        if eventually(Duration::from_millis(500), || shows(&screen, "40 120")).await {
            resized = true;
            break;
        }
    }
    assert!(
        resized,
        "{}",
        String::from_utf8_lossy(&screen.lock().unwrap())
    );
    keyboard.write_all(b"echo $((6*7))\nexit 3\n").unwrap();
    let status = tokio::time::timeout(RUN_PATIENCE, child.wait_with_output())
        .await
        .expect("agent shell did not end")
        .unwrap()
        .status;
    // The answer on a line of its own (after bash's bracketed-paste switch), not the echo.
    // The agent wrote it before it exited; our reader thread may take a moment to copy it
    // from the terminal (CI read the screen once, at once, and missed the last lines).
    let answered = eventually(PATIENCE, || shows(&screen, "42\r\n")).await;
    let shown = String::from_utf8_lossy(&screen.lock().unwrap()).into_owned();
    assert!(answered, "{status:?}: {shown}");
    assert_eq!(status.code(), Some(3), "{shown}");
    // The terminal is back in its own mode: canonical input and echo, as before raw mode.
    let mode = std::process::Command::new("stty")
        .arg("-F")
        .arg(&slave_path)
        .arg("-a")
        .output()
        .unwrap();
    let mode = String::from_utf8_lossy(&mode.stdout);
    assert!(
        mode.split_whitespace().any(|w| w == "icanon")
            && mode.split_whitespace().any(|w| w == "echo"),
        "{mode}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_without_a_terminal_runs_what_it_reads_and_exits_with_its_code() {
    let daemon = Daemon::start();
    let shell = agent_against(&daemon, "shell", &[], b"echo $((6*7))\nexit 3\n").await;
    assert_eq!(shell.code, 3, "{}", shell.stderr);
    assert!(
        String::from_utf8_lossy(&shell.stdout).contains("42"),
        "{}",
        String::from_utf8_lossy(&shell.stdout)
    );
}
