//! The real model HTTP APIs, served by the in-process mock: tool calls, text mode, retries,
//! malformed responses, cost accounting.

use serde_json::Value;

use crate::mock::{anthropic_tools, openai_message, openai_tools, Api, Canned, MockModel};
use crate::{assert_complete_trajectory, assert_ended, Scratch};

const PRICES: [&str; 4] = [
    "-c",
    "model.input_cost_per_token=0.000001",
    "-c",
    "model.output_cost_per_token=0.00001",
];

fn model_args<'a>(mock: &'a MockModel, name: &'a str) -> Vec<&'a str> {
    let mut args = vec![
        "--model",
        name,
        "--base-url",
        &mock.base_url,
        "--task",
        "make f.txt",
        "-c",
        "model.retry_initial_delay=0",
    ];
    args.extend(PRICES);
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_calls_run_in_order_and_429_is_retried() {
    let mock = MockModel::start(
        Api::OpenAi,
        vec![
            Canned::rate_limited(),
            openai_tools(1, "Two steps.", &["echo one > f.txt", "cat f.txt"]),
            openai_tools(
                2,
                "Done.",
                &["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat f.txt"],
            ),
        ],
    )
    .await;
    let s = Scratch::new();
    let run = s.run(&model_args(&mock, "mock-model")).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(mock.violations().is_empty(), "{:?}", mock.violations());
    assert_complete_trajectory(&run, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "one\n");
    assert!(run.stderr.contains("429"), "the retry is reported");
    let requests = mock.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[1]["tools"][0]["function"]["name"], "bash");
    assert_eq!(requests[1]["model"], "mock-model");
    // Second real request carries both tool results, in call order.
    let sent = requests[2]["messages"].as_array().unwrap();
    let tools: Vec<&Value> = sent.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tools[0]["tool_call_id"], "call_1_0");
    assert_eq!(tools[1]["tool_call_id"], "call_1_1");
    assert!(tools[1]["content"].as_str().unwrap().contains("one\\n"));
    // Cost from usage: 2 calls x (1000 x 1e-6 + 100 x 1e-5).
    let cost = run.traj["info"]["model_stats"]["instance_cost"]
        .as_f64()
        .unwrap();
    assert!((cost - 0.004).abs() < 1e-9, "{cost}");
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 2);
    let assistant = run.with_role("assistant")[0];
    assert_eq!(assistant["extra"]["usage"]["input_tokens"], 1000);
    assert_eq!(assistant["extra"]["actions"][1]["command"], "cat f.txt");
    assert!(!serde_json::to_string(&run.traj)
        .unwrap()
        .contains(crate::mock::API_KEY));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_tool_use_round_trips_and_overload_is_retried() {
    let mock = MockModel::start(
        Api::Anthropic,
        vec![
            Canned::status(
                529,
                r#"{"type":"error","error":{"type":"overloaded_error"}}"#,
            ),
            anthropic_tools(1, "Write it.", &["echo two > f.txt", "echo more >> f.txt"]),
            anthropic_tools(
                2,
                "Submit.",
                &["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat f.txt"],
            ),
        ],
    )
    .await;
    let s = Scratch::new();
    let mut args = model_args(&mock, "anthropic/mock-claude");
    // As in mini's SWE-bench config: litellm keys and an OpenAI-only one.
    args.extend([
        "-c",
        "model.model_kwargs={drop_params: true, parallel_tool_calls: true, temperature: 0.0}",
    ]);
    let run = s.run(&args).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(mock.violations().is_empty(), "{:?}", mock.violations());
    assert_complete_trajectory(&run, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "two\nmore\n");
    let requests = mock.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[1]["model"], "mock-claude");
    assert!(requests[1]["system"]
        .as_str()
        .unwrap()
        .contains("helpful assistant"));
    assert_eq!(requests[1]["tools"][0]["name"], "bash");
    assert_eq!(requests[1]["temperature"], 0.0);
    assert!(requests[1].get("parallel_tool_calls").is_none());
    assert!(requests[1].get("drop_params").is_none());
    assert_eq!(requests[1]["max_tokens"], 4096);
    // Trajectory keeps mini's OpenAI-style messages whatever the provider.
    assert_eq!(run.with_role("tool").len(), 2);
    let cost = run.traj["info"]["model_stats"]["instance_cost"]
        .as_f64()
        .unwrap();
    assert!(
        (cost - 2.0 * (2000.0 * 1e-6 + 50.0 * 1e-5)).abs() < 1e-9,
        "{cost}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_mode_parses_the_fenced_block_and_sends_no_tools() {
    let mock = MockModel::start(
        Api::OpenAi,
        vec![
            openai_message(serde_json::json!({"role": "assistant", "content": "THOUGHT: look\n\n```mswea_bash_command\necho hello\n```"})),
            openai_message(serde_json::json!({"role": "assistant", "content": "two blocks\n```mswea_bash_command\na\n```\n```mswea_bash_command\nb\n```"})),
            openai_message(serde_json::json!({"role": "assistant", "content": "```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"})),
        ],
    )
    .await;
    let s = Scratch::new();
    let mut args = model_args(&mock, "local-llm");
    args.extend(["--model-class", "text"]);
    let run = s.run(&args).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(mock.violations().is_empty(), "{:?}", mock.violations());
    let requests = mock.requests();
    assert!(requests[0].get("tools").is_none());
    assert!(requests[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .contains("mswea_bash_command"));
    let users = run.with_role("user");
    assert!(users[1]["content"]
        .as_str()
        .unwrap()
        .starts_with("<returncode>0</returncode>\n<output>\nhello\n</output>"));
    assert!(
        users[2]["content"]
            .as_str()
            .unwrap()
            .contains("found 2 actions"),
        "{}",
        users[2]["content"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tool_arguments_are_format_errors_and_leave_no_dangling_tool_call() {
    let bad = serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_bad", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls"}}
    ]});
    let unknown = serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_py", "type": "function", "function": {"name": "python", "arguments": "{\"code\": \"1\"}"}}
    ]});
    let mock = MockModel::start(
        Api::OpenAi,
        vec![
            openai_message(bad),
            openai_message(unknown),
            Canned::json(serde_json::json!({"id": "x", "choices": []})),
            openai_tools(4, "ok", &["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]),
        ],
    )
    .await;
    let s = Scratch::new();
    let run = s.run(&model_args(&mock, "mock-model")).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(mock.violations().is_empty(), "{:?}", mock.violations());
    let errors: Vec<String> = run
        .with_role("user")
        .iter()
        .filter(|m| m["extra"]["interrupt_type"] == "FormatError")
        .map(|m| m["content"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(errors.len(), 3);
    assert!(
        errors[0].contains("Error parsing tool call arguments"),
        "{}",
        errors[0]
    );
    assert!(errors[1].contains("Unknown tool 'python'"), "{}", errors[1]);
    assert!(errors[2].contains("no message"), "{}", errors[2]);
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_retried_then_ends_with_model_error() {
    let mock = MockModel::start(
        Api::OpenAi,
        vec![
            Canned::status(200, "<html>proxy error</html>"),
            Canned::status(200, "{truncated"),
        ],
    )
    .await;
    let s = Scratch::new();
    let mut args = model_args(&mock, "mock-model");
    args.extend(["-c", "model.retry_attempts=2"]);
    let run = s.run(&args).await;
    assert_ended(&run, 7, "ModelError");
    assert_eq!(mock.requests().len(), 2);
    assert!(run.messages().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .contains("invalid JSON"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authentication_error_is_not_retried() {
    let mock = MockModel::start(
        Api::OpenAi,
        vec![Canned::status(
            401,
            r#"{"error":{"message":"Incorrect API key"}}"#,
        )],
    )
    .await;
    let s = Scratch::new();
    let run = s.run(&model_args(&mock, "mock-model")).await;
    assert_ended(&run, 7, "ModelError");
    assert_eq!(mock.requests().len(), 1);
    assert!(run.stderr.contains("401") || run.traj.to_string().contains("401"));
}

/// The mock's checks catch what they claim to, so a passing run means something.
#[test]
fn the_mock_rejects_unanswered_and_stray_tool_results() {
    use crate::mock::{check_anthropic, check_openai};
    use serde_json::json;
    let call = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]});
    let ok = json!({"messages": [{"role": "user", "content": "t"}, call, {"role": "tool", "tool_call_id": "c1", "content": "x"}]});
    assert!(check_openai(&ok).is_empty());
    let unanswered = json!({"messages": [{"role": "user", "content": "t"}, call, {"role": "user", "content": "more"}]});
    assert!(!check_openai(&unanswered).is_empty());
    let stray = json!({"messages": [{"role": "user", "content": "t"}, {"role": "tool", "tool_call_id": "zz", "content": "x"}]});
    assert!(!check_openai(&stray).is_empty());
    let leaked = json!({"messages": [{"role": "user", "content": "t", "extra": {}}]});
    assert!(!check_openai(&leaked).is_empty());
    let use_block = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]});
    let answered = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}, use_block,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]});
    assert!(check_anthropic(&answered).is_empty());
    let missing = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}, use_block,
        {"role": "user", "content": [{"type": "text", "text": "no result"}]}]});
    assert!(!check_anthropic(&missing).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_model_server_is_retried_then_ends_with_model_error() {
    // A port nothing listens on: bind, note the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}/v1");
    let s = Scratch::new();
    let run = s
        .run(&[
            "--model",
            "mock-model",
            "--base-url",
            &base,
            "--task",
            "t",
            "-c",
            "model.retry_initial_delay=0",
            "-c",
            "model.retry_attempts=3",
        ])
        .await;
    assert_ended(&run, 7, "ModelError");
    assert_eq!(
        run.stderr.matches("retrying in").count(),
        2,
        "{}",
        run.stderr
    );
    let reason = run.messages().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("cannot reach") && reason.contains("3 attempts"),
        "{reason}"
    );
}
