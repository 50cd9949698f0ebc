//! Real containers: podman with runc (lab.md), an image made here from busybox and bash (no
//! registry), the static executor bind-mounted read-only as the entrypoint, serving TLS on a
//! port published on 127.0.0.1 only. Container processes are host processes, so "outside" is
//! the host itself (`ps`, /proc) and `podman exec` for the container's own view.
//!
//! The image is built once per run and cached by podman under a tag naming the digest of its
//! inputs. The two long-lived containers (default and `--privileged`) are shared by the tests
//! of a binary; [`Container::start`] gives a test one of its own (to `podman kill` it). Each
//! is removed by a [`Lifeline`] when the test process ends, however it ends.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::lifeline::Lifeline;
use crate::rootfs::Rootfs;
use crate::target::{
    fresh_token, host_processes, write_private, Endpoint, Outside, Process, Target,
};

pub const PODMAN: &str = "podman";
/// Label on every container the tests start, to find leftovers: `podman ps -a --filter
/// label=executor-tests`.
pub const LABEL: &str = "executor-tests";
/// Start-up of the daemon, including its profile probes.
const START_PATIENCE: Duration = Duration::from_secs(60);

/// How to run a container.
#[derive(Debug, Clone, Copy, Default)]
pub struct ContainerOptions {
    /// `--privileged`: all capabilities, no seccomp, writable cgroups; strict can work.
    pub privileged: bool,
    /// The image without bash ([`image_without_bash`]), the daemon started with
    /// `--interpreter "sh -c"`.
    pub without_bash: bool,
}

pub struct Container {
    pub name: String,
    pub endpoint: Endpoint,
    /// The host file holding the token (mode 0600), bind-mounted read-only.
    pub token_file: PathBuf,
    /// Seconds from `podman run` to the daemon's ready line.
    pub start_seconds: f64,
    _lifeline: Lifeline,
    _run_dir: crate::TempDir,
}

/// The default (unprivileged) container of this test binary, started by the first test that
/// asks; `None` locally when podman or runc is missing (a failure in CI).
pub fn shared() -> Option<&'static Container> {
    static SHARED: OnceLock<Result<Container, String>> = OnceLock::new();
    shared_in(&SHARED, ContainerOptions::default())
}

/// The `--privileged` container of this test binary.
pub fn shared_privileged() -> Option<&'static Container> {
    static SHARED: OnceLock<Result<Container, String>> = OnceLock::new();
    shared_in(
        &SHARED,
        ContainerOptions {
            privileged: true,
            ..ContainerOptions::default()
        },
    )
}

fn shared_in(
    cell: &'static OnceLock<Result<Container, String>>,
    opts: ContainerOptions,
) -> Option<&'static Container> {
    if !tools_present() {
        return None;
    }
    match cell.get_or_init(|| Container::try_start(opts)) {
        Ok(c) => Some(c),
        Err(e) => panic!("the test container did not start: {e}"),
    }
}

fn tools_present() -> bool {
    let have = |program: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    // Rootful podman: the suites look at container processes from the host as root, and
    // rootless containers are another shape (a user namespace) this suite does not cover.
    crate::require("root (rootful podman)", crate::is_root())
        && crate::require("podman (apt-get install podman)", have(PODMAN))
        && crate::require("runc (apt-get install runc)", have("runc"))
        && crate::require(
            "busybox-static and bash-static",
            Path::new(crate::rootfs::BUSYBOX).exists()
                && Path::new(crate::rootfs::BASH_STATIC).exists(),
        )
}

/// `podman` with the runtime lab.md names: crun refuses this host's hybrid cgroups.
pub fn podman() -> Command {
    let mut c = Command::new(PODMAN);
    c.args(["--runtime", "runc"]);
    c
}

/// Run podman, failing with its output unless it succeeds; returns stdout.
fn podman_ok(args: &[&str]) -> Result<String, String> {
    let out = podman().args(args).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "podman {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The test image (busybox, bash, /var/lib), imported once per run from a rootfs tar; returns
/// its name.
pub fn image() -> Result<String, String> {
    static IMAGE: OnceLock<Result<String, String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| import(&Rootfs::base(), "executor-tests"))
        .clone()
}

/// The test image without bash (busybox only, `sh` is its ash), as an Alpine-like task image
/// is: commands must run as `sh -c`. Imported once per run.
pub fn image_without_bash() -> Result<String, String> {
    static IMAGE: OnceLock<Result<String, String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| import(&Rootfs::busybox_only(), "executor-tests-nobash"))
        .clone()
}

/// A task image, as a benchmark's would be: the test image plus git (the host's, with its
/// libraries), so tasks can be git repositories and submissions `git diff`s, and a
/// `/testbed` owned by root (mode 0755) as SWE-bench's images have. Imported once per run,
/// tagged by the digest of its inputs.
pub fn task_image() -> Result<String, String> {
    static IMAGE: OnceLock<Result<String, String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let mut fs = Rootfs::base();
            fs.program_with_libraries("/usr/bin/git");
            fs.dir("testbed", 0o755);
            import(&fs, "executor-tests-task")
        })
        .clone()
}

/// Import `fs` as `localhost/<repo>:<digest>` unless podman has it; returns its name.
fn import(fs: &Rootfs, repo: &str) -> Result<String, String> {
    let name = format!("localhost/{repo}:{}", &fs.digest()[..16]);
    let exists = podman().args(["image", "exists", &name]).status();
    if exists.is_ok_and(|s| s.success()) {
        return Ok(name);
    }
    let dir = crate::TempDir::new().map_err(|e| e.to_string())?;
    let tree = dir.path().join("root");
    fs.write_to(&tree);
    let status = Command::new("sh")
        .args([
            "-c",
            "tar --numeric-owner --owner=0 --group=0 -C \"$1\" -c . | podman import - \"$2\" >/dev/null",
            "import",
        ])
        .arg(&tree)
        .arg(&name)
        .status()
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("podman import {name} failed"));
    }
    Ok(name)
}

/// Whether podman, runc and the image inputs are here (fails in CI when not).
pub fn available() -> bool {
    tools_present()
}

impl Container {
    /// A container of its own for one test (removed when dropped).
    pub fn start(opts: ContainerOptions) -> Option<Self> {
        if !tools_present() {
            return None;
        }
        Some(Self::try_start(opts).unwrap_or_else(|e| panic!("container did not start: {e}")))
    }

    fn try_start(opts: ContainerOptions) -> Result<Self, String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let image = if opts.without_bash {
            image_without_bash()?
        } else {
            image()?
        };
        let executor = crate::static_build::static_executor();
        let run_dir =
            crate::TempDir::with_prefix("executor-container-").map_err(|e| e.to_string())?;
        let token = fresh_token();
        let token_file = run_dir.path().join("token");
        write_private(&token_file, &token);
        let profiles = run_dir.path().join("profiles");
        std::fs::create_dir(&profiles).map_err(|e| e.to_string())?;
        for (name, text) in crate::profiles::small_profiles() {
            std::fs::write(profiles.join(format!("{name}.json")), text)
                .map_err(|e| e.to_string())?;
        }
        let name = format!(
            "executor-tests-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        // Set up before the container exists, so that no way of ending leaves it behind.
        let lifeline = Lifeline::new(&format!("podman rm -f -t 0 {name} >/dev/null 2>&1"));
        let started = Instant::now();
        let mut run = podman();
        run.args(["run", "-d", "--name", &name, "--label", LABEL])
            .args([
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=4096:4096",
            ])
            .args([
                "-p",
                "127.0.0.1::7681",
                "--entrypoint",
                "/usr/local/bin/executor",
            ])
            .args(["-e", "RUST_LOG=info"])
            .arg("-v")
            .arg(format!("{}:/usr/local/bin/executor:ro", executor.display()))
            .arg("-v")
            .arg(format!("{}:/etc/executor-token:ro", token_file.display()))
            .arg("-v")
            .arg(format!("{}:/etc/executor/profiles:ro", profiles.display()));
        if opts.privileged {
            run.arg("--privileged");
        }
        run.arg(&image).args([
            "serve",
            "--listen",
            "0.0.0.0:7681",
            "--tls",
            "--token-file",
            "/etc/executor-token",
            "--profiles-dir",
            "/etc/executor/profiles",
        ]);
        run.args(crate::profiles::allow_every_profile());
        if opts.without_bash {
            run.args(["--interpreter", "sh -c"]);
        }
        let out = run.output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "podman run: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let (url, fingerprint) = wait_ready_line(&name)?;
        let start_seconds = started.elapsed().as_secs_f64();
        let published = podman_ok(&["port", &name, "7681/tcp"])?;
        let host_addr = published
            .lines()
            .next()
            .ok_or("podman port: nothing published")?
            .trim()
            .to_string();
        let url = url.replace("0.0.0.0:7681", &host_addr);
        Ok(Self {
            name,
            endpoint: Endpoint {
                url,
                token,
                fingerprint,
            },
            token_file,
            start_seconds,
            _lifeline: lifeline,
            _run_dir: run_dir,
        })
    }

    /// The daemon's output so far (`podman logs`: ready line and log).
    pub fn logs(&self) -> String {
        podman()
            .args(["logs", &self.name])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default()
    }

    /// Host pid of the container's first process: the daemon, the entrypoint. `None` once the
    /// container stopped.
    pub fn daemon_host_pid(&self) -> Option<i32> {
        let pid = podman_ok(&["inspect", "-f", "{{.State.Pid}}", &self.name]).ok()?;
        pid.trim().parse().ok().filter(|p| *p > 0)
    }

    /// `podman kill`: SIGKILL to the container's first process, as an orchestrator does.
    pub fn kill(&self) {
        podman_ok(&["kill", &self.name]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Whether podman says the container is running.
    pub fn running(&self) -> bool {
        podman_ok(&["inspect", "-f", "{{.State.Running}}", &self.name])
            .is_ok_and(|s| s.trim() == "true")
    }
}

impl Target for Container {
    fn endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    fn token_file(&self) -> PathBuf {
        self.token_file.clone()
    }

    /// `podman exec`: a root shell in the container's namespaces, beside the daemon rather
    /// than under it.
    fn outside(&self, script: &str) -> Outside {
        let out = podman()
            .args([
                "exec",
                &self.name,
                "sh",
                "-c",
                &format!("exec 2>&1; {script}"),
            ])
            .output()
            .expect("podman exec runs");
        Outside {
            code: out.status.code().unwrap_or(-1),
            output: String::from_utf8_lossy(&out.stdout).into_owned(),
        }
    }

    /// The host's processes: a container's are among them, and a survivor that left the
    /// container's cgroup or namespaces would still be seen here.
    fn processes(&self) -> Vec<Process> {
        host_processes()
    }
}

/// Wait for the ready line in `podman logs`: `(url, fingerprint)`.
fn wait_ready_line(name: &str) -> Result<(String, Option<String>), String> {
    let deadline = Instant::now() + START_PATIENCE;
    loop {
        let out = podman()
            .args(["logs", name])
            .output()
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some((url, _, fingerprint)) = stdout.lines().find_map(crate::parse_ready_line) {
            return Ok((url, fingerprint));
        }
        let running = podman_ok(&["inspect", "-f", "{{.State.Running}}", name])
            .is_ok_and(|s| s.trim() == "true");
        if !running || Instant::now() > deadline {
            return Err(format!(
                "no ready line (running: {running}):\n{stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
