//! A TCP proxy whose connections a test can cut, to simulate a network outage.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

/// Forwards every connection it accepts on a loopback port to `target`, and simulates network
/// failures on them: [`Proxy::cut`] drops both sockets of every current connection (no
/// WebSocket close frame), as a broken route with a reset would; [`Proxy::stall`] stops
/// forwarding on them without closing anything, as an outage that delivers nothing (no FIN,
/// no RST) would. Either way new connections are forwarded as usual, unless [`Proxy::refuse`]
/// makes it drop them at once (an outage that lasts).
pub struct Proxy {
    pub addr: SocketAddr,
    inner: std::sync::Arc<ProxyState>,
    acceptor: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct ProxyState {
    links: std::sync::Mutex<Vec<ProxyLink>>,
    accepted: std::sync::atomic::AtomicUsize,
    refusing: std::sync::atomic::AtomicBool,
}

/// One forwarded connection: aborting its task drops both of its sockets.
struct ProxyLink {
    task: tokio::task::AbortHandle,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(ProxyState::default());
        let state = inner.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                state.accepted.fetch_add(1, Ordering::SeqCst);
                if state.refusing.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees its connection closed
                }
                let stalled = Arc::new(AtomicBool::new(false));
                let task = tokio::spawn({
                    let stalled = stalled.clone();
                    async move {
                        let Ok(server) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::join!(
                            pump(client_read, server_write, stalled.clone()),
                            pump(server_read, client_write, stalled),
                        );
                    }
                });
                let mut links = state.links.lock().unwrap();
                links.retain(|l| !l.task.is_finished());
                links.push(ProxyLink {
                    task: task.abort_handle(),
                    stalled,
                });
            }
        });
        Self {
            addr,
            inner,
            acceptor,
        }
    }

    /// The WebSocket URL of the executor behind this proxy.
    pub fn url(&self) -> String {
        format!("ws://{}{}", self.addr, protocol::WS_PATH)
    }

    /// Cut every current connection; returns how many were live.
    pub fn cut(&self) -> usize {
        let links = std::mem::take(&mut *self.inner.links.lock().unwrap());
        let live = links.iter().filter(|l| !l.task.is_finished()).count();
        for link in links {
            link.task.abort();
        }
        live
    }

    /// Stop forwarding on every current connection, both ways, closing nothing; returns how
    /// many were live. Bytes already read are held back, never delivered.
    pub fn stall(&self) -> usize {
        let links = self.inner.links.lock().unwrap();
        let live: Vec<&ProxyLink> = links.iter().filter(|l| !l.task.is_finished()).collect();
        for link in &live {
            link.stalled
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        live.len()
    }

    /// Drop new connections at once (`true`) or forward them again (`false`).
    pub fn refuse(&self, refusing: bool) {
        self.inner
            .refusing
            .store(refusing, std::sync::atomic::Ordering::SeqCst);
    }

    /// Connections accepted so far (forwarded or refused).
    pub fn accepted(&self) -> usize {
        self.inner
            .accepted
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Copy one direction of a proxied connection until EOF, holding everything while `stalled`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stalled: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    // A stalled link delivers no FIN either.
    while stalled.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = to.shutdown().await;
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.cut();
    }
}
