//! Protocol 1.1 files: `upload`, `download`, `stat`, `list_dir`, carried out inside the
//! profile's sandbox as the command's identity. Every case checks what landed on the host, in
//! the daemon's workspace.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use executor_tests::{
    download_req, eventually, peak_rss_kib, req, rss_kib, upload_leftovers, upload_req, Client,
    Daemon,
};
use protocol::{ClientMessage, ErrorCode, ListDirRequest, ServerMessage, StatRequest};
use sha2::{Digest, Sha256};

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn random(len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    getrandom::fill(&mut bytes).unwrap();
    bytes
}

async fn upload(client: &mut Client, id: &str, path: &str, content: &[u8]) -> protocol::Uploaded {
    client
        .upload(upload_req(id, path), content)
        .await
        .unwrap_or_else(|e| panic!("upload {path}: {e:?}"))
}

async fn download(client: &mut Client, id: &str, path: &str) -> Vec<u8> {
    client
        .download(download_req(id, path))
        .await
        .unwrap_or_else(|e| panic!("download {path}: {e:?}"))
        .data
}

async fn stat(client: &mut Client, id: &str, path: &str) -> Result<protocol::FileStat, ErrorCode> {
    client
        .send(&ClientMessage::Stat(StatRequest {
            id: id.to_string(),
            path: path.to_string(),
            profile: None,
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::FileInfo(info) => Ok(info.stat),
        ServerMessage::Error(e) => Err(e.code),
        other => panic!("{id}: expected file_info, got {other:?}"),
    }
}

#[tokio::test]
async fn every_byte_value_round_trips_and_lands_on_the_host_owned_as_a_command_would() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    assert!(
        ["files", "tar"]
            .iter()
            .all(|c| client.hello.capabilities.iter().any(|h| h == c)),
        "{:?}",
        client.hello.capabilities
    );
    let bytes: Vec<u8> = (0..=255u8).collect();
    for profile in ["strict", "landlock"] {
        assert!(
            client
                .hello
                .profiles
                .iter()
                .any(|p| p.name == profile && p.available),
            "{profile} is offered and available: {:?}",
            client.hello.profiles
        );
        let name = format!("bytes-{profile}.bin");
        let mut up = upload_req(&format!("up-{profile}"), &name);
        up.profile = Some(profile.to_string());
        let done = client.upload(up, &bytes).await.unwrap();
        assert_eq!(done.bytes, 256);
        assert!(done.path.ends_with(&format!("/{name}")), "{done:?}");
        let mut down = download_req(&format!("down-{profile}"), &name);
        down.profile = Some(profile.to_string());
        assert_eq!(client.download(down).await.unwrap().data, bytes);

        // On the host: exactly those bytes, owned like a file a command of the profile makes.
        let host = daemon.workspace.join(&name);
        assert_eq!(std::fs::read(&host).unwrap(), bytes, "[{profile}]");
        let mut touch = req(
            &format!("touch-{profile}"),
            &format!("touch made-{profile}"),
        );
        touch.profile = Some(profile.to_string());
        let result = client.exec(touch).await.result.unwrap();
        assert_eq!(result.returncode, 0, "{result:?}");
        let made = std::fs::metadata(daemon.workspace.join(format!("made-{profile}"))).unwrap();
        let uploaded = std::fs::metadata(&host).unwrap();
        assert_eq!(
            (uploaded.uid(), uploaded.gid()),
            (made.uid(), made.gid()),
            "[{profile}]"
        );
        assert_eq!(
            uploaded.uid(),
            65534,
            "[{profile}] the command's uid, not root"
        );
    }
}

#[tokio::test]
async fn a_50_mb_file_round_trips_with_flat_daemon_memory() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let content = random(50 << 20);
    let digest = sha256(&content);
    // Warm the daemon up (its first sandbox, buffers) before the baseline.
    upload(&mut client, "warm", "warm", b"warm").await;
    download(&mut client, "warm-down", "warm").await;
    let before = peak_rss_kib(daemon.pid()).max(rss_kib(daemon.pid()));

    let done = upload(&mut client, "big", "big.bin", &content).await;
    assert_eq!(done.bytes, content.len() as u64);
    assert_eq!(
        sha256(&std::fs::read(daemon.workspace.join("big.bin")).unwrap()),
        digest,
        "the file on the host"
    );
    let back = client
        .download(download_req("big-down", "big.bin"))
        .await
        .unwrap();
    assert_eq!(back.data.len(), content.len());
    assert_eq!(sha256(&back.data), digest);
    assert!(back.chunks > 1, "streamed in chunks");

    let after = peak_rss_kib(daemon.pid());
    assert!(
        after.saturating_sub(before) < 20 * 1024,
        "daemon peak RSS grew from {before} KiB to {after} KiB for a 50 MB round trip"
    );
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

#[tokio::test]
async fn a_download_takes_a_byte_range() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let content: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    upload(&mut client, "up", "range.bin", &content).await;
    for (offset, length, expected) in [
        (100, Some(50), &content[100..150]),
        (990, Some(50), &content[990..]),
        (0, Some(0), &content[..0]),
        (999, None, &content[999..]),
        (1000, None, &content[..0]),
        (5000, Some(10), &content[..0]),
    ] {
        let mut r = download_req("range", "range.bin");
        r.offset = offset;
        r.length = length;
        let got = client.download(r).await.unwrap();
        assert_eq!(got.data, expected, "offset {offset} length {length:?}");
        assert_eq!(got.done.bytes, expected.len() as u64);
    }
    // A range of a tar download makes no sense: refused.
    let mut r = download_req("tar-range", ".");
    r.tar = true;
    r.offset = 1;
    let err = client.download(r).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "{err:?}");
}

#[tokio::test]
async fn the_mode_asked_for_is_applied_and_set_id_bits_are_refused() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for (mode, expected) in [
        (None, 0o644),
        (Some(0o750), 0o750),
        (Some(0o600), 0o600),
        (Some(0o777), 0o777),
    ] {
        let name = format!("mode-{:o}", mode.unwrap_or(0));
        let mut r = upload_req(&name, &name);
        r.mode = mode;
        client.upload(r, b"#!/bin/sh\necho ran\n").await.unwrap();
        let host = std::fs::metadata(daemon.workspace.join(&name)).unwrap();
        assert_eq!(host.permissions().mode() & 0o7777, expected, "{name}");
    }
    // The mode is real: an executable upload runs.
    let result = client.run("x", "./mode-750").await;
    assert_eq!(result.output, "ran\n");
    // A set-id file would hand the command's uid to whoever runs it: such a mode is refused,
    // and nothing is written.
    for mode in [0o4755, 0o2755, 0o1777] {
        let name = format!("mode-{mode:o}");
        let mut r = upload_req(&name, &name);
        r.mode = Some(mode);
        let err = client.upload(r, b"x").await.unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{name}: {err:?}");
        assert!(!daemon.workspace.join(&name).exists(), "{name}");
    }
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

#[tokio::test]
async fn parent_directories_are_created_only_when_asked() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let err = client
        .upload(upload_req("no-parents", "a/b/c.txt"), b"deep")
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NotFound, "{err:?}");
    assert!(!daemon.workspace.join("a").exists(), "a directory was made");

    let mut r = upload_req("parents", "a/b/c.txt");
    r.parents = true;
    client.upload(r, b"deep").await.unwrap();
    assert_eq!(
        std::fs::read(daemon.workspace.join("a/b/c.txt")).unwrap(),
        b"deep"
    );
    let dir = std::fs::metadata(daemon.workspace.join("a/b")).unwrap();
    assert!(dir.is_dir());
    assert_eq!(dir.uid(), 65534, "made as the command's uid");
}

/// What the host (or a tar stream) holds for one path: kind, mode, content or link target.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir(u32),
    File(u32, Vec<u8>),
    Link(String),
}

fn host_tree(root: &Path) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            let node = if meta.is_symlink() {
                Node::Link(std::fs::read_link(&path).unwrap().display().to_string())
            } else if meta.is_dir() {
                stack.push(path.clone());
                Node::Dir(mode)
            } else {
                Node::File(mode, std::fs::read(&path).unwrap())
            };
            out.insert(name, node);
        }
    }
    out
}

fn tar_tree(archive: &[u8]) -> BTreeMap<String, Node> {
    use std::io::Read;
    let mut out = BTreeMap::new();
    let mut archive = tar::Archive::new(archive);
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().display().to_string();
        let name = name
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_string();
        let mode = entry.header().mode().unwrap() & 0o7777;
        let node = match entry.header().entry_type() {
            tar::EntryType::Directory => Node::Dir(mode),
            tar::EntryType::Symlink => {
                Node::Link(entry.link_name().unwrap().unwrap().display().to_string())
            }
            _ => {
                let mut data = Vec::new();
                entry.read_to_end(&mut data).unwrap();
                Node::File(mode, data)
            }
        };
        if name != "." && !name.is_empty() {
            out.insert(name, node);
        }
    }
    out
}

fn build_tar(tree: &BTreeMap<String, Node>) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, node) in tree {
        let mut header = tar::Header::new_gnu();
        header.set_mtime(1_700_000_000);
        match node {
            Node::Dir(mode) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(*mode);
                header.set_size(0);
                builder
                    .append_data(&mut header, name, std::io::empty())
                    .unwrap();
            }
            Node::File(mode, data) => {
                header.set_mode(*mode);
                header.set_size(data.len() as u64);
                builder
                    .append_data(&mut header, name, data.as_slice())
                    .unwrap();
            }
            Node::Link(target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, name, target).unwrap();
            }
        }
    }
    builder.into_inner().unwrap()
}

#[tokio::test]
async fn a_directory_tree_goes_up_and_comes_back_as_tar() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let tree: BTreeMap<String, Node> = [
        ("a.txt", Node::File(0o644, b"alpha\n".to_vec())),
        ("empty", Node::Dir(0o755)),
        ("link", Node::Link("a.txt".into())),
        ("sub", Node::Dir(0o750)),
        (
            "sub/run.sh",
            Node::File(0o755, b"#!/bin/sh\necho sub\n".to_vec()),
        ),
        ("sub/deeper", Node::Dir(0o755)),
        ("sub/deeper/bytes", Node::File(0o600, (0..=255u8).collect())),
    ]
    .into_iter()
    .map(|(n, node)| (n.to_string(), node))
    .collect();
    let archive = build_tar(&tree);
    let mut r = upload_req("tar-up", "tree");
    r.tar = true;
    let done = client.upload(r, &archive).await.unwrap();
    assert_eq!(done.bytes, archive.len() as u64);
    // On the host, the same tree.
    let root = daemon.workspace.join("tree");
    assert_eq!(host_tree(&root), tree);
    assert_eq!(std::fs::metadata(&root).unwrap().uid(), 65534);
    // And back.
    let mut r = download_req("tar-down", "tree");
    r.tar = true;
    let back = client.download(r).await.unwrap();
    assert_eq!(tar_tree(&back.data), tree);
    assert!(upload_leftovers(&root).is_empty());
}

#[tokio::test]
async fn stat_and_list_dir_describe_what_the_host_holds() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut r = upload_req("f", "dir/file");
    r.parents = true;
    r.mode = Some(0o640);
    client.upload(r, b"12345").await.unwrap();
    upload(&mut client, "g", "dir/another", b"").await;
    std::os::unix::fs::symlink("file", daemon.workspace.join("dir/link")).unwrap();
    std::fs::create_dir(daemon.workspace.join("dir/sub")).unwrap();

    let host = std::fs::metadata(daemon.workspace.join("dir/file")).unwrap();
    let info = stat(&mut client, "stat", "dir/file").await.unwrap();
    assert_eq!(info.kind, "file");
    assert_eq!(info.size, 5);
    assert_eq!(info.mode, 0o640);
    assert_eq!((info.uid, info.gid), (host.uid(), host.gid()));
    assert_eq!(info.mtime, host.mtime());
    assert!(info.name.ends_with("/dir/file"), "{info:?}");
    let link = stat(&mut client, "stat-link", "dir/link").await.unwrap();
    assert_eq!(
        (link.kind.as_str(), link.target.as_deref()),
        ("symlink", Some("file"))
    );
    assert_eq!(
        stat(&mut client, "stat-missing", "dir/nope").await,
        Err(ErrorCode::NotFound)
    );

    client
        .send(&ClientMessage::ListDir(ListDirRequest {
            id: "ls".into(),
            path: "dir".into(),
            profile: None,
        }))
        .await;
    let listing = match client.reply_for("ls").await {
        ServerMessage::DirListing(l) => l,
        other => panic!("{other:?}"),
    };
    assert!(!listing.truncated);
    let seen: Vec<(&str, &str, u64)> = listing
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind.as_str(), e.size))
        .collect();
    assert_eq!(
        seen,
        [
            ("another", "file", 0),
            ("file", "file", 5),
            ("link", "symlink", 4),
            ("sub", "dir", seen[3].2),
        ]
    );
    client
        .send(&ClientMessage::ListDir(ListDirRequest {
            id: "ls-missing".into(),
            path: "nodir".into(),
            profile: None,
        }))
        .await;
    assert!(matches!(
        client.reply_for("ls-missing").await,
        ServerMessage::Error(e) if e.code == ErrorCode::NotFound
    ));
}

#[tokio::test]
async fn an_upload_replaces_the_file_atomically_and_leaves_no_temporary_file() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    upload(&mut client, "v1", "atomic.txt", b"version 1\n").await;
    let first = std::fs::metadata(daemon.workspace.join("atomic.txt")).unwrap();
    upload(&mut client, "v2", "atomic.txt", b"version 2\n").await;
    let host = daemon.workspace.join("atomic.txt");
    assert_eq!(std::fs::read(&host).unwrap(), b"version 2\n");
    assert_ne!(
        std::fs::metadata(&host).unwrap().ino(),
        first.ino(),
        "renamed into place, not rewritten"
    );
    assert!(upload_leftovers(&daemon.workspace).is_empty());

    // A failed upload (into a directory the command may not write) leaves nothing either.
    std::fs::create_dir(daemon.workspace.join("locked")).unwrap();
    let err = client
        .upload(upload_req("locked", "locked/x"), b"no")
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Denied, "{err:?}");
    assert!(std::fs::read_dir(daemon.workspace.join("locked"))
        .unwrap()
        .next()
        .is_none());
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

/// Start an upload of `path` as `id` and send it 4 KiB without its end: checks that its
/// temporary file is then beside the destination (the control for "nothing is left").
async fn start_upload_midway(client: &mut Client, daemon: &Daemon, id: &str, path: &str) {
    client
        .send(&ClientMessage::Upload(upload_req(id, path)))
        .await;
    client.write_chunk(id, &[b'p'; 4096], false).await;
    assert!(
        eventually(Duration::from_secs(10), || !upload_leftovers(
            &daemon.workspace
        )
        .is_empty())
        .await,
        "{id}: no temporary file while the upload runs"
    );
}

/// Regression (issue 35): a `write` whose data is not base64 answered `bad_request` but left
/// the upload running and its `.NAME.upload-<hex>` in the workspace until the session closed.
#[tokio::test]
async fn an_upload_given_data_that_is_not_base64_fails_and_removes_its_temporary_file_at_once() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    upload(&mut client, "v1", "kept.txt", b"complete\n").await;
    // Control: mid-upload, the temporary file exists beside the destination.
    start_upload_midway(&mut client, &daemon, "bad", "kept.txt").await;
    client
        .send(&ClientMessage::Write(protocol::WriteRequest {
            id: "bad".into(),
            data: Some("this is *not* base64".into()),
            text: None,
            eof: false,
        }))
        .await;
    match client.reply_for("bad").await {
        ServerMessage::Error(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
            assert!(e.message.contains("not base64"), "{e:?}");
        }
        other => panic!("expected the upload's error, got {other:?}"),
    }
    // At once: by the time the answer arrives, not when the session ends.
    assert!(
        upload_leftovers(&daemon.workspace).is_empty(),
        "temporary upload files left behind: {:?}",
        upload_leftovers(&daemon.workspace)
    );
    assert_eq!(
        std::fs::read(daemon.workspace.join("kept.txt")).unwrap(),
        b"complete\n",
        "a failed upload replaced the file"
    );
    // The one answer: a later write to it is dropped quietly, and the session goes on (the
    // same id uploads again, completely).
    client.write_chunk("bad", b"late", true).await;
    upload(&mut client, "bad", "kept.txt", b"second\n").await;
    assert_eq!(
        std::fs::read(daemon.workspace.join("kept.txt")).unwrap(),
        b"second\n"
    );
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

#[tokio::test]
async fn an_upload_cut_short_by_the_connection_leaves_neither_a_partial_nor_a_temporary_file() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    upload(&mut client, "v1", "cut.txt", b"complete\n").await;
    // Control: mid-upload, the temporary file exists beside the destination.
    start_upload_midway(&mut client, &daemon, "v2", "cut.txt").await;
    // The connection ends before the upload's end-of-file.
    drop(client);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        std::fs::read(daemon.workspace.join("cut.txt")).unwrap(),
        b"complete\n",
        "a partial upload replaced the file"
    );
    assert!(
        eventually(executor_tests::PATIENCE, || upload_leftovers(
            &daemon.workspace
        )
        .is_empty())
        .await,
        "temporary upload files left behind: {:?}",
        upload_leftovers(&daemon.workspace)
    );
}

#[tokio::test]
async fn endless_devices_and_fifos_are_refused_at_once_not_read_forever() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    nix::unistd::mkfifo(
        &daemon.workspace.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o666),
    )
    .unwrap();
    for (profile, path) in [
        ("landlock", "/dev/urandom"),
        ("landlock", "/dev/zero"),
        ("strict", "/dev/zero"),
        ("strict", "fifo"),
        ("landlock", "fifo"),
    ] {
        let mut r = download_req(&format!("dev-{profile}"), path);
        r.profile = Some(profile.to_string());
        let started = std::time::Instant::now();
        let err = client.download(r).await.unwrap_err();
        assert_eq!(
            err.code,
            ErrorCode::BadRequest,
            "[{profile}] {path}: {err:?}"
        );
        assert!(
            err.message.contains("not a regular file"),
            "[{profile}] {path}: {}",
            err.message
        );
        assert!(started.elapsed() < executor_tests::PROMPTLY);
    }
    // Control: a regular file beside the FIFO downloads.
    std::fs::write(daemon.workspace.join("plain"), "plain\n").unwrap();
    assert_eq!(download(&mut client, "plain", "plain").await, b"plain\n");
}

#[tokio::test]
async fn writes_that_follow_a_refused_upload_get_no_reply_of_their_own() {
    // The refusal is the upload's one answer; what the client still sends for it is dropped
    // (executor/src/server/attached.rs: "one already answered (it failed early) drops what
    // still comes"), so a client never takes another error for the upload's answer.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    std::fs::create_dir(daemon.workspace.join("locked")).unwrap();
    client
        .send(&ClientMessage::Upload(upload_req("up", "locked/x")))
        .await;
    for _ in 0..50 {
        client.write_chunk("up", &[b'x'; 1024], false).await;
    }
    client.write_chunk("up", &[], true).await;
    // The first reply may be slow on a busy machine; then 2 s of silence ends the replies.
    let mut replies = Vec::new();
    let mut wait = executor_tests::PATIENCE;
    while let Ok(Some(msg)) = client.recv_within(wait).await {
        replies.push(msg);
        wait = Duration::from_secs(2);
    }
    assert!(
        matches!(replies.first(), Some(ServerMessage::Error(e)) if e.code == ErrorCode::Denied),
        "{:?}",
        replies.first()
    );
    assert_eq!(
        replies.len(),
        1,
        "more than one reply for one upload: {:?}",
        replies.iter().skip(1).take(3).collect::<Vec<_>>()
    );
    assert!(!daemon.workspace.join("locked/x").exists());
}

#[tokio::test]
async fn two_interleaved_uploads_to_one_path_leave_one_whole_version() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let a = vec![b'a'; 300_000];
    let b = vec![b'b'; 300_000];
    for id in ["a", "b"] {
        client
            .send(&ClientMessage::Upload(upload_req(id, "shared.bin")))
            .await;
    }
    for (ca, cb) in a.chunks(30_000).zip(b.chunks(30_000)) {
        client.write_chunk("a", ca, false).await;
        client.write_chunk("b", cb, false).await;
    }
    client.write_chunk("b", &[], true).await;
    client.write_chunk("a", &[], true).await;
    let mut answered = Vec::new();
    while answered.len() < 2 {
        match client.recv().await {
            Some(ServerMessage::Uploaded(u)) => answered.push(u.id),
            Some(ServerMessage::Error(e)) => panic!("{e:?}"),
            Some(_) => {}
            None => panic!("closed"),
        }
    }
    let host = std::fs::read(daemon.workspace.join("shared.bin")).unwrap();
    assert!(host == a || host == b, "a mix of both uploads");
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

#[tokio::test]
async fn an_upload_goes_on_after_a_dropped_connection_is_resumed() {
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    client
        .send(&ClientMessage::Upload(upload_req("up", "resumed.bin")))
        .await;
    client.write_chunk("up", b"first half, ", false).await;
    assert!(
        eventually(Duration::from_secs(10), || !upload_leftovers(
            &daemon.workspace
        )
        .is_empty())
        .await,
        "the upload started"
    );
    // The network fails (no close frame) part way through.
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!daemon.workspace.join("resumed.bin").exists());
    let mut client = daemon.connect().await;
    client
        .send(&ClientMessage::Resume(protocol::ResumeRequest {
            session,
            awaiting: vec!["up".into()],
        }))
        .await;
    match client.recv().await {
        Some(ServerMessage::Resumed(r)) => assert_eq!(r.running, vec!["up".to_string()]),
        other => panic!("expected resumed, got {other:?}"),
    }
    client.write_chunk("up", b"second half", true).await;
    match client.reply_for("up").await {
        ServerMessage::Uploaded(u) => assert_eq!(u.bytes, 23),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        std::fs::read(daemon.workspace.join("resumed.bin")).unwrap(),
        b"first half, second half"
    );
    assert!(upload_leftovers(&daemon.workspace).is_empty());
}

#[tokio::test]
async fn a_tar_upload_does_not_create_set_id_files_either() {
    // A plain upload refuses a mode beyond 0o777 (protocol/README.md: "at most 0o777"): a
    // set-id file hands its owner's uid to whoever runs it. A tar stream is the same upload
    // and must not make one either (set-id bits dropped, or the upload refused). Control: the
    // archive's ordinary permission bits are kept.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut builder = tar::Builder::new(Vec::new());
    for (name, mode) in [("suid", 0o4755), ("sgid", 0o2755), ("plain", 0o750)] {
        let mut header = tar::Header::new_gnu();
        header.set_mode(mode);
        header.set_size(3);
        builder.append_data(&mut header, name, &b"abc"[..]).unwrap();
    }
    let archive = builder.into_inner().unwrap();
    for profile in ["strict", "landlock"] {
        let dir = daemon.workspace.join(format!("tar-{profile}"));
        let mut r = upload_req(&format!("t-{profile}"), &format!("tar-{profile}"));
        r.tar = true;
        r.profile = Some(profile.into());
        let got = client.upload(r, &archive).await;
        if got.is_ok() {
            let mode = |name: &str| {
                std::fs::metadata(dir.join(name))
                    .unwrap()
                    .permissions()
                    .mode()
                    & 0o7777
            };
            assert_eq!(mode("plain"), 0o750, "[{profile}] control");
            for name in ["suid", "sgid"] {
                assert_eq!(
                    mode(name) & 0o7000,
                    0,
                    "[{profile}] {name} is {:o} on the host, owned by uid {}",
                    mode(name),
                    std::fs::metadata(dir.join(name)).unwrap().uid()
                );
            }
        }
    }
}

#[tokio::test]
async fn a_download_whose_connection_drops_fails_at_once_and_the_rest_comes_by_offset() {
    // protocol/README.md, flow control: a download is tied to its connection. Dropped part
    // way (no close frame), it fails with an error the resume delivers, well before the
    // daemon's 60 s wait for a chunk; none of its chunks follow on the new connection.
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let content = random(16 << 20);
    std::fs::write(daemon.workspace.join("big.bin"), &content).unwrap();
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    client
        .send(&ClientMessage::Download(download_req("dl", "big.bin")))
        .await;
    let mut got = Vec::new();
    for seq in 0..3 {
        match client.reply_for("dl").await {
            ServerMessage::DownloadData(chunk) => {
                assert_eq!(chunk.seq, seq);
                got.extend_from_slice(&executor_tests::unb64(&chunk.data));
            }
            other => panic!("expected download_data, got {other:?}"),
        }
    }
    assert!(got.len() < content.len(), "the download was cut part way");
    drop(client);
    let mut client = daemon.connect().await;
    let resumed_at = std::time::Instant::now();
    client
        .send(&ClientMessage::Resume(protocol::ResumeRequest {
            session,
            awaiting: vec!["dl".into()],
        }))
        .await;
    match client.recv().await {
        Some(ServerMessage::Resumed(_)) => {}
        other => panic!("expected resumed, got {other:?}"),
    }
    let err = loop {
        let msg = client
            .recv_within(Duration::from_secs(20).saturating_sub(resumed_at.elapsed()))
            .await
            .unwrap_or_else(|()| {
                panic!(
                    "no answer for the dropped download within 20 s; daemon log:\n{}",
                    daemon.log()
                )
            })
            .expect("connection open");
        match msg {
            ServerMessage::Error(e) if e.id.as_deref() == Some("dl") => break e,
            ServerMessage::DownloadData(c) if c.id == "dl" => {
                panic!(
                    "chunk {} of the dropped download on the new connection",
                    c.seq
                )
            }
            _ => {}
        }
    };
    eprintln!("the error came {:?} after the resume", resumed_at.elapsed());
    assert_eq!(err.code, ErrorCode::EnvironmentError, "{err:?}");
    assert!(err.message.contains("offset"), "{}", err.message);
    assert!(
        resumed_at.elapsed() < Duration::from_secs(20),
        "answered after {:?}",
        resumed_at.elapsed()
    );
    // Nothing more of it follows.
    while let Ok(Some(msg)) = client.recv_within(Duration::from_millis(500)).await {
        if let ServerMessage::DownloadData(c) = &msg {
            assert_ne!(c.id, "dl", "chunk {} after the error", c.seq);
        }
    }
    // Allowed: the rest, by offset, on the new connection, completes the file byte for byte.
    let mut rest = download_req("dl-rest", "big.bin");
    rest.offset = got.len() as u64;
    got.extend_from_slice(&client.download(rest).await.unwrap().data);
    assert_eq!(got.len(), content.len());
    assert!(
        got == content,
        "the pieces differ from the file on the host"
    );
}
