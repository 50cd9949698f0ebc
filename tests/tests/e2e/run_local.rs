//! `executor run`: one command locally, through the daemon's path, with its fork server forked
//! from the run itself. Checked on the host: output and exit status, the process tree while it
//! runs, and nothing left after a timeout or after the run is killed.

use std::process::{Command, Stdio};
use std::time::Duration;

use executor_tests::host_waits::{send_signal, sleepers_gone, sleepers_up};
use executor_tests::{
    descendants, eventually, is_root, marked_sleep, marker, parent_of, require, sleepers, PATIENCE,
};
use nix::sys::signal::Signal;

/// `executor run --profile <profile> <extra> --cwd /tmp -- <command>`.
pub(crate) fn executor_run(profile: &str, extra: &[&str], command: &str) -> Command {
    let mut run = Command::new(executor_tests::binary("executor"));
    run.args(["run", "--profile", profile])
        .args(extra)
        .args(["--cwd", "/tmp", "--", command]);
    run
}

/// No sleeper of `marker` and none of `tree` (the run's processes) left on the host.
async fn assert_all_gone(marker: &str, tree: &[i32], what: &str) {
    assert!(
        sleepers_gone(marker).await,
        "{what}: survivors {:?}",
        sleepers(marker)
    );
    let alive = || {
        tree.iter()
            .filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
            .count()
    };
    assert!(
        eventually(PATIENCE, || alive() == 0).await,
        "{what}: the run's fork server or helper outlived it"
    );
}

#[tokio::test]
async fn a_run_passes_on_the_output_and_the_exit_status_under_each_profile() {
    if !require("root", is_root()) {
        return;
    }
    for profile in ["strict", "landlock"] {
        let out = executor_run(profile, &[], "echo hi; id -u; exit 3")
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hi\n65534\n",
            "{profile}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(3), "{profile}");
        // Control: a command that succeeds exits 0.
        let ok = executor_run(profile, &[], "true").status().unwrap();
        assert_eq!(ok.code(), Some(0), "{profile}");
    }
}

#[tokio::test]
async fn a_run_without_profile_takes_strict_or_else_landlock_and_says_which_and_why() {
    if !require("root", is_root()) {
        return;
    }
    let run = |uid: Option<u32>| {
        let exe = executor_tests::binary("executor");
        let mut c = match uid {
            Some(id) => {
                let mut c = Command::new("setpriv");
                c.args([
                    format!("--reuid={id}"),
                    format!("--regid={id}"),
                    "--clear-groups".into(),
                ])
                .arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.args(["run", "--cwd", "/tmp", "--", "id -u; echo $LC_ALL"]);
        c.output().unwrap()
    };
    // As root: strict, chosen as the strongest, said before the command's output.
    let root = run(None);
    let stderr = String::from_utf8_lossy(&root.stderr);
    assert_eq!(root.status.code(), Some(0), "{stderr}");
    assert_eq!(
        stderr,
        "executor: profile \"strict\" (the strongest; landlock where strict cannot run \
         here; --profile NAME to choose)\n"
    );
    assert_eq!(String::from_utf8_lossy(&root.stdout), "65534\nC.UTF-8\n");
    // As an ordinary user strict cannot build its namespaces: landlock takes its place, the
    // command runs once, and stderr says why.
    let user = run(Some(65534));
    let stderr = String::from_utf8_lossy(&user.stderr);
    assert_eq!(user.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&user.stdout), "65534\nC.UTF-8\n");
    assert!(
        stderr.contains(
            "executor: profile \"landlock\" instead: strict cannot run here (environment_error: "
        ),
        "{stderr}"
    );
    // Named, it is the one used, and said so; never task-container by itself.
    let named = executor_run("landlock", &[], "true").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&named.stderr),
        "executor: profile \"landlock\" (named with --profile)\n"
    );
}

#[tokio::test]
async fn a_run_past_its_timeout_exits_124_and_leaves_no_process_behind() {
    if !require("root", is_root()) {
        return;
    }
    for profile in ["strict", "landlock"] {
        let m = marker();
        let sleep = marked_sleep(&m);
        let mut run = executor_run(
            profile,
            &["--timeout", "2"],
            &format!("setsid {sleep} & ({sleep} &); nohup {sleep} >/dev/null 2>&1 & {sleep}"),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        let run_pid = run.id() as i32;
        assert!(sleepers_up(&m, 4).await, "{profile}: {:?}", sleepers(&m));
        // While it runs: the helper's parent is the run's fork server, itself a child of the
        // run (forked, not exec'd), so every process of the run descends from it.
        let tree = descendants(run_pid);
        for pid in sleepers(&m) {
            assert!(
                tree.contains(&pid),
                "{profile}: sleeper {pid} outside the run"
            );
        }
        let servers: Vec<i32> = tree
            .iter()
            .copied()
            .filter(|p| parent_of(*p) == Some(run_pid))
            .collect();
        assert_eq!(
            servers.len(),
            1,
            "{profile}: the run's children {servers:?}"
        );
        let cmdline = |pid: i32| {
            String::from_utf8_lossy(
                &std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default(),
            )
            .replace('\0', " ")
        };
        assert_eq!(
            cmdline(servers[0]),
            cmdline(run_pid),
            "{profile}: the run's fork server is forked from it, not a binary exec'd again"
        );
        let status = run.wait().unwrap();
        assert_eq!(status.code(), Some(124), "{profile}");
        // Afterwards: no sleeper, and nothing of the run (fork server, helper) left.
        assert_all_gone(&m, &tree, profile).await;
    }
}

#[tokio::test]
async fn a_run_killed_outright_leaves_no_command_and_its_fork_server_exits_after_it() {
    if !require("root", is_root()) {
        return;
    }
    let m = marker();
    let sleep = marked_sleep(&m);
    let mut run = executor_run("landlock", &[], &format!("setsid {sleep} & {sleep}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(sleepers_up(&m, 2).await);
    let tree = descendants(run.id() as i32);
    assert!(!tree.is_empty());
    run.kill().unwrap();
    run.wait().unwrap();
    assert_all_gone(&m, &tree, "killed run").await;
    // Control: the same command, left alone, is still running after a while.
    let m = marker();
    let mut run = executor_run("landlock", &[], &marked_sleep(&m))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    assert!(sleepers_up(&m, 1).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sleepers(&m).len(), 1);
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(sleepers_gone(&m).await);
}

#[tokio::test]
async fn a_run_whose_output_nobody_reads_still_ends_its_command_at_the_timeout() {
    if !require("root", is_root()) {
        return;
    }
    // More output than the pipes between the command and our end hold: the run's writes to
    // its stdout block while we read nothing, and its timer must fire all the same.
    let m = marker();
    let sleep = marked_sleep(&m);
    let mut run = executor_run(
        "landlock",
        &["--timeout", "2"],
        &format!("{sleep} & head -c 4000000 /dev/zero | tr '\\0' x; wait"),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    // Control: the command is running (its sleeper is there) before the timeout.
    assert!(sleepers_up(&m, 1).await, "{:?}", sleepers(&m));
    let tree = descendants(run.id() as i32);
    // Ended by the timeout while its output is still unread.
    assert!(
        sleepers_gone(&m).await,
        "the timeout did not end the command while its output went unread: {:?}",
        sleepers(&m)
    );
    // Reading now lets the run finish: the timeout's exit code, and nothing of it left.
    let mut stdout = run.stdout.take().unwrap();
    let mut printed = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut printed).unwrap();
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(124));
    assert!(printed.len() > 64 * 1024, "{} bytes", printed.len());
    assert_all_gone(&m, &tree, "unread run").await;
}

/// Prints the command's network namespace, its interfaces and whether a datagram to itself
/// over 127.0.0.1 comes back (loopback up), one line each.
const NET_PROBE: &str = r#"
import os, socket
print(os.readlink("/proc/self/ns/net"))
print(",".join(sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:])))
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("127.0.0.1", 0))
    u.settimeout(2)
    u.sendto(b"ping", u.getsockname())
    print(u.recv(4).decode())
except OSError as e:
    print(f"udp: {e.strerror}")
"#;

#[tokio::test]
async fn a_strict_run_has_a_network_namespace_of_its_own_and_its_fork_server_stays_in_the_hosts() {
    use std::io::BufRead;
    if !require("root", is_root()) {
        return;
    }
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let host_ns = host_ns.to_string_lossy();
    for profile in ["strict", "landlock"] {
        let m = marker();
        let mut run = executor_run(
            profile,
            &[],
            &format!(
                "python3 -c '{}'; exec {}",
                NET_PROBE.replace('\'', "'\\''"),
                marked_sleep(&m)
            ),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        let run_pid = run.id() as i32;
        let mut lines = std::io::BufReader::new(run.stdout.take().unwrap()).lines();
        let mut line = || lines.next().and_then(Result::ok).unwrap_or_default();
        let (ns, interfaces, udp) = (line(), line(), line());
        assert!(sleepers_up(&m, 1).await);
        // The run's fork server (the child that shares its command line) is in the host's
        // namespace, also where it made the command's.
        let tree = descendants(run_pid);
        let server = tree
            .iter()
            .copied()
            .find(|p| parent_of(*p) == Some(run_pid))
            .unwrap();
        let server_ns = std::fs::read_link(format!("/proc/{server}/ns/net")).unwrap();
        assert_eq!(
            server_ns.to_string_lossy(),
            host_ns,
            "{profile}: fork server"
        );
        if profile == "strict" {
            assert_ne!(
                ns, host_ns,
                "strict: the command is in the host's namespace"
            );
            assert_eq!(interfaces, "lo", "strict: interfaces");
            assert_eq!(udp, "ping", "strict: loopback is not up");
        } else {
            // Control: landlock makes no namespace; the command sees the host's.
            assert_eq!(ns, host_ns, "landlock");
            let names: Vec<&str> = interfaces.split(',').collect();
            assert!(
                names.contains(&"lo") && names.len() > 1,
                "landlock: {interfaces}"
            );
        }
        run.kill().unwrap();
        run.wait().unwrap();
        assert_all_gone(&m, &tree, profile).await;
    }
}

/// A temporary directory of the test's own under /tmp (mode 0755, as /tmp's runs need to pass
/// through): no other test's run makes homes in it.
fn private_tmpdir() -> executor_tests::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let tmp = executor_tests::TempDir::new_in("/tmp").unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    tmp
}

/// SIGKILL every sleeper of `marker` (its run then ends as if the command had been killed).
fn kill_sleepers(marker: &str) {
    for pid in sleepers(marker) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// A tmpfs mounted on `dir` with a file `kept` in it, as a process outside a sandbox might
/// mount into a home of its uid; the file's path.
fn mount_with_a_file(dir: &std::path::Path) -> std::path::PathBuf {
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap();
    std::fs::write(dir.join("kept"), "on the mount").unwrap();
    dir.join("kept")
}

/// A landlock run of a sleeper with `$TMPDIR` at `tmp`, once its command runs (in a process
/// group of its own with `own_group`, as a terminal starts it): the run, its marker, its fork
/// server, and its home, the one in `tmp` not in `known`. Its cgroup directories are there
/// too (the control of every test that sees them gone).
async fn sleeper_run(
    tmp: &std::path::Path,
    known: &[std::path::PathBuf],
    own_group: bool,
) -> SleeperRun {
    use std::os::unix::process::CommandExt;
    let marker = marker();
    let mut command = executor_run("landlock", &[], &marked_sleep(&marker));
    command
        .env("TMPDIR", tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if own_group {
        command.process_group(0);
    }
    let run = command.spawn().unwrap();
    assert!(sleepers_up(&marker, 1).await);
    let new: Vec<_> = homes_in(tmp)
        .into_iter()
        .filter(|h| !known.contains(h))
        .collect();
    assert_eq!(new.len(), 1, "{new:?}");
    assert!(!crate::host_cgroups::run_cgroup_dirs(run.id()).is_empty());
    let server = fork_server_of(run.id() as i32);
    SleeperRun {
        pid: run.id(),
        run,
        marker,
        server,
        home: new[0].clone(),
    }
}

struct SleeperRun {
    run: std::process::Child,
    pid: u32,
    marker: String,
    server: i32,
    home: std::path::PathBuf,
}

/// A short `executor run --profile landlock` with `$TMPDIR` at `tmp`, to its end and its
/// fork server's (which removes what the run leaves, and sweeps what dead runs left).
async fn run_in(tmp: &std::path::Path) {
    let mut run = executor_run("landlock", &[], "sleep 0.5")
        .env("TMPDIR", tmp)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Found while the command runs (its server is a child of the run until the run exits).
    let server = {
        let pid = run.id() as i32;
        let mut found = None;
        assert!(
            eventually(PATIENCE, || {
                found = children(pid).first().copied();
                found.is_some()
            })
            .await
        );
        found.unwrap()
    };
    assert!(run.wait().unwrap().success());
    assert!(exits(server).await);
}

/// The running processes whose parent is `pid`.
fn children(pid: i32) -> Vec<i32> {
    descendants(pid)
        .into_iter()
        .filter(|p| parent_of(*p) == Some(pid))
        .collect()
}

/// The fork server of the run `pid` (its one child process), once the run's command runs.
fn fork_server_of(pid: i32) -> i32 {
    let children = children(pid);
    assert_eq!(children.len(), 1, "the run's children: {children:?}");
    children[0]
}

/// Whether the process `pid` has exited within [`PATIENCE`].
async fn exits(pid: i32) -> bool {
    eventually(PATIENCE, || !alive(pid)).await
}

/// Asserts that the run `run_pid` left no cgroup directory.
fn assert_no_run_cgroups(run_pid: u32) {
    assert_eq!(
        crate::host_cgroups::run_cgroup_dirs(run_pid),
        Vec::<String>::new(),
        "cgroup directories of run {run_pid} left"
    );
}

/// Asserts that the run `run_pid` left nothing: no command home beneath `tmp` (now, not
/// eventually) and no cgroup directory.
fn assert_run_left_nothing(tmp: &std::path::Path, run_pid: u32) {
    assert!(homes_in(tmp).is_empty(), "{:?}", homes_in(tmp));
    assert_no_run_cgroups(run_pid);
}

/// Asserts that every command home beneath `tmp` is gone within [`PATIENCE`].
async fn assert_homes_go(tmp: &std::path::Path) {
    assert!(
        eventually(PATIENCE, || homes_in(tmp).is_empty()).await,
        "{:?}",
        homes_in(tmp)
    );
}

/// Whether `pid` is still a process that has not exited (a zombie waiting for a reaper that
/// may never come, in a container whose pid 1 reaps nothing, counts as gone).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_string();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// Where runs of ours (root) make their homes in the temporary directory `dir`.
fn homes_dir(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("executor-homes-0")
}

/// The `executor-home-*` directories in `dir`'s homes directory, and in `dir` itself.
fn homes_in(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut homes: Vec<_> = [dir.to_path_buf(), homes_dir(dir)]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("executor-home-"))
        })
        .collect();
    homes.sort();
    homes
}

#[tokio::test]
async fn a_run_makes_a_home_only_where_its_profile_gives_the_command_one_and_removes_it_after() {
    if !require("root", is_root()) {
        return;
    }
    use std::io::BufRead;
    use std::os::unix::fs::MetadataExt;
    // landlock's HOME is the run's own home (the control); strict's is its private /tmp, so
    // none is made for it.
    for (profile, home_made) in [("landlock", true), ("strict", false)] {
        let tmp = private_tmpdir();
        let m = marker();
        let mut run = executor_run(profile, &[], &format!("echo $HOME; {}", marked_sleep(&m)))
            .env("TMPDIR", tmp.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut home = String::new();
        std::io::BufReader::new(run.stdout.take().unwrap())
            .read_line(&mut home)
            .unwrap();
        let home = home.trim().to_string();
        assert!(
            sleepers_up(&m, 1).await,
            "{profile}: the command is not running"
        );
        // While the command runs, seen from the host.
        let homes = homes_in(tmp.path());
        if home_made {
            assert_eq!(homes.len(), 1, "{profile}: {homes:?}");
            assert_eq!(homes[0].to_string_lossy(), home, "{profile}");
            let meta = std::fs::metadata(&homes[0]).unwrap();
            assert_eq!(
                meta.uid(),
                65534,
                "{profile}: the home is the command's own"
            );
            assert_eq!(meta.mode() & 0o777, 0o700, "{profile}");
            // In a directory of root's that others may only pass through.
            assert_eq!(homes[0].parent(), Some(homes_dir(tmp.path()).as_path()));
            let parent = std::fs::metadata(homes_dir(tmp.path())).unwrap();
            assert_eq!((parent.uid(), parent.mode() & 0o777), (0, 0o711));
        } else {
            assert!(homes.is_empty(), "{profile}: {homes:?}");
            assert_eq!(home, "/tmp", "{profile}");
        }
        kill_sleepers(&m);
        run.wait().unwrap();
        // Removed by the run's fork server, just after the run has exited.
        assert!(
            eventually(PATIENCE, || homes_in(tmp.path()).is_empty()).await,
            "{profile}: the home outlived the run: {:?}",
            homes_in(tmp.path())
        );
    }
}

#[tokio::test]
async fn a_killed_runs_home_is_removed_by_its_fork_server_or_else_by_the_next_run() {
    if !require("root", is_root()) {
        return;
    }
    let tmp = private_tmpdir();
    // A run killed outright: its command dies with it, and its fork server, which outlives
    // it, removes its home.
    let SleeperRun {
        mut run,
        marker: killed,
        home,
        ..
    } = sleeper_run(tmp.path(), &[], false).await;
    run.kill().unwrap();
    run.wait().unwrap();
    assert!(sleepers_gone(&killed).await);
    assert!(
        eventually(PATIENCE, || !home.exists()).await,
        "the fork server of a killed run left its home"
    );
    // Two runs killed outright together with their fork servers: their homes stay (nobody
    // is left to remove them). Into one, a mount (as a dead command's home might hold one
    // that its maker put there): a home is never unmounted to be removed.
    let mut left = Vec::new();
    for _ in 0..2 {
        let SleeperRun {
            mut run,
            marker: killed,
            server,
            home,
            ..
        } = sleeper_run(tmp.path(), &left, false).await;
        left.push(home);
        send_signal(server, Signal::SIGKILL);
        run.kill().unwrap();
        run.wait().unwrap();
        assert!(sleepers_gone(&killed).await);
        assert!(exits(server).await);
    }
    assert_eq!(
        homes_in(tmp.path()),
        left,
        "a run killed with its fork server cannot remove its home"
    );
    let mounted = left[1].join("tmp");
    let kept = mount_with_a_file(&mounted);
    // A run that is still going (the control): the next run leaves its home alone.
    let SleeperRun {
        run: mut alive_run,
        marker: running,
        home: alive_home,
        ..
    } = sleeper_run(tmp.path(), &left, false).await;
    // The next run: its own home and the first killed run's are gone after it; the running
    // one's is not, nor the one with a mount beneath it, whose mount is still there.
    run_in(tmp.path()).await;
    let mut expected = vec![left[1].clone(), alive_home];
    expected.sort();
    assert_eq!(homes_in(tmp.path()), expected);
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), "on the mount");
    nix::mount::umount(&mounted).unwrap();
    kill_sleepers(&running);
    alive_run.wait().unwrap();
    // Without the mount, the next run removes it too.
    run_in(tmp.path()).await;
    assert_homes_go(tmp.path()).await;
}

#[tokio::test]
async fn a_ctrl_c_to_the_runs_process_group_leaves_its_fork_server_to_clean_up() {
    if !require("root", is_root()) {
        return;
    }
    let tmp = private_tmpdir();
    // As a terminal's Ctrl-C comes: to the whole foreground process group, the run's fork
    // server included (the command runs in a session of its own).
    let SleeperRun {
        mut run,
        pid: run_pid,
        marker: m,
        server,
        ..
    } = sleeper_run(tmp.path(), &[], true).await;
    // The server, seen from the host: the terminal's signals blocked (SIGHUP, SIGINT and
    // SIGQUIT are bits 0-2 of its mask), none of the run's stdio, not in its directory. (Were
    // it killed, the run would remove what it left itself: only this tells the two apart.)
    let status = std::fs::read_to_string(format!("/proc/{server}/status")).unwrap();
    let blocked = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        blocked & 0b111,
        0b111,
        "the server's blocked signals: {blocked:#x}"
    );
    for fd in 0..3 {
        let target = std::fs::read_link(format!("/proc/{server}/fd/{fd}")).unwrap();
        assert_eq!(target, std::path::Path::new("/dev/null"), "fd {fd}");
    }
    assert_eq!(
        std::fs::read_link(format!("/proc/{server}/cwd")).unwrap(),
        std::path::Path::new("/")
    );
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(run_pid as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    assert_eq!(run.wait().unwrap().code(), Some(130));
    assert!(sleepers_gone(&m).await);
    // The server lived through the Ctrl-C, removed what the run left, and exited.
    assert!(exits(server).await);
    assert_run_left_nothing(tmp.path(), run_pid);
}

#[tokio::test]
async fn a_run_whose_fork_server_died_removes_what_it_left_itself() {
    if !require("root", is_root()) {
        return;
    }
    let tmp = private_tmpdir();
    let SleeperRun {
        mut run,
        pid: run_pid,
        marker: m,
        server,
        ..
    } = sleeper_run(tmp.path(), &[], false).await;
    // The server dies (its command's supervisor with it, and so the command): the run ends
    // on its own, with nobody else to clean up after it.
    send_signal(server, Signal::SIGKILL);
    run.wait().unwrap();
    assert!(sleepers_gone(&m).await);
    // Gone as soon as the run is: it removed them before it exited.
    assert_run_left_nothing(tmp.path(), run_pid);
}

#[tokio::test]
async fn a_run_does_not_unmount_what_was_mounted_into_its_commands_home_to_remove_it() {
    if !require("root", is_root()) {
        return;
    }
    use std::io::BufRead;
    let tmp = private_tmpdir();
    // landlock hands its command's home to uid 65534, whose processes outside the sandbox
    // could mount into it (FUSE). Mounted while the command runs (here by the test, as root):
    // the run's fork server leaves that home and the mount.
    let m = marker();
    let mut run = executor_run(
        "landlock",
        &[],
        &format!("echo $HOME; {}", marked_sleep(&m)),
    )
    .env("TMPDIR", tmp.path())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut home = String::new();
    std::io::BufReader::new(run.stdout.take().unwrap())
        .read_line(&mut home)
        .unwrap();
    let home = std::path::PathBuf::from(home.trim());
    assert!(sleepers_up(&m, 1).await);
    let run_pid = run.id();
    assert!(!crate::host_cgroups::run_cgroup_dirs(run_pid).is_empty());
    let server = fork_server_of(run_pid as i32);
    let mounted = home.join("tmp");
    let kept = mount_with_a_file(&mounted);
    kill_sleepers(&m);
    run.wait().unwrap();
    // Once the run's fork server, which removes what the run leaves, is gone too: it removed
    // the rest (the run's cgroup directories), not the home.
    assert!(exits(server).await);
    assert_no_run_cgroups(run_pid);
    assert_eq!(homes_in(tmp.path()), vec![home.clone()]);
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), "on the mount");
    // Control: once the mount is gone, the next run removes the home.
    nix::mount::umount(&mounted).unwrap();
    run_in(tmp.path()).await;
    assert_homes_go(tmp.path()).await;
}
