//! An in-process model server speaking the real OpenAI chat-completions and Anthropic Messages
//! HTTP APIs. Replies are queued by the test; every request is recorded and checked: each tool
//! result must answer a tool call of the assistant turn right before it, every tool call must be
//! answered before the conversation goes on, and no agent bookkeeping (`extra`) may leak.

use std::collections::{BTreeSet, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;

pub const API_KEY: &str = "test-key-not-secret";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    OpenAi,
    Anthropic,
}

/// One canned HTTP answer.
pub struct Canned {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Canned {
    pub fn json(body: Value) -> Self {
        Self {
            status: 200,
            headers: Vec::new(),
            body: body.to_string(),
        }
    }

    pub fn status(status: u16, body: &str) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.to_string(),
        }
    }

    pub fn rate_limited() -> Self {
        Self {
            status: 429,
            headers: vec![("retry-after", "0".into())],
            body: r#"{"error":{"message":"Rate limit reached","type":"rate_limit_error"}}"#.into(),
        }
    }
}

#[derive(Default)]
struct State {
    replies: VecDeque<Canned>,
    requests: Vec<Value>,
    violations: Vec<String>,
}

pub struct MockModel {
    pub base_url: String,
    state: Arc<Mutex<State>>,
}

impl MockModel {
    pub async fn start(api: Api, replies: Vec<Canned>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            replies: replies.into(),
            ..State::default()
        }));
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(req, state.clone(), api));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let base_url = match api {
            Api::OpenAi => format!("http://{addr}/v1"),
            Api::Anthropic => format!("http://{addr}"),
        };
        Self { base_url, state }
    }

    /// Request bodies received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Protocol invariants the agent broke, if any.
    pub fn violations(&self) -> Vec<String> {
        self.state.lock().unwrap().violations.clone()
    }
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<Mutex<State>>,
    api: Api,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let headers = req.headers().clone();
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut problems = Vec::new();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        problems.push(format!("request body is not JSON: {e}"));
        Value::Null
    });
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    match api {
        Api::OpenAi => {
            if path != "/v1/chat/completions" {
                problems.push(format!("wrong path {path}"));
            }
            if header("authorization") != format!("Bearer {API_KEY}") {
                problems.push("missing or wrong bearer key".into());
            }
            problems.extend(check_openai(&body));
        }
        Api::Anthropic => {
            if path != "/v1/messages" {
                problems.push(format!("wrong path {path}"));
            }
            if header("x-api-key") != API_KEY {
                problems.push("missing or wrong x-api-key".into());
            }
            if header("anthropic-version").is_empty() {
                problems.push("missing anthropic-version".into());
            }
            problems.extend(check_anthropic(&body));
        }
    }
    let canned = {
        let mut state = state.lock().unwrap();
        state.requests.push(body);
        state.violations.extend(problems.iter().cloned());
        if problems.is_empty() {
            state.replies.pop_front()
        } else {
            None
        }
    };
    let canned = canned.unwrap_or_else(|| {
        let message = if problems.is_empty() {
            "mock: no reply queued".to_string()
        } else {
            format!("mock: invalid request: {}", problems.join("; "))
        };
        Canned::status(400, &json!({"error": {"message": message}}).to_string())
    });
    let mut response = Response::builder()
        .status(canned.status)
        .header("content-type", "application/json");
    for (name, value) in canned.headers {
        response = response.header(name, value);
    }
    Ok(response.body(Full::new(Bytes::from(canned.body))).unwrap())
}

/// OpenAI: tool messages answer the pending calls of the last assistant turn, in any order,
/// and nothing else comes before all of them are answered.
pub fn check_openai(body: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(messages) = body["messages"].as_array() else {
        return vec!["no messages".into()];
    };
    let mut pending: BTreeSet<String> = BTreeSet::new();
    for (i, m) in messages.iter().enumerate() {
        if m.get("extra").is_some() {
            problems.push(format!("message {i} leaks `extra`"));
        }
        match m["role"].as_str().unwrap_or_default() {
            "tool" => {
                let id = m["tool_call_id"].as_str().unwrap_or_default();
                if !pending.remove(id) {
                    problems.push(format!(
                        "message {i}: tool result {id:?} answers no pending tool call"
                    ));
                }
            }
            role => {
                if !pending.is_empty() {
                    problems.push(format!(
                        "message {i} ({role}) before tool calls {pending:?} were answered"
                    ));
                    pending.clear();
                }
                if role == "assistant" {
                    for call in m["tool_calls"].as_array().into_iter().flatten() {
                        pending.insert(call["id"].as_str().unwrap_or_default().to_string());
                    }
                }
            }
        }
    }
    if !pending.is_empty() {
        problems.push(format!(
            "request ends with unanswered tool calls {pending:?}"
        ));
    }
    problems
}

/// Anthropic: turns alternate from user; each assistant `tool_use` is answered by a
/// `tool_result` at the start of the next user turn, and each `tool_result` answers one.
pub fn check_anthropic(body: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(messages) = body["messages"].as_array() else {
        return vec!["no messages".into()];
    };
    if body["max_tokens"].as_u64().is_none() {
        problems.push("max_tokens missing".into());
    }
    let mut pending: BTreeSet<String> = BTreeSet::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or_default();
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if role != expected {
            problems.push(format!("message {i} is {role}, expected {expected}"));
        }
        let blocks = m["content"].as_array().cloned().unwrap_or_default();
        if role == "user" {
            let mut seen_text = false;
            for b in &blocks {
                if b["type"] == "tool_result" {
                    if seen_text {
                        problems.push(format!("message {i}: tool_result after text"));
                    }
                    let id = b["tool_use_id"].as_str().unwrap_or_default();
                    if !pending.remove(id) {
                        problems.push(format!(
                            "message {i}: tool_result {id:?} answers no tool_use"
                        ));
                    }
                } else {
                    seen_text = true;
                }
            }
            if !pending.is_empty() {
                problems.push(format!("message {i}: tool_use {pending:?} unanswered"));
                pending.clear();
            }
        } else {
            for b in &blocks {
                if b["type"] == "tool_use" {
                    pending.insert(b["id"].as_str().unwrap_or_default().to_string());
                }
                if b["type"] == "text" && b["text"].as_str().unwrap_or_default().is_empty() {
                    problems.push(format!("message {i}: empty text block"));
                }
            }
        }
    }
    if messages.last().is_some_and(|m| m["role"] != "user") {
        problems.push("last message is not from the user".into());
    }
    problems
}

/// An OpenAI chat completion with one `bash` tool call per command.
pub fn openai_tools(turn: usize, thought: &str, commands: &[&str]) -> Canned {
    let calls: Vec<Value> = commands
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"id": format!("call_{turn}_{i}"), "type": "function",
                   "function": {"name": "bash", "arguments": json!({"command": c}).to_string()}})
        })
        .collect();
    openai_message(json!({"role": "assistant", "content": thought, "tool_calls": calls}))
}

pub fn openai_message(message: Value) -> Canned {
    Canned::json(json!({
        "id": "chatcmpl-mock", "object": "chat.completion", "model": "mock-model",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100},
    }))
}

/// An Anthropic message with one `tool_use` block per command.
pub fn anthropic_tools(turn: usize, thought: &str, commands: &[&str]) -> Canned {
    let mut content = vec![json!({"type": "text", "text": thought})];
    for (i, c) in commands.iter().enumerate() {
        content.push(json!({"type": "tool_use", "id": format!("toolu_{turn}_{i}"), "name": "bash", "input": {"command": c}}));
    }
    Canned::json(json!({
        "id": "msg_mock", "type": "message", "role": "assistant", "model": "mock-claude",
        "content": content, "stop_reason": "tool_use",
        "usage": {"input_tokens": 2000, "output_tokens": 50},
    }))
}
