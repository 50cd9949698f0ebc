//! OpenAI-compatible chat completions (OpenAI, vLLM, llama.cpp, Ollama, ...): one `bash` tool
//! in tool mode, or plain text parsed by [`super::text`] in text mode.

use serde_json::{json, Value};

use super::http::HttpClient;
use super::{
    api_key, base_url, bash_tool_parameters, parse_tool_calls, request_kwargs, strip_extra,
    text::TextParser, timestamp, Action, ModelError, Prices, Reply, BASH_TOOL_DESCRIPTION,
};
use crate::config::ModelConfig;

pub struct OpenAiModel {
    http: HttpClient,
    url: String,
    key: Option<String>,
    model: String,
    kwargs: serde_json::Map<String, Value>,
    prices: Prices,
    /// Text mode when set: no tools, the command is parsed from the content.
    text: Option<TextParser>,
}

impl OpenAiModel {
    pub fn new(
        config: &ModelConfig,
        model_name: &str,
        text: Option<TextParser>,
    ) -> anyhow::Result<Self> {
        let model = model_name
            .strip_prefix("openai/")
            .unwrap_or(model_name)
            .to_string();
        Ok(Self {
            http: HttpClient::new(config)?,
            url: format!(
                "{}/chat/completions",
                base_url(config, "OPENAI_BASE_URL", "https://api.openai.com/v1")
            ),
            key: api_key(config, "OPENAI_API_KEY")?,
            prices: Prices::from_config(config, model_name)?,
            kwargs: request_kwargs(config),
            model,
            text,
        })
    }

    pub fn prices(&self) -> Prices {
        self.prices
    }

    pub async fn query(&mut self, messages: &[Value]) -> Result<Reply, ModelError> {
        let mut body = json!({
            "model": self.model,
            "messages": strip_extra(messages),
        });
        if self.text.is_none() {
            body["tools"] = json!([{
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": BASH_TOOL_DESCRIPTION,
                    "parameters": bash_tool_parameters(),
                }
            }]);
        }
        if let Some(obj) = body.as_object_mut() {
            for (k, v) in &self.kwargs {
                obj.insert(k.clone(), v.clone());
            }
        }
        let mut headers = Vec::new();
        if let Some(key) = &self.key {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        let response = self.http.post_json(&self.url, &headers, &body).await?;
        let usage = &response["usage"];
        let input = usage["prompt_tokens"].as_u64().unwrap_or(0);
        let output = usage["completion_tokens"].as_u64().unwrap_or(0);
        let cost = self.prices.cost(input, output);
        let Some(message) = response["choices"][0].get("message").cloned() else {
            return Err(ModelError::Format {
                error: "The response contained no message (no choices).".into(),
                actions: Vec::new(),
                response,
                cost,
            });
        };
        let mut message = match message {
            Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        message.insert("role".into(), json!("assistant"));
        let content = message
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let actions = match &self.text {
            Some(parser) => parser.parse(&content),
            None => parse_tool_calls(message.get("tool_calls")).map_err(|e| (e, Vec::new())),
        };
        let actions: Vec<Action> = match actions {
            Ok(actions) => actions,
            Err((error, found)) => {
                return Err(ModelError::Format {
                    error,
                    actions: found,
                    response,
                    cost,
                })
            }
        };
        let extra = json!({
            "actions": actions.iter().map(action_json).collect::<Vec<_>>(),
            "response": response,
            "cost": cost,
            "usage": {"input_tokens": input, "output_tokens": output},
            "timestamp": timestamp(),
        });
        message.insert("extra".into(), extra);
        Ok(Reply {
            message: Value::Object(message),
            actions,
            cost,
        })
    }
}

pub fn action_json(action: &Action) -> Value {
    match &action.tool_call_id {
        Some(id) => json!({"command": action.command, "tool_call_id": id}),
        None => json!({"command": action.command}),
    }
}
