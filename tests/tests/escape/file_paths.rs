//! Protocol 1.1 file operations against paths that lead out of what a profile may reach:
//! `..` climbs, absolute paths, symlinks and hardlinks planted in the workspace from the host,
//! tar entries that climb out, and files the command's uid may not read. A file operation runs
//! inside the profile's sandbox as the command's identity, so each must be refused exactly as a
//! command would be; each case checks the host and pairs the denial with an allowed control.

use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};

use executor_tests::{download_req, marker, upload_leftovers, upload_req, Client};
use protocol::{ClientMessage, ErrorCode, ErrorMessage, ListDirRequest, ServerMessage, Uploaded};

use crate::common::*;

async fn upload_as(
    client: &mut Client,
    profile: &str,
    path: &str,
    content: &[u8],
) -> Result<Uploaded, ErrorMessage> {
    let mut r = upload_req(&format!("up-{profile}-{}", marker()), path);
    r.profile = Some(profile.to_string());
    client.upload(r, content).await
}

async fn download_as(
    client: &mut Client,
    profile: &str,
    path: &str,
) -> Result<Vec<u8>, ErrorMessage> {
    let mut r = download_req(&format!("down-{profile}-{}", marker()), path);
    r.profile = Some(profile.to_string());
    client.download(r).await.map(|d| d.data)
}

/// A refusal: `denied`, or `not_found` where the profile's view has no such directory at all
/// (strict's root holds only the system directories and the workspace).
fn assert_refused(label: &str, got: &Result<Uploaded, ErrorMessage>, codes: &[ErrorCode]) {
    match got {
        Ok(done) => panic!("{label} was written: {done:?}"),
        Err(e) => assert!(codes.contains(&e.code), "{label}: {e:?}"),
    }
}

/// Removes a host path (file or directory tree) when dropped.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = executor_tests::scratch::remove_tree(&self.0);
    }
}

fn victim_dir() -> executor_tests::TempDir {
    executor_tests::TempDir::with_prefix_in("escape-victim-", "/var/tmp").unwrap()
}

/// A path outside what the profile may touch, with the error codes a refusal may carry:
/// landlock says Denied; strict, whose view may not hold the path at all, Denied or NotFound.
/// `trusted` is the control.
const OUTSIDE_THE_VIEW: [(&str, Expect, &[ErrorCode]); 3] = [
    (LANDLOCK, Denied, &[ErrorCode::Denied]),
    (STRICT, Denied, &[ErrorCode::Denied, ErrorCode::NotFound]),
    (TRUSTED, Allowed, &[]),
];

#[tokio::test]
async fn an_upload_climbing_out_of_the_workspace_with_dotdot_is_refused() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    // The workspace is /var/tmp/escape-ws-*/workspace: `../../<name>` is /var/tmp/<name>, a
    // directory every uid may write on the host (1777), so only the sandbox stands in the way.
    assert!(daemon.workspace.starts_with("/var/tmp"));
    let m = marker();
    for (profile, expect, codes) in OUTSIDE_THE_VIEW {
        let l = label(profile, expect);
        for (i, climb) in ["../..", "../../../../../../../../var/tmp"]
            .iter()
            .enumerate()
        {
            let name = format!("escape-climb-{m}-{profile}-{i}");
            let host = Path::new("/var/tmp").join(&name);
            let _cleanup = Cleanup(host.clone());
            let got = upload_as(&mut client, profile, &format!("{climb}/{name}"), b"out").await;
            match expect {
                Denied => {
                    assert_refused(&l, &got, codes);
                    assert!(!host.exists(), "{l} wrote {}", host.display());
                }
                Allowed => {
                    got.unwrap_or_else(|e| panic!("{l} control: {e:?}"));
                    assert_eq!(std::fs::read(&host).unwrap(), b"out", "{l} control");
                }
            }
        }
    }
    // Control: `..` that stays inside the workspace is fine.
    std::fs::create_dir(daemon.workspace.join("sub")).unwrap();
    upload_as(&mut client, LANDLOCK, "sub/../inside", b"in")
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(daemon.workspace.join("inside")).unwrap(),
        b"in"
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn an_upload_to_an_absolute_path_outside_the_workspace_is_refused() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let m = marker();
    for dir in ["/etc", "/root"] {
        for (profile, codes) in [
            (LANDLOCK, &[ErrorCode::Denied][..]),
            (STRICT, &[ErrorCode::Denied][..]),
        ] {
            let host = Path::new(dir).join(format!("escape-abs-{m}-{profile}"));
            let _cleanup = Cleanup(host.clone());
            let got = upload_as(&mut client, profile, host.to_str().unwrap(), b"x").await;
            assert_refused(&format!("[{profile}] {}", host.display()), &got, codes);
            assert!(!host.exists(), "[{profile}] wrote {}", host.display());
        }
    }
    // Controls: trusted (root, no policy) writes /root; landlock writes the workspace by its
    // absolute host path.
    let host = PathBuf::from(format!("/root/escape-abs-{m}-trusted"));
    let _cleanup = Cleanup(host.clone());
    upload_as(&mut client, TRUSTED, host.to_str().unwrap(), b"root")
        .await
        .unwrap();
    assert_eq!(std::fs::read(&host).unwrap(), b"root");
    let inside = daemon.workspace.join("absolute-inside");
    upload_as(&mut client, LANDLOCK, inside.to_str().unwrap(), b"ws")
        .await
        .unwrap();
    assert_eq!(std::fs::read(&inside).unwrap(), b"ws");
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_symlink_in_the_workspace_to_a_host_directory_is_not_written_through() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let m = marker();
    symlink("/etc", daemon.workspace.join("etc-link")).unwrap();
    let passwd = std::fs::read("/etc/passwd").unwrap();
    let passwd_inode = std::fs::metadata("/etc/passwd").unwrap().ino();
    for (profile, codes) in [
        (LANDLOCK, &[ErrorCode::Denied][..]),
        (STRICT, &[ErrorCode::Denied][..]),
    ] {
        let name = format!("escape-link-{m}-{profile}");
        let host = Path::new("/etc").join(&name);
        let _cleanup = Cleanup(host.clone());
        let got = upload_as(&mut client, profile, &format!("etc-link/{name}"), b"x").await;
        assert_refused(&format!("[{profile}] through etc-link"), &got, codes);
        assert!(!host.exists(), "[{profile}] wrote {}", host.display());
        assert!(upload_leftovers(Path::new("/etc")).is_empty());

        // An upload *to* a link's own name replaces the link and never writes its target.
        let link = daemon.workspace.join(format!("passwd-link-{profile}"));
        symlink("/etc/passwd", &link).unwrap();
        upload_as(
            &mut client,
            profile,
            &format!("passwd-link-{profile}"),
            b"mine",
        )
        .await
        .unwrap_or_else(|e| panic!("[{profile}] replacing a link: {e:?}"));
        assert!(std::fs::symlink_metadata(&link).unwrap().is_file());
        assert_eq!(std::fs::read(&link).unwrap(), b"mine");
    }
    assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd);
    assert_eq!(
        std::fs::metadata("/etc/passwd").unwrap().ino(),
        passwd_inode
    );
    // Control: a symlink to a directory the profile may write is followed.
    std::fs::create_dir(daemon.workspace.join("real")).unwrap();
    nix::unistd::chown(
        &daemon.workspace.join("real"),
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .unwrap();
    symlink("real", daemon.workspace.join("real-link")).unwrap();
    for profile in [LANDLOCK, STRICT] {
        upload_as(&mut client, profile, &format!("real-link/{profile}"), b"ok")
            .await
            .unwrap_or_else(|e| panic!("[{profile}] control: {e:?}"));
        assert_eq!(
            std::fs::read(daemon.workspace.join("real").join(profile)).unwrap(),
            b"ok"
        );
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn an_upload_to_a_hardlink_of_a_host_file_replaces_the_link_not_the_file() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let victims = victim_dir();
    // strict does not even see the victim's directory.
    for (profile, code) in [(LANDLOCK, ErrorCode::Denied), (STRICT, ErrorCode::NotFound)] {
        // A root-owned file outside the workspace, on the same filesystem, hardlinked in.
        let victim = victims.path().join(format!("victim-{profile}"));
        std::fs::write(&victim, "original\n").unwrap();
        let inode = std::fs::metadata(&victim).unwrap().ino();
        let link = daemon.workspace.join(format!("hl-{profile}"));
        std::fs::hard_link(&victim, &link).unwrap();
        assert_eq!(std::fs::metadata(&victim).unwrap().nlink(), 2);

        // Denied: the victim by its own path.
        let direct = upload_as(&mut client, profile, victim.to_str().unwrap(), b"direct\n").await;
        assert_refused(
            &format!("[{profile}] {}", victim.display()),
            &direct,
            &[code],
        );
        // Allowed: the link's name in the workspace, replaced by a new file.
        upload_as(
            &mut client,
            profile,
            &format!("hl-{profile}"),
            b"replaced\n",
        )
        .await
        .unwrap_or_else(|e| panic!("[{profile}] upload to the link's name: {e:?}"));
        assert_eq!(std::fs::read(&link).unwrap(), b"replaced\n");
        assert_ne!(std::fs::metadata(&link).unwrap().ino(), inode);
        let after = std::fs::metadata(&victim).unwrap();
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "original\n",
            "[{profile}] the host file was written through its hardlink"
        );
        assert_eq!((after.ino(), after.nlink(), after.uid()), (inode, 1, 0));
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_download_of_a_file_the_profile_may_not_read_is_refused() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let m = marker();
    let secret = PathBuf::from(format!("/root/escape-secret-{m}"));
    let _cleanup = Cleanup(secret.clone());
    std::fs::write(&secret, format!("secret {m}\n")).unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for (profile, expect, codes) in OUTSIDE_THE_VIEW {
        let l = label(profile, expect);
        let got = download_as(&mut client, profile, secret.to_str().unwrap()).await;
        match expect {
            Denied => {
                let err = got.expect_err(&format!("{l} read the secret"));
                assert!(codes.contains(&err.code), "{l}: {err:?}");
                assert!(
                    !err.message.contains(&format!("secret {m}")),
                    "{l}: {err:?}"
                );
            }
            Allowed => assert_eq!(got.unwrap(), format!("secret {m}\n").into_bytes(), "{l}"),
        }
    }
    // Listing /root is refused to landlock too; its workspace lists fine.
    for (path, ok) in [("/root", false), (".", true)] {
        let id = format!("ls-{}", marker());
        client
            .send(&ClientMessage::ListDir(ListDirRequest {
                id: id.clone(),
                path: path.into(),
                profile: Some(LANDLOCK.into()),
            }))
            .await;
        match (client.reply_for(&id).await, ok) {
            (ServerMessage::DirListing(_), true) => {}
            (ServerMessage::Error(e), false) => assert_eq!(e.code, ErrorCode::Denied, "{e:?}"),
            (other, _) => panic!("list_dir {path}: {other:?}"),
        }
    }
    // Control: a 0600 file of the command's own uid in the workspace downloads.
    let own = daemon.workspace.join("own");
    std::fs::write(&own, "own\n").unwrap();
    std::fs::set_permissions(&own, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    nix::unistd::chown(
        &own,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .unwrap();
    assert_eq!(
        download_as(&mut client, LANDLOCK, "own").await.unwrap(),
        b"own\n"
    );
    assert_daemon_intact(&daemon).await;
}

/// A tar header for `name` written straight into the name field, so that names the tar
/// crate's own builder refuses (`..`) can be made.
fn raw_entry(
    builder: &mut tar::Builder<Vec<u8>>,
    name: &str,
    kind: tar::EntryType,
    link: &str,
    data: &[u8],
) {
    let mut header = tar::Header::new_old();
    header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
    header.set_entry_type(kind);
    header.set_mode(0o644);
    header.set_size(data.len() as u64);
    if !link.is_empty() {
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    header.set_cksum();
    builder.append(&header, data).unwrap();
}

#[tokio::test]
async fn a_tar_upload_whose_entries_climb_out_is_refused() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let victims = victim_dir();
    std::fs::set_permissions(
        victims.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let target = victims.path().display().to_string();
    // Three classic tar slips: a `..` entry, a symlink entry pointing outside followed by an
    // entry through it, and an absolute name (which must land inside, its `/` stripped).
    let dotdot = {
        let mut b = tar::Builder::new(Vec::new());
        let climb = format!("../../../../../../..{target}/dotdot");
        raw_entry(&mut b, &climb, tar::EntryType::Regular, "", b"x");
        b.into_inner().unwrap()
    };
    let through_link = {
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(&mut b, "out", tar::EntryType::Symlink, &target, b"");
        raw_entry(&mut b, "out/through", tar::EntryType::Regular, "", b"x");
        b.into_inner().unwrap()
    };
    let absolute = {
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(
            &mut b,
            &format!("{target}/absolute"),
            tar::EntryType::Regular,
            "",
            b"x",
        );
        b.into_inner().unwrap()
    };
    for profile in [LANDLOCK, STRICT, TRUSTED] {
        for (name, archive) in [("dotdot", &dotdot), ("link", &through_link)] {
            let dir = format!("tar-{profile}-{name}");
            let mut r = upload_req(&format!("tar-{profile}-{name}"), &dir);
            r.tar = true;
            r.profile = Some(profile.to_string());
            let got = client.upload(r, archive).await;
            assert!(got.is_err(), "[{profile}] {name}: {got:?}");
        }
        let dir = format!("tar-{profile}-abs");
        let mut r = upload_req(&format!("tar-{profile}-abs"), &dir);
        r.tar = true;
        r.profile = Some(profile.to_string());
        client
            .upload(r, &absolute)
            .await
            .unwrap_or_else(|e| panic!("[{profile}] absolute entry: {e:?}"));
        let inside = daemon
            .workspace
            .join(&dir)
            .join(target.trim_start_matches('/'))
            .join("absolute");
        assert!(inside.is_file(), "[{profile}] {}", inside.display());
    }
    let outside: Vec<_> = std::fs::read_dir(victims.path())
        .unwrap()
        .flatten()
        .collect();
    assert!(
        outside.is_empty(),
        "a tar entry landed outside: {outside:?}"
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_symlink_in_the_workspace_to_a_host_file_does_not_download_it() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let m = marker();
    // World-readable on the host (0755 directory, 0644 file): only the sandbox's view of the
    // filesystem keeps it from the command.
    let victims = victim_dir();
    std::fs::set_permissions(
        victims.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let secret = victims.path().join("secret");
    std::fs::write(&secret, format!("secret {m}\n")).unwrap();
    let dir = daemon.workspace.join("links");
    std::fs::create_dir(&dir).unwrap();
    symlink(&secret, dir.join("to-secret")).unwrap();
    for (profile, expect, code) in [
        (LANDLOCK, Denied, Some(ErrorCode::Denied)),
        (STRICT, Denied, Some(ErrorCode::NotFound)),
        (TRUSTED, Allowed, None),
    ] {
        let l = label(profile, expect);
        let got = download_as(&mut client, profile, "links/to-secret").await;
        match (expect, code) {
            (Denied, Some(code)) => {
                let err = got.expect_err(&format!("{l} read the secret through a link"));
                assert_eq!(err.code, code, "{l}: {err:?}");
            }
            _ => assert_eq!(got.unwrap(), format!("secret {m}\n").into_bytes(), "{l}"),
        }
        // A tar download of the directory stores the link itself, never its target's bytes.
        let mut r = download_req(&format!("tar-{profile}"), "links");
        r.profile = Some(profile.to_string());
        r.tar = true;
        let archive = client.download(r).await.unwrap().data;
        let needle = format!("secret {m}");
        assert!(
            !archive
                .windows(needle.len())
                .any(|w| w == needle.as_bytes()),
            "{l} the tar stream holds the link's target"
        );
        let mut entries = tar::Archive::new(archive.as_slice());
        let link = entries
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.path().unwrap().ends_with("to-secret"))
            .unwrap_or_else(|| panic!("{l} no entry for the link"));
        assert_eq!(link.header().entry_type(), tar::EntryType::Symlink, "{l}");
        assert_eq!(link.link_name().unwrap().unwrap(), secret, "{l}");
    }
    assert_daemon_intact(&daemon).await;
}
