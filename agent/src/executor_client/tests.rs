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
            network: None,
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

/// A connection that greets as `session` (with a grace period), takes the client's first
/// message without answering it, and breaks.
fn breaks_after_first_message(session: &str, resume_grace: f64) -> Vec<Step> {
    vec![
        hello(session, resume_grace),
        answer(|_| Vec::new()),
        Step::Drop,
    ]
}

/// The executor's `resumed` for `session`, with `running` still going.
fn resumed(session: &str, running: &[&str]) -> ServerMessage {
    ServerMessage::Resumed(Resumed {
        session: session.into(),
        running: running.iter().map(|id| id.to_string()).collect(),
    })
}

/// Answers any `resume` with `resumed` for `session`, with `running` still going.
fn answer_resume(session: &'static str, running: &'static [&'static str]) -> Step {
    answer(move |_| vec![resumed(session, running)])
}

/// Answers the client's sync cancel (the command it sent before the break) with not found.
fn answer_sync_cancel_not_found() -> Step {
    answer(|sync| match sync {
        ClientMessage::Cancel(c) => vec![not_found(Some(c.id.clone()))],
        other => panic!("expected the sync cancel, got {other:?}"),
    })
}

/// Answers an exec with a result printing `output`.
fn answer_exec(output: &'static str) -> Step {
    answer(move |exec| vec![result(&exec_id(exec), output)])
}

/// Close the environment and return every message the fake executor received.
async fn close_and_read(
    env: &mut Environment,
    seen: &Mutex<Vec<ClientMessage>>,
) -> Vec<ClientMessage> {
    env.close().await;
    seen.lock().unwrap().clone()
}

#[tokio::test]
async fn a_command_still_running_after_the_break_is_waited_for_in_the_resumed_session() {
    let (url, seen) = fake_executor(vec![
        breaks_after_first_message("s1", 30.0),
        vec![
            hello("s2", 30.0),
            answer_resume("s1", &["a1"]),
            Step::Send(Box::new(result("a1", "finished\n"))),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "sleep 1; echo finished").await;
    assert_eq!((out.output.as_str(), out.returncode), ("finished\n", 0));
    let seen = close_and_read(&mut env, &seen).await;
    assert_eq!(exec_id(&seen[0]), "a1");
    assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[tokio::test]
async fn a_request_lost_in_the_break_is_sent_again_in_the_resumed_session() {
    let (url, seen) = fake_executor(vec![
        // The request arrives, but as far as the executor knows it never did.
        breaks_after_first_message("s1", 30.0),
        vec![
            hello("s2", 30.0),
            answer_resume("s1", &[]),
            answer_sync_cancel_not_found(),
            answer_exec("ran\n"),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "echo ran").await;
    assert_eq!((out.output.as_str(), out.returncode), ("ran\n", 0));
    let seen = close_and_read(&mut env, &seen).await;
    assert_eq!(exec_id(&seen[0]), "a1");
    assert_eq!(resume_of(&seen[1]), ("s1".into(), vec!["a1".into()]));
    assert!(matches!(&seen[2], ClientMessage::Cancel(_)), "{seen:?}");
    assert_eq!(exec_id(&seen[3]), "a1");
    assert_eq!(seen.len(), 4, "{seen:?}");
}

#[tokio::test]
async fn a_result_in_the_replay_is_taken_and_the_command_is_not_run_again() {
    let (url, seen) = fake_executor(vec![
        breaks_after_first_message("s1", 30.0),
        vec![
            hello("s2", 30.0),
            answer(|_| {
                vec![
                    resumed("s1", &[]),
                    result("a1", "done while you were away\n"),
                ]
            }),
            answer_sync_cancel_not_found(),
        ],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "true").await;
    assert_eq!(out.output, "done while you were away\n");
    let seen = close_and_read(&mut env, &seen).await;
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
        breaks_after_first_message("s1", 30.0),
        vec![
            hello("s2", 30.0),
            answer(|_| vec![not_found(None)]),
            answer_exec("second\n"),
            Step::Drop,
        ],
        // The session now is the second connection's own.
        vec![
            hello("s3", 30.0),
            answer_resume("s2", &[]),
            answer_sync_cancel_not_found(),
            answer_exec("third\n"),
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
    let seen = close_and_read(&mut env, &seen).await;
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
        breaks_after_first_message("s1", 0.0),
        vec![hello("s2", 0.0), answer_exec("fresh\n")],
    ])
    .await;
    let mut env = open(&url).await;
    let out = execute(&mut env, "sleep 9").await;
    assert_eq!(out.exception_info, CUT_SHORT);
    assert_eq!(execute(&mut env, "echo fresh").await.output, "fresh\n");
    let seen = close_and_read(&mut env, &seen).await;
    assert!(
        !seen.iter().any(|m| matches!(m, ClientMessage::Resume(_))),
        "{seen:?}"
    );
}

#[tokio::test]
async fn every_command_asks_for_the_configured_network_and_a_resent_one_too() {
    let (url, seen) = fake_executor(vec![
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
            answer(|exec| vec![result(&exec_id(exec), "again\n")]),
        ],
    ])
    .await;
    let policy = protocol::RequestNetwork::Policy {
        allow: vec!["pypi.org:443".into()],
        deny: vec!["evil.pypi.org".into()],
    };
    let config = EnvironmentConfig {
        network: Some(policy.clone()),
        ..Default::default()
    };
    let mut env = Environment::open(&url, None, config, Choice::Default)
        .await
        .unwrap();
    assert_eq!(execute(&mut env, "echo ran").await.output, "ran\n");
    assert_eq!(execute(&mut env, "echo again").await.output, "again\n");
    env.close().await;
    let seen = seen.lock().unwrap().clone();
    let networks: Vec<_> = seen
        .iter()
        .filter_map(|m| match m {
            ClientMessage::Exec(req) => Some(req.network.clone()),
            _ => None,
        })
        .collect();
    // The first try, the one sent again after the resume, and the next command.
    assert_eq!(networks, vec![Some(policy); 3], "{seen:?}");
}

#[tokio::test]
async fn the_profile_line_names_the_network_asked_and_why_the_profile_cannot_hold_a_policy() {
    let mut held = hello("s1", 0.0);
    if let Step::Send(message) = &mut held {
        if let ServerMessage::Hello(h) = message.as_mut() {
            h.profiles[0].network = Some(protocol::ProfileNetwork {
                mode: "host".into(),
                policy_enforceable: false,
                policy_reason: "no network namespace here".into(),
                ..Default::default()
            });
        }
    }
    let (url, _) = fake_executor(vec![vec![held]]).await;
    let config = EnvironmentConfig {
        network: Some(protocol::RequestNetwork::Policy {
            allow: vec!["pypi.org:443".into()],
            deny: vec!["evil.pypi.org".into()],
        }),
        ..Default::default()
    };
    let mut env = Environment::open(&url, None, config, Choice::Default)
        .await
        .unwrap();
    let line = env.profile_line();
    assert!(
        line.ends_with(
            "; network asked: policy allow pypi.org:443 deny evil.pypi.org \
             (the executor says: no network namespace here)"
        ),
        "{line}"
    );
    // Control: `none` asked needs no policy, so no reason is given; nothing asked, nothing said.
    env.config.network = Some(protocol::RequestNetwork::None {});
    assert!(env.profile_line().ends_with("; network asked: none"));
    env.config.network = None;
    assert!(!env.profile_line().contains("network"));
    env.close().await;
}
