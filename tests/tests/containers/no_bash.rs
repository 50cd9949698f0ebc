//! An image without bash (busybox only, an Alpine-like task image): the probes of `executor
//! check` run each profile's command under the interpreter it is given, as `serve` does, so
//! without `--interpreter` every profile is reported unavailable (landlock and trusted for want
//! of bash), and with
//! `--interpreter "sh -c"` the host's real answer comes back; `serve --interpreter "sh -c"`
//! runs commands there.

use executor_tests::checks::run_as;
use executor_tests::container::{Container, ContainerOptions};
use executor_tests::Target;

/// `executor check`'s line for `profile`: `NAME  ok  layers` or `NAME  NO  reason`.
fn check_line<'a>(check: &'a str, profile: &str) -> &'a str {
    check
        .lines()
        .find(|l| l.split_whitespace().next() == Some(profile))
        .unwrap_or_else(|| panic!("executor check does not list {profile}:\n{check}"))
}

#[tokio::test]
async fn without_bash_check_needs_the_interpreter_that_serve_is_given() {
    let Some(c) = Container::start(ContainerOptions {
        without_bash: true,
        ..ContainerOptions::default()
    }) else {
        return;
    };
    // Control: the image has sh and no bash.
    assert_eq!(c.outside_ok("echo $0"), "sh\n");
    assert_ne!(c.outside("command -v bash").code, 0, "the image has bash");
    // Without --interpreter, check probes with bash: every profile unavailable; those that get
    // as far as starting the interpreter (strict and task-container stop earlier, at the
    // namespaces this container refuses) name the missing bash.
    let plain = c.outside("executor check");
    for profile in ["strict", "landlock", "task-container", "trusted"] {
        let line = check_line(&plain.output, profile);
        assert_eq!(
            line.split_whitespace().nth(1),
            Some("NO"),
            "{profile} probed ok without bash:\n{}",
            plain.output
        );
    }
    for profile in ["landlock", "trusted"] {
        let line = check_line(&plain.output, profile);
        assert!(
            line.contains("cannot start bash"),
            "the reason does not name the missing interpreter: {line}"
        );
    }
    assert!(
        plain.output.contains("default profile: none"),
        "{}",
        plain.output
    );
    // With the interpreter the daemon uses, landlock is available (and the default) again;
    // strict stays refused, for the container's own reason (no namespaces), not bash.
    let with = c.outside_ok("executor check --interpreter 'sh -c'");
    let landlock = check_line(&with, "landlock");
    assert_eq!(landlock.split_whitespace().nth(1), Some("ok"), "{with}");
    assert!(with.contains("interpreter: sh -c"), "{with}");
    assert!(with.contains("default profile: landlock"), "{with}");
    let strict = check_line(&with, "strict");
    assert!(
        strict.split_whitespace().nth(1) == Some("NO") && !strict.contains("bash"),
        "{with}"
    );
    // serve --interpreter "sh -c" (the container's entrypoint) runs a command under landlock.
    let mut client = c.endpoint().connect().await;
    assert_eq!(client.hello.default_profile, "landlock");
    let result = run_as(
        &mut client,
        None,
        "sh",
        "echo ran as $(id -u); readlink /proc/$$/exe",
        crate::TIMEOUT,
    )
    .await;
    assert_eq!(result.extra.isolation.profile, "landlock");
    assert_eq!(result.output, "ran as 65534\n/bin/busybox\n", "{result:?}");
}
