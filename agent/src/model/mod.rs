//! Model clients. Each speaks its provider's protocol and hands the loop the same thing: an
//! assistant message in OpenAI chat format (what mini-swe-agent stores in trajectories) plus the
//! bash actions parsed from it. Provider details stop here.

pub mod anthropic;
mod http;
pub mod openai;
pub mod scripted;
pub mod text;

use std::path::Path;

use serde_json::{json, Value};

use crate::config::ModelConfig;

/// One bash command the model asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub command: String,
    /// The tool call this action answers; `None` for text mode and human commands.
    pub tool_call_id: Option<String>,
}

/// A successful model turn.
#[derive(Debug)]
pub struct Reply {
    /// The assistant message as stored in the trajectory (with `extra`).
    pub message: Value,
    pub actions: Vec<Action>,
    pub cost: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The response could not be turned into actions; shown to the model through the format
    /// error template. The response still cost money and counts as a call.
    #[error("format error: {error}")]
    Format {
        error: String,
        /// Commands found, for templates that count them (`{{actions|length}}`).
        actions: Vec<String>,
        /// What the model said, kept in the trajectory.
        response: Value,
        cost: f64,
    },
    /// The provider could not be reached or refused; retries are exhausted.
    #[error("{0}")]
    Fatal(String),
}

/// BASH_TOOL of mini-swe-agent (OpenAI function-calling schema).
pub fn bash_tool_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The bash command to execute"}
        },
        "required": ["command"]
    })
}

pub const BASH_TOOL_DESCRIPTION: &str = "Execute a bash command";

/// Turn OpenAI-format `tool_calls` into actions, with mini's error messages.
pub fn parse_tool_calls(tool_calls: Option<&Value>) -> Result<Vec<Action>, String> {
    let calls = tool_calls
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
        .ok_or_else(|| {
            "No tool calls found in the response. Every response MUST include at least one tool call."
                .to_string()
        })?;
    let mut actions = Vec::with_capacity(calls.len());
    for call in calls {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        let raw_args = call["function"]["arguments"].as_str().unwrap_or_default();
        let mut error = String::new();
        let args: Value = match serde_json::from_str(raw_args) {
            Ok(args) => args,
            Err(e) => {
                error.push_str(&format!("Error parsing tool call arguments: {e}. "));
                Value::Null
            }
        };
        if name != "bash" {
            error.push_str(&format!("Unknown tool '{name}'. "));
        }
        let command = args.get("command").and_then(Value::as_str);
        if command.is_none() {
            error.push_str("Missing 'command' argument in bash tool call.");
        }
        let id = call["id"].as_str().filter(|id| !id.is_empty());
        if id.is_none() {
            error.push_str(" Tool call without an id.");
        }
        match (command, id) {
            (Some(command), Some(id)) if error.is_empty() => actions.push(Action {
                command: command.to_string(),
                tool_call_id: Some(id.to_string()),
            }),
            _ => return Err(error.trim().to_string()),
        }
    }
    Ok(actions)
}

/// Token prices in dollars per token.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prices {
    pub input: f64,
    pub output: f64,
    pub known: bool,
}

impl Prices {
    /// From the config's per-token prices, else a litellm-style registry file.
    pub fn from_config(config: &ModelConfig, model: &str) -> anyhow::Result<Self> {
        if config.input_cost_per_token.is_some() || config.output_cost_per_token.is_some() {
            return Ok(Self {
                input: config.input_cost_per_token.unwrap_or(0.0),
                output: config.output_cost_per_token.unwrap_or(0.0),
                known: true,
            });
        }
        if let Some(path) = &config.litellm_model_registry {
            return Self::from_registry(path, model);
        }
        Ok(Self::default())
    }

    fn from_registry(path: &Path, model: &str) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model registry {}", path.display()))?;
        let registry: Value = serde_json::from_str(&text)
            .with_context(|| format!("model registry {} is not JSON", path.display()))?;
        let short = model.rsplit('/').next().unwrap_or(model);
        let entry = registry.get(model).or_else(|| registry.get(short));
        Ok(match entry {
            Some(entry) => Self {
                input: entry["input_cost_per_token"].as_f64().unwrap_or(0.0),
                output: entry["output_cost_per_token"].as_f64().unwrap_or(0.0),
                known: true,
            },
            None => Self::default(),
        })
    }

    pub fn cost(&self, input_tokens: u64, output_tokens: u64) -> f64 {
        input_tokens as f64 * self.input + output_tokens as f64 * self.output
    }
}

/// Seconds since the epoch, as mini's `time.time()` timestamps.
pub fn timestamp() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The configured model, dispatched by kind.
pub enum Model {
    OpenAi(openai::OpenAiModel),
    Anthropic(anthropic::AnthropicModel),
    Scripted(scripted::ScriptedModel),
}

/// Which client a config selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    OpenAi,
    Text,
    Anthropic,
    Scripted,
}

impl Kind {
    pub fn resolve(class: Option<&str>, model_name: &str) -> anyhow::Result<Self> {
        if let Some(class) = class {
            return match class {
                "openai" | "litellm" | "litellm_toolcall" | "openai_toolcall" | "toolcall" => {
                    Ok(Self::OpenAi)
                }
                "text" | "litellm_textbased" | "openai_text" | "textbased" => Ok(Self::Text),
                "anthropic" => Ok(Self::Anthropic),
                "scripted" => Ok(Self::Scripted),
                other => anyhow::bail!(
                    "unknown model_class {other:?}: use openai, text, anthropic or scripted"
                ),
            };
        }
        Ok(
            if model_name == "scripted" || model_name.starts_with("scripted/") {
                Self::Scripted
            } else if model_name.starts_with("anthropic/") || model_name.starts_with("claude") {
                Self::Anthropic
            } else {
                Self::OpenAi
            },
        )
    }

    pub fn style(self) -> crate::templates::Style {
        match self {
            Self::Text => crate::templates::Style::Text,
            _ => crate::templates::Style::ToolCalls,
        }
    }

    pub fn type_name(self) -> &'static str {
        match self {
            Self::OpenAi => "agent.model.openai.OpenAiModel",
            Self::Text => "agent.model.text.TextModel",
            Self::Anthropic => "agent.model.anthropic.AnthropicModel",
            Self::Scripted => "agent.model.scripted.ScriptedModel",
        }
    }
}

impl Model {
    pub async fn query(&mut self, messages: &[Value]) -> Result<Reply, ModelError> {
        match self {
            Self::OpenAi(m) => m.query(messages).await,
            Self::Anthropic(m) => m.query(messages).await,
            Self::Scripted(m) => m.query(messages),
        }
    }
}

/// Fields of a chat message an OpenAI-compatible server takes back. Replies carry more
/// (`reasoning_content`, `refusal`, `annotations`, ...), kept in the trajectory but not sent:
/// some servers reject them in requests.
const CHAT_MESSAGE_FIELDS: &[&str] = &["role", "content", "tool_calls", "tool_call_id", "name"];

/// Messages as the provider sees them: chat fields only, without mini's `extra` bookkeeping.
pub fn strip_extra(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .filter(|m| m["role"] != "exit")
        .map(|m| match m {
            Value::Object(fields) => Value::Object(
                fields
                    .iter()
                    .filter(|(k, v)| CHAT_MESSAGE_FIELDS.contains(&k.as_str()) && !v.is_null())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            other => other.clone(),
        })
        .collect()
}

/// Read an API key from a file or an environment variable; never logged.
pub fn api_key(config: &ModelConfig, default_env: &str) -> anyhow::Result<Option<String>> {
    use anyhow::Context;
    if let Some(path) = &config.api_key_file {
        let key = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read api_key_file {}", path.display()))?;
        return Ok(Some(key.trim().to_string()));
    }
    let var = config.api_key_env.as_deref().unwrap_or(default_env);
    Ok(std::env::var(var).ok().filter(|k| !k.is_empty()))
}

/// Keys litellm understands that are not part of the provider's request body.
const LITELLM_ONLY: &[&str] = &[
    "drop_params",
    "api_base",
    "base_url",
    "api_key",
    "custom_llm_provider",
    "num_retries",
    "timeout",
];

/// `model_kwargs` that go into the request body.
pub fn request_kwargs(config: &ModelConfig) -> serde_json::Map<String, Value> {
    config
        .model_kwargs
        .iter()
        .filter(|(k, _)| !LITELLM_ONLY.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The base URL from the config, `model_kwargs.api_base`, an environment variable, or a default.
pub fn base_url(config: &ModelConfig, env_var: &str, default: &str) -> String {
    config
        .base_url
        .clone()
        .or_else(|| {
            config
                .model_kwargs
                .get("api_base")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .or_else(|| std::env::var(env_var).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| default.to_string())
        .trim_end_matches('/')
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, args: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
    }

    #[test]
    fn tool_calls_become_actions_in_order() {
        let calls = json!([
            call("a", "bash", r#"{"command":"ls"}"#),
            call("b", "bash", r#"{"command":"pwd"}"#)
        ]);
        let actions = parse_tool_calls(Some(&calls)).unwrap();
        assert_eq!(actions.len(), 2);
        assert_eq!(actions[1].command, "pwd");
        assert_eq!(actions[1].tool_call_id.as_deref(), Some("b"));
    }

    #[test]
    fn malformed_tool_calls_are_format_errors() {
        assert!(parse_tool_calls(None)
            .unwrap_err()
            .contains("No tool calls"));
        let bad_json = json!([call("a", "bash", "{not json")]);
        assert!(parse_tool_calls(Some(&bad_json))
            .unwrap_err()
            .contains("Error parsing tool call arguments"));
        let wrong_tool = json!([call("a", "python", r#"{"command":"x"}"#)]);
        assert!(parse_tool_calls(Some(&wrong_tool))
            .unwrap_err()
            .contains("Unknown tool 'python'"));
        let no_command = json!([call("a", "bash", r#"{"cmd":"x"}"#)]);
        assert!(parse_tool_calls(Some(&no_command))
            .unwrap_err()
            .contains("Missing 'command'"));
    }

    #[test]
    fn model_kind_is_inferred_from_the_name() {
        assert_eq!(
            Kind::resolve(None, "anthropic/claude-x").unwrap(),
            Kind::Anthropic
        );
        assert_eq!(Kind::resolve(None, "gpt-4.1").unwrap(), Kind::OpenAi);
        assert_eq!(Kind::resolve(None, "scripted").unwrap(), Kind::Scripted);
        assert_eq!(
            Kind::resolve(Some("litellm_textbased"), "x").unwrap(),
            Kind::Text
        );
        assert!(Kind::resolve(Some("nope"), "x").is_err());
    }

    #[test]
    fn requests_carry_chat_fields_only() {
        let sent = strip_extra(&[
            json!({"role": "assistant", "content": "x", "reasoning_content": "r", "refusal": null,
                   "tool_calls": [], "extra": {"cost": 1}}),
            json!({"role": "exit", "content": "done"}),
        ]);
        assert_eq!(
            sent,
            vec![json!({"role": "assistant", "content": "x", "tool_calls": []})]
        );
    }

    #[test]
    fn cost_uses_per_token_prices() {
        let prices = Prices {
            input: 0.001,
            output: 0.002,
            known: true,
        };
        assert!((prices.cost(100, 10) - 0.12).abs() < 1e-12);
    }
}
