//! The client's recovery logic against a scripted fake executor.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ErrorCode, Hello, ServerMessage};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::session::CUT_SHORT;
use super::{Choice, Environment, Output};
use crate::config::EnvironmentConfig;

use protocol::{
    Ending, ErrorMessage, ExecResult, Isolation, Limits, ProfileSummary, ResultExtra, Resumed,
};

/// Builds the answer to a client message.
type Answerer = Box<dyn FnOnce(&ClientMessage) -> Vec<ServerMessage> + Send>;

/// One step of a fake executor's connection.
enum Step {
    Send(Box<ServerMessage>),
    /// Read the client's next message and answer it.
    Answer(Answerer),
    /// Drop the connection without a close frame, as a network failure does.
    Drop,
}

fn answer(f: impl FnOnce(&ClientMessage) -> Vec<ServerMessage> + Send + 'static) -> Step {
    Step::Answer(Box::new(f))
}

fn hello(session: &str, resume_grace: f64) -> Step {
    Step::Send(Box::new(ServerMessage::Hello(Box::new(Hello {
        protocol: protocol::PROTOCOL_VERSION,
        profiles: vec![ProfileSummary {
            name: "trusted".into(),
            description: String::new(),
            available: true,
            layers: vec!["session".into()],
            missing: vec![],
            unavailable_reason: None,
        }],
        default_profile: "trusted".into(),
        limits: Limits {
            default_timeout: 30.0,
            max_timeout: 60.0,
            max_env_entries: 8,
            max_env_bytes: 1024,
            ..Limits::default()
        },
        session: session.into(),
        resume_grace,
        ..Hello::default()
    }))))
}

fn result(id: &str, output: &str) -> ServerMessage {
    ServerMessage::Result(ExecResult {
        id: id.into(),
        output: output.into(),
        returncode: 0,
        exception_info: String::new(),
        extra: ResultExtra {
            ended: Ending::Exited,
            timed_out: false,
            cancelled: false,
            duration_ms: 1.0,
            signal: None,
            output_bytes: output.len() as u64,
            truncated: false,
            elided_bytes: 0,
            killed_processes: 0,
            limits_hit: Vec::new(),
            isolation: Isolation {
                profile: "trusted".into(),
                layers: Vec::new(),
                missing: Vec::new(),
                network: None,
            },
        },
    })
}

fn not_found(id: Option<String>) -> ServerMessage {
    ServerMessage::Error(ErrorMessage {
        id,
        code: ErrorCode::NotFound,
        message: "nothing by that name".into(),
    })
}

fn exec_id(msg: &ClientMessage) -> String {
    match msg {
        ClientMessage::Exec(req) => req.id.clone(),
        other => panic!("expected exec, got {other:?}"),
    }
}

/// A fake executor that serves `connections` one after another, each by its steps, and
/// records every message the client sends.
async fn fake_executor(connections: Vec<Vec<Step>>) -> (String, Arc<Mutex<Vec<ClientMessage>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "ws://{}{}",
        listener.local_addr().unwrap(),
        protocol::WS_PATH
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        for steps in connections {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
            let mut dropped = false;
            for step in steps {
                let replies = match step {
                    Step::Send(msg) => vec![*msg],
                    Step::Answer(answer) => {
                        let Some(msg) = next_client_message(&mut ws).await else {
                            panic!("the client left early");
                        };
                        log.lock().unwrap().push(msg.clone());
                        answer(&msg)
                    }
                    Step::Drop => {
                        dropped = true;
                        break;
                    }
                };
                for reply in replies {
                    let text = serde_json::to_string(&reply).unwrap();
                    ws.send(Message::text(text)).await.unwrap();
                }
            }
            if dropped {
                continue;
            }
            // Record whatever else the client sends until it closes.
            while let Some(msg) = next_client_message(&mut ws).await {
                log.lock().unwrap().push(msg);
            }
        }
    });
    (url, seen)
}

async fn next_client_message(ws: &mut WebSocketStream<TcpStream>) -> Option<ClientMessage> {
    loop {
        match ws.next().await? {
            Ok(Message::Text(text)) => return Some(serde_json::from_str(text.as_str()).unwrap()),
            Ok(Message::Close(_)) | Err(_) => return None,
            Ok(_) => continue,
        }
    }
}

async fn open(url: &str) -> Environment {
    Environment::open(url, None, EnvironmentConfig::default(), Choice::Default)
        .await
        .unwrap()
}

async fn execute(env: &mut Environment, command: &str) -> Output {
    tokio::time::timeout(Duration::from_secs(20), env.execute(command))
        .await
        .expect("no answer in time")
        .unwrap()
}

fn resume_of(msg: &ClientMessage) -> (String, Vec<String>) {
    match msg {
        ClientMessage::Resume(r) => (r.session.clone(), r.awaiting.clone()),
        other => panic!("expected resume, got {other:?}"),
    }
}

#[tokio::test]
async fn a_command_still_running_after_the_break_is_waited_for_in_the_resumed_session() {
    let (url, seen) = fake_executor(vec![
        vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
        vec![
            hello("s2", 30.0),
            answer(|_| {
                vec![ServerMessage::Resumed(Resumed {
                    session: "s1".into(),
                    running: vec!["a1".into()],
                })]
            }),
            Step::Send(Box::new(result("a1", "finished\n"))),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "sleep 1; echo finished").await;
    assert_eq!((out.output.as_str(), out.returncode), ("finished\n", 0));
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(exec_id(&seen[0]), "a1");
    assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[tokio::test]
async fn a_request_lost_in_the_break_is_sent_again_in_the_resumed_session() {
    let (url, seen) = fake_executor(vec![
        // The request arrives, but as far as the executor knows it never did.
        vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
        vec![
            hello("s2", 30.0),
            answer(|_| {
                vec![ServerMessage::Resumed(Resumed {
                    session: "s1".into(),
                    running: Vec::new(),
                })]
            }),
            answer(|sync| match sync {
                ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                other => panic!("expected the sync cancel, got {other:?}"),
            }),
            answer(|exec| vec![result(&exec_id(exec), "ran\n")]),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "echo ran").await;
    assert_eq!((out.output.as_str(), out.returncode), ("ran\n", 0));
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(exec_id(&seen[0]), "a1");
    assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
    assert!(matches!(&seen[2], ClientMessage::Cancel(_)), "{seen:?}");
    assert_eq!(exec_id(&seen[3]), "a1");
    assert_eq!(seen.len(), 4, "{seen:?}");
}

#[tokio::test]
async fn a_result_in_the_replay_is_taken_and_the_command_is_not_run_again() {
    let (url, seen) = fake_executor(vec![
        vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
        vec![
            hello("s2", 30.0),
            answer(|_| {
                vec![
                    ServerMessage::Resumed(Resumed {
                        session: "s1".into(),
                        running: Vec::new(),
                    }),
                    result("a1", "done while you were away\n"),
                ]
            }),
            answer(|sync| match sync {
                ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                other => panic!("expected the sync cancel, got {other:?}"),
            }),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "true").await;
    assert_eq!(out.output, "done while you were away\n");
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .filter(|m| matches!(m, ClientMessage::Exec(_)))
            .count()
            == 1,
        "the command was sent again: {seen:?}"
    );
}

#[tokio::test]
async fn an_expired_session_cuts_the_command_short_and_the_new_session_goes_on() {
    let (url, seen) = fake_executor(vec![
        vec![hello("s1", 30.0), answer(|_| Vec::new()), Step::Drop],
        vec![
            hello("s2", 30.0),
            answer(|_| vec![not_found(None)]),
            answer(|exec| vec![result(&exec_id(exec), "second\n")]),
            Step::Drop,
        ],
        // The session now is the second connection's own.
        vec![
            hello("s3", 30.0),
            answer(|_| {
                vec![ServerMessage::Resumed(Resumed {
                    session: "s2".into(),
                    running: Vec::new(),
                })]
            }),
            answer(|sync| match sync {
                ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
                other => panic!("expected the sync cancel, got {other:?}"),
            }),
            answer(|exec| vec![result(&exec_id(exec), "third\n")]),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "sleep 9").await;
    assert_eq!(out.returncode, protocol::RETURNCODE_NOT_FINISHED);
    assert_eq!(out.exception_info, CUT_SHORT);
    assert_eq!(execute(&mut env, "echo second").await.output, "second\n");
    // Dropped while idle: the agent notices when it sends the next command, resumes the
    // second session, learns the command never arrived there, and sends it again.
    assert_eq!(execute(&mut env, "echo third").await.output, "third\n");
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
    assert_eq!(exec_id(&seen[2]), "a2");
    assert_eq!(resume_of(&seen[3]), ("s2".into(), vec!["a3".into()]));
    assert!(matches!(&seen[4], ClientMessage::Cancel(_)), "{seen:?}");
    assert_eq!(exec_id(&seen[5]), "a3");
    assert_eq!(seen.len(), 6, "{seen:?}");
}

#[tokio::test]
async fn without_a_grace_period_no_resume_is_asked_for() {
    let (url, seen) = fake_executor(vec![
        vec![hello("s1", 0.0), answer(|_| Vec::new()), Step::Drop],
        vec![
            hello("s2", 0.0),
            answer(|exec| vec![result(&exec_id(exec), "fresh\n")]),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "sleep 9").await;
    assert_eq!(out.exception_info, CUT_SHORT);
    assert_eq!(execute(&mut env, "echo fresh").await.output, "fresh\n");
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    assert!(
        !seen.iter().any(|m| matches!(m, ClientMessage::Resume(_))),
        "{seen:?}"
    );
}
