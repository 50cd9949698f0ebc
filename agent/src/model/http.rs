//! JSON over HTTPS with bounded retries: 408, 429 and 5xx answers, connection errors, timeouts
//! and bodies that are not JSON are retried with exponential backoff (or the server's
//! `Retry-After`); anything else fails at once. Request headers (the API key) never appear in
//! errors or logs.

use std::time::Duration;

use serde_json::Value;

use super::ModelError;
use crate::config::ModelConfig;

pub struct HttpClient {
    client: reqwest::Client,
    attempts: u32,
    initial_delay: f64,
    max_delay: f64,
}

/// Longest body excerpt quoted in an error.
const EXCERPT: usize = 500;

impl HttpClient {
    pub fn new(config: &ModelConfig) -> Result<Self, ModelError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(config.request_timeout.max(1.0)))
            .connect_timeout(Duration::from_secs(30))
            .user_agent(concat!("agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ModelError::Fatal(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self {
            client,
            attempts: config.retry_attempts.max(1),
            initial_delay: config.retry_initial_delay.max(0.0),
            max_delay: config.retry_max_delay.max(0.0),
        })
    }

    /// POST `body` as JSON and return the JSON answer.
    pub async fn post_json(
        &self,
        url: &str,
        headers: &[(&str, String)],
        body: &Value,
    ) -> Result<Value, ModelError> {
        let mut delay = self.initial_delay;
        let mut attempt = 1;
        loop {
            let (problem, retry_after) = match self.post_once(url, headers, body).await {
                Ok(value) => return Ok(value),
                Err(Failure::Fatal(msg)) => return Err(ModelError::Fatal(msg)),
                Err(Failure::Retry { message, after }) => (message, after),
            };
            if attempt >= self.attempts {
                return Err(ModelError::Fatal(format!(
                    "{problem} (gave up after {attempt} attempts)"
                )));
            }
            let wait = retry_after.unwrap_or(delay).min(self.max_delay.max(0.0));
            eprintln!(
                "model: {problem}; retrying in {wait:.1}s (attempt {}/{})",
                attempt + 1,
                self.attempts
            );
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            delay = (delay * 2.0).min(self.max_delay);
            attempt += 1;
        }
    }

    async fn post_once(
        &self,
        url: &str,
        headers: &[(&str, String)],
        body: &Value,
    ) -> Result<Value, Failure> {
        let mut request = self.client.post(url).json(body);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let response = request.send().await.map_err(|e| Failure::Retry {
            message: format!("cannot reach {url}: {}", without_url(&e)),
            after: None,
        })?;
        let status = response.status();
        let after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0);
        let text = response.text().await.map_err(|e| Failure::Retry {
            message: format!(
                "reading the response from {url} failed: {}",
                without_url(&e)
            ),
            after: None,
        })?;
        if status.is_success() {
            return serde_json::from_str(&text).map_err(|e| Failure::Retry {
                message: format!(
                    "the model server answered with invalid JSON ({e}): {}",
                    excerpt(&text)
                ),
                after: None,
            });
        }
        let message = format!("HTTP {status} from {url}: {}", excerpt(&text));
        let code = status.as_u16();
        if code == 408 || code == 429 || status.is_server_error() {
            Err(Failure::Retry { message, after })
        } else {
            Err(Failure::Fatal(message))
        }
    }
}

enum Failure {
    Retry { message: String, after: Option<f64> },
    Fatal(String),
}

fn excerpt(text: &str) -> String {
    let trimmed = text.trim();
    match trimmed.char_indices().nth(EXCERPT) {
        Some((cut, _)) => format!("{}...", &trimmed[..cut]),
        None => trimmed.to_string(),
    }
}

/// reqwest errors print the URL, which we already show; keep the cause only.
fn without_url(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    if let Some(url) = err.url() {
        text = text.replace(&format!(" ({url})"), "");
    }
    let mut source = std::error::Error::source(err);
    while let Some(inner) = source {
        text.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    text
}
