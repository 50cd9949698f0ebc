//! The remote-VM case, for real: Debian 12's cloud kernel (6.1, pure cgroup v2) under qemu,
//! the static executor started by the VM's /init with `--tls`, reached over qemu's forwarded
//! port with the certificate pinned, and checked through the VM's side channel (processes,
//! files, cgroups), never through the executor alone. One VM serves every test of this binary
//! (`executor_tests::vm::shared`).

mod agent_demo;
mod cgroups;
mod kill;
mod landlock;
mod limits;
mod profiles;

/// Timeouts of commands in the VM: everything runs under software emulation.
pub const SLOW_TIMEOUT: f64 = 20.0;
