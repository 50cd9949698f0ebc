//! The soak's operations, one function a kind: each checks what it got.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use base64::Engine;
use protocol::{ClientMessage, DownloadRequest, ServerMessage, SignalRequest, UploadRequest};

use crate::soak_conn::{b64, conn, drop_and_resume, sha, Conn, Rng, Shared};
use crate::soak_host::kill_by_cmdline;

/// Lines of a counter process.
const COUNT: u32 = 400;

/// `exec` of an echo: its output and latency.
pub(crate) async fn op_exec(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn.id("exec");
    let mut req = crate::client::request(id.clone(), &format!("echo {id}"), "");
    req.profile = None;
    req.env = shared.env();
    let t0 = Instant::now();
    let (result, _) = conn.client.run(req).await?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if result.returncode != 0 || result.output != format!("{id}\n") {
        bail!("exec {id}: {} {:?}", result.returncode, result.output);
    }
    if let Ok(mut t) = shared.tally.lock() {
        t.exec_ms.push(ms);
    }
    Ok(())
}

/// The counter's whole output: "1\n2\n...COUNT\n".
pub(crate) fn counter_expected() -> Vec<u8> {
    (1..=COUNT)
        .map(|i| format!("{i}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Read a counter process from `offset` to its end, checking that each reply starts where it
/// was asked (or later by exactly `dropped`); stop early, before the end, after `stop_at`
/// bytes if given. Returns the bytes read and the offset reached.
pub(crate) async fn read_counter(
    conn: &mut Conn,
    id: &str,
    mut offset: u64,
    got: &mut Vec<u8>,
    dropped: &mut u64,
    stop_at: Option<u64>,
) -> anyhow::Result<u64> {
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        let out = conn.read(id, offset).await?;
        if out.offset != offset + out.dropped {
            bail!(
                "read from {offset} answered from {} with dropped {}",
                out.offset,
                out.dropped
            );
        }
        *dropped += out.dropped;
        got.extend(b64().decode(out.data.as_bytes())?);
        offset = out.next_offset;
        if out.eof {
            return Ok(offset);
        }
        if stop_at.is_some_and(|s| offset >= s) {
            return Ok(offset);
        }
        if Instant::now() > give_up {
            bail!("{id}: no end after 120 s at offset {offset}");
        }
    }
}

/// Check a counter's output read through `resumes` resumes: exactly 1..COUNT, or, when the
/// daemon said it dropped bytes, a tail of it.
pub(crate) fn check_counter(shared: &Shared, id: &str, got: &[u8], dropped: u64, resumed: bool) {
    let want = counter_expected();
    let ok = if dropped == 0 {
        got == want.as_slice()
    } else {
        want.ends_with(got) && got.len() as u64 + dropped == want.len() as u64
    };
    if !ok {
        let text = String::from_utf8_lossy(got);
        let lines: Vec<&str> = text.lines().collect();
        shared.integrity(format!(
            "{id}: {} bytes read (dropped {dropped}), {} wanted; first lines {:?}, last {:?}",
            got.len(),
            want.len(),
            &lines[..lines.len().min(3)],
            &lines[lines.len().saturating_sub(3)..]
        ));
    } else if let Ok(mut t) = shared.tally.lock() {
        t.checked_bytes += got.len() as u64;
        t.resumed_reads += u64::from(resumed);
    }
}

pub(crate) fn counter_command(pace: &str) -> String {
    format!("for i in $(seq 1 {COUNT}); do echo $i; {pace}done")
}

/// A counter process read whole by offset; `drop_after`: drop the connection after that many
/// bytes, resume, and read on from the last `next_offset`.
pub(crate) async fn op_counter(
    shared: &Shared,
    c: &mut Option<Conn>,
    drop_after: Option<u64>,
) -> anyhow::Result<()> {
    let pace = if drop_after.is_some() {
        "sleep 0.005; "
    } else {
        ""
    };
    let id = conn(c)?
        .spawn(shared, "count", counter_command(pace), false)
        .await?;
    let (mut got, mut dropped) = (Vec::new(), 0);
    let offset = read_counter(conn(c)?, &id, 0, &mut got, &mut dropped, drop_after).await?;
    if drop_after.is_some() && !drop_and_resume(shared, c, vec![]).await? {
        return Ok(());
    }
    read_counter(conn(c)?, &id, offset, &mut got, &mut dropped, None).await?;
    let (rc, info) = conn(c)?.wait(&id).await?;
    if rc != 0 {
        bail!("{id} exited {rc}: {info}");
    }
    check_counter(shared, &id, &got, dropped, drop_after.is_some());
    Ok(())
}

/// A PTY process reads a line typed on its terminal and answers it.
pub(crate) async fn op_pty(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn
        .spawn(shared, "pty", "read -r x; echo \"got-$x\"".into(), true)
        .await?;
    let word = format!("w{}", conn.serial);
    conn.write(&id, format!("{word}\n").as_bytes(), false)
        .await?;
    let (mut got, mut offset) = (Vec::new(), 0);
    loop {
        let out = conn.read(&id, offset).await?;
        got.extend(b64().decode(out.data.as_bytes())?);
        offset = out.next_offset;
        if out.eof {
            break;
        }
    }
    let text = String::from_utf8_lossy(&got);
    if !text.contains(&format!("got-{word}\r\n")) {
        bail!("{id}: the terminal showed {text:?}");
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc != 0 {
        bail!("{id} exited {rc}: {info}");
    }
    Ok(())
}

/// `signal TERM` to a sleeping process's tree, or INT to its terminal's foreground group.
pub(crate) async fn op_signal(
    shared: &Shared,
    c: &mut Option<Conn>,
    pty: bool,
) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn.spawn(shared, "sig", "sleep 60".into(), pty).await?;
    conn.client
        .send(&ClientMessage::Signal(SignalRequest {
            id: id.clone(),
            // To a terminal's foreground group: INT, as Ctrl-C (the kernel's TIOCSIG takes
            // only INT, QUIT and TSTP; TERM is refused with EINVAL).
            signal: if pty { "INT" } else { "TERM" }.into(),
            foreground: pty,
        }))
        .await?;
    match conn.next_for(&id).await? {
        ServerMessage::Done(_) => {}
        other => bail!("expected done, got {other:?}"),
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc == 0 {
        bail!("{id} ended 0 after SIGTERM: {info}");
    }
    Ok(())
}

pub(crate) async fn upload_start(conn: &mut Conn, path: &str) -> anyhow::Result<String> {
    let id = conn.id("up");
    conn.client
        .send(&ClientMessage::Upload(UploadRequest {
            id: id.clone(),
            path: path.to_string(),
            mode: None,
            parents: true,
            tar: false,
            profile: None,
        }))
        .await?;
    Ok(id)
}

pub(crate) const CHUNK: usize = 128 * 1024;

pub(crate) async fn upload(conn: &mut Conn, path: &str, data: &[u8]) -> anyhow::Result<()> {
    let id = upload_start(conn, path).await?;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        conn.write(&id, chunk, i + 1 == chunks.len()).await?;
    }
    match conn.next_for(&id).await? {
        ServerMessage::Uploaded(up) if up.bytes == data.len() as u64 => Ok(()),
        other => bail!("upload {path}: got {other:?}"),
    }
}

/// Download `path` from `offset` into `got`; `stop_after` chunks: return early (Ok(false)).
pub(crate) async fn download(
    conn: &mut Conn,
    path: &str,
    got: &mut Vec<u8>,
    stop_after: Option<u64>,
) -> anyhow::Result<(String, bool)> {
    let id = conn.id("down");
    conn.client
        .send(&ClientMessage::Download(DownloadRequest {
            id: id.clone(),
            path: path.to_string(),
            offset: got.len() as u64,
            length: None,
            tar: false,
            profile: None,
        }))
        .await?;
    let mut seq = 0;
    loop {
        match conn.next_for(&id).await? {
            ServerMessage::DownloadData(chunk) => {
                if chunk.seq != seq {
                    bail!("{id}: seq {} where {seq} was due", chunk.seq);
                }
                seq += 1;
                got.extend(b64().decode(chunk.data.as_bytes())?);
                if stop_after.is_some_and(|s| seq >= s) {
                    return Ok((id, false));
                }
            }
            ServerMessage::Downloaded(_) => return Ok((id, true)),
            other => bail!("{id}: unexpected {other:?}"),
        }
    }
}

pub(crate) fn check_hash(shared: &Shared, what: &str, got: &[u8], want: &[u8]) {
    if sha(got) != sha(want) {
        shared.integrity(format!(
            "{what}: {} bytes with sha256 {}, sent {} bytes with {}",
            got.len(),
            sha(got),
            want.len(),
            sha(want)
        ));
    } else if let Ok(mut t) = shared.tally.lock() {
        t.checked_bytes += got.len() as u64;
    }
}

/// Upload random bytes, download them, compare.
pub(crate) async fn op_files(
    shared: &Shared,
    c: &mut Option<Conn>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let size = 16 * 1024 + rng.below(512 * 1024) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}.bin", conn.number);
    upload(conn, &path, &data).await?;
    let mut got = Vec::new();
    download(conn, &path, &mut got, None).await?;
    check_hash(shared, &path, &got, &data);
    Ok(())
}

/// Drop the connection half way through an upload, resume, send the rest: either it is
/// taken whole (checked by a download) or it failed with the drop (expected).
pub(crate) async fn op_drop_upload(
    shared: &Shared,
    c: &mut Option<Conn>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let size = 4 * CHUNK + rng.below(CHUNK as u64) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}-dropped.bin", conn(c)?.number);
    let id = upload_start(conn(c)?, &path).await?;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    conn(c)?.write(&id, chunks[0], false).await?;
    conn(c)?.write(&id, chunks[1], false).await?;
    if !drop_and_resume(shared, c, vec![id.clone()]).await? {
        return Ok(());
    }
    let conn = conn(c)?;
    for (i, chunk) in chunks.iter().enumerate().skip(2) {
        conn.write(&id, chunk, i + 1 == chunks.len()).await?;
    }
    match conn.next_for(&id).await {
        Ok(ServerMessage::Uploaded(up)) => {
            shared.note_expected("upload taken whole across a drop");
            let mut got = Vec::new();
            download(conn, &path, &mut got, None).await?;
            if up.bytes != data.len() as u64 {
                shared.integrity(format!("{id}: uploaded says {} bytes", up.bytes));
            }
            check_hash(shared, &path, &got, &data);
        }
        Ok(other) => bail!("{id}: got {other:?}"),
        Err(_) => shared.note_expected("upload failed by the drop"),
    }
    Ok(())
}

/// Drop the connection two chunks into a download, resume, download the rest by offset.
pub(crate) async fn op_drop_download(
    shared: &Shared,
    c: &mut Option<Conn>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let size = 1024 * 1024 + rng.below(512 * 1024) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}-big.bin", conn(c)?.number);
    upload(conn(c)?, &path, &data).await?;
    let mut got = Vec::new();
    let (id, whole) = download(conn(c)?, &path, &mut got, Some(2)).await?;
    if whole {
        bail!("{id}: a download of {} bytes ended in 2 chunks", data.len());
    }
    if !drop_and_resume(shared, c, vec![id.clone()]).await? {
        return Ok(());
    }
    // The download's answer kept for the resume: its error (protocol/README: a download
    // whose connection drops fails at once, and none of its chunks reaches another
    // connection), or `downloaded` when it was written to the dropped connection before the
    // drop was noticed (the doc: compare `bytes` with what arrived, fetch the rest by offset).
    let conn = conn(c)?;
    let resumed = Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(75), conn.next_for(&id))
        .await
        .map_err(|_| anyhow!("{id}: no answer within 75 s of a resume awaiting it"))?;
    let completed = match next {
        Ok(ServerMessage::DownloadData(d)) => {
            shared.integrity(format!(
                "{id}: chunk {} of a dropped download on the resumed connection",
                d.seq
            ));
            false
        }
        Ok(ServerMessage::Downloaded(_)) => true,
        Ok(other) => bail!("{id}: after the resume: {other:?}"),
        Err(_) => {
            shared.note_expected("download failed by the drop");
            false
        }
    };
    // At once, not after a wait for data that will never be sent: 20 s is far above the
    // milliseconds it takes, even on a busy machine.
    if resumed.elapsed() > Duration::from_secs(20) {
        shared.integrity(format!(
            "{id}: its answer came {:?} after the resume",
            resumed.elapsed()
        ));
    }
    if completed {
        shared.note_expected(
            "downloaded written to the dropped connection before the drop was noticed",
        );
    }
    if got.len() < data.len() {
        download(conn, &path, &mut got, None).await?;
    }
    check_hash(shared, &format!("{path} across a drop"), &got, &data);
    Ok(())
}

/// A process found on the host by its command line and killed with SIGKILL.
pub(crate) async fn op_host_kill(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let marker = format!("soakkill-{}-{}-{}", shared.mark, conn.number, conn.serial);
    let id = conn
        .spawn(
            shared,
            "kill",
            format!(": {marker}; while :; do sleep 0.05; done"),
            false,
        )
        .await?;
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        if kill_by_cmdline(&marker) > 0 {
            break;
        }
        if Instant::now() > give_up {
            bail!("{id}: no process with {marker} in its command line on the host");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc == 0 {
        bail!("{id} ended 0 after SIGKILL: {info}");
    }
    Ok(())
}

pub(crate) async fn one_op(
    shared: &Shared,
    c: &mut Option<Conn>,
    kind: &str,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    match kind {
        "exec" => op_exec(shared, c).await,
        "counter" => op_counter(shared, c, None).await,
        "pty" => op_pty(shared, c).await,
        "signal" => op_signal(shared, c, rng.below(2) == 0).await,
        "files" => op_files(shared, c, rng).await,
        "drop_process" => op_counter(shared, c, Some(200 + rng.below(800))).await,
        "drop_upload" => op_drop_upload(shared, c, rng).await,
        "drop_download" => op_drop_download(shared, c, rng).await,
        _ => op_host_kill(shared, c).await,
    }
}
