//! Every exit status of the loop, driven by the scripted model against a local executor that
//! the agent starts itself.

use executor_tests::{marked_sleep, marker};
use nix::sys::signal::Signal;
use serde_json::Value;

use crate::{assert_ended, signal, started, Scratch};

fn scripted(s: &Scratch, script: &str) -> String {
    s.write("script.yaml", script).display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_with_returncode_0_submits_the_rest_of_the_output() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- thought: write then submit, two tool calls in one turn\n  commands:\n    - echo patch-body > f.txt\n    - echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat f.txt\n",
            &[],
        )
        .await;
    assert_ended(&run, 0, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "patch-body\n");
    assert!(run.stdout.contains("Exit status: Submitted"));
    assert!(
        run.stderr.contains("SCRIPTED"),
        "the scripted model must say so"
    );
    // The first call's result answers its tool call; the submitting call ends the run.
    let tools = run.with_role("tool");
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0]["tool_call_id"], "call_1_0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_from_a_failing_command_does_not_submit() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
            &[],
        )
        .await;
    assert_eq!(run.code, 0);
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 2);
    assert_eq!(run.traj["info"]["submission"], "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_limit_ends_the_run_with_limits_exceeded() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: echo 1\n- command: echo 2\n- command: echo 3\n",
            &["--step-limit", "2"],
        )
        .await;
    assert_ended(&run, 3, "LimitsExceeded");
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 2);
    assert_eq!(run.with_role("tool").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_limit_ends_the_run_once_reached() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: echo 1\n  cost: 1.0\n- command: echo 2\n  cost: 1.0\n- command: echo 3\n  cost: 1.0\n",
            &["--cost-limit", "1.5"],
        )
        .await;
    assert_ended(&run, 3, "LimitsExceeded");
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 2);
    assert_eq!(run.traj["info"]["model_stats"]["instance_cost"], 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_time_limit_ends_the_run_with_time_exceeded() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: sleep 30\n- command: echo never\n",
            &["-c", "agent.wall_time_limit=1"],
        )
        .await;
    assert_ended(&run, 4, "TimeExceeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_format_errors_are_fed_back_then_end_the_run() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- content: I think I am done.\n- content: still no tool call\n- content: nope\n- command: echo never\n",
            &["-c", "agent.format_error_limit=3"],
        )
        .await;
    assert_ended(&run, 5, "RepeatedFormatError");
    let errors: Vec<&Value> = run
        .with_role("user")
        .into_iter()
        .filter(|m| m["extra"]["interrupt_type"] == "FormatError")
        .collect();
    assert_eq!(errors.len(), 3);
    let content = errors[0]["content"].as_str().unwrap();
    assert!(content.starts_with("Tool call error:"), "{content}");
    assert!(content.contains("No tool calls found"), "{content}");
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_error_does_not_count_once_the_model_recovers() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- content: oops\n- command: echo ok\n- content: oops\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
            &["-c", "agent.format_error_limit=2"],
        )
        .await;
    assert_ended(&run, 0, "Submitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_that_runs_out_ends_with_model_error() {
    let s = Scratch::new();
    let run = s.run_scripted("- command: echo only one\n", &[]).await;
    assert_ended(&run, 7, "ModelError");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_timeout_is_shown_to_the_model_with_returncode_minus_1() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: echo before; sleep 30\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
            &["--timeout", "1"],
        )
        .await;
    assert_eq!(run.code, 0);
    let tool = run.with_role("tool")[0].clone();
    let shown: Value = serde_json::from_str(tool["content"].as_str().unwrap()).unwrap();
    assert_eq!(shown["returncode"], -1);
    assert_eq!(shown["output"], "before\n");
    assert!(!shown["exception_info"].as_str().unwrap().is_empty());
    assert_eq!(tool["extra"]["executor"]["timed_out"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_output_is_shown_as_head_elided_count_and_tail() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: seq 1 30000\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
            &[],
        )
        .await;
    assert_eq!(run.code, 0);
    let full: String = (1..=30000).map(|i| format!("{i}\n")).collect();
    let tool = run.with_role("tool")[0].clone();
    assert_eq!(tool["extra"]["raw_output"], full.as_str());
    let shown: Value = serde_json::from_str(tool["content"].as_str().unwrap()).unwrap();
    assert_eq!(shown["output_head"], &full[..5000]);
    assert_eq!(shown["output_tail"], &full[full.len() - 5000..]);
    assert_eq!(shown["elided_chars"], full.len() - 10000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_saves_the_trajectory_and_exits_interrupted() {
    let s = Scratch::new();
    let marker = marker();
    let child = s
        .scripted(&format!("- command: {}\n", marked_sleep(&marker)), &[])
        .spawn()
        .unwrap();
    assert!(started(&marker).await, "the command never started");
    signal(&child, Signal::SIGINT);
    let run = s.finish(child).await;
    assert_ended(&run, 130, "Interrupted");
    assert_eq!(run.with_role("assistant").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mini_swe_agent_config_file_loads_and_its_templates_apply() {
    let s = Scratch::new();
    let script = scripted(
        &s,
        "- command: echo hi\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n",
    );
    // Shaped like mini-swe-agent v2's mini.yaml, with keys this agent does not use.
    let config = s.write(
        "mini.yaml",
        r#"agent:
  system_template: |
    You are a helpful assistant. Step limit {{step_limit}}.
  instance_template: |
    Please solve this issue: {{task}} on {{system}} {{machine}} [{{version}}]
  step_limit: 0.
  cost_limit: 3.
  mode: confirm
environment:
  env:
    PAGER: cat
    GREETING: from-config
  environment_class: local
model:
  model_kwargs:
    drop_params: true
  observation_template: |
    <returncode>{{output.returncode}}</returncode>
    <output>{{ output.output -}}</output>
"#,
    );
    let run = s
        .run(&[
            "-c",
            config.to_str().unwrap(),
            "--model",
            "scripted",
            "--script",
            &script,
            "--task",
            "fix it",
        ])
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stderr.contains("environment.environment_class"),
        "ignored keys are reported"
    );
    assert!(
        run.stderr.contains("not a terminal"),
        "confirm mode falls back to yolo in batch"
    );
    let messages = run.messages();
    assert_eq!(
        messages[0]["content"],
        "You are a helpful assistant. Step limit 0."
    );
    let instance = messages[1]["content"].as_str().unwrap();
    assert!(
        instance.starts_with("Please solve this issue: fix it on Linux"),
        "{instance}"
    );
    let uname_v = std::process::Command::new("uname")
        .arg("-v")
        .output()
        .unwrap()
        .stdout;
    let uname_v = String::from_utf8_lossy(&uname_v).trim().to_string();
    assert!(instance.contains(&format!("[{uname_v}]")), "{instance}");
    assert_eq!(
        run.with_role("tool")[0]["content"],
        "<returncode>0</returncode>\n<output>hi\n</output>"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_template_variable_is_a_config_error() {
    let s = Scratch::new();
    let run = s
        .run_scripted(
            "- command: echo hi\n",
            &["-c", "agent.instance_template=Task {{tsak}}"],
        )
        .await;
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("instance template"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_settings_reach_the_commands_and_preds_json_is_written() {
    let s = Scratch::new();
    let preds = s.path().join("preds.json");
    let mut cmd = s.scripted(
        "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo \"$FROM_CONFIG $FROM_HOST $OVERRIDDEN\" && echo $0\n",
        &[
            "-c",
            "environment.env.FROM_CONFIG=config",
            "-c",
            "environment.env.OVERRIDDEN=env-wins",
            "-c",
            "environment.forward_env=[FROM_HOST, OVERRIDDEN, NOT_SET_ANYWHERE]",
            "-c",
            "environment.interpreter=[sh, -c]",
            "--instance-id",
            "owner__repo-1",
            "--preds",
            preds.to_str().unwrap(),
        ],
    );
    cmd.env("FROM_HOST", "host").env("OVERRIDDEN", "host-loses");
    let run = s.finish(cmd.spawn().unwrap()).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.traj["info"]["submission"], "config host env-wins\nsh\n");
    let preds: Value = serde_json::from_str(&std::fs::read_to_string(&preds).unwrap()).unwrap();
    assert_eq!(preds["owner__repo-1"]["instance_id"], "owner__repo-1");
    assert_eq!(preds["owner__repo-1"]["model_name_or_path"], "scripted");
    assert_eq!(
        preds["owner__repo-1"]["model_patch"],
        "config host env-wins\nsh\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_leaves_a_valid_trajectory_of_every_finished_step() {
    let s = Scratch::new();
    let marker = marker();
    // An executor the test owns: a local one would outlive the SIGKILLed agent.
    let daemon = executor_tests::Daemon::start();
    let child = s
        .scripted_against(
            &daemon,
            &format!(
                "- command: echo first step\n- command: {}\n",
                marked_sleep(&marker)
            ),
            &[],
        )
        .spawn()
        .unwrap();
    assert!(started(&marker).await);
    signal(&child, Signal::SIGKILL);
    let run = s.finish(child).await;
    assert_eq!(run.code, -1, "killed by a signal");
    assert_eq!(run.traj["trajectory_format"], "mini-swe-agent-1.1");
    assert_eq!(run.exit_status(), "", "no exit was recorded");
    let tools = run.with_role("tool");
    assert_eq!(tools.len(), 1);
    assert!(tools[0]["content"].as_str().unwrap().contains("first step"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_errors_exit_2_with_a_reason() {
    let s = Scratch::new();
    let script = scripted(&s, "- command: echo hi\n");
    let no_task = s.run(&["--model", "scripted", "--script", &script]).await;
    assert_eq!(no_task.code, 2);
    assert!(no_task.stderr.contains("--task"), "{}", no_task.stderr);
    let no_model = s.run(&["--task", "t"]).await;
    assert_eq!(no_model.code, 2);
    assert!(no_model.stderr.contains("no model"), "{}", no_model.stderr);
    let bad_profile = s
        .run_scripted("- command: echo hi\n", &["--profile", "no-such-profile"])
        .await;
    assert_eq!(bad_profile.code, 2);
    assert!(
        bad_profile
            .stderr
            .contains("offers no profile \"no-such-profile\""),
        "{}",
        bad_profile.stderr
    );
    let bad_config = s.run(&["-c", "agent.step_limit=-3", "--task", "t"]).await;
    assert_eq!(bad_config.code, 2);
    assert!(
        bad_config.stderr.contains("invalid configuration"),
        "{}",
        bad_config.stderr
    );
}
