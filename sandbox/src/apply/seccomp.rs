//! The seccomp filter: a deny list of syscalls a command never needs and attackers love, as
//! data, plus a kill for foreign syscall ABIs.
//!
//! Denied syscalls fail with EPERM (programs handle that; a kill would look like a crash).
//! The i386 ABI (int 0x80) fails the architecture check of seccompiler's filter and kills the
//! process; the x32 ABI shares x86_64's audit architecture, so a short prologue kills any
//! syscall number with the x32 bit set, and makes clone3 fail with ENOSYS.
//!
//! It is one program, installed once: every installed filter is verified and JIT-compiled by
//! the kernel per command, which made three filters a large part of a command's setup. For the
//! same reason the syscalls refused whatever their arguments are found by a binary search
//! ahead of seccompiler's program for those whose arguments decide (seccompiler spends five
//! instructions on each, and its 512-instruction program took 0.3 ms to install), and a second
//! search allows every syscall that has no rule at once. At each install the kernel runs the
//! program for every syscall number to cache those it always allows: with linear chains that
//! walk was most of the install (the `install_time_of_the_searches_and_of_a_chain` probe,
//! median of 30 installs: 88-148 to 42-80 us with the fewest rules, 187-202 to 101-112 us
//! with every extra rule).

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
    #[error("seccomp filter: a jump past 255 instructions")]
    TooLarge,
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

/// The syscalls refused whatever their arguments: [`DENIED`], and SysV IPC where asked.
fn denied_outright(extra: Extra) -> Vec<i64> {
    let mut nrs: Vec<i64> = DENIED.iter().map(|(nr, _)| *nr).collect();
    if extra.deny_sysv_ipc {
        nrs.extend(SYSV_IPC);
    }
    nrs.sort_unstable();
    nrs.dedup();
    nrs
}

/// The syscalls whose arguments decide, as seccompiler's program (its own architecture check
/// first), and their numbers (sorted).
fn deny_list(extra: Extra) -> Result<(BpfProgram, Vec<i64>), SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
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
    let decided_by_arguments = rules.keys().copied().collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )?;
    Ok((filter.try_into()?, decided_by_arguments))
}

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JA: u16 = 0x05; // BPF_JMP | BPF_JA
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K
/// `AUDIT_ARCH_X86_64` (linux/audit.h: EM_X86_64 with the 64-bit and little-endian bits).
const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;

fn insn(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// What runs first:
/// - kill a syscall of any other architecture (the i386 ABI, int 0x80);
/// - kill any syscall number with the x32 bit (same audit arch as x86_64, so the architecture
///   check does not catch it);
/// - clone3 passes its flags in memory, where seccomp cannot look: make it ENOSYS so libc falls
///   back to clone(2), which the deny list inspects.
///
/// It leaves the syscall number loaded, for [`deny_outright`]. Jumps are relative, so
/// seccompiler's program works unchanged after both.
fn prologue() -> BpfProgram {
    vec![
        // seccomp_data.arch is at offset 4, seccomp_data.nr at 0.
        insn(BPF_LD_W_ABS, 0, 0, 4),
        insn(BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
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

/// What a [`search`] does for the numbers it lists and for the others.
#[derive(Clone, Copy)]
enum Listed {
    /// Listed: EPERM; others: on to what follows.
    Refused,
    /// Listed: on to what follows; others: allowed.
    Decided,
}

/// A test of the loaded syscall number against `nrs` (sorted and distinct) as a binary search:
/// compares on the way down to a leaf of a few, which compares each. A linear chain cost the
/// kernel a walk of every compare for every syscall number each time it builds its cache of
/// the numbers the filter always allows (at each install: `seccomp_cache_prepare`).
fn search(nrs: &[i64], listed: Listed) -> Result<BpfProgram, SeccompError> {
    const LEAF: usize = 8;
    if nrs.len() <= LEAF {
        // From compare i of n, a match jumps n - i ahead: to the refusal past the jump over it
        // (Refused), or past the allowing return (Decided).
        let mut program: BpfProgram = nrs
            .iter()
            .enumerate()
            .map(|(i, nr)| insn(BPF_JEQ_K, (nrs.len() - i) as u8, 0, *nr as u32))
            .collect();
        match listed {
            Listed::Refused => {
                program.push(insn(BPF_JA, 0, 0, 1));
                program.push(insn(
                    BPF_RET_K,
                    0,
                    0,
                    libc::SECCOMP_RET_ERRNO | (libc::EPERM as u32 & libc::SECCOMP_RET_DATA),
                ));
            }
            Listed::Decided => program.push(insn(BPF_RET_K, 0, 0, libc::SECCOMP_RET_ALLOW)),
        }
        return Ok(program);
    }
    let (low, high) = nrs.split_at(nrs.len() / 2);
    let low = search(low, listed)?;
    let high_program = search(high, listed)?;
    // At or above the high half's first number: past the low half and the jump that ends it.
    let over_low = u8::try_from(low.len() + 1).map_err(|_| SeccompError::TooLarge)?;
    let mut program = vec![insn(BPF_JGE_K, over_low, 0, high[0] as u32)];
    program.extend(low);
    program.push(insn(BPF_JA, 0, 0, high_program.len() as u32));
    program.extend(high_program);
    Ok(program)
}

/// The whole program: the prologue, the syscalls refused outright, then seccompiler's program
/// for those whose arguments decide.
fn program(extra: Extra) -> Result<BpfProgram, SeccompError> {
    let (by_arguments, decided_by_arguments) = deny_list(extra)?;
    let mut program = prologue();
    program.extend(search(&denied_outright(extra), Listed::Refused)?);
    // Every other syscall is allowed here, as seccompiler's program would after walking its
    // compares; the prologue has already checked the architecture.
    program.extend(search(&decided_by_arguments, Listed::Decided)?);
    program.extend(by_arguments);
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

    const STRICTEST: Extra = Extra {
        deny_inet: true,
        deny_sysv_ipc: true,
        own_process_only: true,
    };

    #[test]
    fn filters_compile_and_every_denial_has_a_reason() {
        let (base, decided) = deny_list(Extra::default()).unwrap();
        let base = base.len();
        assert!(deny_list(STRICTEST).unwrap().0.len() > base);
        let outright = denied_outright(Extra::default()).len();
        assert_eq!(outright, DENIED.len());
        assert!(denied_outright(STRICTEST).len() > outright);
        let refused = search(&denied_outright(Extra::default()), Listed::Refused).unwrap();
        let decided = search(&decided, Listed::Decided).unwrap();
        assert_eq!(
            program(Extra::default()).unwrap().len(),
            prologue().len() + refused.len() + decided.len() + base
        );
        // The kernel's limit on one program; and under what seccompiler alone made (512).
        assert!(program(STRICTEST).unwrap().len() < 400);
        for (nr, reason) in DENIED.iter().chain(OTHER_PROCESS_BY_PID) {
            assert!(!reason.is_empty(), "syscall {nr}");
        }
    }

    /// What `program` answers for syscall number `nr` of x86_64, by running it: the
    /// instructions [`prologue`] and [`search`] emit and nothing else. `u32::MAX` when it falls
    /// off the end (on to seccompiler's program).
    fn run(program: &[sock_filter], nr: u32) -> u32 {
        // The number loaded, as the prologue leaves it for the searches.
        let (mut pc, mut a) = (0, nr);
        while let Some(i) = program.get(pc) {
            pc += 1;
            match i.code {
                BPF_LD_W_ABS if i.k == 0 => a = nr,
                BPF_LD_W_ABS if i.k == 4 => a = AUDIT_ARCH_X86_64,
                BPF_JEQ_K => pc += usize::from(if a == i.k { i.jt } else { i.jf }),
                BPF_JGE_K => pc += usize::from(if a >= i.k { i.jt } else { i.jf }),
                BPF_JA => pc += i.k as usize,
                BPF_RET_K => return i.k,
                other => panic!("unexpected instruction {other:#x}"),
            }
        }
        assert_eq!(pc, program.len(), "a jump past the end");
        u32::MAX
    }

    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn a_search_tells_exactly_the_listed_numbers_from_the_others() {
        // Sets of every size past the leaves' size, the empty one included, in both modes.
        for n in 0..40 {
            let nrs: Vec<i64> = (0..n).map(|i| i * 3 + 1).collect();
            let refused = search(&nrs, Listed::Refused).unwrap();
            let decided = search(&nrs, Listed::Decided).unwrap();
            for nr in 0..130u32 {
                let listed = nrs.contains(&i64::from(nr));
                let (want_refused, want_decided) = if listed {
                    (EPERM, u32::MAX)
                } else {
                    (u32::MAX, libc::SECCOMP_RET_ALLOW)
                };
                assert_eq!(run(&refused, nr), want_refused, "{n} listed, nr {nr}");
                assert_eq!(run(&decided, nr), want_decided, "{n} listed, nr {nr}");
            }
        }
    }

    #[test]
    fn ahead_of_seccompilers_program_each_number_gets_its_answer() {
        for extra in [Extra::default(), STRICTEST] {
            let refused = denied_outright(extra);
            let (_, decided) = deny_list(extra).unwrap();
            let program = program(extra).unwrap();
            let ahead = &program[..program.len() - deny_list(extra).unwrap().0.len()];
            for nr in (0..1024u32).chain([X32_SYSCALL_BIT, X32_SYSCALL_BIT + 1]) {
                let want = if nr >= X32_SYSCALL_BIT {
                    libc::SECCOMP_RET_KILL_PROCESS
                } else if i64::from(nr) == libc::SYS_clone3 {
                    libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32
                } else if refused.contains(&i64::from(nr)) {
                    EPERM
                } else if decided.contains(&i64::from(nr)) {
                    u32::MAX
                } else {
                    libc::SECCOMP_RET_ALLOW
                };
                assert_eq!(run(ahead, nr), want, "{extra:?} nr {nr}");
            }
            // Control for the check itself: a number the list refuses, and one it leaves to
            // seccompiler, answer differently.
            assert_eq!(run(ahead, libc::SYS_keyctl as u32), EPERM);
            assert_eq!(run(ahead, libc::SYS_socket as u32), u32::MAX);
        }
    }

    /// Median install time of `program` over 30 threads, in microseconds.
    fn install_micros(program: BpfProgram) -> u128 {
        let program = std::sync::Arc::new(program);
        let mut times: Vec<u128> = (0..30)
            .map(|_| {
                let program = program.clone();
                std::thread::spawn(move || {
                    nix::sys::prctl::set_no_new_privs().unwrap();
                    let start = std::time::Instant::now();
                    seccompiler::apply_filter(&program).unwrap();
                    start.elapsed().as_micros()
                })
                .join()
                .unwrap()
            })
            .collect();
        times.sort_unstable();
        times[times.len() / 2]
    }

    #[test]
    #[ignore = "a measurement: prints install times"]
    fn install_time_of_the_searches_and_of_a_chain() {
        for extra in [Extra::default(), STRICTEST] {
            // What the program was before the searches: a compare per refused syscall, then
            // seccompiler's program.
            let nrs = denied_outright(extra);
            let mut chain = prologue();
            chain.extend(
                nrs.iter()
                    .enumerate()
                    .map(|(i, nr)| insn(BPF_JEQ_K, (nrs.len() - i) as u8, 0, *nr as u32)),
            );
            chain.push(insn(BPF_JA, 0, 0, 1));
            chain.push(insn(BPF_RET_K, 0, 0, EPERM));
            chain.extend(deny_list(extra).unwrap().0);
            let (c, t) = (chain.len(), program(extra).unwrap().len());
            for _ in 0..3 {
                println!(
                    "{extra:?}: chain {c} instructions {} us, searches {t} instructions {} us",
                    install_micros(chain.clone()),
                    install_micros(program(extra).unwrap())
                );
            }
        }
    }

    /// Run `probe` on a thread of its own under the filter of `extra` (no_new_privs and the
    /// filter bind only the calling thread), or without any.
    fn on_a_thread<T: Send + 'static>(
        extra: Option<Extra>,
        probe: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            if let Some(extra) = extra {
                nix::sys::prctl::set_no_new_privs().unwrap();
                install(extra).unwrap();
            }
            probe()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn the_filter_refuses_each_kind_of_denial_and_lets_the_rest_through() {
        use crate::sys::syscall_errno as errno;
        // Each harmless when allowed: keyctl(KEYCTL_GET_KEYRING_ID, the thread's keyring, no
        // create), shmget of a private key of size 0 (EINVAL), clone3 without its arguments
        // (EINVAL or EFAULT), getppid, socket(AF_VSOCK) and socket(AF_UNIX).
        let probe = || {
            [
                errno(libc::SYS_keyctl, [0, -1, 0]),
                errno(libc::SYS_shmget, [libc::IPC_PRIVATE as libc::c_long, 0, 0]),
                errno(libc::SYS_clone3, [0, 0, 0]),
                errno(libc::SYS_getppid, [0, 0, 0]),
                errno(
                    libc::SYS_socket,
                    [libc::AF_VSOCK.into(), libc::SOCK_STREAM.into(), 0],
                ),
                errno(
                    libc::SYS_socket,
                    [libc::AF_UNIX.into(), libc::SOCK_STREAM.into(), 0],
                ),
            ]
        };
        let [keyctl, shm, clone3, ppid, vsock, unix] = on_a_thread(Some(STRICTEST), probe);
        assert_eq!(keyctl, libc::EPERM, "keyctl, refused outright");
        assert_eq!(
            shm,
            libc::EPERM,
            "shmget, refused outright with deny_sysv_ipc"
        );
        assert_eq!(clone3, libc::ENOSYS, "clone3, the prologue");
        assert_eq!(
            vsock,
            libc::EPERM,
            "socket(AF_VSOCK), refused by its argument"
        );
        assert_eq!(ppid, 0, "getppid is allowed");
        assert_eq!(unix, 0, "socket(AF_UNIX) is allowed");
        // Control: the same calls without the filter reach the kernel's own answers.
        let [keyctl, shm, clone3, ..] = on_a_thread(None, probe);
        assert_ne!(keyctl, libc::EPERM);
        assert_eq!(shm, libc::EINVAL);
        assert_ne!(clone3, libc::ENOSYS);
        // Without deny_sysv_ipc, SysV IPC is the kernel's to answer.
        let [_, shm, ..] = on_a_thread(Some(Extra::default()), probe);
        assert_eq!(shm, libc::EINVAL);
    }
}
