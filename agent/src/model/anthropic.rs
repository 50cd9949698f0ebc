//! Anthropic Messages API with one `bash` tool. The conversation is kept in OpenAI chat format
//! (mini's trajectory format) and translated here on every request: the system message moves
//! to `system`, assistant tool calls become `tool_use` blocks, and tool messages become
//! `tool_result` blocks of the following user turn.

use serde_json::{json, Map, Value};

use super::http::HttpClient;
use super::{
    api_key, base_url, bash_tool_parameters, parse_tool_calls, request_kwargs, timestamp,
    ModelError, Prices, Reply, BASH_TOOL_DESCRIPTION,
};
use crate::config::ModelConfig;
use crate::model::openai::action_json;

pub const API_VERSION: &str = "2023-06-01";
const DEFAULT_MAX_TOKENS: u64 = 4096;

pub struct AnthropicModel {
    http: HttpClient,
    url: String,
    key: Option<String>,
    model: String,
    kwargs: Map<String, Value>,
    prices: Prices,
}

impl AnthropicModel {
    pub fn new(config: &ModelConfig, model_name: &str) -> anyhow::Result<Self> {
        let model = model_name
            .strip_prefix("anthropic/")
            .unwrap_or(model_name)
            .to_string();
        Ok(Self {
            http: HttpClient::new(config)?,
            url: format!(
                "{}/v1/messages",
                base_url(config, "ANTHROPIC_BASE_URL", "https://api.anthropic.com")
            ),
            key: api_key(config, "ANTHROPIC_API_KEY")?,
            prices: Prices::from_config(config, model_name)?,
            kwargs: anthropic_kwargs(request_kwargs(config), model_name),
            model,
        })
    }

    pub fn prices(&self) -> Prices {
        self.prices
    }

    pub async fn query(&mut self, messages: &[Value]) -> Result<Reply, ModelError> {
        let (system, turns) = to_anthropic(messages);
        let mut body = json!({
            "model": self.model,
            "max_tokens": DEFAULT_MAX_TOKENS,
            "messages": turns,
            "tools": [{
                "name": "bash",
                "description": BASH_TOOL_DESCRIPTION,
                "input_schema": bash_tool_parameters(),
            }],
        });
        if !system.is_empty() {
            body["system"] = json!(system);
        }
        if let Some(obj) = body.as_object_mut() {
            for (k, v) in &self.kwargs {
                obj.insert(k.clone(), v.clone());
            }
        }
        let mut headers = vec![("anthropic-version", API_VERSION.to_string())];
        if let Some(key) = &self.key {
            headers.push(("x-api-key", key.clone()));
        }
        let response = self.http.post_json(&self.url, &headers, &body).await?;
        let usage = &response["usage"];
        let input = [
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
        ]
        .iter()
        .map(|k| usage[*k].as_u64().unwrap_or(0))
        .sum::<u64>();
        let output = usage["output_tokens"].as_u64().unwrap_or(0);
        let cost = self.prices.cost(input, output);
        let Some(blocks) = response["content"].as_array() else {
            return Err(ModelError::Format {
                error: "The response contained no content blocks.".into(),
                actions: Vec::new(),
                response,
                cost,
            });
        };
        let mut text = String::new();
        let mut tool_calls = Vec::new();
        for block in blocks {
            match block["type"].as_str() {
                Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
                Some("tool_use") => tool_calls.push(json!({
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": serde_json::to_string(&block["input"]).unwrap_or_default(),
                    },
                })),
                _ => {}
            }
        }
        let tool_calls = Value::Array(tool_calls);
        let actions = match parse_tool_calls(Some(&tool_calls)) {
            Ok(actions) => actions,
            Err(error) => {
                return Err(ModelError::Format {
                    error,
                    actions: Vec::new(),
                    response,
                    cost,
                })
            }
        };
        let message = json!({
            "role": "assistant",
            "content": text,
            "tool_calls": tool_calls,
            "extra": {
                "actions": actions.iter().map(action_json).collect::<Vec<_>>(),
                "response": response,
                "cost": cost,
                "usage": {"input_tokens": input, "output_tokens": output},
                "timestamp": timestamp(),
            },
        });
        Ok(Reply {
            message,
            actions,
            cost,
        })
    }
}

/// Request fields of the Messages API that `model_kwargs` may set.
const MESSAGES_API_FIELDS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "thinking",
    "tool_choice",
    "service_tier",
];

/// Keep the kwargs the Messages API accepts. mini's configs are written for litellm, which
/// drops the rest (`drop_params`), e.g. OpenAI's `parallel_tool_calls` in its SWE-bench config;
/// sending them would get a 400. What is dropped is said once.
fn anthropic_kwargs(kwargs: Map<String, Value>, model_name: &str) -> Map<String, Value> {
    let (kept, dropped): (Vec<_>, Vec<_>) = kwargs
        .into_iter()
        .partition(|(k, _)| MESSAGES_API_FIELDS.contains(&k.as_str()));
    if !dropped.is_empty() {
        let names: Vec<&str> = dropped.iter().map(|(k, _)| k.as_str()).collect();
        eprintln!(
            "model: not sending model_kwargs the Anthropic Messages API does not take for {model_name}: {}",
            names.join(", ")
        );
    }
    kept.into_iter().collect()
}

/// OpenAI-format history to Anthropic's `system` and alternating `messages`.
pub fn to_anthropic(messages: &[Value]) -> (String, Vec<Value>) {
    let mut system = Vec::new();
    let mut turns: Vec<(String, Vec<Value>)> = Vec::new();
    let mut push = |role: &str, block: Value| match turns.last_mut() {
        Some((last, blocks)) if last == role => blocks.push(block),
        _ => turns.push((role.to_string(), vec![block])),
    };
    for message in messages {
        let content = message["content"].as_str().unwrap_or_default();
        match message["role"].as_str() {
            Some("system") => system.push(content.to_string()),
            // Our own replies go back exactly as the API sent them: thinking blocks (and their
            // signatures) must precede tool use when extended thinking is on.
            Some("assistant") if message["extra"]["response"]["type"] == "message" => {
                for block in message["extra"]["response"]["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let empty_text =
                        block["type"] == "text" && block["text"].as_str().is_none_or(str::is_empty);
                    if !empty_text {
                        push("assistant", block.clone());
                    }
                }
            }
            Some("assistant") => {
                if !content.is_empty() {
                    push("assistant", json!({"type": "text", "text": content}));
                }
                for call in message["tool_calls"].as_array().into_iter().flatten() {
                    let args = call["function"]["arguments"].as_str().unwrap_or("{}");
                    let input: Value = serde_json::from_str(args).unwrap_or_else(|_| json!({}));
                    push(
                        "assistant",
                        json!({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": input}),
                    );
                }
            }
            Some("tool") => push(
                "user",
                json!({"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content}),
            ),
            Some("user") => push("user", json!({"type": "text", "text": content})),
            _ => {}
        }
    }
    let turns = turns
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    (system.join("\n"), turns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_replies_are_sent_back_verbatim_with_thinking() {
        let raw = json!({"type": "message", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "text", "text": ""},
            {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}
        ]});
        let history = vec![
            json!({"role": "user", "content": "task"}),
            json!({"role": "assistant", "content": "", "tool_calls": [], "extra": {"response": raw}}),
            json!({"role": "tool", "tool_call_id": "t1", "content": "a"}),
        ];
        let (_, turns) = to_anthropic(&history);
        let blocks = turns[1]["content"].as_array().unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0]["signature"], "sig");
        assert_eq!(blocks[1]["id"], "t1");
    }

    #[test]
    fn tool_results_join_the_next_user_turn() {
        let history = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "task"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}},
                {"id": "t2", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"pwd\"}"}}
            ]}),
            json!({"role": "tool", "tool_call_id": "t1", "content": "a"}),
            json!({"role": "tool", "tool_call_id": "t2", "content": "b"}),
            json!({"role": "user", "content": "format error"}),
        ];
        let (system, turns) = to_anthropic(&history);
        assert_eq!(system, "sys");
        assert_eq!(turns.len(), 3);
        assert_eq!(turns[1]["content"][0]["type"], "tool_use");
        assert_eq!(turns[1]["content"][1]["input"]["command"], "pwd");
        let results = turns[2]["content"].as_array().unwrap();
        assert_eq!(results[0]["tool_use_id"], "t1");
        assert_eq!(results[1]["tool_use_id"], "t2");
        assert_eq!(results[2]["type"], "text");
    }
}
