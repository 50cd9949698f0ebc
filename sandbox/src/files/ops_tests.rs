//! Tests of the file operations, run in the test process (no sandbox).

use std::os::unix::fs::symlink;

use super::*;

/// Runs `op` with `input` as stdin: the exit code, the header, the bytes after it.
fn run(op: FileOp, input: &[u8]) -> (i32, Header, Vec<u8>) {
    // As the daemon sends an upload: framed, and committed.
    let mut framed = Vec::new();
    for chunk in input.chunks(64 * 1024) {
        framed.extend_from_slice(&crate::files::frame_header(chunk.len()));
        framed.extend_from_slice(chunk);
    }
    framed.extend_from_slice(&crate::files::frame_header(0));
    let mut input = framed.as_slice();
    let mut output = Vec::new();
    let code = serve(&op, &mut input, &mut output);
    let end = output
        .iter()
        .position(|&b| b == b'\n')
        .expect("a header line");
    let header = serde_json::from_slice(&output[..end]).expect("header JSON");
    (code, header, output[end + 1..].to_vec())
}

fn path_str(path: &Path) -> String {
    path.to_str().expect("UTF-8 test path").to_owned()
}

fn write_op(path: &Path, mode: u32) -> FileOp {
    FileOp::Write {
        path: path_str(path),
        mode,
        parents: false,
        max_bytes: u64::MAX,
    }
}

fn read_op(path: &Path, offset: u64, length: Option<u64>) -> FileOp {
    FileOp::Read {
        path: path_str(path),
        offset,
        length,
    }
}

fn error_message(header: &Header) -> &str {
    match header {
        Header::Error { message, .. } => message,
        Header::Ok { .. } => panic!("succeeded: {header:?}"),
    }
}

fn ok_bytes(header: &Header) -> u64 {
    match header {
        Header::Ok { bytes, .. } => bytes.expect("bytes in the header"),
        Header::Error { message, .. } => panic!("failed: {message}"),
    }
}

fn error_kind(header: &Header) -> ErrorKind {
    match header {
        Header::Error { kind, .. } => *kind,
        Header::Ok { .. } => panic!("succeeded: {header:?}"),
    }
}

fn leftovers(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.contains(".upload-"))
        .collect();
    names.sort();
    names
}

/// Uploads `content` to `path` and downloads it back.
fn round_trip(path: &Path, content: &[u8]) {
    let (code, header, _) = run(write_op(path, 0o644), content);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(ok_bytes(&header), content.len() as u64);
    let (code, header, body) = run(read_op(path, 0, None), &[]);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(ok_bytes(&header), content.len() as u64);
    assert!(body == content, "content differs");
}

#[test]
fn write_then_read_round_trips_every_byte_value() {
    let dir = tempfile::tempdir().expect("tempdir");
    let content: Vec<u8> = (0..=255u8).collect();
    round_trip(&dir.path().join("bytes"), &content);
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn five_megabytes_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let content: Vec<u8> = (0..5_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    round_trip(&dir.path().join("big"), &content);
}

#[test]
fn write_answers_with_the_absolute_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let real = dir.path().canonicalize().expect("canonicalize");
    let (code, header, _) = run(write_op(&dir.path().join("f"), 0o644), b"x");
    assert_eq!(code, 0);
    let Header::Ok { path, .. } = header else {
        panic!("failed: {header:?}")
    };
    assert_eq!(path, path_str(&real.join("f")));
    // A relative path starts at the current directory.
    let cwd = std::env::current_dir()
        .expect("cwd")
        .canonicalize()
        .expect("canonicalize");
    assert_eq!(absolute(Path::new("some-name")), cwd.join("some-name"));
    assert_eq!(absolute(Path::new("/")), PathBuf::from("/"));
}

#[test]
fn write_replaces_a_symlink_instead_of_writing_through_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("target");
    fs::write(&target, b"target stays").expect("write");
    let link = dir.path().join("link");
    symlink(&target, &link).expect("symlink");

    let (code, header, _) = run(write_op(&link, 0o644), b"new");
    assert_eq!(code, 0, "{header:?}");
    let Header::Ok { path, .. } = &header else {
        panic!("failed: {header:?}")
    };
    assert!(path.ends_with("/link"), "the link's own path: {path}");
    assert!(fs::symlink_metadata(&link).expect("lstat").is_file());
    assert_eq!(fs::read(&link).expect("read"), b"new");
    assert_eq!(fs::read(&target).expect("read"), b"target stays");
}

#[test]
fn write_replaces_a_hardlink_leaving_the_other_name_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = dir.path().join("first");
    fs::write(&first, b"first stays").expect("write");
    let second = dir.path().join("second");
    fs::hard_link(&first, &second).expect("hard_link");

    let (code, header, _) = run(write_op(&second, 0o644), b"new");
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(fs::read(&second).expect("read"), b"new");
    assert_eq!(fs::read(&first).expect("read"), b"first stays");
    assert_eq!(fs::metadata(&first).expect("stat").nlink(), 1);
}

#[test]
fn write_applies_the_mode_exactly_whatever_the_umask() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 0o777 and 0o666 lose bits to any usual umask (022) if only open(2) sets them.
    for mode in [0o600, 0o640, 0o666, 0o751, 0o777, 0o4755, 0o000] {
        let path = dir.path().join(format!("m{mode:o}"));
        let (code, header, _) = run(write_op(&path, mode), b"x");
        assert_eq!(code, 0, "{header:?}");
        let got = fs::metadata(&path).expect("stat").mode() & 0o7777;
        assert_eq!(got, mode, "mode {mode:o} became {got:o}");
    }
    // Replacing an existing file gives it the new mode too.
    let path = dir.path().join("again");
    fs::write(&path, b"old").expect("write");
    fs::set_permissions(&path, Permissions::from_mode(0o600)).expect("chmod");
    let (code, _, _) = run(write_op(&path, 0o755), b"new");
    assert_eq!(code, 0);
    assert_eq!(fs::metadata(&path).expect("stat").mode() & 0o7777, 0o755);

    let (code, header, _) = run(write_op(&dir.path().join("bad"), 0o100644), b"x");
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
}

#[test]
fn write_creates_parents_only_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("a/b/file");

    let (code, header, _) = run(write_op(&path, 0o644), b"x");
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::NotFound);
    assert!(!dir.path().join("a").exists());

    let op = FileOp::Write {
        path: path_str(&path),
        mode: 0o644,
        parents: true,
        max_bytes: 10,
    };
    let (code, header, _) = run(op, b"x");
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(fs::read(&path).expect("read"), b"x");
    assert!(fs::metadata(dir.path().join("a/b")).expect("stat").is_dir());
}

#[test]
fn write_over_max_bytes_leaves_no_temporary_file_and_no_destination() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    let op = |max_bytes| FileOp::Write {
        path: path_str(&path),
        mode: 0o644,
        parents: false,
        max_bytes,
    };

    let (code, header, _) = run(op(10), &[7u8; 11]);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::TooLarge);
    assert!(!path.exists());
    assert!(leftovers(dir.path()).is_empty());

    // Exactly the limit is fine.
    let (code, header, _) = run(op(10), &[7u8; 10]);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(ok_bytes(&header), 10);
    // A file that was there stays as it was.
    let (code, _, _) = run(op(10), &[8u8; 100_000]);
    assert_eq!(code, 1);
    assert_eq!(fs::read(&path).expect("read"), [7u8; 10]);
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_write_cut_off_before_its_commit_leaves_the_old_file_and_no_temporary_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    fs::write(&path, b"old").expect("write");
    let op = FileOp::Write {
        path: path_str(&path),
        mode: 0o644,
        parents: false,
        max_bytes: 1 << 20,
    };
    // Content framed as the daemon sends it, but the connection went before the commit.
    let mut cut = crate::files::frame_header(5).to_vec();
    cut.extend_from_slice(b"new c");
    let mut input = cut.as_slice();
    let mut output = Vec::new();
    assert_eq!(serve(&op, &mut input, &mut output), 1);
    let text = String::from_utf8_lossy(&output);
    assert!(text.contains("cut off"), "{text}");
    assert_eq!(fs::read(&path).expect("read"), b"old");
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn write_onto_a_directory_is_invalid_and_leaves_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = dir.path().join("sub");
    fs::create_dir(&sub).expect("mkdir");
    fs::write(sub.join("inside"), b"kept").expect("write");
    let (code, header, _) = run(write_op(&sub, 0o644), b"x");
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
    assert_eq!(fs::read(sub.join("inside")).expect("read"), b"kept");
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn read_honours_offset_and_length() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    fs::write(&path, b"0123456789").expect("write");
    let cases: [(u64, Option<u64>, &[u8]); 6] = [
        (0, None, b"0123456789"),
        (3, None, b"3456789"),
        (3, Some(4), b"3456"),
        (8, Some(100), b"89"),
        (10, None, b""),
        (1000, Some(5), b""),
    ];
    for (offset, length, expected) in cases {
        let (code, header, body) = run(read_op(&path, offset, length), &[]);
        assert_eq!(code, 0, "{header:?}");
        assert_eq!(ok_bytes(&header), expected.len() as u64);
        assert_eq!(body, expected, "offset {offset} length {length:?}");
        let Header::Ok {
            stat: Some(stat), ..
        } = header
        else {
            panic!("no stat")
        };
        assert_eq!(stat.kind, "file");
        assert_eq!(stat.size, 10);
    }
}

#[test]
fn read_follows_a_symlink_but_refuses_a_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("f"), b"data").expect("write");
    symlink("f", dir.path().join("link")).expect("symlink");
    let (code, _, body) = run(read_op(&dir.path().join("link"), 0, None), &[]);
    assert_eq!(code, 0);
    assert_eq!(body, b"data");

    let (code, header, body) = run(read_op(dir.path(), 0, None), &[]);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
    assert!(body.is_empty());
}

/// Every path under `root` with what it is: (relative path, kind, mode, content or target).
fn tree(root: &Path) -> Vec<(String, String, u32, Vec<u8>)> {
    let mut found = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(relative) = stack.pop() {
        let path = root.join(&relative);
        let metadata = fs::symlink_metadata(&path).expect("lstat");
        let content = if metadata.is_file() {
            fs::read(&path).expect("read")
        } else if metadata.file_type().is_symlink() {
            fs::read_link(&path)
                .expect("readlink")
                .into_os_string()
                .into_vec()
        } else {
            Vec::new()
        };
        if metadata.is_dir() {
            for entry in fs::read_dir(&path).expect("read_dir") {
                stack.push(relative.join(entry.expect("entry").file_name()));
            }
        }
        let mode = if metadata.file_type().is_symlink() {
            0
        } else {
            metadata.mode() & 0o7777
        };
        found.push((
            path_str(&relative),
            kind_name(&metadata).to_owned(),
            mode,
            content,
        ));
    }
    found.sort();
    found
}

#[test]
fn pack_then_unpack_gives_the_same_tree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = dir.path().join("source");
    fs::create_dir_all(source.join("sub/deeper")).expect("mkdir");
    fs::write(source.join("plain"), b"plain text").expect("write");
    fs::write(source.join("sub/tool"), b"#!/bin/sh\necho hi\n").expect("write");
    fs::set_permissions(source.join("sub/tool"), Permissions::from_mode(0o755)).expect("chmod");
    fs::write(source.join("sub/deeper/empty"), b"").expect("write");
    fs::set_permissions(source.join("sub/deeper"), Permissions::from_mode(0o700)).expect("chmod");
    symlink("sub/tool", source.join("link")).expect("symlink");
    symlink("/nowhere/at/all", source.join("dangling")).expect("symlink");

    let (code, header, archive) = run(
        FileOp::Pack {
            path: path_str(&source),
        },
        &[],
    );
    assert_eq!(code, 0, "{header:?}");
    assert!(matches!(header, Header::Ok { .. }));
    assert_eq!(archive.len() % 512, 0);

    let copy = dir.path().join("copy");
    let op = FileOp::Unpack {
        path: path_str(&copy),
        parents: false,
        max_bytes: u64::MAX,
    };
    let (code, header, _) = run(op, &archive);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(ok_bytes(&header), archive.len() as u64);
    assert_eq!(tree(&copy), tree(&source));
    assert_eq!(
        fs::read_link(copy.join("link")).expect("readlink"),
        Path::new("sub/tool")
    );
}

#[test]
fn pack_leaves_out_sockets_and_does_not_wait_on_fifos() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("file"), b"x").expect("write");
    let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).expect("bind");
    nix::unistd::mkfifo(
        &dir.path().join("pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .expect("mkfifo");

    let (code, header, archive) = run(
        FileOp::Pack {
            path: path_str(dir.path()),
        },
        &[],
    );
    assert_eq!(code, 0, "{header:?}");
    let mut names = Vec::new();
    for entry in tar::Archive::new(&archive[..]).entries().expect("entries") {
        let entry = entry.expect("entry");
        names.push((
            String::from_utf8_lossy(&entry.path_bytes()).into_owned(),
            entry.header().entry_type(),
        ));
    }
    assert_eq!(
        names,
        [
            (".".to_owned(), tar::EntryType::Directory),
            ("file".to_owned(), tar::EntryType::Regular),
            ("pipe".to_owned(), tar::EntryType::Fifo),
        ]
    );
}

#[test]
fn pack_of_a_file_is_invalid() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("f"), b"x").expect("write");
    let (code, header, body) = run(
        FileOp::Pack {
            path: path_str(&dir.path().join("f")),
        },
        &[],
    );
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
    assert!(body.is_empty());
}

/// A raw tar entry: the crate's own builder refuses the names these tests need.
fn raw_entry(name: &[u8], kind: tar::EntryType, link: &[u8], data: &[u8]) -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..name.len()].copy_from_slice(name);
    header.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    header.set_entry_type(kind);
    header.set_mode(0o644);
    header.set_size(data.len() as u64);
    header.set_cksum();
    let mut bytes = header.as_bytes().to_vec();
    bytes.extend_from_slice(data);
    bytes.resize(bytes.len().div_ceil(512) * 512, 0);
    bytes
}

fn end_of_archive() -> Vec<u8> {
    vec![0u8; 1024]
}

fn unpack_op(path: &Path) -> FileOp {
    FileOp::Unpack {
        path: path_str(path),
        parents: false,
        max_bytes: u64::MAX,
    }
}

#[test]
fn unpack_refuses_an_entry_with_dot_dot_and_writes_nothing_outside() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("dst");
    let mut archive = raw_entry(b"fine", tar::EntryType::Regular, b"", b"ok");
    archive.extend(raw_entry(b"../evil", tar::EntryType::Regular, b"", b"bad"));
    archive.extend(end_of_archive());

    let (code, header, _) = run(unpack_op(&dst), &archive);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
    assert!(error_message(&header).ends_with("entry ../evil leaves the directory"));
    assert!(!dir.path().join("evil").exists());
    assert!(!dst.join("evil").exists());
}

#[test]
fn unpack_refuses_to_write_through_a_symlink_it_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("dst");
    let mut archive = raw_entry(b"up", tar::EntryType::Symlink, b"..", b"");
    archive.extend(raw_entry(b"up/evil", tar::EntryType::Regular, b"", b"bad"));
    archive.extend(end_of_archive());

    let (code, header, _) = run(unpack_op(&dst), &archive);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
    assert!(error_message(&header).contains("outside of destination"));
    assert!(!dir.path().join("evil").exists());
}

#[test]
fn unpack_keeps_an_absolute_entry_inside() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("dst");
    let mut archive = raw_entry(b"/abs/file", tar::EntryType::Regular, b"", b"in");
    archive.extend(end_of_archive());
    let (code, header, _) = run(unpack_op(&dst), &archive);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(fs::read(dst.join("abs/file")).expect("read"), b"in");
}

#[test]
fn unpack_over_max_bytes_is_too_large() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("dst");
    let mut archive = raw_entry(b"big", tar::EntryType::Regular, b"", &[1u8; 4096]);
    archive.extend(end_of_archive());
    let op = FileOp::Unpack {
        path: path_str(&dst),
        parents: false,
        max_bytes: 2048,
    };
    let (code, header, _) = run(op, &archive);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::TooLarge);
}

#[test]
fn unpack_creates_parents_only_when_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dst = dir.path().join("a/b");
    let mut archive = raw_entry(b"f", tar::EntryType::Regular, b"", b"x");
    archive.extend(end_of_archive());

    let (code, header, _) = run(unpack_op(&dst), &archive);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::NotFound);

    let op = FileOp::Unpack {
        path: path_str(&dst),
        parents: true,
        max_bytes: u64::MAX,
    };
    let (code, header, _) = run(op, &archive);
    assert_eq!(code, 0, "{header:?}");
    assert_eq!(fs::read(dst.join("f")).expect("read"), b"x");

    // Onto a file: not a directory.
    let (code, header, _) = run(unpack_op(&dst.join("f")), &archive);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
}

#[test]
fn unpack_of_garbage_is_invalid() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, header, _) = run(unpack_op(&dir.path().join("dst")), &[0x55u8; 1024]);
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
}

#[test]
fn stat_describes_a_file_a_directory_and_a_symlink_without_following_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let real = dir.path().canonicalize().expect("canonicalize");
    fs::write(dir.path().join("f"), b"12345").expect("write");
    fs::set_permissions(dir.path().join("f"), Permissions::from_mode(0o640)).expect("chmod");
    fs::create_dir(dir.path().join("d")).expect("mkdir");
    symlink("f", dir.path().join("l")).expect("symlink");

    let stat_of = |name: &str| {
        let (code, header, _) = run(
            FileOp::Stat {
                path: path_str(&dir.path().join(name)),
            },
            &[],
        );
        assert_eq!(code, 0, "{header:?}");
        let Header::Ok {
            path,
            stat: Some(stat),
            ..
        } = header
        else {
            panic!("no stat: {header:?}")
        };
        assert_eq!(path, path_str(&real.join(name)));
        assert_eq!(stat.name, path);
        stat
    };
    let file = stat_of("f");
    assert_eq!(
        (file.kind.as_str(), file.size, file.mode),
        ("file", 5, 0o640)
    );
    assert_eq!(file.target, None);
    assert!(file.mtime > 0);
    assert_eq!(stat_of("d").kind, "dir");
    let link = stat_of("l");
    assert_eq!(link.kind, "symlink");
    assert_eq!(link.target.as_deref(), Some("f"));

    let (code, header, _) = run(
        FileOp::Stat {
            path: path_str(&dir.path().join("missing")),
        },
        &[],
    );
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::NotFound);
}

#[test]
fn list_gives_sorted_entries_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("b-file"), b"xy").expect("write");
    fs::create_dir(dir.path().join("c-dir")).expect("mkdir");
    symlink("b-file", dir.path().join("a-link")).expect("symlink");

    let (code, header, _) = run(
        FileOp::List {
            path: path_str(dir.path()),
        },
        &[],
    );
    assert_eq!(code, 0, "{header:?}");
    let Header::Ok {
        entries: Some(entries),
        truncated,
        ..
    } = header
    else {
        panic!("no entries: {header:?}")
    };
    assert!(!truncated);
    let names: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind.as_str()))
        .collect();
    assert_eq!(
        names,
        [("a-link", "symlink"), ("b-file", "file"), ("c-dir", "dir")]
    );
    assert_eq!(entries[0].target.as_deref(), Some("b-file"));
    assert_eq!(entries[1].size, 2);

    let (code, header, _) = run(
        FileOp::List {
            path: path_str(&dir.path().join("b-file")),
        },
        &[],
    );
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Invalid);
}

#[test]
fn list_stops_at_the_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    for i in 0..=MAX_LIST_ENTRIES {
        fs::File::create(dir.path().join(format!("{i:05}"))).expect("create");
    }
    let (code, header, _) = run(
        FileOp::List {
            path: path_str(dir.path()),
        },
        &[],
    );
    assert_eq!(code, 0);
    let Header::Ok {
        entries: Some(entries),
        truncated,
        ..
    } = header
    else {
        panic!("no entries: {header:?}")
    };
    assert!(truncated);
    assert_eq!(entries.len(), MAX_LIST_ENTRIES);
    assert_eq!(entries[0].name, "00000");
}

#[test]
fn os_errors_map_to_the_wire_kinds() {
    let kind = |errno| kind_of(&io::Error::from_raw_os_error(errno));
    assert_eq!(kind(libc::ENOENT), ErrorKind::NotFound);
    for errno in [libc::EACCES, libc::EPERM, libc::EROFS, libc::EXDEV] {
        assert_eq!(kind(errno), ErrorKind::Denied, "errno {errno}");
    }
    for errno in [libc::EISDIR, libc::ENOTDIR, libc::ENOSPC, libc::ELOOP] {
        assert_eq!(kind(errno), ErrorKind::Invalid, "errno {errno}");
    }
    // As the tar crate passes them on: the kind survives, the errno does not.
    let wrapped = io::Error::new(io::ErrorKind::PermissionDenied, "wrapped");
    assert_eq!(kind_of(&wrapped), ErrorKind::Denied);
}

#[test]
fn a_refused_write_names_the_path_and_the_os_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("missing/f");
    let (_, header, _) = run(write_op(&path, 0o644), b"x");
    let Header::Error { message, .. } = header else {
        panic!("succeeded")
    };
    assert!(message.starts_with("cannot write /"), "{message}");
    assert!(
        message.ends_with("missing/f: No such file or directory (os error 2)"),
        "{message}"
    );
}

/// Permission checks do not apply to root, so this runs only as another user.
#[test]
fn a_write_the_permissions_forbid_is_denied() {
    if nix::unistd::geteuid().is_root() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let locked = dir.path().join("locked");
    fs::create_dir(&locked).expect("mkdir");
    fs::set_permissions(&locked, Permissions::from_mode(0o555)).expect("chmod");
    let (code, header, _) = run(write_op(&locked.join("f"), 0o644), b"x");
    assert_eq!(code, 1);
    assert_eq!(error_kind(&header), ErrorKind::Denied);
}
