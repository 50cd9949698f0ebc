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
