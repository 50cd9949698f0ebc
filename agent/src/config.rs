//! Run configuration: mini-swe-agent's YAML keys (`agent`, `model`, `environment`) plus ours.
//!
//! Files and `KEY=VALUE` overrides are merged as plain YAML trees first (later wins, maps merge
//! recursively, as mini's `-c` does), then read into typed sections. Keys we do not use are
//! kept, reported once, and recorded in the trajectory, so a real mini-swe-agent config loads
//! unchanged.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // Causes are in the messages, not `source`s: `{:#}` would print them twice.
    #[error("cannot read config file {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    NotFound(crate::config_files::NotFound),
    #[error("config file {path} is not valid YAML: {error}")]
    Yaml {
        path: String,
        error: serde_norway::Error,
    },
    #[error(
        "config override {spec:?} is not KEY=VALUE with a dotted key such as agent.step_limit=10"
    )]
    Override { spec: String },
    #[error("config override {spec:?}: the value is not valid YAML: {error}")]
    OverrideValue {
        spec: String,
        error: serde_norway::Error,
    },
    #[error("invalid configuration: {0}")]
    Invalid(serde_json::Error),
}

/// The whole configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Config {
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub environment: EnvironmentConfig,
    /// Top-level sections we do not use (e.g. mini's `run`).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// Interaction mode, as in mini's CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A person approves, edits or rejects each command before it runs.
    Confirm,
    /// Every command runs without asking.
    Yolo,
    /// The person types the commands; the model is not queried.
    Human,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_template: Option<String>,
    /// Model calls allowed; 0 means no limit. mini writes `0.` so floats are accepted.
    #[serde(default, deserialize_with = "count")]
    pub step_limit: u64,
    /// Dollars; 0 means no limit. The run stops once the cost reaches it.
    #[serde(default = "default_cost_limit")]
    pub cost_limit: f64,
    /// Seconds of wall-clock time for the whole run; 0 means no limit.
    #[serde(default)]
    pub wall_time_limit: f64,
    /// Consecutive format errors after which the run ends with `RepeatedFormatError`.
    #[serde(default = "default_format_error_limit", deserialize_with = "count")]
    pub format_error_limit: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_path: Option<PathBuf>,
    /// mini v1 kept these under `agent`; v2 moved them to `model`. Both are read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_observation_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_error_template: Option<String>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            system_template: None,
            instance_template: None,
            step_limit: 0,
            cost_limit: default_cost_limit(),
            wall_time_limit: 0.0,
            format_error_limit: default_format_error_limit(),
            mode: None,
            output_path: None,
            action_observation_template: None,
            format_error_template: None,
            other: BTreeMap::new(),
        }
    }
}

fn default_cost_limit() -> f64 {
    3.0
}

fn default_format_error_limit() -> u64 {
    5
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    /// `openai` (tool calls), `text` (fenced block, no tools), `anthropic`, `scripted`; mini's
    /// litellm class names are accepted too. Inferred from `model_name` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_class: Option<String>,
    /// Passed into the request body (temperature, max_tokens, ...); litellm-only keys dropped.
    #[serde(default)]
    pub model_kwargs: Map<String, Value>,
    #[serde(
        default,
        alias = "action_observation_template",
        skip_serializing_if = "Option::is_none"
    )]
    pub observation_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_error_template: Option<String>,
    /// Text mode: regex whose first group is the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_regex: Option<String>,
    /// API base, e.g. `http://localhost:8000/v1` for vLLM (`model_kwargs.api_base` also works).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Environment variable holding the API key (default `OPENAI_API_KEY` / `ANTHROPIC_API_KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// File holding the API key; read at start, never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// Dollars per input (prompt) token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_cost_per_token: Option<f64>,
    /// Dollars per output (completion) token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_cost_per_token: Option<f64>,
    /// litellm-style JSON registry: `{model: {input_cost_per_token, output_cost_per_token}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub litellm_model_registry: Option<PathBuf>,
    /// Attempts per model call, counting the first (429, 5xx and connection errors retry).
    #[serde(default = "default_retry_attempts")]
    pub retry_attempts: u32,
    /// First backoff delay in seconds; doubles per attempt up to `retry_max_delay`.
    #[serde(default = "default_retry_initial_delay")]
    pub retry_initial_delay: f64,
    #[serde(default = "default_retry_max_delay")]
    pub retry_max_delay: f64,
    /// Seconds one HTTP request may take.
    #[serde(default = "default_request_timeout")]
    pub request_timeout: f64,
    /// Scripted model: YAML file of responses to replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<PathBuf>,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            model_name: None,
            model_class: None,
            model_kwargs: Map::new(),
            observation_template: None,
            format_error_template: None,
            action_regex: None,
            base_url: None,
            api_key_env: None,
            api_key_file: None,
            input_cost_per_token: None,
            output_cost_per_token: None,
            litellm_model_registry: None,
            retry_attempts: default_retry_attempts(),
            retry_initial_delay: default_retry_initial_delay(),
            retry_max_delay: default_retry_max_delay(),
            request_timeout: default_request_timeout(),
            script: None,
            other: BTreeMap::new(),
        }
    }
}

fn default_retry_attempts() -> u32 {
    8
}
fn default_retry_initial_delay() -> f64 {
    1.0
}
fn default_retry_max_delay() -> f64 {
    30.0
}
fn default_request_timeout() -> f64 {
    600.0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnvironmentConfig {
    /// Working directory of every command; the executor's workspace when empty.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "non_empty"
    )]
    pub cwd: Option<String>,
    /// Create `cwd` (through the executor) before the first command.
    #[serde(default = "yes")]
    pub create_cwd: bool,
    /// Variables set for every command; win over `forward_env`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Host variables passed through when set.
    #[serde(default)]
    pub forward_env: Vec<String>,
    /// Interpreter argv, e.g. `["bash", "-c"]`; wrapped in the executor's when they differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interpreter: Option<Vec<String>>,
    /// Seconds per command.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// Sandbox profile; chosen from the executor's hello when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// The network every command asks for: `none`, `host`, or `{mode: policy, allow: [RULE,
    /// ...], deny: [...]}` (see [`crate::network`]); it narrows what the executor grants this
    /// client, never widens it. Absent: the client's.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::network::deserialize"
    )]
    pub network: Option<protocol::RequestNetwork>,
    /// `ws://` or `wss://` URL of a running executor; a local one is started when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_url: Option<String>,
    /// File with the executor's bearer token (or set `EXECUTOR_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// SHA-256 fingerprint of the `wss://` executor's certificate (`sha256:<hex>`, as
    /// `executor tls-fingerprint` prints it): exactly that certificate is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_fingerprint: Option<String>,
    /// Extra CA certificate (PEM) trusted for `wss://`, besides the WebPKI roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// The `executor` binary to start locally (default: next to `agent`, then `PATH`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_bin: Option<PathBuf>,
    /// Reconnection attempts after a lost connection before `EnvironmentError`.
    #[serde(default = "default_reconnect_attempts")]
    pub reconnect_attempts: u32,
    /// Where executors run: `local`, `remote`, `docker`, `ssh`, `reverse` (default: `remote`
    /// when an executor URL is given, else `local`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<String>,
    /// Seconds a deployment may take to give a usable executor (not a command timeout).
    #[serde(default = "crate::deploy::config::default_start_timeout")]
    pub start_timeout: f64,
    /// The task's image (`docker`); a batch instance's own image wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The static executor copied or mounted into targets (`docker`, `ssh`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_static: Option<PathBuf>,
    /// A pool of running executors (`remote`); `executor_url` adds one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote: Vec<crate::deploy::config::RemoteExecutor>,
    #[serde(default)]
    pub docker: crate::deploy::config::DockerConfig,
    #[serde(default)]
    pub ssh: crate::deploy::config::SshConfig,
    #[serde(default)]
    pub reverse: crate::deploy::config::ReverseConfig,
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        Self {
            cwd: None,
            create_cwd: true,
            env: BTreeMap::new(),
            forward_env: Vec::new(),
            interpreter: None,
            timeout: default_timeout(),
            profile: None,
            network: None,
            executor_url: None,
            token_file: None,
            tls_fingerprint: None,
            tls_ca: None,
            executor_bin: None,
            reconnect_attempts: default_reconnect_attempts(),
            deployment: None,
            start_timeout: crate::deploy::config::default_start_timeout(),
            image: None,
            executor_static: None,
            remote: Vec::new(),
            docker: Default::default(),
            ssh: Default::default(),
            reverse: Default::default(),
            other: BTreeMap::new(),
        }
    }
}

fn yes() -> bool {
    true
}
fn default_timeout() -> f64 {
    30.0
}
fn default_reconnect_attempts() -> u32 {
    5
}

/// Accept `10`, `10.0` or `"10"` for counts (mini's YAML writes `step_limit: 0.`).
fn count<'de, D: Deserializer<'de>>(de: D) -> Result<u64, D::Error> {
    let value = Value::deserialize(de)?;
    let number = match &value {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        Value::Null => Some(0.0),
        _ => None,
    };
    match number {
        Some(n) if n >= 0.0 && n.fract() == 0.0 && n < 1e15 => Ok(n as u64),
        _ => Err(serde::de::Error::custom(format!(
            "expected a non-negative whole number, got {value}"
        ))),
    }
}

fn non_empty<'de, D: Deserializer<'de>>(de: D) -> Result<Option<String>, D::Error> {
    let value = Option::<String>::deserialize(de)?;
    Ok(value.filter(|s| !s.is_empty()))
}

/// Load and merge config sources in order: each is a YAML file path or `dotted.key=value`.
pub fn load(sources: &[String]) -> Result<Config, ConfigError> {
    let mut tree = Value::Object(Map::new());
    for source in sources {
        let layer = if looks_like_override(source) {
            override_tree(source)?
        } else {
            read_config(source)?
        };
        merge(&mut tree, layer);
    }
    serde_json::from_value(tree).map_err(ConfigError::Invalid)
}

fn looks_like_override(source: &str) -> bool {
    match source.split_once('=') {
        Some((key, _)) => {
            !key.is_empty()
                && !key.contains('/')
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
        }
        None => false,
    }
}

/// A config given by path or by name (`swebench.yaml`: see [`crate::config_files::find`]).
fn read_config(spec: &str) -> Result<Value, ConfigError> {
    let found = crate::config_files::find(spec).map_err(ConfigError::NotFound)?;
    let text = match &found {
        crate::config_files::Found::File(path) => {
            std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
                path: path.clone(),
                error,
            })?
        }
        crate::config_files::Found::Bundled { text, .. } => text.to_string(),
    };
    let value: Value = serde_norway::from_str(&text).map_err(|error| ConfigError::Yaml {
        path: found.describe(),
        error,
    })?;
    Ok(if value.is_null() {
        Value::Object(Map::new())
    } else {
        value
    })
}

fn override_tree(spec: &str) -> Result<Value, ConfigError> {
    let Some((key, raw)) = spec.split_once('=') else {
        return Err(ConfigError::Override { spec: spec.into() });
    };
    let value: Value = serde_norway::from_str(raw).map_err(|error| ConfigError::OverrideValue {
        spec: spec.into(),
        error,
    })?;
    let mut tree = value;
    for part in key.rsplit('.') {
        if part.is_empty() {
            return Err(ConfigError::Override { spec: spec.into() });
        }
        let mut map = Map::new();
        map.insert(part.to_string(), tree);
        tree = Value::Object(map);
    }
    Ok(tree)
}

/// Recursive merge: maps merge key by key, anything else is replaced.
pub fn merge(base: &mut Value, layer: Value) {
    match (base, layer) {
        (Value::Object(base), Value::Object(layer)) => {
            for (key, value) in layer {
                match base.get_mut(&key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (slot, value) => *slot = value,
    }
}

impl Config {
    /// Keys we accept but do not act on, for one warning at start.
    pub fn ignored_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.other.keys().cloned().collect();
        let sections: [(&str, &BTreeMap<String, Value>); 3] = [
            ("agent", &self.agent.other),
            ("model", &self.model.other),
            ("environment", &self.environment.other),
        ];
        for (section, other) in sections {
            keys.extend(other.keys().map(|k| format!("{section}.{k}")));
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_yaml(text: &str) -> Config {
        let value: Value = serde_norway::from_str(text).unwrap();
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn mini_config_keys_load_and_unknown_keys_are_kept() {
        let config = from_yaml(
            "agent:\n  system_template: s\n  step_limit: 0.\n  cost_limit: 3.\n  mode: confirm\n\
             environment:\n  cwd: ''\n  env:\n    PAGER: cat\n  environment_class: docker\n\
             model:\n  model_name: gpt-x\n  model_kwargs:\n    drop_params: true\n  observation_template: o\n",
        );
        assert_eq!(config.agent.step_limit, 0);
        assert_eq!(config.agent.mode, Some(Mode::Confirm));
        assert_eq!(config.environment.cwd, None);
        assert_eq!(config.model.observation_template.as_deref(), Some("o"));
        assert_eq!(config.ignored_keys(), vec!["environment.environment_class"]);
    }

    #[test]
    fn missing_sections_get_the_same_defaults_as_empty_ones() {
        let config = from_yaml("{}");
        assert_eq!(config.model.retry_attempts, 8);
        assert_eq!(config.model.request_timeout, 600.0);
        assert_eq!(config.environment.timeout, 30.0);
        assert_eq!(config.agent.cost_limit, 3.0);
        let config = from_yaml("model: {}\nenvironment: {}\nagent: {}\n");
        assert_eq!(config.model.retry_attempts, 8);
        assert_eq!(config.environment.timeout, 30.0);
    }

    #[test]
    fn v1_observation_key_is_an_alias() {
        let config = from_yaml("model:\n  action_observation_template: x\n");
        assert_eq!(config.model.observation_template.as_deref(), Some("x"));
    }

    #[test]
    fn overrides_merge_into_nested_maps() {
        let mut tree = override_tree("agent.step_limit=7").unwrap();
        merge(&mut tree, override_tree("agent.cost_limit=1.5").unwrap());
        let config: Config = serde_json::from_value(tree).unwrap();
        assert_eq!(config.agent.step_limit, 7);
        assert_eq!(config.agent.cost_limit, 1.5);
        assert!(looks_like_override("model.model_name=x"));
        assert!(!looks_like_override("configs/a=b.yaml"));
        assert!(!looks_like_override("plain.yaml"));
    }

    #[test]
    fn negative_step_limit_is_rejected() {
        let value: Value = serde_norway::from_str("agent:\n  step_limit: -1\n").unwrap();
        assert!(serde_json::from_value::<Config>(value).is_err());
    }
}
