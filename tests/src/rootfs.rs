//! The root filesystems of the VM and the container images, described as a list of entries so
//! that a digest of that list keys the cache in `target/`: the same inputs give the same key,
//! and a changed binary or script gives a new image.
//!
//! The base is what a minimal task image has: busybox (with a link per applet) for the tools
//! and `sh`, and bash because commands run as `bash -c`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// busybox-static and bash-static from Debian.
pub const BUSYBOX: &str = "/usr/bin/busybox";
pub const BASH_STATIC: &str = "/usr/bin/bash-static";

enum Entry {
    Dir {
        path: String,
        mode: u32,
    },
    File {
        path: String,
        from: PathBuf,
        mode: u32,
    },
    Text {
        path: String,
        text: String,
        mode: u32,
    },
    Link {
        path: String,
        to: String,
    },
}

/// A root filesystem to build: paths are relative to its root, without a leading `/`.
#[derive(Default)]
pub struct Rootfs {
    entries: Vec<Entry>,
}

impl Rootfs {
    /// busybox with a link for each applet in /bin, bash, and the directories a daemon and
    /// its commands expect.
    pub fn base() -> Self {
        Self::busybox_with(true)
    }

    /// [`Rootfs::base`] without bash: `sh` is busybox's ash, as in an Alpine-like image, where
    /// commands must run as `sh -c`.
    pub fn busybox_only() -> Self {
        Self::busybox_with(false)
    }

    fn busybox_with(bash: bool) -> Self {
        let mut fs = Self::default();
        for dir in [
            "bin", "sbin", "etc", "proc", "sys", "dev", "root", "var/lib", "var/log",
        ] {
            fs.dir(dir, 0o755);
        }
        fs.dir("usr/local/bin", 0o755);
        fs.dir("tmp", 0o1777);
        fs.file("bin/busybox", BUSYBOX, 0o755);
        if bash {
            fs.file("bin/bash", BASH_STATIC, 0o755);
        }
        for applet in busybox_applets() {
            if applet != "busybox" && applet != "bash" {
                fs.link(&format!("bin/{applet}"), "busybox");
            }
        }
        fs.text(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            0o644,
        );
        fs.text("etc/group", "root:x:0:\nnogroup:x:65534:\n", 0o644);
        // No locale files, as in a busybox task image: the executor gives commands `C` here
        // (the profiles' C.UTF-8 only where the root has it), so bash never warns before
        // their output (containers' `locale::`).
        fs
    }

    /// Copies of every regular file under the host's `/<path>`, with their modes.
    pub fn host_tree(&mut self, path: &str) -> &mut Self {
        let out = Command::new("find")
            .arg(format!("/{path}"))
            .args(["-type", "f"])
            .output()
            .expect("find runs");
        let mut files: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        files.sort();
        for file in files {
            let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777;
            self.file(file.trim_start_matches('/'), &file, mode);
        }
        self
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> &mut Self {
        self.entries.push(Entry::Dir {
            path: path.into(),
            mode,
        });
        self
    }

    /// A copy of the host file `from` (symlinks followed).
    pub fn file(&mut self, path: &str, from: impl Into<PathBuf>, mode: u32) -> &mut Self {
        self.entries.push(Entry::File {
            path: path.into(),
            from: from.into(),
            mode,
        });
        self
    }

    pub fn text(&mut self, path: &str, text: &str, mode: u32) -> &mut Self {
        self.entries.push(Entry::Text {
            path: path.into(),
            text: text.into(),
            mode,
        });
        self
    }

    pub fn link(&mut self, path: &str, to: &str) -> &mut Self {
        self.entries.push(Entry::Link {
            path: path.into(),
            to: to.into(),
        });
        self
    }

    /// A dynamically linked host program with the shared libraries and loader it needs, at
    /// the same paths (for tools a test image needs but Debian ships no static build of).
    pub fn program_with_libraries(&mut self, program: &str) -> &mut Self {
        let ldd = Command::new("ldd").arg(program).output().expect("ldd runs");
        assert!(ldd.status.success(), "ldd {program} failed");
        self.file(program.trim_start_matches('/'), program, 0o755);
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            // "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux... (0x...)"
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(path) = path.filter(|p| p.starts_with('/')) {
                self.file(path.trim_start_matches('/'), path, 0o755);
            }
        }
        self
    }

    /// Hex SHA-256 over every entry, file contents included: the cache key of the image.
    pub fn digest(&self) -> String {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        for entry in &self.entries {
            let (kind, path, body, mode): (&str, &str, Vec<u8>, u32) = match entry {
                Entry::Dir { path, mode } => ("dir", path, Vec::new(), *mode),
                Entry::File { path, from, mode } => (
                    "file",
                    path,
                    std::fs::read(from)
                        .unwrap_or_else(|e| panic!("cannot read {}: {e}", from.display())),
                    *mode,
                ),
                Entry::Text { path, text, mode } => {
                    ("text", path, text.clone().into_bytes(), *mode)
                }
                Entry::Link { path, to } => ("link", path, to.clone().into_bytes(), 0),
            };
            for part in [kind.as_bytes(), path.as_bytes(), &mode.to_le_bytes()] {
                ctx.update(&(part.len() as u64).to_le_bytes());
                ctx.update(part);
            }
            ctx.update(&(body.len() as u64).to_le_bytes());
            ctx.update(&body);
        }
        ctx.finish()
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Create the tree under `root` (which must not exist yet).
    pub fn write_to(&self, root: &Path) {
        std::fs::create_dir_all(root).unwrap();
        for entry in &self.entries {
            match entry {
                Entry::Dir { path, mode } => {
                    let dest = root.join(path);
                    std::fs::create_dir_all(&dest).unwrap();
                    set_mode(&dest, *mode);
                }
                Entry::File { path, from, mode } => {
                    let dest = parent_made(root, path);
                    std::fs::copy(from, &dest)
                        .unwrap_or_else(|e| panic!("cannot copy {}: {e}", from.display()));
                    set_mode(&dest, *mode);
                }
                Entry::Text { path, text, mode } => {
                    let dest = parent_made(root, path);
                    std::fs::write(&dest, text).unwrap();
                    set_mode(&dest, *mode);
                }
                Entry::Link { path, to } => {
                    let dest = parent_made(root, path);
                    let _ = std::fs::remove_file(&dest);
                    std::os::unix::fs::symlink(to, &dest).unwrap();
                }
            }
        }
    }
}

fn parent_made(root: &Path, path: &str) -> PathBuf {
    let dest = root.join(path);
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    dest
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn busybox_applets() -> Vec<String> {
    let out = Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {BUSYBOX}: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Build `what` into `dir/<digest>/<file>` with `build(rootfs tree, output path)` unless it is
/// there already; returns the output path. Built into a temporary name and renamed, so an
/// interrupted build never leaves a half-written image under the final name.
pub fn cached(fs: &Rootfs, dir: &Path, file: &str, build: impl FnOnce(&Path, &Path)) -> PathBuf {
    let home = dir.join(fs.digest());
    let out = home.join(file);
    if out.exists() {
        return out;
    }
    std::fs::create_dir_all(&home).unwrap();
    let staging = crate::TempDir::with_prefix_in("staging-", &home).unwrap();
    let tree = staging.path().join("root");
    fs.write_to(&tree);
    let partial = staging.path().join(file);
    build(&tree, &partial);
    std::fs::rename(&partial, &out).unwrap();
    out
}
