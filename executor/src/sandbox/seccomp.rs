//! The seccomp filter: a deny list of syscalls a command never needs and attackers love, as
//! data, plus a kill for foreign syscall ABIs.
//!
//! Denied syscalls fail with EPERM (programs handle that; a kill would look like a crash).
//! The i386 ABI (int 0x80) fails the architecture check of seccompiler's filter and kills the
//! process; the x32 ABI shares x86_64's audit architecture, so a short prologue kills any
//! syscall number with the x32 bit set, and makes clone3 fail with ENOSYS.
//!
//! It is one program, installed once: every installed filter is verified and JIT-compiled by
//! the kernel per command, which made three filters a large part of a command's setup.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("seccomp: {0}")]
    Install(#[from] seccompiler::Error),
}

/// Syscalls denied outright, each with the reason.
const DENIED: &[(i64, &str)] = &[
    (
        libc::SYS_io_uring_setup,
        "io_uring bypasses seccomp for the operations it performs",
    ),
    (libc::SYS_io_uring_enter, "io_uring"),
    (libc::SYS_io_uring_register, "io_uring"),
    (libc::SYS_ptrace, "inspecting or steering other processes"),
    (
        libc::SYS_process_vm_readv,
        "reading other processes' memory",
    ),
    (
        libc::SYS_process_vm_writev,
        "writing other processes' memory",
    ),
    (
        libc::SYS_pidfd_getfd,
        "copying another process's descriptors (ptrace's job, which is denied)",
    ),
    (
        libc::SYS_process_madvise,
        "advising on another process's memory",
    ),
    (
        libc::SYS_process_mrelease,
        "reaping another process's memory",
    ),
    (
        libc::SYS_kcmp,
        "comparing other processes' kernel objects (reveals their descriptors and memory)",
    ),
    (
        libc::SYS_bpf,
        "kernel programs; a frequent source of privilege escalations",
    ),
    (
        libc::SYS_perf_event_open,
        "kernel and hardware profiling, side channels",
    ),
    (libc::SYS_keyctl, "the kernel keyring is not namespaced"),
    (libc::SYS_add_key, "the kernel keyring is not namespaced"),
    (
        libc::SYS_request_key,
        "the kernel keyring is not namespaced",
    ),
    (
        libc::SYS_mount,
        "the covering mounts of the sandbox must stay",
    ),
    (
        libc::SYS_umount2,
        "the covering mounts of the sandbox must stay",
    ),
    (libc::SYS_pivot_root, "the root of the sandbox must stay"),
    (libc::SYS_fsopen, "new mount API"),
    (libc::SYS_fsconfig, "new mount API"),
    (libc::SYS_fsmount, "new mount API"),
    (libc::SYS_fspick, "new mount API"),
    (libc::SYS_move_mount, "new mount API"),
    (libc::SYS_open_tree, "new mount API"),
    (libc::SYS_mount_setattr, "new mount API"),
    (libc::SYS_init_module, "kernel modules"),
    (libc::SYS_finit_module, "kernel modules"),
    (libc::SYS_delete_module, "kernel modules"),
    (libc::SYS_kexec_load, "replacing the kernel"),
    (libc::SYS_kexec_file_load, "replacing the kernel"),
    (
        libc::SYS_unshare,
        "no new namespaces: user namespaces expose kernel attack surface",
    ),
    (libc::SYS_setns, "no joining other namespaces"),
    (
        libc::SYS_userfaultfd,
        "a classic tool for winning kernel races",
    ),
    (libc::SYS_swapon, "host memory configuration"),
    (libc::SYS_swapoff, "host memory configuration"),
    (libc::SYS_reboot, "host power"),
    (libc::SYS_acct, "host accounting"),
    (
        libc::SYS_open_by_handle_at,
        "opens files by handle, bypassing path checks (Shocker)",
    ),
    (libc::SYS_name_to_handle_at, "pairs with open_by_handle_at"),
    (libc::SYS_lookup_dcookie, "kernel profiling"),
    (libc::SYS_quotactl, "host filesystem quotas"),
    (libc::SYS_syslog, "the kernel log"),
    (libc::SYS_vhangup, "terminal hangups"),
    (libc::SYS_settimeofday, "the host clock"),
    (libc::SYS_clock_settime, "the host clock"),
    (libc::SYS_clock_adjtime, "the host clock"),
    (libc::SYS_adjtimex, "the host clock"),
];

/// clone(2) flags that create namespaces; clone with any of them is denied like unshare.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// Terminal ioctls refused on every descriptor: a process on a PTY (protocol 1.1 `pty`) holds a
/// real terminal of the host's devpts, and no program run on one needs these.
const TERMINAL_IOCTLS: &[(libc::c_ulong, &str)] = &[
    (
        libc::TIOCSTI as libc::c_ulong,
        "types into a terminal's input",
    ),
    (
        libc::TIOCSETD as libc::c_ulong,
        "line disciplines: loads kernel modules (n_hdlc, n_gsm) with a history of local-root bugs",
    ),
    (
        libc::TIOCCONS as libc::c_ulong,
        "redirects the host console's output",
    ),
    (libc::TIOCLINUX as libc::c_ulong, "virtual console control"),
];

/// Syscall numbers at or above this belong to the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// SysV IPC and POSIX message queue syscalls: refused where the command has no IPC namespace
/// of its own, since their keys and names reach the host's segments, queues and semaphores
/// (and a queue a command creates outlives it: a few hundred filled the host's queue limit for
/// every other user).
const SYSV_IPC: &[i64] = &[
    libc::SYS_mq_open,
    libc::SYS_mq_unlink,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_notify,
    libc::SYS_mq_getsetattr,
    libc::SYS_shmget,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_msgget,
    libc::SYS_msgsnd,
    libc::SYS_msgrcv,
    libc::SYS_msgctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semctl,
    libc::SYS_semtimedop,
];

/// Syscalls that change another process's limits, priority, scheduling or memory placement
/// when given its pid (argument 0), with the kernel checking only that the uids match. Without
/// a pid namespace, a command could aim them at other clients' commands or the daemon:
/// `prlimit --pid P --cpu=1:1` killed another client's process, `--nofile=3:3` starved a
/// daemon running as the same user of descriptors. They stay allowed on the caller itself
/// (pid 0), which is how libc and programs use them on themselves.
const OTHER_PROCESS_BY_PID: &[(i64, &str)] = &[
    (libc::SYS_prlimit64, "another process's resource limits"),
    (libc::SYS_sched_setaffinity, "another process's CPUs"),
    (libc::SYS_sched_setscheduler, "another process's scheduler"),
    (libc::SYS_sched_setparam, "another process's scheduling"),
    (libc::SYS_sched_setattr, "another process's scheduling"),
    (
        libc::SYS_migrate_pages,
        "another process's memory placement",
    ),
    (libc::SYS_move_pages, "another process's memory placement"),
];

/// `setpriority(which, who, prio)` and `ioprio_set(which, who, prio)`: only on the caller
/// (`which` = PRIO_PROCESS / IOPRIO_WHO_PROCESS, `who` = 0); a process group or a whole uid
/// would take in other clients' commands.
const OWN_PRIORITY: &[(i64, u64)] = &[
    (libc::SYS_setpriority, libc::PRIO_PROCESS as u64),
    // IOPRIO_WHO_PROCESS (linux/ioprio.h); the libc crate does not name it.
    (libc::SYS_ioprio_set, 1),
];

/// What the filter refuses beyond the fixed list, decided by the plan.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extra {
    /// No IPv4 or IPv6 sockets (no network and no network namespace to contain it).
    pub deny_inet: bool,
    /// No SysV IPC (no IPC namespace).
    pub deny_sysv_ipc: bool,
    /// Limits, priorities and scheduling of the caller only (no pid namespace: other
    /// processes of the same uid would be reachable by pid).
    pub own_process_only: bool,
}

fn deny_list(extra: Extra) -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|(nr, _)| (*nr, Vec::new())).collect();
    let domain_is = |domain: i32| {
        SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            domain as u64,
        )?])
    };
    // vsock ignores network namespaces: in a VM it leads to the hypervisor's services.
    let mut socket_rules = vec![domain_is(libc::AF_VSOCK)?];
    if extra.deny_inet {
        // No IPv4 or IPv6 socket at all, which also closes what landlock's TCP rules miss
        // (MPTCP, TCP Fast Open via sendto).
        socket_rules.push(domain_is(libc::AF_INET)?);
        socket_rules.push(domain_is(libc::AF_INET6)?);
    }
    rules.insert(libc::SYS_socket, socket_rules);
    if extra.deny_sysv_ipc {
        rules.extend(SYSV_IPC.iter().map(|nr| (*nr, Vec::new())));
    }
    // clone: deny when any namespace flag is set (one rule per flag; rules are ORed).
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*flag),
                *flag,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    // ioctl's request is an unsigned int to the kernel: compare the low 32 bits only, or high
    // bits set by the caller would slip past.
    let ioctl_rules = TERMINAL_IOCTLS
        .iter()
        .map(|(request, _)| {
            SeccompRule::new(vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                *request,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctl_rules);
    if extra.own_process_only {
        let arg_is_not = |arg: u8, value: u64| {
            SeccompRule::new(vec![SeccompCondition::new(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Ne,
                value,
            )?])
        };
        for (nr, _) in OTHER_PROCESS_BY_PID {
            rules.insert(*nr, vec![arg_is_not(0, 0)?]);
        }
        for (nr, own) in OWN_PRIORITY {
            rules.insert(*nr, vec![arg_is_not(0, *own)?, arg_is_not(1, 0)?]);
        }
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )?;
    Ok(filter.try_into()?)
}

/// What runs before the deny list (whose own first step, the architecture check, follows):
/// - kill any syscall number with the x32 bit (same audit arch as x86_64, so the architecture
///   check does not catch it);
/// - clone3 passes its flags in memory, where seccomp cannot look: make it ENOSYS so libc falls
///   back to clone(2), which the deny list inspects.
///
/// Jumps are relative, so the deny list's program works unchanged after it.
fn prologue() -> BpfProgram {
    const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let insn = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        // seccomp_data.nr is at offset 0.
        insn(BPF_LD_W_ABS, 0, 0, 0),
        insn(BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),
        insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        insn(BPF_JEQ_K, 0, 1, libc::SYS_clone3 as u32),
        insn(
            BPF_RET_K,
            0,
            0,
            libc::SECCOMP_RET_ERRNO | (libc::ENOSYS as u32 & libc::SECCOMP_RET_DATA),
        ),
    ]
}

/// The whole program: the prologue, then the deny list.
fn program(extra: Extra) -> Result<BpfProgram, SeccompError> {
    let mut program = prologue();
    program.extend(deny_list(extra)?);
    Ok(program)
}

/// Install the filter on the calling thread (no_new_privs must already be set).
pub fn install(extra: Extra) -> Result<(), SeccompError> {
    seccompiler::apply_filter(&program(extra)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile_and_every_denial_has_a_reason() {
        let base = deny_list(Extra::default()).unwrap().len();
        assert!(base > DENIED.len());
        let strictest = Extra {
            deny_inet: true,
            deny_sysv_ipc: true,
            own_process_only: true,
        };
        assert!(deny_list(strictest).unwrap().len() > base);
        assert_eq!(
            program(Extra::default()).unwrap().len(),
            base + prologue().len()
        );
        // The kernel's limit on one program.
        assert!(program(strictest).unwrap().len() < 4096);
        for (nr, reason) in DENIED.iter().chain(OTHER_PROCESS_BY_PID) {
            assert!(!reason.is_empty(), "syscall {nr}");
        }
    }
}
