//! A scripted model that replays a file of responses: for demos and tests, never a real LLM.
//!
//! The script is a YAML list; each entry is one model turn:
//! ```yaml
//! - thought: Let me look around.      # the assistant's text
//!   command: ls -la                   # one bash tool call ...
//! - commands: [git status, git diff]  # ... or several, run in order
//!   cost: 0.25                        # dollars this turn "costs" (default 0)
//! - content: "no tool call here"      # text only: the loop sees a format error
//! ```

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Value};

use super::openai::action_json;
use super::{timestamp, Action, ModelError, Reply};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default)]
    pub thought: String,
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub commands: Vec<String>,
    /// Raw assistant text with no tool call.
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub cost: f64,
}

pub struct ScriptedModel {
    steps: Vec<Step>,
    next: usize,
    pub source: String,
}

impl ScriptedModel {
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the script {}", path.display()))?;
        Self::from_yaml(&text, path.display().to_string())
    }

    pub fn from_yaml(text: &str, source: String) -> anyhow::Result<Self> {
        let steps: Vec<Step> = serde_norway::from_str(text)
            .map_err(|e| anyhow::anyhow!("script {source} is not a list of steps: {e}"))?;
        Ok(Self {
            steps,
            next: 0,
            source,
        })
    }

    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn query(&mut self, _messages: &[Value]) -> Result<Reply, ModelError> {
        let Some(step) = self.steps.get(self.next).cloned() else {
            return Err(ModelError::Fatal(format!(
                "the scripted model has no response left ({} replayed from {})",
                self.next, self.source
            )));
        };
        self.next += 1;
        let turn = self.next;
        let commands: Vec<String> = step.command.into_iter().chain(step.commands).collect();
        let content = step.content.unwrap_or(step.thought);
        let response = json!({"scripted": true, "source": self.source, "turn": turn});
        if commands.is_empty() {
            return Err(ModelError::Format {
                error: "No tool calls found in the response. Every response MUST include at least one tool call."
                    .into(),
                actions: Vec::new(),
                response: json!({"content": content, "scripted": response}),
                cost: step.cost,
            });
        }
        let actions: Vec<Action> = commands
            .iter()
            .enumerate()
            .map(|(i, command)| Action {
                command: command.clone(),
                tool_call_id: Some(format!("call_{turn}_{i}")),
            })
            .collect();
        let tool_calls: Vec<Value> = actions
            .iter()
            .map(|a| {
                json!({
                    "id": a.tool_call_id,
                    "type": "function",
                    "function": {
                        "name": "bash",
                        "arguments": json!({"command": a.command}).to_string(),
                    },
                })
            })
            .collect();
        let message = json!({
            "role": "assistant",
            "content": content,
            "tool_calls": tool_calls,
            "extra": {
                "actions": actions.iter().map(action_json).collect::<Vec<_>>(),
                "response": response,
                "cost": step.cost,
                "timestamp": timestamp(),
            },
        });
        Ok(Reply {
            message,
            actions,
            cost: step.cost,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_replay_in_order_then_run_out() {
        let mut model = ScriptedModel::from_yaml(
            "- thought: t\n  command: ls\n- content: oops\n",
            "test".into(),
        )
        .unwrap();
        let reply = model.query(&[]).unwrap();
        assert_eq!(reply.actions[0].command, "ls");
        assert_eq!(reply.message["tool_calls"][0]["id"], "call_1_0");
        assert!(matches!(model.query(&[]), Err(ModelError::Format { .. })));
        assert!(matches!(model.query(&[]), Err(ModelError::Fatal(_))));
    }

    #[test]
    fn unknown_keys_in_a_script_are_errors() {
        assert!(ScriptedModel::from_yaml("- comand: ls\n", "t".into()).is_err());
    }
}
