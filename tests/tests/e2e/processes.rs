//! Protocol 1.1 processes: programs kept running across requests (`spawn`, `write`, `read`,
//! `signal`, `resize`, `wait`, `list_processes`), checked by what they answer and, where there
//! is one, by their effect on the host (files, the process table).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use executor_tests::{
    b64, eventually, marked_sleep, marker, processes_matching, req, sleepers, unb64, Client,
    Daemon, PATIENCE,
};
use protocol::{
    ClientMessage, ErrorCode, ErrorMessage, Exited, ListProcessesRequest, ProcessOutput, PtySize,
    ReadRequest, ResizeRequest, ResumeRequest, ServerMessage, SignalRequest, SpawnRequest,
    WaitRequest, WriteRequest,
};

fn spawn_req(id: &str, command: &str) -> SpawnRequest {
    SpawnRequest {
        id: id.to_string(),
        command: command.to_string(),
        cwd: None,
        env: BTreeMap::new(),
        timeout: None,
        profile: None,
        pty: None,
    }
}

/// Spawn and wait for `spawned`; a refusal fails the test.
async fn spawn(client: &mut Client, r: SpawnRequest) {
    let id = r.id.clone();
    let pty = r.pty.is_some();
    client.send(&ClientMessage::Spawn(r)).await;
    match client.reply_for(&id).await {
        ServerMessage::Spawned(s) => assert_eq!(s.pty, pty, "{id}: {s:?}"),
        other => panic!("{id}: expected spawned, got {other:?}"),
    }
}

/// Spawn expecting a refusal.
async fn spawn_refused(client: &mut Client, r: SpawnRequest) -> ErrorMessage {
    let id = r.id.clone();
    client.send(&ClientMessage::Spawn(r)).await;
    match client.reply_for(&id).await {
        ServerMessage::Error(e) => e,
        other => panic!("{id}: expected an error, got {other:?}"),
    }
}

async fn write_text(client: &mut Client, id: &str, text: &str) {
    client
        .send(&ClientMessage::Write(WriteRequest {
            id: id.to_string(),
            data: None,
            text: Some(text.to_string()),
            eof: false,
        }))
        .await;
}

async fn read(client: &mut Client, id: &str, offset: u64, wait: f64) -> ProcessOutput {
    client
        .send(&ClientMessage::Read(ReadRequest {
            id: id.to_string(),
            offset,
            max_bytes: None,
            wait: Some(wait),
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::ProcessOutput(out) => out,
        other => panic!("{id}: expected process_output, got {other:?}"),
    }
}

/// Read from `*offset` on until the output read in this call contains `needle` (or the
/// output ends, or [`PATIENCE`] passes: both fail the test). Nothing may be dropped.
async fn read_until(client: &mut Client, id: &str, offset: &mut u64, needle: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    loop {
        let out = read(client, id, *offset, 1.0).await;
        assert_eq!(out.dropped, 0, "{id}: output lost");
        assert_eq!(out.offset, *offset, "{id}: read from elsewhere");
        let data = unb64(&out.data);
        assert_eq!(out.next_offset, out.offset + data.len() as u64);
        seen.extend_from_slice(&data);
        *offset = out.next_offset;
        let text = String::from_utf8_lossy(&seen).into_owned();
        if text.contains(needle) {
            return text;
        }
        assert!(!out.eof, "{id}: output ended without {needle:?}: {text:?}");
        assert!(
            Instant::now() < deadline,
            "{id}: no {needle:?} in time: {text:?}"
        );
    }
}

/// Everything from `offset` to the end of the output.
async fn read_to_eof(client: &mut Client, id: &str, mut offset: u64) -> Vec<u8> {
    let deadline = Instant::now() + PATIENCE;
    let mut all = Vec::new();
    loop {
        let out = read(client, id, offset, 1.0).await;
        assert_eq!(out.dropped, 0, "{id}: output lost");
        all.extend_from_slice(&unb64(&out.data));
        offset = out.next_offset;
        if out.eof {
            return all;
        }
        assert!(Instant::now() < deadline, "{id}: output did not end");
    }
}

async fn wait(client: &mut Client, id: &str, timeout: f64) -> Exited {
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: id.to_string(),
            timeout: Some(timeout),
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Exited(e) => e,
        other => panic!("{id}: expected exited, got {other:?}"),
    }
}

async fn signal(client: &mut Client, id: &str, name: &str, foreground: bool) {
    client
        .send(&ClientMessage::Signal(SignalRequest {
            id: id.to_string(),
            signal: name.to_string(),
            foreground,
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Done(_) => {}
        other => panic!("{id}: expected done for {name}, got {other:?}"),
    }
}

async fn run(client: &mut Client, r: protocol::ExecRequest) -> protocol::ExecResult {
    let id = r.id.clone();
    client
        .exec(r)
        .await
        .result
        .unwrap_or_else(|e| panic!("{id}: {e:?}"))
}

async fn list(client: &mut Client) -> Vec<protocol::ProcessInfo> {
    let tag = format!("list-{}", marker());
    client
        .send(&ClientMessage::ListProcesses(ListProcessesRequest {
            id: Some(tag.clone()),
        }))
        .await;
    match client.reply_for(&tag).await {
        ServerMessage::Processes(list) => list.processes,
        other => panic!("expected processes, got {other:?}"),
    }
}

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

/// A free TCP port on the host's loopback.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command that fetches `url` with Python's urllib, retrying for a few seconds while the
/// server starts; it prints the body or the last error.
fn fetch(url: &str) -> String {
    format!(
        "python3 - <<'EOF'\n\
         import time, urllib.request\n\
         err = None\n\
         for _ in range(40):\n\
         \x20   try:\n\
         \x20       print(urllib.request.urlopen('{url}', timeout=2).read().decode(), end='')\n\
         \x20       break\n\
         \x20   except Exception as e:\n\
         \x20       err = e\n\
         \x20       time.sleep(0.1)\n\
         else:\n\
         \x20   print('unreachable:', err)\n\
         EOF"
    )
}

#[tokio::test]
async fn a_server_spawned_under_task_container_is_reached_by_a_second_command_and_the_host() {
    // Which profiles share a network with the next command (sandbox-profiles/*.json):
    // task-container and trusted use the host's network; strict gives every command a network
    // namespace of its own (a loopback nobody else reaches, see the next test); landlock
    // refuses IP sockets altogether (seccomp), so no server can even listen there.
    // task-container hides the state directory, so the workspace lives outside it.
    let root = tempfile::Builder::new()
        .prefix("e2e-ws-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let workspace = root.path().join("ws");
    let daemon = Daemon::start_with(&[
        "--allow-profile",
        "task-container",
        "--allow-profile",
        "strict",
        "--workspace",
        workspace.to_str().unwrap(),
    ]);
    let mut client = daemon.connect().await;
    let m = marker();
    std::fs::write(workspace.join("hello.txt"), format!("served {m}\n")).unwrap();
    let port = free_port();
    let mut server = spawn_req(
        "server",
        &format!("exec python3 -m http.server {port} --bind 127.0.0.1"),
    );
    server.profile = Some("task-container".into());
    spawn(&mut client, server).await;
    let url = format!("http://127.0.0.1:{port}/hello.txt");
    let mut exec = req("client", &fetch(&url));
    exec.profile = Some("task-container".into());
    let result = run(&mut client, exec).await;
    assert_eq!(result.output, format!("served {m}\n"), "{result:?}");
    // The host reaches it too, and the server logged both requests.
    let body = executor_tests::http_get(
        format!("127.0.0.1:{port}").parse().unwrap(),
        "/hello.txt",
        None,
    )
    .await
    .unwrap();
    assert!(body.ends_with(&format!("served {m}\n")), "{body}");
    let mut offset = 0;
    read_until(&mut client, "server", &mut offset, "GET /hello.txt").await;
    signal(&mut client, "server", "TERM", false).await;
    let exited = wait(&mut client, "server", 10.0).await;
    assert!(!exited.running, "{exited:?}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the server still listens after TERM"
    );
}

#[tokio::test]
async fn under_strict_and_landlock_no_command_can_listen_on_tcp_so_none_reaches_another() {
    // strict gives each command a loopback of its own and landlock's TCP rules refuse bind;
    // landlock (no namespaces) has seccomp refuse IP sockets. So a server spawned there never
    // listens, and a second command (or the host) has nothing to reach. Control: the same
    // listener under task-container (the host's network).
    let root = tempfile::Builder::new()
        .prefix("e2e-ws-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let workspace = root.path().join("ws");
    let daemon = Daemon::start_with(&[
        "--allow-profile",
        "task-container",
        "--allow-profile",
        "strict",
        "--allow-profile",
        "landlock",
        "--workspace",
        workspace.to_str().unwrap(),
    ]);
    let mut client = daemon.connect().await;
    for (profile, listens) in [
        ("strict", false),
        ("landlock", false),
        ("task-container", true),
    ] {
        let port = free_port();
        let id = format!("listen-{profile}");
        let mut r = spawn_req(
            &id,
            &format!(
                "python3 -c \"import socket, time\n\
                 try:\n s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n\
                 except OSError as e:\n print('refused', e.errno); raise SystemExit(1)\n\
                 print('listening', flush=True); time.sleep(30)\""
            ),
        );
        r.profile = Some(profile.to_string());
        spawn(&mut client, r).await;
        let mut offset = 0;
        let said = read_until(&mut client, &id, &mut offset, "\n").await;
        let host_reaches = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if listens {
            assert!(said.starts_with("listening"), "[{profile}] {said:?}");
            assert!(host_reaches, "[{profile}] control: the host reaches it");
            signal(&mut client, &id, "KILL", false).await;
        } else {
            assert!(said.starts_with("refused"), "[{profile}] {said:?}");
            assert!(!host_reaches, "[{profile}] something listens on {port}");
            assert_eq!(wait(&mut client, &id, 10.0).await.returncode, 1);
        }
        assert!(!wait(&mut client, &id, 10.0).await.running);
    }
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
            eventually(Duration::from_secs(5), || sleepers(&m).is_empty()).await,
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

#[tokio::test]
async fn term_reaches_the_whole_tree_and_kill_leaves_nothing_on_the_host() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    // A shell and a background child that both trap TERM and go on, and a plain background
    // sleep that TERM ends. The child says when its trap is set: a TERM that came before would
    // end it (the static release build's daemon is fast enough to get there first).
    let command = format!(
        "trap 'echo shell-got-TERM' TERM\n\
         sh -c 'trap \"echo child-got-TERM\" TERM; echo child-armed; while :; do sleep 0.05; done # {m}' &\n\
         {} &\n\
         echo ready\n\
         while :; do sleep 0.05; done",
        marked_sleep(&m)
    );
    spawn(&mut client, spawn_req("tree", &command)).await;
    let mut offset = 0;
    let started = read_until(&mut client, "tree", &mut offset, "ready").await;
    if !started.contains("child-armed") {
        read_until(&mut client, "tree", &mut offset, "child-armed").await;
    }
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 1).await);
    signal(&mut client, "tree", "TERM", false).await;
    let seen = read_until(&mut client, "tree", &mut offset, "TERM").await;
    let seen = if seen.contains("shell-got-TERM") && seen.contains("child-got-TERM") {
        seen
    } else {
        let more = read_until(
            &mut client,
            "tree",
            &mut offset,
            if seen.contains("shell") {
                "child-got-TERM"
            } else {
                "shell-got-TERM"
            },
        )
        .await;
        seen + &more
    };
    assert!(seen.contains("shell-got-TERM"), "{seen:?}");
    assert!(seen.contains("child-got-TERM"), "{seen:?}");
    assert!(
        eventually(Duration::from_secs(5), || sleepers(&m).is_empty()).await,
        "TERM did not reach the background sleep"
    );
    // The trapping processes live on: TERM did not end the process.
    assert!(wait(&mut client, "tree", 0.0).await.running);
    assert!(!processes_matching(&m).is_empty());
    signal(&mut client, "tree", "KILL", false).await;
    let exited = wait(&mut client, "tree", 10.0).await;
    assert!(!exited.running, "{exited:?}");
    assert_ne!(exited.returncode, 0, "{exited:?}");
    assert!(
        eventually(Duration::from_secs(5), || processes_matching(&m).is_empty()).await,
        "survivors of KILL: {:?}",
        processes_matching(&m)
    );
}

#[tokio::test]
async fn a_dropped_connection_without_grace_kills_the_processes_trees() {
    let daemon = Daemon::start();
    let m = marker();
    let mut client = daemon.connect().await;
    let s = marked_sleep(&m);
    spawn(&mut client, spawn_req("a", &format!("setsid {s} & {s}"))).await;
    let mut pty = spawn_req("b", &format!("( {s} & ) ; {s}"));
    pty.pty = Some(PtySize { rows: 5, cols: 20 });
    spawn(&mut client, pty).await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 4).await);
    drop(client);
    assert!(
        eventually(Duration::from_secs(5), || processes_matching(&m).is_empty()).await,
        "survivors: {:?}",
        processes_matching(&m)
    );
    // The daemon serves the next client.
    let mut next = daemon.connect().await;
    assert_eq!(next.run("after", "echo alive").await.output, "alive\n");
}

#[tokio::test]
async fn processes_die_with_the_daemon() {
    let mut daemon = Daemon::start();
    let m = marker();
    let mut client = daemon.connect().await;
    spawn(
        &mut client,
        spawn_req("a", &format!("setsid {s} & {s}", s = marked_sleep(&m))),
    )
    .await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
    daemon.signal_and_wait(nix::sys::signal::Signal::SIGTERM);
    assert!(
        eventually(Duration::from_secs(5), || processes_matching(&m).is_empty()).await,
        "survivors: {:?}",
        processes_matching(&m)
    );
}

#[tokio::test]
async fn a_resumed_session_reads_on_from_its_offset_and_sees_every_line_exactly_once() {
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    spawn(
        &mut client,
        spawn_req(
            "lines",
            "for i in $(seq 1 60); do echo line-$i; sleep 0.03; done",
        ),
    )
    .await;
    let mut offset = 0;
    let mut got = read_until(&mut client, "lines", &mut offset, "line-5\n").await;
    // The network fails: no close frame.
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut client = daemon.connect().await;
    client
        .send(&ClientMessage::Resume(ResumeRequest {
            session: session.clone(),
            awaiting: vec![],
        }))
        .await;
    match client.recv().await {
        Some(ServerMessage::Resumed(r)) => {
            assert_eq!(r.session, session);
            assert_eq!(r.running, vec!["lines".to_string()], "{r:?}");
        }
        other => panic!("expected resumed, got {other:?}"),
    }
    let rest = read_to_eof(&mut client, "lines", offset).await;
    got.push_str(&String::from_utf8(rest).unwrap());
    let expected: String = (1..=60).map(|i| format!("line-{i}\n")).collect();
    assert_eq!(got, expected);
    assert_eq!(wait(&mut client, "lines", 10.0).await.returncode, 0);
}

#[tokio::test]
async fn output_beyond_the_buffer_is_dropped_oldest_first_and_offsets_add_up() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let cap = client.hello.limits.max_process_buffer_bytes as u64;
    assert!(cap > 0, "hello names the per-process buffer");
    // Fixed-width numbered records: the byte at any offset is known.
    const RECORDS: u64 = 300_000;
    let total = RECORDS * 10;
    assert!(total > 2 * cap, "make more output than the buffer holds");
    spawn(
        &mut client,
        spawn_req(
            "flood",
            &format!(
                "python3 -c \"import sys; sys.stdout.write(''.join('%09d\\n' % i for i in \
                 range({RECORDS})))\""
            ),
        ),
    )
    .await;
    let exited = wait(&mut client, "flood", 20.0).await;
    assert_eq!(exited.returncode, 0, "{exited:?}");
    let expected = |from: u64, len: usize| -> Vec<u8> {
        (from..from + len as u64)
            .map(|p| {
                let record = format!("{:09}\n", p / 10);
                record.as_bytes()[(p % 10) as usize]
            })
            .collect()
    };
    let first = read(&mut client, "flood", 0, 0.0).await;
    assert_eq!(first.offset, total - cap, "{first:?}");
    assert_eq!(first.dropped, total - cap);
    let data = unb64(&first.data);
    assert_eq!(first.next_offset, first.offset + data.len() as u64);
    assert_eq!(data, expected(first.offset, data.len()));
    // From there on, every byte to the end, nothing more dropped.
    let mut offset = first.next_offset;
    let mut n = data.len() as u64;
    loop {
        let out = read(&mut client, "flood", offset, 0.0).await;
        assert_eq!(out.dropped, 0);
        assert_eq!(out.offset, offset);
        let data = unb64(&out.data);
        assert_eq!(data, expected(offset, data.len()), "at {offset}");
        offset = out.next_offset;
        n += data.len() as u64;
        if out.eof {
            break;
        }
    }
    assert_eq!((offset, n), (total, cap));
    // A reader part way through the lost bytes learns exactly how many it missed.
    let mid = read(&mut client, "flood", 1000, 0.0).await;
    assert_eq!((mid.offset, mid.dropped), (total - cap, total - cap - 1000));
    let info = list(&mut client).await;
    assert_eq!(info[0].output_bytes, total);
}

#[tokio::test]
async fn spawns_beyond_max_commands_per_connection_are_busy() {
    let daemon = Daemon::start_with(&["--max-commands-per-connection", "2"]);
    let mut client = daemon.connect().await;
    assert_eq!(client.hello.limits.max_commands_per_connection, 2);
    let m = marker();
    spawn(&mut client, spawn_req("one", &marked_sleep(&m))).await;
    spawn(&mut client, spawn_req("two", &marked_sleep(&m))).await;
    let err = spawn_refused(&mut client, spawn_req("three", &marked_sleep(&m))).await;
    assert_eq!(err.code, ErrorCode::Busy, "{err:?}");
    // An exec counts against the same limit.
    let refused = client
        .exec(req("exec", "echo no"))
        .await
        .result
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Busy, "{refused:?}");
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sleepers(&m).len(), 2, "the third never ran");
    // Control: once one ends, a spawn fits again.
    signal(&mut client, "one", "KILL", false).await;
    assert!(!wait(&mut client, "one", 10.0).await.running);
    spawn(&mut client, spawn_req("three", &marked_sleep(&m))).await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
}

#[tokio::test]
async fn writes_to_a_process_that_never_reads_stdin_end_in_busy() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let chunk = vec![b'x'; 64 * 1024];
    const WRITES: usize = 150;
    // Control: a process that reads takes every write.
    spawn(&mut client, spawn_req("reader", "wc -c")).await;
    for _ in 0..WRITES {
        client.write_chunk("reader", &chunk, false).await;
    }
    client.write_chunk("reader", &[], true).await;
    let out = read_to_eof(&mut client, "reader", 0).await;
    assert_eq!(
        String::from_utf8(out).unwrap().trim(),
        (WRITES * chunk.len()).to_string()
    );

    spawn(&mut client, spawn_req("deaf", &marked_sleep(&m))).await;
    for _ in 0..WRITES {
        client.write_chunk("deaf", &chunk, false).await;
    }
    // A `wait` after the writes: its answer comes after every error the writes caused.
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: "deaf".into(),
            timeout: None,
        }))
        .await;
    let mut busy = 0;
    loop {
        match client.reply_for("deaf").await {
            ServerMessage::Error(e) => {
                assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
                assert!(e.message.contains("not reading its stdin"), "{}", e.message);
                busy += 1;
            }
            ServerMessage::Exited(e) => {
                assert!(e.running, "the process is unharmed: {e:?}");
                break;
            }
            other => panic!("expected busy, got {other:?}"),
        }
    }
    // The daemon took a bounded number of writes (its queue of 64, plus what the socket's
    // buffer holds) and refused the rest.
    let taken = WRITES - busy;
    assert!(
        (64..=80).contains(&taken),
        "{taken} of {WRITES} writes taken"
    );
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 1).await);
}

#[tokio::test]
async fn requests_for_an_unknown_process_are_not_found() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("known", "echo here")).await;
    assert_eq!(
        read_to_eof(&mut client, "known", 0).await,
        b"here\n".to_vec()
    );
    for msg in [
        ClientMessage::Read(ReadRequest {
            id: "ghost".into(),
            offset: 0,
            max_bytes: None,
            wait: None,
        }),
        ClientMessage::Wait(WaitRequest {
            id: "ghost".into(),
            timeout: None,
        }),
        ClientMessage::Signal(SignalRequest {
            id: "ghost".into(),
            signal: "TERM".into(),
            foreground: false,
        }),
        ClientMessage::Write(WriteRequest {
            id: "ghost".into(),
            data: Some(b64(b"x")),
            text: None,
            eof: false,
        }),
    ] {
        client.send(&msg).await;
        match client.reply_for("ghost").await {
            ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{msg:?}: {e:?}"),
            other => panic!("{msg:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn when_the_shell_exits_its_background_jobs_are_killed_and_the_output_ends() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let s = marked_sleep(&m);
    spawn(
        &mut client,
        spawn_req("bg", &format!("{s} & setsid {s} & echo shell done")),
    )
    .await;
    // The sleeps hold the output open; the output still ends once the shell has.
    assert_eq!(
        read_to_eof(&mut client, "bg", 0).await,
        b"shell done\n".to_vec()
    );
    let exited = wait(&mut client, "bg", 10.0).await;
    assert_eq!(exited.returncode, 0, "{exited:?}");
    assert_eq!(exited.extra.as_ref().unwrap().killed_processes, 2);
    assert!(
        eventually(Duration::from_secs(5), || sleepers(&m).is_empty()).await,
        "survivors: {:?}",
        sleepers(&m)
    );
}

#[tokio::test]
async fn stop_and_cont_reach_the_tree_and_kill_ends_a_stopped_tree() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    spawn(
        &mut client,
        spawn_req("t", &format!("{s} & {s}", s = marked_sleep(&m))),
    )
    .await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
    let state = |want: char| {
        let m = m.clone();
        move || {
            let pids = sleepers(&m);
            pids.len() == 2
                && pids
                    .iter()
                    .all(|p| executor_tests::process_state(*p) == Some(want))
        }
    };
    signal(&mut client, "t", "SIGSTOP", false).await;
    assert!(eventually(Duration::from_secs(5), state('T')).await, "STOP");
    signal(&mut client, "t", "CONT", false).await;
    assert!(eventually(Duration::from_secs(5), state('S')).await, "CONT");
    signal(&mut client, "t", "STOP", false).await;
    assert!(eventually(Duration::from_secs(5), state('T')).await);
    signal(&mut client, "t", "KILL", false).await;
    let exited = wait(&mut client, "t", 10.0).await;
    assert!(!exited.running);
    assert!(
        eventually(Duration::from_secs(5), || processes_matching(&m).is_empty()).await,
        "a stopped tree survived KILL: {:?}",
        processes_matching(&m)
    );
    // An unknown signal name is refused, and the known one names the process.
    client
        .send(&ClientMessage::Signal(SignalRequest {
            id: "t".into(),
            signal: "SEGV".into(),
            foreground: false,
        }))
        .await;
    match client.reply_for("t").await {
        ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_process_past_its_timeout_is_killed_with_its_tree() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let mut r = spawn_req(
        "slow",
        &format!("echo begun; setsid {s} & {s}", s = marked_sleep(&m)),
    );
    r.timeout = Some(1.0);
    spawn(&mut client, r).await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
    let exited = wait(&mut client, "slow", 10.0).await;
    assert!(!exited.running);
    assert_eq!(exited.returncode, protocol::RETURNCODE_NOT_FINISHED);
    assert!(exited.extra.as_ref().unwrap().timed_out, "{exited:?}");
    assert!(
        eventually(Duration::from_secs(3), || processes_matching(&m).is_empty()).await,
        "survivors: {:?}",
        processes_matching(&m)
    );
    // Its output stays readable after the end.
    assert_eq!(read_to_eof(&mut client, "slow", 0).await, b"begun\n");
}

#[tokio::test]
async fn a_dropped_sessions_processes_live_through_the_grace_period_and_then_die() {
    let daemon = Daemon::start_with(&["--resume-grace", "2"]);
    let mut client = daemon.connect().await;
    let m = marker();
    spawn(
        &mut client,
        spawn_req("p", &format!("setsid {s} & {s}", s = marked_sleep(&m))),
    )
    .await;
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
    drop(client);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        sleepers(&m).len(),
        2,
        "killed before the grace period ended"
    );
    assert!(
        eventually(Duration::from_secs(8), || processes_matching(&m).is_empty()).await,
        "the tree outlived the grace period: {:?}",
        processes_matching(&m)
    );
}

#[tokio::test]
async fn a_running_process_id_cannot_be_taken_again_but_an_ended_ones_can() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    spawn(&mut client, spawn_req("p", &marked_sleep(&m))).await;
    let err = spawn_refused(&mut client, spawn_req("p", "echo second")).await;
    assert_eq!(err.code, ErrorCode::DuplicateId, "{err:?}");
    let refused = client.exec(req("p", "echo exec")).await.result.unwrap_err();
    assert_eq!(refused.code, ErrorCode::DuplicateId, "{refused:?}");
    // Only the first one runs (`spawned` comes once its shell runs; the sleep just after).
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 1).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sleepers(&m).len(), 1);
    signal(&mut client, "p", "KILL", false).await;
    assert!(!wait(&mut client, "p", 10.0).await.running);
    // Ended: the id is free again, and the new process's output is its own.
    spawn(&mut client, spawn_req("p", "echo second")).await;
    assert_eq!(read_to_eof(&mut client, "p", 0).await, b"second\n");
}

#[tokio::test]
async fn waiting_reads_are_bounded_per_session() {
    // Every buffer a client can fill must have a limit (design.md, "Bounded"). A `read` with
    // `wait` parks until output comes or the wait passes (up to 60 s); a client may send them
    // far faster than they end, so past 64 waiting (protocol/README.md) they are `busy`.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("quiet", "sleep 120")).await;
    // Control: a waiting read is answered when its wait passes.
    let out = read(&mut client, "quiet", 0, 0.2).await;
    assert!(out.data.is_empty() && !out.eof, "{out:?}");
    let before = executor_tests::rss_kib(daemon.pid());
    let text = serde_json::to_string(&ClientMessage::Read(ReadRequest {
        id: "quiet".into(),
        offset: 0,
        max_bytes: None,
        wait: Some(60.0),
    }))
    .unwrap();
    const READS: usize = 5_000;
    const WAITING: usize = 64;
    for _ in 0..READS {
        client.send_text(&text).await;
    }
    // Everything sent has been handled once a request behind it is answered.
    client
        .send(&ClientMessage::ListProcesses(ListProcessesRequest {
            id: Some("after".into()),
        }))
        .await;
    let mut busy = 0;
    loop {
        match client.recv().await {
            Some(ServerMessage::Error(e)) if e.id.as_deref() == Some("quiet") => {
                assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
                busy += 1;
            }
            Some(ServerMessage::Processes(_)) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(busy, READS - WAITING, "reads refused past the waiting ones");
    let grown = executor_tests::rss_kib(daemon.pid()).saturating_sub(before);
    assert!(
        grown < 20 * 1024,
        "{READS} reads grew the daemon by {grown} KiB"
    );
    // Output wakes the parked reads: each is answered.
    signal(&mut client, "quiet", "KILL", false).await;
    let mut answered = 0;
    while answered < WAITING {
        match client.recv().await {
            Some(ServerMessage::ProcessOutput(out)) if out.id == "quiet" => answered += 1,
            Some(_) => {}
            None => panic!("closed"),
        }
    }
}

#[tokio::test]
async fn ended_processes_are_kept_for_reading_until_eight_newer_ones_push_them_out() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for i in 0..10 {
        let id = format!("p{i}");
        spawn(&mut client, spawn_req(&id, &format!("echo out-{i}"))).await;
        assert_eq!(wait(&mut client, &id, 10.0).await.returncode, 0);
    }
    // p9's spawn found nine ended ones (p0..p8): the oldest went, eight stayed.
    client
        .send(&ClientMessage::Read(ReadRequest {
            id: "p0".into(),
            offset: 0,
            max_bytes: None,
            wait: None,
        }))
        .await;
    assert!(matches!(
        client.reply_for("p0").await,
        ServerMessage::Error(e) if e.code == ErrorCode::NotFound
    ));
    assert_eq!(read_to_eof(&mut client, "p1", 0).await, b"out-1\n");
    spawn(&mut client, spawn_req("p10", "echo out-10")).await;
    assert_eq!(wait(&mut client, "p10", 10.0).await.returncode, 0);
    let listed: Vec<String> = list(&mut client).await.into_iter().map(|p| p.id).collect();
    let mut expected: Vec<String> = (2..=10).map(|i| format!("p{i}")).collect();
    expected.sort();
    assert_eq!(listed, expected, "the oldest ended ones are forgotten");
    client
        .send(&ClientMessage::Read(ReadRequest {
            id: "p1".into(),
            offset: 0,
            max_bytes: None,
            wait: None,
        }))
        .await;
    match client.reply_for("p1").await {
        ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("p1: {other:?}"),
    }
    assert_eq!(read_to_eof(&mut client, "p2", 0).await, b"out-2\n");
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
