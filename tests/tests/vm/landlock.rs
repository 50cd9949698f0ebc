//! The landlock profile on 6.1's landlock ABI (2: no TCP rules, no signal or socket scoping,
//! no truncate right). What it still refuses, each with its allowed control, checked on the
//! VM's files from outside; and what ABI 2 cannot do, covered by the profile's other layers
//! (seccomp refuses IP sockets, so the missing TCP rules open nothing).

use executor_tests::checks::run_as;
use executor_tests::{marker, vm, Target};

#[tokio::test]
async fn landlock_on_abi_2_still_confines_reads_and_writes_to_its_paths() {
    let Some(vm) = vm::shared() else { return };
    let m = marker();
    // Open to everyone by mode, so only landlock can refuse them to uid 65534.
    vm.outside_ok(&format!(
        "mkdir -p /srv/open && chmod 1777 /srv/open && echo secret-{m} > /srv/readable-{m} \
         && chmod 644 /srv/readable-{m} && echo visible-{m} > /etc/probe-{m} && chmod 644 /etc/probe-{m}"
    ));
    let mut client = vm.endpoint().connect().await;
    let probe = format!(
        "echo w > /srv/open/w-{m} 2>/dev/null && echo wrote-srv\n\
         echo w > /tmp/w-{m} && echo wrote-tmp\n\
         cat /srv/readable-{m} 2>/dev/null || echo read-srv-refused\n\
         cat /etc/probe-{m}"
    );
    let result = run_as(
        &mut client,
        Some("landlock"),
        "fs",
        &probe,
        crate::SLOW_TIMEOUT,
    )
    .await;
    let out = &result.output;
    assert!(
        out.contains("wrote-tmp"),
        "control: /tmp is writable: {result:?}"
    );
    assert!(
        out.contains(&format!("visible-{m}")),
        "control: /etc is readable: {result:?}"
    );
    assert!(
        !out.contains("wrote-srv"),
        "wrote outside its paths: {result:?}"
    );
    assert!(
        out.contains("read-srv-refused"),
        "read outside its paths: {result:?}"
    );
    assert!(
        !out.contains(&format!("secret-{m}")),
        "read outside its paths: {result:?}"
    );
    // From outside: the allowed write landed, the refused one did not.
    assert_eq!(
        vm.outside(&format!("test -e /tmp/w-{m}")).code,
        0,
        "/tmp/w-{m} missing"
    );
    assert_ne!(
        vm.outside(&format!("test -e /srv/open/w-{m}")).code,
        0,
        "/srv/open/w-{m} exists"
    );
}

#[tokio::test]
async fn without_landlock_tcp_rules_seccomp_still_refuses_tcp() {
    let Some(vm) = vm::shared() else { return };
    let m = marker();
    let port = 9100;
    // A listener in the VM, outside the sandbox, writing what it receives to a file.
    vm.outside_ok(&format!(
        "(nc -l -p {port} >/tmp/got-{m} 2>&1 </dev/null &) ; sleep 0.5"
    ));
    let mut client = vm.endpoint().connect().await;
    let send = format!("echo hi-{m} > /dev/tcp/127.0.0.1/{port} && echo sent || echo refused");
    let confined = run_as(
        &mut client,
        Some("landlock"),
        "tcp",
        &send,
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert!(confined.output.contains("refused"), "{confined:?}");
    // Control: without the sandbox the same connection goes through and is received.
    let open = run_as(
        &mut client,
        Some("trusted"),
        "tcp-control",
        &send,
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert!(open.output.contains("sent"), "{open:?}");
    let got = vm.outside_ok(&format!("sleep 0.5; cat /tmp/got-{m}"));
    assert_eq!(got, format!("hi-{m}\n"), "the listener received");
}

#[tokio::test]
async fn a_landlock_command_cannot_signal_the_daemon_but_can_signal_its_own_children() {
    let Some(vm) = vm::shared() else { return };
    let daemon = vm.daemon_pid();
    let mut client = vm.endpoint().connect().await;
    let probe = format!(
        "sleep 30 & kill -0 $! && echo own-ok\n\
         kill -0 {daemon} 2>/dev/null && echo daemon-reached || echo daemon-refused\n\
         kill $!"
    );
    let result = run_as(
        &mut client,
        Some("landlock"),
        "signal",
        &probe,
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert!(result.output.contains("own-ok"), "control: {result:?}");
    assert!(result.output.contains("daemon-refused"), "{result:?}");
    // From outside: the daemon lives on.
    assert_eq!(vm.daemon_pid(), daemon);
}

/// Landlock's rights after ABI 2, in ABI order: truncate (3), TCP rules (4), ioctl on devices
/// (5), signal and abstract-socket scoping (6). 6.1 cannot enforce them.
const BEYOND_ABI_2: [&str; 4] = [
    "landlock_truncate",
    "landlock_tcp",
    "landlock_ioctl_dev",
    "landlock_scope",
];

#[tokio::test]
async fn landlock_on_abi_2_names_the_rights_it_cannot_enforce_in_hello_check_and_result() {
    let Some(vm) = vm::shared() else { return };
    let mut client = vm.endpoint().connect().await;
    assert_eq!(client.hello.host.landlock_abi, 2, "{:?}", client.hello.host);
    let summary = client
        .hello
        .profiles
        .iter()
        .find(|p| p.name == "landlock")
        .expect("the hello lists landlock")
        .clone();
    assert!(summary.available, "{summary:?}");
    assert!(
        summary.layers.iter().any(|l| l == "landlock"),
        "landlock is not among its layers: {summary:?}"
    );
    assert_eq!(
        summary.missing, BEYOND_ABI_2,
        "the hello's missing rights of landlock"
    );
    // Control: what ABI 2 has (filesystem rules, refer) is enforced, so not named.
    for had in ["landlock_filesystem", "landlock_refer"] {
        assert!(!summary.missing.iter().any(|m| m == had), "{summary:?}");
    }
    // A command's isolation report says the same.
    let result = run_as(
        &mut client,
        Some("landlock"),
        "report",
        "echo ran",
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert_eq!(result.output, "ran\n", "{result:?}");
    let isolation = &result.extra.isolation;
    assert_eq!(isolation.profile, "landlock");
    assert!(
        isolation.layers.iter().any(|l| l == "landlock"),
        "{isolation:?}"
    );
    assert_eq!(
        isolation.missing, BEYOND_ABI_2,
        "the result's missing rights"
    );
    // And `executor check` in the VM: "landlock  ok  <layers>", then "missing here: ...".
    let check = vm.outside_ok("executor check");
    let mut lines = check.lines();
    lines
        .find(|l| l.split_whitespace().take(2).eq(["landlock", "ok"]))
        .unwrap_or_else(|| panic!("check does not call landlock ok:\n{check}"));
    let missing = lines
        .next()
        .and_then(|l| l.trim().strip_prefix("missing here:"))
        .unwrap_or_else(|| panic!("check names no missing rights for landlock:\n{check}"));
    assert!(
        missing.split_whitespace().eq(BEYOND_ABI_2),
        "check's missing rights: {missing}"
    );
}

#[tokio::test]
async fn without_abi_6_scoping_a_landlock_command_can_signal_other_processes_of_its_uid() {
    let Some(vm) = vm::shared() else { return };
    let m = marker();
    // A process of uid 65534 (the landlock command's uid) outside every sandbox.
    vm.outside_ok(&format!(
        "su -s /bin/sh nobody -c 'exec sleep 3600.{m}' </dev/null >/dev/null 2>&1 &"
    ));
    let outsider = executor_tests::target::wait_sleepers(vm, &m, 1).await[0].pid;
    let mut client = vm.endpoint().connect().await;
    let probe = format!("kill -TERM {outsider} 2>/dev/null && echo reached || echo refused");
    // strict's pid namespace hides it: the signal cannot reach it.
    let strict = run_as(
        &mut client,
        Some("strict"),
        "scope-strict",
        &probe,
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert!(strict.output.contains("refused"), "{strict:?}");
    assert_eq!(
        vm.sleepers(&m).len(),
        1,
        "strict's command reached a process outside its namespace"
    );
    // landlock on ABI 2 has no signal scoping (named `landlock_scope` in its `missing`): the
    // signal reaches a process of the same uid, and the VM sees it gone.
    let landlock = run_as(
        &mut client,
        Some("landlock"),
        "scope-landlock",
        &probe,
        crate::SLOW_TIMEOUT,
    )
    .await;
    assert!(landlock.output.contains("reached"), "{landlock:?}");
    executor_tests::target::assert_none_left(vm, &m, "the landlock command's signal").await;
}
