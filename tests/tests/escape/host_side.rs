//! The host side of a case: processes it plants for commands to attack (canaries), what its
//! listeners received, what must be gone after a kill, and files it removes when done.

use std::io::{ErrorKind, Read};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use executor_tests::{eventually, marked_sleep, process_state, processes_matching, PATIENCE};

/// The process lives (exists and is no zombie).
pub fn alive(pid: i32) -> bool {
    matches!(process_state(pid), Some(s) if s != 'Z')
}

/// A host process that commands must not be able to touch, killed and reaped when dropped.
pub struct Canary {
    child: Child,
    pub pid: i32,
}

impl Canary {
    /// `sh -c 'exec <marked sleep of m>'`: a process of the daemon's uid.
    pub async fn sleep(m: &str) -> Canary {
        let mut command = Command::new("sh");
        command.arg("-c").arg(format!("exec {}", marked_sleep(m)));
        Canary::start(command).await
    }

    /// Start `command` (stdin closed) and wait until it runs.
    pub async fn start(mut command: Command) -> Canary {
        let child = command.stdin(Stdio::null()).spawn().unwrap();
        let pid = child.id() as i32;
        assert!(
            eventually(PATIENCE, || alive(pid)).await,
            "the canary {command:?} (pid {pid}) never ran"
        );
        Canary { child, pid }
    }

    pub fn alive(&self) -> bool {
        alive(self.pid)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A listener the host holds for commands to reach.
pub trait Listener {
    type Stream: Read;
    fn set_nonblocking(&self, on: bool) -> std::io::Result<()>;
    fn accept_one(&self) -> std::io::Result<Self::Stream>;
    fn prepare(stream: &Self::Stream) -> std::io::Result<()>;
}

impl Listener for TcpListener {
    type Stream = std::net::TcpStream;
    fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        TcpListener::set_nonblocking(self, on)
    }
    fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().map(|(s, _)| s)
    }
    fn prepare(stream: &Self::Stream) -> std::io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))
    }
}

impl Listener for UnixListener {
    type Stream = std::os::unix::net::UnixStream;
    fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        UnixListener::set_nonblocking(self, on)
    }
    fn accept_one(&self) -> std::io::Result<Self::Stream> {
        self.accept().map(|(s, _)| s)
    }
    fn prepare(stream: &Self::Stream) -> std::io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))
    }
}

/// Accept one connection within a short wait and return what it sent (`None`: nobody came).
pub fn accepted<L: Listener>(listener: &L) -> Option<String> {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        match listener.accept_one() {
            Ok(mut stream) => {
                L::prepare(&stream).unwrap();
                let mut buf = Vec::new();
                let _ = stream.read_to_end(&mut buf);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// No host process carries the marker `m` any more (waited for): panics "`<context>`:
/// survivors [...]" otherwise.
pub async fn assert_none_left(m: &str, context: &str) {
    assert!(
        eventually(PATIENCE, || processes_matching(m).is_empty()).await,
        "{context}: survivors {:?}",
        processes_matching(m)
    );
}

/// A file or empty directory the case planted on the host, removed when dropped (so also when
/// the case fails).
pub struct RemoveOnDrop(pub std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if std::fs::remove_file(&self.0).is_err() {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
}
