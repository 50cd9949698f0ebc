//! Processes at a terminal or a pipe: REPLs, every byte through cat, PTY size, Ctrl-C, and
//! the terminal ioctls a PTY process may not use.

use super::*;
use executor_tests::host_waits::{sleepers_gone, sleepers_up};

#[tokio::test]
async fn a_python_repl_is_driven_over_three_turns_and_keeps_its_state() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    assert!(
        client.hello.capabilities.iter().any(|c| c == "processes"),
        "{:?}",
        client.hello.capabilities
    );
    spawn(&mut client, spawn_req("py", "python3 -u -i -q")).await;
    let mut offset = 0;
    // Prompts go to stderr, which is merged into the one stream.
    read_until(&mut client, "py", &mut offset, ">>> ").await;

    write_text(&mut client, "py", "x = 6 * 7\nx\n").await;
    read_until(&mut client, "py", &mut offset, "42\n").await;

    write_text(&mut client, "py", "words = ['a', 'b'] * x\nlen(words)\n").await;
    read_until(&mut client, "py", &mut offset, "84\n").await;

    // The third turn leaves its answer on the host, in the workspace.
    write_text(
        &mut client,
        "py",
        "open('repl-answer', 'w').write(str(x + len(words)))\n",
    )
    .await;
    read_until(&mut client, "py", &mut offset, "3\n").await;
    assert_eq!(
        std::fs::read_to_string(daemon.workspace.join("repl-answer")).unwrap(),
        "126"
    );
    let info = list(&mut client).await;
    assert_eq!(info.len(), 1, "{info:?}");
    assert!(
        info[0].running && info[0].output_bytes == offset,
        "{info:?}"
    );

    // End of input ends the REPL.
    client
        .send(&ClientMessage::Write(WriteRequest {
            id: "py".into(),
            data: None,
            text: None,
            eof: true,
        }))
        .await;
    let exited = wait(&mut client, "py", 10.0).await;
    assert!(!exited.running);
    assert_eq!(exited.returncode, 0, "{exited:?}");
}

#[tokio::test]
async fn cat_echoes_every_byte_value_and_ends_with_eof_and_returncode_0() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("cat", "cat")).await;
    let bytes: Vec<u8> = (0..=255u8).collect();
    client.write_chunk("cat", &bytes, false).await;
    client.write_chunk("cat", b"end\n", true).await;
    let out = read_to_eof(&mut client, "cat", 0).await;
    let mut expected = bytes.clone();
    expected.extend_from_slice(b"end\n");
    assert_eq!(out, expected);
    let exited = wait(&mut client, "cat", 10.0).await;
    assert!(!exited.running, "{exited:?}");
    assert_eq!(exited.returncode, 0, "{exited:?}");
    assert_eq!(
        exited.extra.as_ref().map(|e| e.ended),
        Some(protocol::Ending::Exited)
    );
    let info = list(&mut client).await;
    assert_eq!(info.len(), 1, "{info:?}");
    assert!(!info[0].running, "{info:?}");
    assert_eq!(info[0].returncode, Some(0));
    assert_eq!(info[0].output_bytes, expected.len() as u64);
    // A read at the end says so at once.
    let end = read(&mut client, "cat", expected.len() as u64, 0.0).await;
    assert!(end.eof && end.data.is_empty(), "{end:?}");
}

#[tokio::test]
async fn a_pty_has_the_asked_size_and_resize_changes_it() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut r = spawn_req(
        "tty",
        "stty size; trap 'stty size' WINCH; echo ready; while :; do sleep 0.05; done",
    );
    r.pty = Some(PtySize { rows: 24, cols: 80 });
    spawn(&mut client, r).await;
    let mut offset = 0;
    let first = read_until(&mut client, "tty", &mut offset, "ready").await;
    assert!(first.contains("24 80\r\n"), "{first:?}");
    client
        .send(&ClientMessage::Resize(ResizeRequest {
            id: "tty".into(),
            rows: 40,
            cols: 132,
        }))
        .await;
    assert!(matches!(
        client.reply_for("tty").await,
        ServerMessage::Done(_)
    ));
    read_until(&mut client, "tty", &mut offset, "40 132\r\n").await;
    // A resize of a process without a terminal is refused.
    spawn(&mut client, spawn_req("plain", "sleep 30")).await;
    client
        .send(&ClientMessage::Resize(ResizeRequest {
            id: "plain".into(),
            rows: 10,
            cols: 10,
        }))
        .await;
    match client.reply_for("plain").await {
        ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn ctrl_c_reaches_the_foreground_job_and_the_shell_lives_on() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    // strict (pid namespace, own init) and landlock (no namespaces) set the terminal up
    // differently; job control must work under both.
    for profile in ["strict", "landlock"] {
        let m = marker();
        let id = format!("sh-{profile}");
        let mut r = spawn_req(&id, "exec bash --norc --noprofile -i");
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        r.profile = Some(profile.to_string());
        spawn(&mut client, r).await;
        let mut offset = 0;
        write_text(&mut client, &id, "echo up-$((40+2))\n").await;
        read_until(&mut client, &id, &mut offset, "up-42").await;
        write_text(&mut client, &id, &format!("{}\n", marked_sleep(&m))).await;
        assert!(
            sleepers_up(&m, 1).await,
            "[{profile}] the foreground sleep did not start"
        );
        signal(&mut client, &id, "INT", true).await;
        assert!(
            sleepers_gone(&m).await,
            "[{profile}] Ctrl-C did not reach the foreground job"
        );
        // The shell is back at its prompt and still running.
        assert!(wait(&mut client, &id, 0.0).await.running, "[{profile}]");
        // Denial: a signal the terminal cannot send is refused, naming those it can, and
        // reaches nobody.
        client
            .send(&ClientMessage::Signal(SignalRequest {
                id: id.clone(),
                signal: "TERM".into(),
                foreground: true,
            }))
            .await;
        match client.reply_for(&id).await {
            ServerMessage::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "[{profile}] {e:?}");
                assert!(e.message.contains("INT or QUIT"), "[{profile}] {e:?}");
            }
            other => panic!("[{profile}] {other:?}"),
        }
        assert!(wait(&mut client, &id, 0.0).await.running, "[{profile}]");
        write_text(&mut client, &id, "echo back-$((1+2))\n").await;
        read_until(&mut client, &id, &mut offset, "back-3").await;
        write_text(&mut client, &id, "exit 3\n").await;
        let exited = wait(&mut client, &id, 10.0).await;
        assert!(!exited.running);
        assert_eq!(exited.returncode, 3, "[{profile}] {exited:?}");
    }
}

/// A PTY process holds a real terminal of the host's devpts: the ioctls that reach beyond its
/// own terminal (typing into its input, changing its line discipline, which loads kernel
/// modules, taking the console) are refused by seccomp; asking and setting its size works.
#[tokio::test]
async fn a_pty_process_cannot_use_the_terminal_ioctls_that_reach_beyond_it() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let probe = r#"python3 -c '
import fcntl, struct, termios
def attempt(name, request, arg):
    try:
        fcntl.ioctl(0, request, arg)
        print(name, "allowed")
    except OSError as e:
        print(name, "refused", e.errno)
attempt("TIOCGWINSZ", termios.TIOCGWINSZ, bytes(8))
attempt("TIOCSWINSZ", termios.TIOCSWINSZ, struct.pack("HHHH", 30, 90, 0, 0))
attempt("TIOCSTI", termios.TIOCSTI, b"x")
attempt("TIOCSETD", 0x5423, struct.pack("i", 0))
attempt("TIOCCONS", termios.TIOCCONS, b"")
'"#;
    for profile in ["strict", "landlock"] {
        let id = format!("ioctl-{profile}");
        let mut r = spawn_req(&id, probe);
        r.profile = Some(profile.to_string());
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        spawn(&mut client, r).await;
        let out = String::from_utf8_lossy(&read_to_eof(&mut client, &id, 0).await).into_owned();
        // Control: the terminal's own size is the command's to read and set.
        assert!(out.contains("TIOCGWINSZ allowed"), "{profile}: {out}");
        assert!(out.contains("TIOCSWINSZ allowed"), "{profile}: {out}");
        // EPERM (1) is seccomp's answer, not the terminal's.
        for name in ["TIOCSTI", "TIOCSETD", "TIOCCONS"] {
            assert!(
                out.contains(&format!("{name} refused 1")),
                "{profile}: {out}"
            );
        }
    }
}

/// A PTY process has a real terminal under strict (made in a devpts instance of the
/// sandbox's own, where `script` makes its terminals too, and `/dev/tty` in its minimal /dev)
/// and under landlock (rules for `/dev/tty` and `/dev/ptmx`): `/dev/tty` opens, a
/// program that prompts there (git asking for a password) gets what the client types, and
/// `script` makes a terminal of its own. Denial beside it: TIOCSTI through `/dev/tty` is
/// refused as on stdin; a process without a terminal cannot open `/dev/tty`.
#[tokio::test]
async fn a_pty_process_opens_dev_tty_and_git_and_script_use_it() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let command = r#"exec 3</dev/tty && echo opened-dev-tty
script -qc 'echo from-script; tty' /dev/null
python3 -c '
import fcntl, termios
fd = open("/dev/tty", "rb+", buffering=0)
try:
    fcntl.ioctl(fd, termios.TIOCSTI, b"x")
    print("TIOCSTI allowed")
except OSError as e:
    print("TIOCSTI refused", e.errno)
'
printf 'protocol=https\nhost=example.invalid\n\n' | GIT_ASKPASS= SSH_ASKPASS= git credential fill
echo done-$((6*7))"#;
    for profile in ["strict", "landlock"] {
        let id = format!("tty-{profile}");
        let mut r = spawn_req(&id, command);
        r.profile = Some(profile.to_string());
        // The profiles turn git's prompts off for commands without a terminal; a client
        // with one turns them back on.
        r.env.insert("GIT_TERMINAL_PROMPT".into(), "1".into());
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        spawn(&mut client, r).await;
        let mut offset = 0;
        read_until(&mut client, &id, &mut offset, "Username for").await;
        write_text(&mut client, &id, "alice\r").await;
        read_until(&mut client, &id, &mut offset, "Password for").await;
        write_text(&mut client, &id, "s3cret\r").await;
        let rest = read_to_eof(&mut client, &id, offset).await;
        let out = String::from_utf8_lossy(&rest).into_owned();
        let exited = wait(&mut client, &id, 10.0).await;
        assert_eq!(exited.returncode, 0, "[{profile}] {exited:?}");
        assert!(out.contains("username=alice"), "[{profile}] {out}");
        assert!(out.contains("password=s3cret"), "[{profile}] {out}");
        // The password was read with echo off: it is not in the output before git's answer.
        let before = out.split("password=").next().unwrap_or_default();
        assert!(!before.contains("s3cret"), "[{profile}] echoed: {out}");
        assert!(out.contains("done-42"), "[{profile}] {out}");
        let all = String::from_utf8_lossy(&read_to_eof(&mut client, &id, 0).await).into_owned();
        assert!(all.contains("opened-dev-tty"), "[{profile}] {all}");
        assert!(
            all.contains("from-script\r\n/dev/pts/"),
            "[{profile}] {all}"
        );
        assert!(all.contains("TIOCSTI refused 1"), "[{profile}] {all}");

        // Control: without a terminal there is no controlling one to open.
        let plain = format!("plain-{profile}");
        let mut r = spawn_req(&plain, "exec 3</dev/tty && echo opened || echo no-tty");
        r.profile = Some(profile.to_string());
        spawn(&mut client, r).await;
        let out = String::from_utf8_lossy(&read_to_eof(&mut client, &plain, 0).await).into_owned();
        assert!(
            out.contains("No such device or address"),
            "[{profile}] {out}"
        );
        assert!(out.contains("no-tty"), "[{profile}] {out}");
    }
}

/// `tty` names the process's terminal, a `/dev/pts/N` that is its stdin, under every profile
/// (under strict, before its terminal was made in the sandbox: "not a tty").
#[tokio::test]
async fn tty_names_the_terminal_of_a_pty_process() {
    // Every profile: task-container has a mount namespace (its terminal is made in its own
    // devpts, as strict's), trusted none (the daemon's terminal, as landlock's).
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    let mut client = daemon.connect().await;
    for profile in ["strict", "landlock", "task-container", "trusted"] {
        let id = format!("name-{profile}");
        let mut r = spawn_req(
            &id,
            "tty; [ \"$(tty)\" -ef /dev/stdin ] && echo same-terminal",
        );
        r.profile = Some(profile.to_string());
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        spawn(&mut client, r).await;
        let out = String::from_utf8_lossy(&read_to_eof(&mut client, &id, 0).await).into_owned();
        assert!(out.starts_with("/dev/pts/"), "[{profile}] {out}");
        assert!(out.contains("same-terminal"), "[{profile}] {out}");
    }
}

/// Denial beside the terminal: another process's terminal stays out of reach. Under strict a
/// PTY process's /dev/pts holds its own terminal and nothing else (a second process of the
/// same uid running at the same time has one of its own, as the control shows); under
/// landlock the host's /dev/pts is there, but the daemon's other terminals (root's, mode
/// 0620) do not open.
#[tokio::test]
async fn a_pty_process_cannot_reach_another_process_terminal() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for profile in ["strict", "landlock"] {
        let first = format!("first-{profile}");
        let mut r = spawn_req(&first, "tty; echo first-up; exec sleep 60");
        r.profile = Some(profile.to_string());
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        spawn(&mut client, r).await;
        let mut offset = 0;
        let out = read_until(&mut client, &first, &mut offset, "first-up").await;
        let name = out.lines().next().unwrap_or_default().trim().to_string();
        assert!(name.starts_with("/dev/pts/"), "[{profile}] {out}");

        let second = format!("second-{profile}");
        let probe = format!(
            "tty; echo list: $(ls /dev/pts); \
             if [ \"$(tty)\" != {name} ]; then \
               (exec 3<>{name}) 2>/dev/null && echo opened-first || echo first-refused; \
             else echo same-name; fi"
        );
        let mut r = spawn_req(&second, &probe);
        r.profile = Some(profile.to_string());
        r.pty = Some(PtySize { rows: 24, cols: 80 });
        spawn(&mut client, r).await;
        let out = String::from_utf8_lossy(&read_to_eof(&mut client, &second, 0).await).into_owned();
        // Control: the second process has a terminal of its own.
        assert!(out.starts_with("/dev/pts/"), "[{profile}] {out}");
        assert!(!out.contains("opened-first"), "[{profile}] {out}");
        if profile == "strict" {
            // Its own devpts: one terminal (its own, numbered like the first's in the
            // first's instance) and the multiplexer.
            assert!(out.contains("list: 0 ptmx\r\n"), "[{profile}] {out}");
            assert!(out.contains("same-name"), "[{profile}] {out}");
        } else {
            assert!(out.contains("first-refused"), "[{profile}] {out}");
        }
        signal(&mut client, &first, "KILL", false).await;
    }
}
