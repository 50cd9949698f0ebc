//! A remote VM for real: Debian 12's cloud kernel (6.1, pure cgroup v2 with
//! `cgroup_no_v1=all`) under qemu's software emulation, its /init starting the static executor
//! with `--tls`. Tests reach the daemon as an agent on another machine would: through qemu's
//! forwarded port on 127.0.0.1, over `wss://` with the certificate pinned; and they look inside
//! through a side channel that is not the executor.
//!
//! One VM per test binary ([`shared`]): booting under emulation takes seconds, the checks
//! share it. A [`Lifeline`] kills qemu when the test process ends, however it ends.

mod image;
mod side_channel;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use image::cache_dir;
use side_channel::SideChannel;

use crate::lifeline::Lifeline;
use crate::target::{
    free_port, fresh_token, parse_ps, write_private, Endpoint, Outside, Process, Target,
};

/// Boot and start-up of the daemon under emulation (TCG), on a loaded 2-core machine: 240 s
/// was not enough at a load average of 13 to 21, where every suite ran at once.
const BOOT_PATIENCE: Duration = Duration::from_secs(600);
/// One side-channel request (a `ps` of the whole VM takes a fraction of a second).
const SIDE_PATIENCE: Duration = Duration::from_secs(60);

pub const QEMU: &str = "qemu-system-x86_64";

pub struct Vm {
    pub endpoint: Endpoint,
    /// The host's loopback port forwarded to the executor's 7681.
    pub port: u16,
    /// Seconds from spawning qemu to the daemon's ready line on the console.
    pub boot_seconds: f64,
    /// The host file holding the token (mode 0600), for clients that read one (the agent).
    pub token_file: PathBuf,
    console: PathBuf,
    side: Mutex<SideChannel>,
    qemu: Mutex<Child>,
    _lifeline: Lifeline,
    _run_dir: crate::TempDir,
}

/// The VM of this test binary, booted by the first test that asks; `None` (locally) when qemu
/// or the other tools are missing, through [`crate::require`] (a failure in CI).
pub fn shared() -> Option<&'static Vm> {
    static VM: OnceLock<Result<Vm, String>> = OnceLock::new();
    if !tools_present() {
        return None;
    }
    match VM.get_or_init(Vm::boot) {
        Ok(vm) => Some(vm),
        Err(e) => panic!("the test VM did not come up: {e}"),
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
    crate::require(
        "qemu-system-x86_64 (apt-get install qemu-system-x86)",
        have(QEMU),
    ) && crate::require(
        "busybox-static and bash-static",
        std::path::Path::new(crate::rootfs::BUSYBOX).exists()
            && std::path::Path::new(crate::rootfs::BASH_STATIC).exists(),
    ) && crate::require("cpio", have("cpio"))
        && crate::require("git (the demo task's repository)", have("git"))
}

impl Vm {
    fn boot() -> Result<Self, String> {
        let (vmlinuz, kernel_root) = image::kernel()?;
        let base = image::base_initramfs(&kernel_root, &crate::static_build::static_executor());
        let run_dir = crate::TempDir::with_prefix("executor-vm-").map_err(|e| e.to_string())?;
        let token = fresh_token();
        let token_file = run_dir.path().join("token");
        write_private(&token_file, &token);
        let initrd = image::initrd_with_token(&base, &token, run_dir.path());
        let console = run_dir.path().join("console.log");
        let side_socket = run_dir.path().join("side.sock");
        let port = free_port();
        let started = Instant::now();
        let qemu = Command::new(QEMU)
            .args(["-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "2"])
            .args(["-nodefaults", "-display", "none", "-no-reboot"])
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-kernel")
            .arg(&vmlinuz)
            .arg("-initrd")
            .arg(&initrd)
            .args([
                "-append",
                "console=ttyS0 quiet panic=-1 cgroup_no_v1=all",
                "-netdev",
                &format!("user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:7681"),
                "-device",
                "virtio-net-pci,netdev=net0",
                "-device",
                "virtio-rng-pci",
                "-device",
                "virtio-serial-pci",
                "-chardev",
                &format!(
                    "socket,id=side,path={},server=on,wait=off",
                    side_socket.display()
                ),
                "-device",
                "virtserialport,chardev=side,name=side",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(run_dir.path().join("qemu.log")).unwrap())
            .spawn()
            .map_err(|e| format!("{QEMU}: {e}"))?;
        let lifeline = Lifeline::new(&format!("kill -9 {}", qemu.id()));
        let qemu = Mutex::new(qemu);
        let (url, fingerprint) = wait_ready_line(&console, &qemu, run_dir.path())?;
        let boot_seconds = started.elapsed().as_secs_f64();
        // The daemon listens on 0.0.0.0:7681 in the VM; the host reaches it on the forward.
        let url = url.replace("0.0.0.0:7681", &format!("127.0.0.1:{port}"));
        let side = SideChannel::connect(&side_socket, BOOT_PATIENCE)?;
        Ok(Self {
            endpoint: Endpoint {
                url,
                token,
                fingerprint: Some(fingerprint),
            },
            port,
            boot_seconds,
            token_file,
            console,
            side: Mutex::new(side),
            qemu,
            _lifeline: lifeline,
            _run_dir: run_dir,
        })
    }

    /// The serial console so far (kernel messages, /init's, the daemon's ready line).
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// The daemon's log in the VM.
    pub fn daemon_log(&self) -> String {
        self.outside("cat /var/log/executor.log").output
    }

    /// Pid of the daemon in the VM.
    pub fn daemon_pid(&self) -> i32 {
        self.processes()
            .into_iter()
            .find(|p| p.cmdline.starts_with("executor serve"))
            .map(|p| p.pid)
            .unwrap_or_else(|| panic!("no executor serve in the VM:\n{}", self.console()))
    }
}

impl Target for Vm {
    fn endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    fn token_file(&self) -> PathBuf {
        self.token_file.clone()
    }

    fn outside(&self, script: &str) -> Outside {
        let mut side = self.side.lock().unwrap_or_else(|e| e.into_inner());
        side.try_run(script, SIDE_PATIENCE)
            .unwrap_or_else(|e| panic!("VM side channel: {e}\nconsole:\n{}", self.console()))
    }

    fn processes(&self) -> Vec<Process> {
        parse_ps(&self.outside_ok("ps -o pid,stat,args"))
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let mut qemu = self.qemu.lock().unwrap_or_else(|e| e.into_inner());
        let _ = qemu.kill();
        let _ = qemu.wait();
    }
}

/// Wait for `executor listening on wss://... tls-fingerprint sha256:...` on the console.
fn wait_ready_line(
    console: &std::path::Path,
    qemu: &Mutex<Child>,
    run_dir: &std::path::Path,
) -> Result<(String, String), String> {
    let deadline = Instant::now() + BOOT_PATIENCE;
    loop {
        let text = std::fs::read_to_string(console).unwrap_or_default();
        if let Some((url, _, Some(fingerprint))) = text.lines().find_map(crate::parse_ready_line) {
            return Ok((url, fingerprint));
        }
        let exited = qemu.lock().unwrap().try_wait().ok().flatten();
        if exited.is_some() || Instant::now() > deadline {
            let qemu_log = std::fs::read_to_string(run_dir.join("qemu.log")).unwrap_or_default();
            return Err(format!(
                "no ready line within {BOOT_PATIENCE:?} (qemu exit: {exited:?})\nqemu: {qemu_log}\nconsole:\n{text}"
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
