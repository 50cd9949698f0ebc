//! A minimal protocol client: connect with the bearer token, read hello, run commands.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ErrorMessage, ExecRequest, ExecResult, Hello, ServerMessage};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Longest wait for any one message; a daemon that says nothing for this long fails the run.
const PATIENCE: Duration = Duration::from_secs(60);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

pub struct Client {
    ws: Ws,
}

/// What came back for one request.
pub struct Received {
    pub result: Result<ExecResult, ErrorMessage>,
    /// UTF-8 bytes of `data` in the request's `output` messages.
    pub streamed_bytes: u64,
}

impl Client {
    /// Connect to `url` with `Authorization: Bearer <token>` and read the hello.
    pub async fn connect(url: &str, token: &str) -> anyhow::Result<(Self, Hello)> {
        let mut req = url.into_client_request().context("bad daemon url")?;
        req.headers_mut().insert(
            "Authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).context("token is not a header")?,
        );
        // TCP_NODELAY, as the daemon sets on its side and asyncio clients by default: a small
        // request right behind a large message (a `write` chunk) must not wait for the ACK.
        let connect = tokio_tungstenite::connect_async_with_config(req, None, true);
        let (ws, _) = tokio::time::timeout(PATIENCE, connect)
            .await
            .map_err(|_| anyhow!("no WebSocket handshake within {PATIENCE:?}"))?
            .with_context(|| format!("cannot connect to {url}"))?;
        let mut client = Self { ws };
        match client.recv().await? {
            ServerMessage::Hello(hello) => Ok((client, *hello)),
            other => bail!("expected hello, got {other:?}"),
        }
    }

    pub async fn send(&mut self, msg: &ClientMessage) -> anyhow::Result<()> {
        let text = serde_json::to_string(msg)?;
        self.ws
            .send(Message::text(text))
            .await
            .context("cannot send to the daemon")
    }

    /// The next protocol message; an error on close, timeout or invalid JSON.
    pub async fn recv(&mut self) -> anyhow::Result<ServerMessage> {
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.ws.next())
                .await
                .map_err(|_| anyhow!("the daemon sent nothing for {PATIENCE:?}"))?;
            match frame {
                Some(Ok(Message::Text(text))) => {
                    return serde_json::from_str(text.as_str())
                        .with_context(|| format!("invalid message from the daemon: {text}"));
                }
                Some(Ok(Message::Close(_))) | None => bail!("the daemon closed the connection"),
                Some(Err(err)) => return Err(err).context("WebSocket error"),
                Some(Ok(_)) => {}
            }
        }
    }

    /// Send `req` and wait for its result or error, counting streamed output on the way.
    pub async fn exec(&mut self, req: ExecRequest) -> anyhow::Result<Received> {
        let id = req.id.clone();
        self.send(&ClientMessage::Exec(req)).await?;
        let mut streamed_bytes = 0u64;
        loop {
            match self.recv().await? {
                ServerMessage::Output(chunk) if chunk.id == id => {
                    streamed_bytes += chunk.data.len() as u64;
                }
                ServerMessage::Result(result) if result.id == id => {
                    return Ok(Received {
                        result: Ok(result),
                        streamed_bytes,
                    })
                }
                ServerMessage::Error(err) if err.id.as_deref() == Some(id.as_str()) => {
                    return Ok(Received {
                        result: Err(err),
                        streamed_bytes,
                    })
                }
                _ => {}
            }
        }
    }

    /// Run `req`, insisting on a result (not a protocol error).
    pub async fn run(&mut self, req: ExecRequest) -> anyhow::Result<(ExecResult, u64)> {
        let id = req.id.clone();
        let got = self.exec(req).await?;
        match got.result {
            Ok(result) => Ok((result, got.streamed_bytes)),
            Err(err) => bail!("command {id}: {}: {}", err.code, err.message),
        }
    }

    /// Close politely; errors do not matter at this point.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ws.close(None)).await;
    }
}

/// A request for `command` under `profile`, everything else at the daemon's defaults.
pub fn request(id: String, command: &str, profile: &str) -> ExecRequest {
    ExecRequest {
        id,
        command: command.to_string(),
        cwd: None,
        env: BTreeMap::new(),
        timeout: None,
        profile: Some(profile.to_string()),
        stream: false,
        network: None,
    }
}
