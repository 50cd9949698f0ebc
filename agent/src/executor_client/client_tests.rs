//! The protocol 1.1 client against a fake executor written as straight-line code: the
//! messages it sends, chunking, early refusals, and decoding of what comes back.

use std::future::Future;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use protocol::{
    ClientMessage, Done, DownloadData, DownloadRequest, Downloaded, ErrorCode, ErrorMessage,
    Exited, FileInfo, FileStat, Hello, Limits, ProcessOutput, PtySize, ServerMessage, SpawnRequest,
    Spawned, UploadRequest, Uploaded,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::client::{Client, ClientError};
use crate::tls::Tls;

type Peer = WebSocketStream<TcpStream>;

fn hello(capabilities: &[&str], max_message_bytes: usize) -> Hello {
    Hello {
        protocol: protocol::PROTOCOL_VERSION,
        limits: Limits {
            max_message_bytes,
            max_upload_bytes: 1 << 30,
            ..Limits::default()
        },
        capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
        ..Hello::default()
    }
}

async fn send(peer: &mut Peer, message: ServerMessage) {
    let text = serde_json::to_string(&message).unwrap();
    peer.send(Message::text(text)).await.unwrap();
}

/// The client's next message, `None` once it closed the connection.
async fn next(peer: &mut Peer) -> Option<ClientMessage> {
    loop {
        match peer.next().await {
            Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(&text).unwrap()),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => continue,
        }
    }
}

/// A client connected to a fake executor that greets with `hello` and then runs `script`.
async fn with_fake<F, Fut>(hello: Hello, script: F) -> (Client, tokio::task::JoinHandle<()>)
where
    F: FnOnce(Peer) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "ws://{}{}",
        listener.local_addr().unwrap(),
        protocol::WS_PATH
    );
    let fake = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut peer = tokio_tungstenite::accept_async(tcp).await.unwrap();
        send(&mut peer, ServerMessage::Hello(Box::new(hello))).await;
        script(peer).await;
    });
    let tls = Tls::new(None, None).unwrap();
    let client = Client::connect(&url, None, &tls).await.unwrap();
    (client, fake)
}

fn error(id: &str, code: ErrorCode, message: &str) -> ServerMessage {
    ServerMessage::Error(ErrorMessage {
        id: Some(id.into()),
        code,
        message: message.into(),
    })
}

#[tokio::test]
async fn a_missing_capability_is_a_clear_error_naming_it() {
    let (client, _fake) = with_fake(hello(&["processes"], 0), |_| async {}).await;
    assert!(client.require("processes", "x").is_ok());
    let err = client
        .require("files", "file copies")
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"files\""), "{err}");
    assert!(err.contains("file copies"), "{err}");
    assert!(err.contains("upgrade the executor"), "{err}");
}

#[tokio::test]
async fn an_upload_is_sent_in_chunks_that_fit_a_message_and_rebuild_the_bytes() {
    // Every byte value, many times over, through a small message limit.
    let source: Vec<u8> = (0..=255u8).cycle().take(50_000).collect();
    let limit = 8192;
    let expected = source.clone();
    let (mut client, fake) = with_fake(hello(&["files"], limit), move |mut peer| async move {
        let Some(ClientMessage::Upload(request)) = next(&mut peer).await else {
            panic!("expected upload")
        };
        assert_eq!(request.path, "dir/f");
        assert_eq!(request.mode, Some(0o640));
        let mut received = Vec::new();
        loop {
            let Some(ClientMessage::Write(write)) = next(&mut peer).await else {
                panic!("expected write")
            };
            assert_eq!(write.id, request.id);
            let text = serde_json::to_string(&ClientMessage::Write(write.clone())).unwrap();
            assert!(text.len() <= limit, "a write of {} bytes", text.len());
            received.extend(BASE64.decode(write.data.unwrap()).unwrap());
            if write.eof {
                break;
            }
        }
        assert_eq!(received, expected);
        let bytes = received.len() as u64;
        send(
            &mut peer,
            ServerMessage::Uploaded(Uploaded {
                id: request.id,
                path: "/work/dir/f".into(),
                bytes,
            }),
        )
        .await;
    })
    .await;
    let mut progress = Vec::new();
    let uploaded = client
        .upload(
            UploadRequest {
                id: "up1".into(),
                path: "dir/f".into(),
                mode: Some(0o640),
                parents: false,
                tar: false,
                profile: None,
            },
            &source[..],
            "source",
            &mut |n| progress.push(n),
        )
        .await
        .unwrap();
    assert_eq!(uploaded.bytes, 50_000);
    assert_eq!(progress.last(), Some(&50_000));
    fake.await.unwrap();
    client.close().await;
}

#[tokio::test]
async fn an_upload_refused_at_once_stops_sending_and_keeps_the_executors_message() {
    let big = vec![0u8; 20 << 20];
    let (mut client, fake) = with_fake(hello(&["files"], 16 * 1024), |mut peer| async move {
        let Some(ClientMessage::Upload(request)) = next(&mut peer).await else {
            panic!("expected upload")
        };
        send(
            &mut peer,
            error(
                &request.id,
                ErrorCode::Denied,
                "/etc/x: Read-only file system",
            ),
        )
        .await;
        // Count what still comes until the client closes.
        let mut writes = 0;
        while next(&mut peer).await.is_some() {
            writes += 1;
        }
        let chunks = (20 << 20) / (12 * 1024);
        assert!(writes < chunks / 2, "{writes} writes after the refusal");
    })
    .await;
    let err = client
        .upload(
            UploadRequest {
                id: "up1".into(),
                path: "/etc/x".into(),
                mode: None,
                parents: false,
                tar: false,
                profile: None,
            },
            &big[..],
            "big",
            &mut |_| {},
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Denied));
    assert!(err.to_string().contains("Read-only file system"), "{err}");
    client.close().await;
    fake.await.unwrap();
}

#[tokio::test]
async fn a_download_arrives_in_order_and_its_total_is_checked() {
    let (mut client, fake) = with_fake(hello(&["files"], 0), |mut peer| async move {
        let Some(ClientMessage::Download(request)) = next(&mut peer).await else {
            panic!("expected download")
        };
        for (seq, piece) in [&[0u8, 1, 2][..], &[255, 254][..]].into_iter().enumerate() {
            send(
                &mut peer,
                ServerMessage::DownloadData(DownloadData {
                    id: request.id.clone(),
                    seq: seq as u64,
                    data: BASE64.encode(piece),
                }),
            )
            .await;
        }
        send(
            &mut peer,
            ServerMessage::Downloaded(Downloaded {
                id: request.id.clone(),
                path: request.path.clone(),
                bytes: 5,
            }),
        )
        .await;
        // A second download whose pieces skip one.
        let Some(ClientMessage::Download(request)) = next(&mut peer).await else {
            panic!("expected download")
        };
        send(
            &mut peer,
            ServerMessage::DownloadData(DownloadData {
                id: request.id,
                seq: 1,
                data: String::new(),
            }),
        )
        .await;
        while next(&mut peer).await.is_some() {}
    })
    .await;
    let request = |id: &str| DownloadRequest {
        id: id.into(),
        path: "f".into(),
        offset: 0,
        length: None,
        tar: false,
        profile: None,
    };
    let mut sink = Vec::new();
    let done = client
        .download(request("d1"), &mut sink, "sink", &mut |_| {})
        .await
        .unwrap();
    assert_eq!(done.bytes, 5);
    assert_eq!(sink, [0, 1, 2, 255, 254]);
    let err = client
        .download(request("d2"), Vec::new(), "sink", &mut |_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Protocol(_)), "{err}");
    client.close().await;
    fake.await.unwrap();
}

#[tokio::test]
async fn process_requests_carry_their_fields_and_answers_are_decoded() {
    let (mut client, fake) = with_fake(hello(&["processes", "pty"], 0), |mut peer| async move {
        let Some(ClientMessage::Spawn(spawn)) = next(&mut peer).await else {
            panic!("expected spawn")
        };
        assert_eq!(spawn.pty, Some(PtySize { rows: 24, cols: 80 }));
        send(
            &mut peer,
            ServerMessage::Spawned(Spawned {
                id: spawn.id.clone(),
                pty: true,
            }),
        )
        .await;
        let Some(ClientMessage::Write(write)) = next(&mut peer).await else {
            panic!("expected write")
        };
        assert_eq!(BASE64.decode(write.data.unwrap()).unwrap(), b"ls\n");
        assert!(write.eof);
        let Some(ClientMessage::Read(read)) = next(&mut peer).await else {
            panic!("expected read")
        };
        assert_eq!((read.offset, read.wait), (3, Some(5.0)));
        send(
            &mut peer,
            ServerMessage::ProcessOutput(ProcessOutput {
                id: spawn.id.clone(),
                offset: 10,
                data: BASE64.encode([0u8, 0xff]),
                next_offset: 12,
                dropped: 7,
                eof: true,
            }),
        )
        .await;
        for _ in 0..2 {
            match next(&mut peer).await {
                Some(ClientMessage::Resize(r)) => assert_eq!((r.rows, r.cols), (50, 132)),
                Some(ClientMessage::Signal(s)) => assert!(s.signal == "INT" && s.foreground),
                other => panic!("unexpected {other:?}"),
            }
            send(
                &mut peer,
                ServerMessage::Done(Done {
                    id: spawn.id.clone(),
                }),
            )
            .await;
        }
        let Some(ClientMessage::Wait(wait)) = next(&mut peer).await else {
            panic!("expected wait")
        };
        assert_eq!(wait.timeout, Some(1.0));
        send(
            &mut peer,
            ServerMessage::Exited(Exited {
                id: spawn.id.clone(),
                running: false,
                returncode: 3,
                exception_info: String::new(),
                extra: None,
            }),
        )
        .await;
        let Some(ClientMessage::Stat(stat)) = next(&mut peer).await else {
            panic!("expected stat")
        };
        send(
            &mut peer,
            error(&stat.id, ErrorCode::NotFound, "no such file"),
        )
        .await;
        let Some(ClientMessage::Stat(stat)) = next(&mut peer).await else {
            panic!("expected stat")
        };
        send(
            &mut peer,
            ServerMessage::FileInfo(FileInfo {
                id: stat.id,
                stat: FileStat {
                    name: "/work/d".into(),
                    kind: "dir".into(),
                    ..FileStat::default()
                },
            }),
        )
        .await;
        while next(&mut peer).await.is_some() {}
    })
    .await;
    client
        .spawn(SpawnRequest {
            id: "p1".into(),
            command: "bash -i".into(),
            cwd: None,
            env: Default::default(),
            timeout: None,
            profile: None,
            pty: Some(PtySize { rows: 24, cols: 80 }),
            network: None,
        })
        .await
        .unwrap();
    client.write("p1", b"ls\n", true).await.unwrap();
    let output = client.read("p1", 3, Some(5.0)).await.unwrap();
    assert_eq!(output.data, [0, 0xff]);
    assert_eq!(
        (output.offset, output.next_offset, output.dropped),
        (10, 12, 7)
    );
    assert!(output.eof);
    assert_eq!(output.after(11), [0xff]);
    client
        .resize(
            "p1",
            PtySize {
                rows: 50,
                cols: 132,
            },
        )
        .await
        .unwrap();
    client.signal("p1", "INT", true).await.unwrap();
    let exited = client.wait("p1", Some(1.0)).await.unwrap();
    assert_eq!((exited.running, exited.returncode), (false, 3));
    let missing = client.stat("nope", None).await.unwrap_err();
    assert_eq!(missing.code(), Some(ErrorCode::NotFound));
    assert_eq!(client.stat("d", None).await.unwrap().kind, "dir");
    client.close().await;
    fake.await.unwrap();
}
