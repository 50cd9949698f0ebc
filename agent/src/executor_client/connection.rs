//! Opening a WebSocket to an executor: TLS, the bearer token, the hello; and `resume`.

use std::path::PathBuf;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, Hello, ResumeRequest, ServerMessage};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::tls::{self, Tls};

/// How to reach an executor (one a deployment started, or named in the configuration).
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `ws://` or `wss://` URL of `/v1/ws`.
    pub url: String,
    pub token: Option<String>,
    /// A file holding the token (mode 0600), for clients that read one.
    pub token_file: Option<PathBuf>,
    /// `sha256:<hex>` of a `wss://` executor's certificate, to pin.
    pub tls_fingerprint: Option<String>,
    pub tls_ca: Option<PathBuf>,
}

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How long connecting plus the hello may take.
const CONNECT_PATIENCE: Duration = Duration::from_secs(10);

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct ConnectError {
    pub reason: String,
    /// False when trying again cannot help (the executor's certificate was refused).
    pub retry: bool,
}

impl From<String> for ConnectError {
    fn from(reason: String) -> Self {
        Self {
            reason,
            retry: true,
        }
    }
}

/// The executor's answer to `resume`.
pub enum Resume {
    /// The ids of the session's commands still running.
    Resumed(Vec<String>),
    /// Why not (the session expired or is unknown); the connection is a fresh session.
    Refused(String),
}

/// Ask for `session` back as the first message on a new connection. `Err`: the connection
/// failed.
pub async fn resume(ws: &mut Ws, session: &str, awaiting: &[String]) -> Result<Resume, String> {
    let request = ClientMessage::Resume(ResumeRequest {
        session: session.to_string(),
        awaiting: awaiting.to_vec(),
    });
    let text = serde_json::to_string(&request).map_err(|e| e.to_string())?;
    let exchange = async {
        ws.send(Message::text(text))
            .await
            .map_err(|e| e.to_string())?;
        loop {
            let text = match ws.next().await {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) | None => {
                    return Err("the executor closed the connection".to_string())
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.to_string()),
            };
            match serde_json::from_str::<ServerMessage>(text.as_str()) {
                Ok(ServerMessage::Resumed(resumed)) if resumed.session == session => {
                    return Ok(Resume::Resumed(resumed.running))
                }
                // `not_found`, or an executor that does not know `resume` (`bad_request`):
                // errors about no request carry no id.
                Ok(ServerMessage::Error(err)) if err.id.is_none() => {
                    return Ok(Resume::Refused(format!("{}: {}", err.code, err.message)))
                }
                Ok(_) => continue,
                Err(e) => return Err(format!("unreadable answer to resume: {e}")),
            }
        }
    };
    tokio::time::timeout(CONNECT_PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| Err("no answer to resume in time".into()))
}

/// What an HTTP refusal of the upgrade means, for the statuses the executor answers with:
/// 401 for a token it does not know or no token at all (which of the two, we know), 403 for
/// a browser `Origin` or a `Host` it refuses. Retrying cannot help either.
fn refused_status(
    error: &tokio_tungstenite::tungstenite::Error,
    sent_token: bool,
) -> Option<String> {
    let tokio_tungstenite::tungstenite::Error::Http(response) = error else {
        return None;
    };
    match response.status().as_u16() {
        401 if sent_token => Some(
            "the executor refused the token we sent (HTTP 401 Unauthorized): it is not this \
             executor's token; check --token-file / environment.token_file / EXECUTOR_TOKEN"
                .into(),
        ),
        401 => Some(
            "the executor requires a token and none was given (HTTP 401 Unauthorized): pass \
             --token-file PATH (environment.token_file) or set EXECUTOR_TOKEN"
                .into(),
        ),
        403 => Some(
            "the executor refused the connection (HTTP 403 Forbidden): it refuses requests \
             whose Origin header is not in its --allow-origin list, and on a loopback listener \
             a Host that is not a loopback name"
                .into(),
        ),
        _ => None,
    }
}

/// Open a connection and read the hello.
pub async fn connect(
    url: &str,
    token: Option<&str>,
    tls: &Tls,
) -> Result<(Ws, Hello), ConnectError> {
    let attempt = async {
        let connector = tls.connector(url).map_err(|reason| ConnectError {
            reason,
            retry: false,
        })?;
        let mut request = url.into_client_request().map_err(|e| e.to_string())?;
        if let Some(token) = token {
            let value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| "the token contains characters not allowed in a header".to_string())?;
            request.headers_mut().insert("Authorization", value);
        }
        // Nagle off (`disable_nagle`): a small request right behind a large one (a write and
        // the list_processes that confirms it) must not wait for the delayed ACK.
        let connected =
            tokio_tungstenite::connect_async_tls_with_config(request, None, true, connector).await;
        let (mut ws, _) = connected.map_err(|e| match tls::certificate_refused(&e) {
            Some(reason) => ConnectError {
                reason,
                retry: false,
            },
            None => match refused_status(&e, token.is_some()) {
                Some(reason) => ConnectError {
                    reason,
                    retry: false,
                },
                None => ConnectError::from(e.to_string()),
            },
        })?;
        loop {
            match ws.next().await {
                Some(Ok(Message::Text(text))) => {
                    return match serde_json::from_str::<ServerMessage>(text.as_str()) {
                        Ok(ServerMessage::Hello(hello)) => Ok((ws, *hello)),
                        Ok(other) => Err(format!("expected hello, got {other:?}").into()),
                        Err(e) => Err(format!("unreadable hello: {e}").into()),
                    };
                }
                Some(Ok(Message::Close(frame))) => {
                    return Err(format!(
                        "the executor closed the connection{}",
                        frame.map(|f| format!(": {}", f.reason)).unwrap_or_default()
                    )
                    .into())
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.to_string().into()),
                None => return Err("the executor closed the connection".to_string().into()),
            }
        }
    };
    tokio::time::timeout(CONNECT_PATIENCE, attempt)
        .await
        .unwrap_or_else(|_| Err("timed out".to_string().into()))
}
