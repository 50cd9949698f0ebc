//! Profiles the daemon's configuration chooses: extra profiles from a directory, an allow-list,
//! an explicit default.

use executor_tests::{req, Daemon};
use protocol::ErrorCode;

#[tokio::test]
async fn a_profile_from_a_directory_is_offered_and_applied() {
    let dir = executor_tests::TempDir::new().unwrap();
    let trusted = include_str!("../../../sandbox-profiles/trusted.json");
    let mut custom: serde_json::Value = serde_json::from_str(trusted).unwrap();
    custom["name"] = "custom".into();
    custom["env"]["CUSTOM_MARK"] = "from-the-profile-dir".into();
    std::fs::write(dir.path().join("custom.json"), custom.to_string()).unwrap();
    // Like trusted, it confines nothing: offered only when named.
    let unnamed = Daemon::start_with(&["--profiles-dir", dir.path().to_str().unwrap()]);
    let hello = unnamed.connect().await.hello;
    assert!(!hello.profiles.iter().any(|p| p.name == "custom"));
    assert!(hello.not_offered.iter().any(|p| p.name == "custom"));
    let daemon = Daemon::start_with(&[
        "--profiles-dir",
        dir.path().to_str().unwrap(),
        "--allow-profile",
        "custom",
        "--allow-profile",
        "trusted",
    ]);
    let mut client = daemon.connect().await;
    let offered = client.hello.profiles.iter().find(|p| p.name == "custom");
    assert!(
        offered.is_some_and(|p| p.available),
        "{:?}",
        client.hello.profiles
    );
    let mut r = req("c", "echo $CUSTOM_MARK");
    r.profile = Some("custom".into());
    let result = client.exec(r).await.result.unwrap();
    assert_eq!(result.output, "from-the-profile-dir\n");
    assert_eq!(result.extra.isolation.profile, "custom");
    // Control: a built-in profile does not have the variable.
    let mut r = req("t", "echo ${CUSTOM_MARK:-unset}");
    r.profile = Some("trusted".into());
    assert_eq!(client.exec(r).await.result.unwrap().output, "unset\n");
}

#[tokio::test]
async fn an_invalid_profile_file_stops_the_daemon_from_starting() {
    let dir = executor_tests::TempDir::new().unwrap();
    std::fs::write(
        dir.path().join("broken.json"),
        r#"{"name":"broken","netwrok":1}"#,
    )
    .unwrap();
    let state = executor_tests::TempDir::new().unwrap();
    let out = std::process::Command::new(executor_tests::binary("executor"))
        .args(["serve", "--listen", "127.0.0.1:0", "--profiles-dir"])
        .arg(dir.path())
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("broken"), "{stderr}");
}

#[tokio::test]
async fn only_allowed_profiles_can_be_used() {
    let daemon = Daemon::start_with(&[
        "--allow-profile",
        "strict",
        "--allow-profile",
        "landlock",
        "--allow-profile",
        "task-container",
    ]);
    let mut client = daemon.connect().await;
    let names: Vec<&str> = client
        .hello
        .profiles
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names, ["landlock", "strict", "task-container"]);
    let mut r = req("t", "id -u");
    r.profile = Some("trusted".into());
    let err = client.exec(r).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::ProfileDenied);
    // Allowed twin.
    let mut r = req("l", "id -u");
    r.profile = Some("landlock".into());
    assert_eq!(client.exec(r).await.result.unwrap().output, "65534\n");
}

#[tokio::test]
async fn an_explicit_default_profile_is_used_for_requests_that_name_none() {
    let daemon = Daemon::start_with(&["--default-profile", "landlock"]);
    let mut client = daemon.connect().await;
    assert_eq!(client.hello.default_profile, "landlock");
    let result = client.run("d", "true").await;
    assert_eq!(result.extra.isolation.profile, "landlock");
    assert!(!result
        .extra
        .isolation
        .layers
        .contains(&"pid_ns".to_string()));
}

#[tokio::test]
async fn a_landlock_only_profile_that_hides_a_granted_path_is_refused() {
    // Without a mount namespace, "hidden" was silently ignored: a custom landlock profile
    // hiding /etc/ssh still listed it.
    let dir = executor_tests::TempDir::new().unwrap();
    let base: serde_json::Value =
        serde_json::from_str(include_str!("../../../sandbox-profiles/landlock.json")).unwrap();
    let mut bad = base.clone();
    bad["name"] = "hiding".into();
    bad["filesystem"]["hidden"] = serde_json::json!([{"path": "/etc/ssh", "reason": "host keys"}]);
    std::fs::write(dir.path().join("hiding.json"), bad.to_string()).unwrap();
    let refused = Daemon::try_start_opts(executor_tests::DaemonOptions {
        extra: vec!["--profiles-dir".into(), dir.path().display().to_string()],
        ..Default::default()
    });
    let log = refused.err().expect("the daemon started with the profile");
    assert!(log.contains("/etc/ssh") && log.contains("beneath"), "{log}");
    // Control: hiding a path no grant opens is accepted, and it stays unreachable.
    let outside = executor_tests::TempDir::with_prefix_in("hidden-", "/var/tmp").unwrap();
    std::fs::write(outside.path().join("secret"), "s3cret").unwrap();
    let mut good = base;
    good["name"] = "hiding".into();
    good["filesystem"]["hidden"] =
        serde_json::json!([{"path": outside.path(), "reason": "not for commands"}]);
    std::fs::write(dir.path().join("hiding.json"), good.to_string()).unwrap();
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: vec!["--profiles-dir".into(), dir.path().display().to_string()],
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut client = daemon.connect().await;
    let mut r = req(
        "h",
        &format!("cat {}/secret; echo rc=$?", outside.path().display()),
    );
    r.profile = Some("hiding".into());
    let out = client.exec(r).await.result.unwrap().output;
    assert!(!out.contains("s3cret") && !out.contains("rc=0"), "{out}");
}
