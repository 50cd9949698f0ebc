//! `agent batch` with the `local` deployment: an executor of its own per instance on this host.

use std::time::Duration;

use serde_json::json;

use crate::{assert_fixed, interrupt, processes_with, slow_script, wait_for, Bench, SHORT_SCRIPT};

#[tokio::test]
async fn a_local_batch_writes_minis_outputs_and_a_rerun_skips_what_is_done() {
    let bench = Bench::new(3, &[], &[]);
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    let preds = bench.preds();
    assert_eq!(preds.len(), 3, "{preds:?}");
    for i in 0..3 {
        let id = bench.id(i);
        assert_eq!(preds[&id]["instance_id"], id.as_str());
        assert_eq!(preds[&id]["model_name_or_path"], "scripted");
        assert_fixed(&bench.patch(i), i);
        let traj = bench.trajectory(i);
        assert_eq!(traj["trajectory_format"], "mini-swe-agent-1.1");
        assert_eq!(traj["instance_id"], id.as_str());
        assert_eq!(traj["info"]["exit_status"], "Submitted");
        assert_eq!(traj["info"]["config"]["deployment"], "local");
    }
    assert_eq!(bench.statuses()["Submitted"].len(), 3);
    assert_plain_progress(&run.stderr, &bench, 3);
    assert!(
        bench.log().contains("started a local executor"),
        "{}",
        bench.log()
    );
    // Every executor went with its instance.
    assert!(
        processes_with(&bench.tag).is_empty(),
        "{:?}",
        processes_with(&bench.tag)
    );

    // A rerun finds every id in preds.json and runs nothing.
    let again = bench.run(&["-w", "2"]).await;
    assert_eq!(again.code, 0);
    assert!(again.stderr.contains("3 already in"), "{}", again.stderr);
    for i in 0..3 {
        assert_eq!(bench.starts(i), 1, "instance {i} ran twice");
    }
    // --redo-existing runs them again (the control of the skip).
    let redo = bench
        .run(&["--redo-existing", "--filter", &bench.id(1)])
        .await;
    assert_eq!(redo.code, 0);
    assert_eq!(bench.starts(1), 2);
    assert_eq!(bench.starts(0), 1);
    assert_eq!(bench.preds().len(), 3);
}

/// Not on a terminal, the batch says in plain lines when each instance starts and how it
/// ended, counted `[k/total]`: one start and one end per instance, each count once, and none
/// of the terminal's drawing (no bar, no escape sequences).
fn assert_plain_progress(stderr: &str, bench: &Bench, n: usize) {
    let mut counts = Vec::new();
    for i in 0..n {
        let id = bench.id(i);
        let starts = stderr
            .lines()
            .filter(|l| *l == format!("batch: {id}: started"))
            .count();
        assert_eq!(starts, 1, "{id}: {stderr}");
        let ends: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("batch: [") && l.contains(&format!("] {id}: Submitted (")))
            .collect();
        assert_eq!(ends.len(), 1, "{id}: {stderr}");
        // `batch: [k/n] <id>: Submitted (1.2s)`
        let (count, rest) = ends[0]["batch: [".len()..].split_once('/').unwrap();
        assert!(rest.starts_with(&format!("{n}] ")), "{}", ends[0]);
        assert!(ends[0].ends_with("s)"), "{}", ends[0]);
        counts.push(count.parse::<usize>().unwrap());
    }
    counts.sort();
    assert_eq!(counts, (1..=n).collect::<Vec<_>>(), "{stderr}");
    assert!(!stderr.contains("ETA"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "{stderr}");
}

/// On a terminal, the same batch draws an overall bar with its ETA and the table of exit
/// statuses instead, and prints none of the plain per-instance lines (their control is the
/// test above, whose stderr is a pipe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_terminal_a_batch_draws_a_bar_with_eta_and_a_status_table_not_plain_lines() {
    use std::io::Read;
    let bench = Bench::new(2, &[], &[]);
    let size = nix::pty::Winsize {
        ws_row: 40,
        ws_col: 200,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None).unwrap();
    let mut command = bench.command(&["-w", "2"]);
    command.stderr(std::fs::File::from(pty.slave));
    let child = command.spawn().unwrap();
    // Our copy of the terminal's far side goes, so the reader sees the end with the batch's.
    drop(command);
    let mut master = std::fs::File::from(pty.master);
    let reader = std::thread::spawn(move || {
        let mut screen = Vec::new();
        let mut buffer = [0u8; 4096];
        // EIO once the batch, the last holder of the far side, has exited.
        while let Ok(n) = master.read(&mut buffer) {
            if n == 0 {
                break;
            }
            screen.extend_from_slice(&buffer[..n]);
        }
        String::from_utf8_lossy(&screen).into_owned()
    });
    let run = crate::finish(child).await;
    assert_eq!(run.code, 0);
    let screen = tokio::task::spawn_blocking(move || reader.join().unwrap())
        .await
        .unwrap();
    eprintln!("--- terminal ---\n{screen}");
    assert_eq!(bench.preds().len(), 2);
    // The bar, finished, with its count (no ETA before a first instance is done: none of
    // indicatif's `ETA 0s`); the table with both ids under Submitted.
    assert!(screen.contains("2/2 instances done"), "{screen}");
    assert!(!screen.contains("ETA 0s"), "{screen}");
    assert!(screen.contains('='), "{screen}");
    assert!(screen.contains("exit status  count  recent"), "{screen}");
    // Its rows are drawn over each other with cursor moves, not newlines: the last one drawn.
    let row = &screen[screen.rfind("Submitted").unwrap()..];
    let row: String = row.chars().take(100).collect();
    let count = row["Submitted".len()..].trim_start();
    assert!(count.starts_with("2  "), "{row:?}");
    for i in 0..2 {
        assert!(row.contains(&bench.id(i)), "{row:?}");
        assert!(
            !screen.contains(&format!("batch: {}: started", bench.id(i))),
            "{screen}"
        );
    }
    assert!(!screen.contains("batch: [1/2]"), "{screen}");
    // The summary line still ends it.
    assert!(screen.contains("batch: done in"), "{screen}");
}

#[tokio::test]
async fn a_model_error_and_a_failing_startup_command_are_recorded_and_the_batch_goes_on() {
    // 0 submits; 1's model runs out of answers; 2's startup command fails.
    let bench = Bench::new(
        3,
        &[(1, SHORT_SCRIPT)],
        &[(2, json!({"value": "2; exit 3"}))],
    );
    let run = bench.run(&["-w", "1"]).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted");
    assert_fixed(&bench.patch(0), 0);
    assert_eq!(bench.status_of(1), "ModelError");
    assert_eq!(bench.patch(1), "");
    assert_eq!(bench.status_of(2), "RuntimeError");
    assert_eq!(bench.patch(2), "");
    let failed = bench.trajectory(2);
    assert_eq!(failed["info"]["exit_status"], "RuntimeError");
    assert_eq!(failed["instance_id"], bench.id(2).as_str());
    assert!(
        failed["info"]["traceback"]
            .as_str()
            .unwrap()
            .contains("returned 3"),
        "{failed}"
    );
    assert!(processes_with(&bench.tag).is_empty());
}

#[tokio::test]
async fn an_interrupted_batch_resumes_without_running_a_finished_instance_twice() {
    // 0 and 1 finish at once; 2 and 3 are still running their first command at Ctrl-C.
    // A duration of its own: the host's `sleep 60`s (another test's) must not count.
    let bench = Bench::new(4, &[(2, &slow_script(131)), (3, &slow_script(131))], &[]);
    let child = bench.command(&["-w", "2"]).spawn().unwrap();
    let running = wait_for(Duration::from_secs(300), || {
        bench.preds().len() == 2 && processes_with("sleep 131").len() >= 2
    })
    .await;
    assert!(
        running,
        "never reached two done and two running: {}",
        bench.log()
    );
    interrupt(&child);
    let first = crate::finish(child).await;
    assert_eq!(first.code, 130);
    // preds.json is whole and holds only what finished.
    let preds = bench.preds();
    assert_eq!(
        preds.keys().cloned().collect::<Vec<_>>(),
        [bench.id(0), bench.id(1)],
        "{preds:?}"
    );
    assert_eq!(bench.trajectory(2)["info"]["exit_status"], "Interrupted");
    assert!(
        processes_with(&bench.tag).is_empty(),
        "{:?}",
        processes_with(&bench.tag)
    );

    bench.script(2, crate::FIX_SCRIPT);
    bench.script(3, crate::FIX_SCRIPT);
    let second = bench.run(&["-w", "2"]).await;
    assert_eq!(second.code, 0);
    assert_eq!(bench.preds().len(), 4);
    for i in 0..4 {
        assert_fixed(&bench.patch(i), i);
    }
    assert_eq!(
        (bench.starts(0), bench.starts(1)),
        (1, 1),
        "a finished instance ran again"
    );
    assert_eq!((bench.starts(2), bench.starts(3)), (2, 2));
}

#[tokio::test]
async fn a_hangup_stops_the_batch_cleanly_as_sigterm_does() {
    // 0 finishes at once; 1 is running its first command at the hangup (a closed terminal).
    let bench = Bench::new(2, &[(1, &slow_script(132))], &[]);
    let child = bench.command(&["-w", "2"]).spawn().unwrap();
    let running = wait_for(Duration::from_secs(300), || {
        bench.preds().len() == 1 && !processes_with("sleep 132").is_empty()
    })
    .await;
    assert!(
        running,
        "never reached one done and one running: {}",
        bench.log()
    );
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let finished = crate::finish(child).await;
    // Not killed by the signal: it stopped, saved, tore down and said so.
    assert_eq!(finished.code, 130, "{}", finished.stderr);
    assert!(
        finished.stderr.contains("batch: interrupted"),
        "{}",
        finished.stderr
    );
    assert_eq!(bench.trajectory(1)["info"]["exit_status"], "Interrupted");
    assert_eq!(
        bench.preds().keys().cloned().collect::<Vec<_>>(),
        [bench.id(0)]
    );
    assert!(
        processes_with(&bench.tag).is_empty(),
        "{:?}",
        processes_with(&bench.tag)
    );
}
