//! Symlink and hardlink tricks against the daemon's own file handling: symlinks planted where
//! the daemon writes (token, audit log), a working directory that is a symlink to the state
//! directory, and a host file hardlinked into the workspace.

use std::os::unix::fs::symlink;
use std::path::PathBuf;

use executor_tests::{marker, Client, Daemon, DaemonOptions};

use crate::common::*;

/// A directory under /var/tmp (same filesystem as the workspaces, outside every sandbox view)
/// holding victim files.
fn victim_dir() -> executor_tests::TempDir {
    executor_tests::TempDir::with_prefix_in("escape-victim-", "/var/tmp").unwrap()
}

/// Try to start a daemon (every profile offered) whose state directory already holds a symlink
/// `name` -> `target`, planted before it starts.
fn daemon_with_planted_symlink(name: &'static str, target: PathBuf) -> Result<Daemon, String> {
    Daemon::try_start_opts(DaemonOptions {
        extra: executor_tests::ALLOW_ALL_PROFILES
            .map(String::from)
            .to_vec(),
        prepare: Some(Box::new(move |state| {
            symlink(&target, state.join(name)).unwrap();
        })),
        ..Default::default()
    })
}

#[tokio::test]
async fn a_symlink_planted_at_the_audit_log_is_not_followed() {
    let victims = victim_dir();
    let victim = victims.path().join("victim");
    std::fs::write(&victim, "victim\n").unwrap();
    let started = daemon_with_planted_symlink("audit.jsonl", victim.clone());
    if let Ok(daemon) = &started {
        // It started: run commands and check they are not appended through the link.
        let mut client = daemon.connect().await;
        run_in(&mut client, TRUSTED, "audited", "echo audited").await;
        drop(client);
        // Time for a write that must not happen (the control below shows it would by now).
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    }
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "victim\n",
        "the daemon wrote its audit log through a planted symlink"
    );
    // Control: with a plain state directory the same command is audited, so the daemon does
    // write the audit log when it runs a command.
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    let mut client = daemon.connect().await;
    run_in(&mut client, TRUSTED, "audited", "echo audited").await;
    assert!(
        executor_tests::eventually(SETTLE, || !daemon.audit().is_empty()).await,
        "control: the command was audited"
    );
}

#[tokio::test]
async fn a_dangling_symlink_planted_at_the_token_does_not_receive_the_token() {
    let victims = victim_dir();
    let victim = victims.path().join("stolen-token");
    let started = daemon_with_planted_symlink("token", victim.clone());
    assert!(
        !victim.exists(),
        "the daemon wrote its token through a planted symlink to {} (started: {})",
        victim.display(),
        started.is_ok()
    );
    // Control: a plain state directory does get a token file.
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    assert!(daemon.state.path().join("token").is_file());
    assert!(!daemon.token.is_empty());
}

#[tokio::test]
async fn a_symlink_planted_at_the_token_does_not_choose_the_token() {
    // A world-readable file someone else controls must never become the bearer token.
    let victims = victim_dir();
    let planted = victims.path().join("chosen");
    std::fs::write(&planted, "attacker-chosen-token-0123456789abcdef\n").unwrap();
    let started = daemon_with_planted_symlink("token", planted.clone());
    if let Ok(daemon) = &started {
        let got =
            Client::connect(&daemon.url, Some("attacker-chosen-token-0123456789abcdef")).await;
        assert!(
            got.is_err(),
            "the daemon accepted a token from a planted symlink"
        );
    }
    // Control: the daemon's real token does authenticate.
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    assert!(Client::connect(&daemon.url, Some(&daemon.token))
        .await
        .is_ok());
}

#[tokio::test]
async fn a_cwd_symlinked_to_the_state_dir_does_not_expose_the_token() {
    let Some(daemon) = daemon_with(DaemonOptions {
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    }) else {
        return;
    };
    let link: PathBuf = daemon.workspace.join(format!("statelink-{}", marker()));
    symlink(daemon.state.path(), &link).unwrap();
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let mut r = preq(
            row.profile,
            &format!("{}-cwd", row.profile),
            "cat token; pwd",
            10.0,
        );
        r.cwd = Some(link.display().to_string());
        let got = client.exec(r).await.result;
        let out = match &got {
            Ok(result) => result.output.clone(),
            Err(e) => format!("refused: {} {}", e.code, e.message),
        };
        row.check_contains(&out, &daemon.token, "read the token");
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_host_file_hardlinked_into_the_workspace_cannot_be_written_through() {
    let Some(daemon) = daemon_with(DaemonOptions {
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    }) else {
        return;
    };
    let victims = victim_dir();
    each_row(&daemon, &ONLY_TRUSTED_TASK_LEFT_OUT, async |client, row| {
        let victim = victims.path().join(format!("file-{}", row.profile));
        std::fs::write(&victim, "original\n").unwrap();
        let name = format!("hl-{}", marker());
        let out = row
            .output(
                client,
                "hardlink",
                &format!(
                    "ln {v} {name}; echo ln_rc=$?; echo appended >> {name}; \
                 ln {s}/token tok-{name}; cat tok-{name}",
                    v = victim.display(),
                    s = daemon.state.path().display()
                ),
            )
            .await;
        let now = std::fs::read_to_string(&victim).unwrap();
        match row.expect {
            Denied => {
                assert_eq!(
                    now, "original\n",
                    "{row} wrote a host file through a hardlink: {out}"
                );
                assert!(
                    !out.contains(&daemon.token),
                    "{row} hardlinked the token: {out}"
                );
            }
            Allowed => assert_eq!(now, "original\nappended\n", "{row} control: {out}"),
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn the_working_directory_is_entered_as_the_command_so_it_tells_nothing_more() {
    // The daemon used to check and enter `cwd` as root, before dropping to the command's uid:
    // a request's outcome then told whether a path the command may not read exists (a command
    // ran in /root/<existing>, an error came back for /root/<missing>).
    let Some(daemon) = daemon() else {
        return;
    };
    let m = marker();
    let existing = PathBuf::from(format!("/root/escape-cwd-{m}"));
    std::fs::create_dir(&existing).unwrap();
    let _rm = RemoveOnDrop(existing.clone());
    let missing = format!("/root/escape-missing-{m}");
    let mut client = daemon.connect().await;
    let answer = |cwd: String| {
        let mut r = preq(LANDLOCK, "cwd", "pwd", 10.0);
        r.cwd = Some(cwd.clone());
        (r, cwd)
    };
    let mut seen = Vec::new();
    for cwd in [existing.display().to_string(), missing] {
        let (r, cwd) = answer(cwd);
        let got = client.exec(r).await.result;
        // Only the path may differ between the two answers.
        seen.push(format!("{got:?}").replace(&cwd, "<cwd>"));
    }
    assert!(
        seen[0].contains("Err"),
        "[landlock] ran in a directory its uid cannot enter: {}",
        seen[0]
    );
    assert_eq!(seen[0], seen[1], "[landlock] the answers differ");
    // Control: a directory the command may enter works.
    let (r, _) = answer("/tmp".into());
    assert_eq!(client.exec(r).await.result.unwrap().output, "/tmp\n");
}
