//! An image without the `C.UTF-8` locale (busybox and a static bash, no /usr/lib/locale): the
//! profiles' UTF-8 locale would make bash warn before every command's output, so commands
//! there get `C`, and the first line of the output is the command's own (a submission marker
//! stays a submission).

use executor_tests::checks::run_as;
use executor_tests::{container, is_root, require, Daemon, Target};

const FIRST: &str = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT";

#[tokio::test]
async fn in_an_image_without_the_utf8_locale_commands_get_c_and_their_output_comes_first() {
    let Some(c) = container::shared() else { return };
    // The image has no locale files at all.
    assert_ne!(c.outside("ls /usr/lib/locale").code, 0);
    let mut client = c.endpoint().connect().await;
    let command = format!("echo {FIRST}; echo \"$LANG $LC_ALL\"");
    let result = run_as(&mut client, None, "c", &command, crate::TIMEOUT).await;
    assert_eq!(result.output, format!("{FIRST}\nC C\n"), "{result:?}");
    // Control: the warning is real there. A request that names C.UTF-8 itself gets it, and
    // bash's complaint comes first.
    let mut asked = executor_tests::checks::preq(None, "utf8", &command, crate::TIMEOUT);
    asked.env.insert("LC_ALL".into(), "C.UTF-8".into());
    client.send(&protocol::ClientMessage::Exec(asked)).await;
    let warned = executor_tests::checks::result_within(
        &mut client,
        "utf8",
        std::time::Duration::from_secs(30),
    )
    .await;
    assert!(
        warned
            .output
            .starts_with("bash: warning: setlocale: LC_ALL: cannot change locale"),
        "{warned:?}"
    );
}

#[tokio::test]
async fn on_a_host_with_the_locale_commands_get_c_utf8() {
    if !require("root", is_root()) {
        return;
    }
    // A Debian host (CI's) has it from libc-bin.
    if !require(
        "C.UTF-8 in /usr/lib/locale (Debian's libc-bin)",
        std::path::Path::new("/usr/lib/locale/C.utf8/LC_CTYPE").exists(),
    ) {
        return;
    }
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let result = run_as(
        &mut client,
        None,
        "u",
        &format!("echo {FIRST}; echo \"$LANG $LC_ALL\""),
        crate::TIMEOUT,
    )
    .await;
    assert_eq!(result.output, format!("{FIRST}\nC.UTF-8 C.UTF-8\n"));
}
