//! Processes at a terminal or a pipe: REPLs, every byte through cat, PTY size, Ctrl-C, and
//! the terminal ioctls a PTY process may not use.

use super::*;

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
            eventually(PATIENCE, || sleepers(&m).len() == 1).await,
            "[{profile}] the foreground sleep did not start"
        );
        signal(&mut client, &id, "INT", true).await;
        assert!(
            eventually(executor_tests::PATIENCE, || sleepers(&m).is_empty()).await,
            "[{profile}] Ctrl-C did not reach the foreground job"
        );
        // The shell is back at its prompt and still running.
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
