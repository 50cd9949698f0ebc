//! Dangerous syscalls through python3 ctypes, and the 32-bit (int 0x80) and x32 ABIs through a
//! tiny static ELF written by the test and a raw syscall number. `trusted` (root, no seccomp)
//! is the control that shows each probe reaches the kernel.

use executor_tests::{marker, proc_status};

use crate::common::*;

/// (name, python body printing `<name>=<ret> <name>_errno=<errno>`). Each call is built so
/// that, with permission, it succeeds (ret >= 0) as root: that is the `trusted` control.
fn probes() -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "io_uring_setup",
            r#"
params = ctypes.create_string_buffer(120)
r, e = sc(425, 4, params)
print(f"io_uring_setup={r} io_uring_setup_errno={e}")
"#,
        ),
        (
            "ptrace_traceme",
            r#"
pid = os.fork()
if pid == 0:
    r, e = sc(101, 0, 0, 0, 0)   # PTRACE_TRACEME
    print(f"ptrace_traceme={r} ptrace_traceme_errno={e}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"#,
        ),
        (
            "bpf",
            r#"
import struct
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(112))   # BPF_MAP_TYPE_ARRAY
r, e = sc(321, 0, attr, 128)   # BPF_MAP_CREATE
print(f"bpf={r} bpf_errno={e}")
"#,
        ),
        (
            "keyctl",
            r#"
r, e = sc(248, ctypes.c_char_p(b"user"), ctypes.c_char_p(b"escape"), ctypes.c_char_p(b"x"), 1, -2)   # add_key to the process keyring
print(f"keyctl={r} keyctl_errno={e}")
"#,
        ),
        (
            "perf_event_open",
            r#"
attr = ctypes.create_string_buffer(128)
ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 128), 8)   # PERF_TYPE_SOFTWARE, size; config 0 = cpu clock
r, e = sc(298, attr, 0, -1, -1, 0)
print(f"perf_event_open={r} perf_event_open_errno={e}")
"#,
        ),
        (
            "userfaultfd",
            r#"
r, e = sc(323, 0)
print(f"userfaultfd={r} userfaultfd_errno={e}")
"#,
        ),
        (
            "open_by_handle_at",
            r#"
handle = ctypes.create_string_buffer(128)
ctypes.memmove(handle, (ctypes.c_uint32 * 2)(120, 0), 8)
mount_id = ctypes.c_int(0)
r, e = sc(303, -100, ctypes.c_char_p(b"/"), handle, ctypes.byref(mount_id), 0)   # name_to_handle_at
r, e = sc(304, -100, handle, 0)   # open_by_handle_at(AT_FDCWD, ...)
print(f"open_by_handle_at={r} open_by_handle_at_errno={e}")
"#,
        ),
        (
            "fsopen",
            r#"
r, e = sc(430, ctypes.c_char_p(b"tmpfs"), 0)
print(f"fsopen={r} fsopen_errno={e}")
"#,
        ),
        // ptrace's neighbours: each reaches into another process (here the command's own
        // child or itself, which they would be allowed to), and each was allowed.
        (
            "pidfd_getfd",
            r#"
child, pidfd = sleeping_child()
r, e = sc(438, pidfd, 1, 0)     # pidfd_getfd: the child's stdout
os.kill(child, 9)
os.waitpid(child, 0)
print(f"pidfd_getfd={r} pidfd_getfd_errno={e}")
"#,
        ),
        (
            "kcmp",
            r#"
r, e = sc(312, os.getpid(), os.getpid(), 0, 1, 1)   # KCMP_FILE: fd 1 against fd 1
print(f"kcmp={r} kcmp_errno={e}")
"#,
        ),
        (
            "process_madvise",
            r#"
import mmap
buf = mmap.mmap(-1, 4096)
buf.write(b"x" * 4096)
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
iov = Iovec(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 4096)
me, _ = sc(434, os.getpid(), 0)
r, e = sc(440, me, ctypes.byref(iov), 1, 20, 0)   # MADV_COLD on our own page
print(f"process_madvise={r} process_madvise_errno={e}")
"#,
        ),
        (
            "process_mrelease",
            r#"
child, pidfd = sleeping_child()
os.kill(child, 9)
r, e = sc(448, pidfd, 0)        # process_mrelease of the dying child
os.waitpid(child, 0)
# Allowed, it reaps (0) or finds the child gone already (ESRCH); only seccomp says EPERM.
if e == 3:
    r, e = 0, 0
print(f"process_mrelease={r} process_mrelease_errno={e}")
"#,
        ),
    ]
}

#[tokio::test]
async fn dangerous_syscalls_are_denied_with_eperm() {
    let Some(daemon) = daemon() else {
        return;
    };
    let body: String = probes().iter().map(|(_, b)| *b).collect();
    let probe = python(&body);
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "syscalls", &probe).await;
        for (name, _) in probes() {
            let ret: i64 = field(&out, name)
                .unwrap_or_else(|| panic!("{row} {name} not reported: {out}"))
                .parse()
                .unwrap();
            let errno = field(&out, &format!("{name}_errno"));
            match row.expect {
                Denied => assert!(
                    ret == -1 && errno == Some("1"),
                    "{row} {name} returned {ret} errno {errno:?} (want EPERM): {out}"
                ),
                Allowed => assert!(ret >= 0, "{row} control: {name} failed: {out}"),
            }
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn seccomp_is_in_filter_mode_as_seen_from_the_host() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let (id, pid) = start_sleeper(client, row.profile, "seccomp", &m, "", 30.0).await;
        let mode = proc_status(pid, "Seccomp:");
        match row.expect {
            Denied => assert_eq!(mode.as_deref(), Some("2"), "{row} seccomp mode"),
            Allowed => assert_eq!(mode.as_deref(), Some("0"), "{row} control"),
        }
        cancel(client, &id).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

/// A static x86_64 ELF that makes the i386 `getpid` through `int 0x80`, then exits with 42
/// through the 64-bit `exit`. Under a seccomp filter that kills the 32-bit ABI it dies of
/// SIGSYS before reaching the exit.
fn int80_elf() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    let code: &[u8] = &[
        0xb8, 0x14, 0x00, 0x00, 0x00, // mov eax, 20 (i386 getpid)
        0xcd, 0x80, // int 0x80
        0xbf, 0x2a, 0x00, 0x00, 0x00, // mov edi, 42
        0xb8, 0x3c, 0x00, 0x00, 0x00, // mov eax, 60 (x86_64 exit)
        0x0f, 0x05, // syscall
    ];
    let total = (64 + 56 + code.len()) as u64;
    let mut elf = Vec::new();
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&(BASE + 64 + 56).to_le_bytes()); // entry
    elf.extend_from_slice(&64u64.to_le_bytes()); // phoff
    elf.extend_from_slice(&0u64.to_le_bytes()); // shoff
    elf.extend_from_slice(&0u32.to_le_bytes()); // flags
    elf.extend_from_slice(&64u16.to_le_bytes()); // ehsize
    elf.extend_from_slice(&56u16.to_le_bytes()); // phentsize
    elf.extend_from_slice(&1u16.to_le_bytes()); // phnum
    elf.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // R+X
    elf.extend_from_slice(&0u64.to_le_bytes()); // offset
    elf.extend_from_slice(&BASE.to_le_bytes()); // vaddr
    elf.extend_from_slice(&BASE.to_le_bytes()); // paddr
    elf.extend_from_slice(&total.to_le_bytes()); // filesz
    elf.extend_from_slice(&total.to_le_bytes()); // memsz
    elf.extend_from_slice(&0x1000u64.to_le_bytes()); // align
    elf.extend_from_slice(code);
    elf
}

#[tokio::test]
async fn the_32_bit_syscall_abi_kills_the_process() {
    let Some(daemon) = daemon() else {
        return;
    };
    let name = format!("int80-{}", marker());
    let path = daemon.workspace.join(&name);
    executor_tests::write_executable(&path, int80_elf(), 0o755);
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row
            .output(client, "int80", &format!("./{name}; echo rc=$?"))
            .await;
        match row.expect {
            // 128 + SIGSYS (31).
            Denied => assert_eq!(field(&out, "rc"), Some("159"), "{row} {out}"),
            Allowed => assert_eq!(field(&out, "rc"), Some("42"), "{row} control: {out}"),
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn the_x32_syscall_abi_kills_the_process() {
    // getpid with the x32 bit set. This kernel may lack x32 (ENOSYS under trusted); the filter
    // must still see the number and kill, or x32 becomes a way around a per-number deny list.
    let Some(daemon) = daemon() else {
        return;
    };
    let probe = format!(
        "{}\necho rc=$?",
        python("r, e = sc(0x40000000 | 39)\nprint(f'x32={r} x32_errno={e}')")
    );
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "x32", &probe).await;
        match row.expect {
            Denied => {
                assert_eq!(field(&out, "rc"), Some("159"), "{row} {out}");
                assert!(field(&out, "x32").is_none(), "{row} {out}");
            }
            Allowed => {
                assert_eq!(field(&out, "rc"), Some("0"), "{row} control: {out}");
                assert!(field(&out, "x32").is_some(), "{row} control: {out}");
            }
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn clone3_is_answered_enosys_so_that_libc_falls_back_to_the_inspected_clone() {
    // clone3 passes its flags in memory, where seccomp cannot look: the filter makes it
    // ENOSYS (glibc then uses clone(2), whose namespace flags the deny list checks).
    let Some(daemon) = daemon() else {
        return;
    };
    let probe = python("r, e = sc(435, 0, 0)\nprint(f'clone3={r} errno={e}')");
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "clone3", &probe).await;
        assert_eq!(field(&out, "clone3"), Some("-1"), "{row} {out}");
        match row.expect {
            Denied => assert_eq!(field(&out, "errno"), Some("38"), "{row} {out}"),
            // The kernel itself refuses a null, zero-sized argument (EINVAL), not ENOSYS.
            Allowed => assert_eq!(field(&out, "errno"), Some("22"), "{row} control: {out}"),
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}
