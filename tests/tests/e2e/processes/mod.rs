//! Protocol 1.1 processes: programs kept running across requests (`spawn`, `write`, `read`,
//! `signal`, `resize`, `wait`, `list_processes`), checked by what they answer and, where there
//! is one, by their effect on the host (files, the process table).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use executor_tests::{
    b64, eventually, marked_sleep, marker, processes_matching, req, sleepers, unb64, Client,
    Daemon, PATIENCE,
};
use protocol::{
    ClientMessage, ErrorCode, ErrorMessage, Exited, ListProcessesRequest, ProcessOutput, PtySize,
    ReadRequest, ResizeRequest, ResumeRequest, ServerMessage, SignalRequest, SpawnRequest,
    WaitRequest, WriteRequest,
};

fn spawn_req(id: &str, command: &str) -> SpawnRequest {
    SpawnRequest {
        id: id.to_string(),
        command: command.to_string(),
        cwd: None,
        env: BTreeMap::new(),
        timeout: None,
        profile: None,
        pty: None,
        network: None,
    }
}

/// Spawn and wait for `spawned`; a refusal fails the test.
async fn spawn(client: &mut Client, r: SpawnRequest) {
    let id = r.id.clone();
    let pty = r.pty.is_some();
    client.send(&ClientMessage::Spawn(r)).await;
    match client.reply_for(&id).await {
        ServerMessage::Spawned(s) => assert_eq!(s.pty, pty, "{id}: {s:?}"),
        other => panic!("{id}: expected spawned, got {other:?}"),
    }
}

/// Spawn expecting a refusal.
async fn spawn_refused(client: &mut Client, r: SpawnRequest) -> ErrorMessage {
    let id = r.id.clone();
    client.send(&ClientMessage::Spawn(r)).await;
    match client.reply_for(&id).await {
        ServerMessage::Error(e) => e,
        other => panic!("{id}: expected an error, got {other:?}"),
    }
}

async fn write_text(client: &mut Client, id: &str, text: &str) {
    client
        .send(&ClientMessage::Write(WriteRequest {
            id: id.to_string(),
            data: None,
            text: Some(text.to_string()),
            eof: false,
        }))
        .await;
}

async fn read(client: &mut Client, id: &str, offset: u64, wait: f64) -> ProcessOutput {
    client
        .send(&ClientMessage::Read(ReadRequest {
            id: id.to_string(),
            offset,
            max_bytes: None,
            wait: Some(wait),
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::ProcessOutput(out) => out,
        other => panic!("{id}: expected process_output, got {other:?}"),
    }
}

/// Read from `*offset` on until the output read in this call contains `needle` (or the
/// output ends, or [`PATIENCE`] passes: both fail the test). Nothing may be dropped.
async fn read_until(client: &mut Client, id: &str, offset: &mut u64, needle: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    loop {
        let out = read(client, id, *offset, 1.0).await;
        assert_eq!(out.dropped, 0, "{id}: output lost");
        assert_eq!(out.offset, *offset, "{id}: read from elsewhere");
        let data = unb64(&out.data);
        assert_eq!(out.next_offset, out.offset + data.len() as u64);
        seen.extend_from_slice(&data);
        *offset = out.next_offset;
        let text = String::from_utf8_lossy(&seen).into_owned();
        if text.contains(needle) {
            return text;
        }
        assert!(!out.eof, "{id}: output ended without {needle:?}: {text:?}");
        assert!(
            Instant::now() < deadline,
            "{id}: no {needle:?} in time: {text:?}"
        );
    }
}

/// Everything from `offset` to the end of the output.
async fn read_to_eof(client: &mut Client, id: &str, mut offset: u64) -> Vec<u8> {
    let deadline = Instant::now() + PATIENCE;
    let mut all = Vec::new();
    loop {
        let out = read(client, id, offset, 1.0).await;
        assert_eq!(out.dropped, 0, "{id}: output lost");
        all.extend_from_slice(&unb64(&out.data));
        offset = out.next_offset;
        if out.eof {
            return all;
        }
        assert!(Instant::now() < deadline, "{id}: output did not end");
    }
}

async fn wait(client: &mut Client, id: &str, timeout: f64) -> Exited {
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: id.to_string(),
            timeout: Some(timeout),
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Exited(e) => e,
        other => panic!("{id}: expected exited, got {other:?}"),
    }
}

async fn signal(client: &mut Client, id: &str, name: &str, foreground: bool) {
    client
        .send(&ClientMessage::Signal(SignalRequest {
            id: id.to_string(),
            signal: name.to_string(),
            foreground,
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Done(_) => {}
        other => panic!("{id}: expected done for {name}, got {other:?}"),
    }
}

async fn list(client: &mut Client) -> Vec<protocol::ProcessInfo> {
    let tag = format!("list-{}", marker());
    client
        .send(&ClientMessage::ListProcesses(ListProcessesRequest {
            id: Some(tag.clone()),
        }))
        .await;
    match client.reply_for(&tag).await {
        ServerMessage::Processes(list) => list.processes,
        other => panic!("expected processes, got {other:?}"),
    }
}

mod bounds;
mod lifetime;
mod memory;
mod network;
mod terminal;
