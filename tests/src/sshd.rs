//! A real sshd on a loopback port for the ssh deployment, with a host key and a client key
//! made here: the deploy suite and the benchmark start it alike.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};

/// Where Debian's openssh-server puts it.
pub const SSHD: &str = "/usr/sbin/sshd";

/// An sshd on a loopback port, with a host key and a client key made here; killed on drop.
pub struct Sshd {
    child: std::process::Child,
    /// The loopback port it listens on.
    pub port: u16,
    dir: crate::TempDir,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keygen(path: &Path) -> anyhow::Result<()> {
    let ok = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .context("cannot run ssh-keygen")?;
    if !ok.success() {
        bail!("ssh-keygen failed");
    }
    Ok(())
}

impl Sshd {
    /// Start one; root is needed (it logs in as root with the client key).
    pub fn start() -> anyhow::Result<Self> {
        if !Path::new(SSHD).exists() {
            bail!("{SSHD} is missing (apt-get install openssh-server)");
        }
        let dir = crate::TempDir::with_prefix("executor-tests-sshd-")?;
        let d = dir.path();
        keygen(&d.join("host_key"))?;
        keygen(&d.join("client_key"))?;
        std::fs::copy(d.join("client_key.pub"), d.join("authorized_keys"))?;
        // sshd's privilege separation directory.
        std::fs::create_dir_all("/run/sshd")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\n\
             AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\n\
             PermitRootLogin prohibit-password\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
             AllowTcpForwarding local\nMaxStartups 64\nMaxSessions 64\n\
             ClientAliveInterval 5\nClientAliveCountMax 2\n",
            d = d.display()
        );
        std::fs::write(d.join("sshd_config"), config)?;
        let child = std::process::Command::new(SSHD)
            .args(["-D", "-e", "-f"])
            .arg(d.join("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("sshd.log"))?)
            .spawn()
            .context("cannot start sshd")?;
        let mut sshd = Self { child, port, dir };
        let up = (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        if !up {
            let _ = sshd.child.kill();
            bail!(
                "sshd did not start: {}",
                std::fs::read_to_string(sshd.dir.path().join("sshd.log")).unwrap_or_default()
            );
        }
        Ok(sshd)
    }

    /// The client key that logs in as root.
    pub fn key(&self) -> PathBuf {
        self.dir.path().join("client_key")
    }

    /// `agent` flags for the ssh deployment to this sshd, with the static executor.
    pub fn deploy_flags(&self) -> Vec<String> {
        vec![
            "--deploy".into(),
            "ssh".into(),
            "--ssh-host".into(),
            "root@127.0.0.1".into(),
            "--ssh-port".into(),
            self.port.to_string(),
            "--ssh-identity".into(),
            self.key().display().to_string(),
            "--ssh-option".into(),
            "StrictHostKeyChecking=no".into(),
            "--ssh-option".into(),
            "UserKnownHostsFile=/dev/null".into(),
            "--ssh-option".into(),
            "LogLevel=ERROR".into(),
            "--executor-static".into(),
            crate::static_executor().display().to_string(),
        ]
    }
}
