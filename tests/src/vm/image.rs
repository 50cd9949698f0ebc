//! What the VM boots: Debian 12's cloud kernel (downloaded with apt-get into `target/`) and an
//! initramfs of busybox, bash, the static executor, the virtio modules and /init, cached in
//! `target/test-images/vm/<digest of its inputs>/`. The token is not in the cached image: a
//! second small archive holding it is appended per boot (the kernel unpacks concatenated cpio
//! archives in order).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::rootfs::{cached, Rootfs};

/// The Debian metapackage whose dependency is the kernel image package to boot.
const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// Modules /init loads, in dependency order (the cloud kernel builds virtio as modules).
const MODULES: [&str; 10] = [
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_console",
    "virtio-rng",
];

/// Where images are cached.
pub fn cache_dir() -> PathBuf {
    crate::static_build::target_dir().join("test-images")
}

/// The extracted kernel package: `(vmlinuz, the package's root)`. Downloaded once with
/// `apt-get download`, which needs apt's lists (`apt-get update`, as `.ci/run` does).
pub fn kernel() -> Result<(PathBuf, PathBuf), String> {
    let depends = Command::new("apt-cache")
        .args(["depends", KERNEL_METAPACKAGE])
        .output()
        .map_err(|e| format!("apt-cache: {e}"))?;
    let package = String::from_utf8_lossy(&depends.stdout)
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Depends: linux-image-")
                .map(str::to_string)
        })
        .map(|rest| format!("linux-image-{rest}"))
        .ok_or_else(|| {
            format!("apt-cache knows no {KERNEL_METAPACKAGE} (run apt-get update first)")
        })?;
    let root = cache_dir().join("kernel").join(&package);
    if !root.join("boot").exists() {
        std::fs::create_dir_all(cache_dir()).map_err(|e| e.to_string())?;
        let download =
            crate::TempDir::with_prefix_in("download-", cache_dir()).map_err(|e| e.to_string())?;
        let status = Command::new("apt-get")
            .args(["download", "-q", &package])
            .current_dir(download.path())
            .status()
            .map_err(|e| format!("apt-get: {e}"))?;
        if !status.success() {
            return Err(format!("apt-get download {package} failed"));
        }
        let deb = std::fs::read_dir(download.path())
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or("apt-get download left no .deb")?;
        let unpacked = download.path().join("root");
        let status = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&deb)
            .arg(&unpacked)
            .status()
            .map_err(|e| format!("dpkg-deb: {e}"))?;
        if !status.success() {
            return Err(format!("dpkg-deb -x {} failed", deb.display()));
        }
        std::fs::create_dir_all(root.parent().unwrap()).map_err(|e| e.to_string())?;
        std::fs::rename(&unpacked, &root).map_err(|e| e.to_string())?;
    }
    let vmlinuz = std::fs::read_dir(root.join("boot"))
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .ok_or("no vmlinuz in the kernel package")?;
    Ok((vmlinuz, root))
}

/// The cached base initramfs (gzip'd newc cpio) for this kernel and executor.
pub fn base_initramfs(kernel_root: &Path, executor: &Path) -> PathBuf {
    let mut fs = Rootfs::base();
    fs.file("usr/local/bin/executor", executor, 0o755)
        .text("init", include_str!("init.sh"), 0o755)
        // The agent's demo task runs git in the workspace; Debian has no static git.
        .program_with_libraries("/usr/bin/git");
    fs.text("etc/vm-modules", &(MODULES.join("\n") + "\n"), 0o644);
    for module in MODULES {
        fs.file(
            &format!("lib/modules/{module}.ko"),
            find_module(kernel_root, module),
            0o644,
        );
    }
    let flags = crate::profiles::allow_every_profile().join(" ");
    fs.text("etc/executor/serve-flags", &(flags + "\n"), 0o644);
    for (name, text) in crate::profiles::small_profiles() {
        fs.text(&format!("etc/executor/profiles/{name}.json"), &text, 0o644);
    }
    cached(&fs, &cache_dir().join("vm"), "base.cpio.gz", |tree, out| {
        // Debug lines make the binary four times larger; every boot unpacks and copies it.
        let status = Command::new("strip")
            .arg(tree.join("usr/local/bin/executor"))
            .status()
            .expect("strip (binutils) runs");
        assert!(status.success(), "strip failed");
        cpio(tree, out, true)
    })
}

/// A newc cpio (gzip'd when `gzip`) of `tree`, every file owned by root.
pub fn cpio(tree: &Path, out: &Path, gzip: bool) {
    let compress = if gzip { "| gzip -1" } else { "" };
    let status = Command::new("sh")
        .args([
            "-c",
            &format!(
                "cd \"$1\" && find . | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0 {compress} > \"$2\""
            ),
            "cpio",
        ])
        .arg(tree)
        .arg(out)
        .status()
        .expect("sh runs");
    assert!(status.success(), "cpio of {} failed", tree.display());
}

/// The boot's initrd: the cached base followed by an archive holding `/etc/executor-token`.
pub fn initrd_with_token(base: &Path, token: &str, dir: &Path) -> PathBuf {
    let mut secret = Rootfs::default();
    secret
        .dir("etc", 0o755)
        .text("etc/executor-token", token, 0o600);
    let tree = dir.join("secret");
    secret.write_to(&tree);
    let archive = dir.join("secret.cpio");
    cpio(&tree, &archive, false);
    let initrd = dir.join("initrd.img");
    let mut bytes = std::fs::read(base).unwrap();
    // Archives start on a 4-byte boundary (the kernel skips the zero padding).
    bytes.resize(bytes.len().next_multiple_of(4), 0);
    bytes.extend(std::fs::read(&archive).unwrap());
    std::fs::write(&initrd, bytes).unwrap();
    initrd
}

fn find_module(kernel_root: &Path, name: &str) -> PathBuf {
    let file = format!("{name}.ko");
    let out = Command::new("find")
        .arg(kernel_root.join("lib/modules"))
        .args(["-name", &file])
        .output()
        .expect("find runs");
    let found = String::from_utf8_lossy(&out.stdout);
    let path = found
        .lines()
        .next()
        .unwrap_or_else(|| panic!("module {file} not in the kernel package"));
    PathBuf::from(path)
}
