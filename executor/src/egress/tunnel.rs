//! A tunnel to an allowed target (after CONNECT, or a captured connection): its first bytes
//! judged, then relayed both ways untouched.
//!
//! The first bytes the command sends decide what is checked:
//! - a TLS record (`0x16`): the ClientHello, read with rustls's [`Acceptor`] (which parses it
//!   without answering), must carry no SNI or the target's name (an SNI that names another
//!   host would let a server that hosts both, such as a CDN, serve a name the policy does not
//!   allow: domain fronting);
//! - an HTTP/1 request line (`GET /path HTTP/1.1`): its `Host`, when present, must name the
//!   target, and a head that does not parse is refused;
//! - anything else passes (SSH, a database protocol): the target is the one the policy
//!   allowed, dialed by the proxy itself.
//!
//! Only the first message is judged: later requests on a kept-alive plain-HTTP tunnel still
//! reach only the server dialed, never another. Server-first protocols work: the target's
//! bytes flow to the command while the proxy waits for the command's first bytes, and only
//! once those have begun must the message complete within the time limit.

use std::io;

use rustls::server::Acceptor;
use sandbox::network::Host;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{authority_matches, Limits};

/// Why a tunnel ended early.
#[derive(Debug)]
pub enum End {
    /// Its first message was refused.
    Refused {
        code: &'static str,
        reason: String,
    },
    Io(io::Error),
}

impl From<io::Error> for End {
    fn from(err: io::Error) -> Self {
        Self::Io(err)
    }
}

/// Bytes read at once each way of a relay: larger than `tokio::io::copy`'s 8 KiB (a syscall
/// pair per 8 KiB each side), small enough that the tunnels a command may hold (256) stay a
/// few MiB when data flows. (splice(2) through a pipe was tried and measured no faster on
/// loopback, at two more descriptors per tunnel: bench/JOURNAL.md, "Network policy".)
const RELAY_BUFFER: usize = 64 * 1024;

/// Judge the command's first message, then relay both ways until both sides are done.
pub async fn relay<C, U>(
    client: C,
    upstream: U,
    target: &Host,
    port: u16,
    limits: &Limits,
) -> Result<(), End>
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut up_read, mut up_write) = tokio::io::split(upstream);
    let up = async {
        let first = first_message(&mut client_read, target, port, limits).await?;
        up_write.write_all(&first).await?;
        let mut client_read = tokio::io::BufReader::with_capacity(RELAY_BUFFER, &mut client_read);
        tokio::io::copy_buf(&mut client_read, &mut up_write).await?;
        up_write.shutdown().await?;
        Ok::<_, End>(())
    };
    let down = async {
        let mut up_read = tokio::io::BufReader::with_capacity(RELAY_BUFFER, &mut up_read);
        tokio::io::copy_buf(&mut up_read, &mut client_write).await?;
        client_write.shutdown().await?;
        Ok::<_, End>(())
    };
    // A refused first message ends both directions at once.
    tokio::try_join!(up, down).map(|_| ())
}

/// Read and judge the command's first message; the bytes read, to be sent on.
async fn first_message<R>(
    reader: &mut R,
    target: &Host,
    port: u16,
    limits: &Limits,
) -> Result<Vec<u8>, End>
where
    R: AsyncRead + Unpin,
{
    let mut buf = Vec::with_capacity(4096);
    // No time limit on the first byte: a server-first protocol's client waits to be spoken to.
    if read_more(reader, &mut buf, limits.max_head).await? == 0 {
        return Ok(buf);
    }
    match tokio::time::timeout(limits.first_bytes, judge(reader, buf, target, port, limits)).await {
        Ok(result) => result,
        Err(_) => Err(End::Refused {
            code: "slow_first_message",
            reason: format!(
                "the first message did not arrive whole within {:?}",
                limits.first_bytes
            ),
        }),
    }
}

async fn judge<R>(
    reader: &mut R,
    mut buf: Vec<u8>,
    target: &Host,
    port: u16,
    limits: &Limits,
) -> Result<Vec<u8>, End>
where
    R: AsyncRead + Unpin,
{
    const TLS_HANDSHAKE: u8 = 0x16;
    let too_long = |what: &str| End::Refused {
        code: "first_message_too_long",
        reason: format!("{what} longer than {} bytes", limits.max_head),
    };
    if buf.first() == Some(&TLS_HANDSHAKE) {
        let mut acceptor = Acceptor::default();
        let mut fed = 0;
        loop {
            while fed < buf.len() {
                let n = acceptor.read_tls(&mut &buf[fed..])?;
                if n == 0 {
                    break;
                }
                fed += n;
            }
            match acceptor.accept() {
                Ok(Some(accepted)) => {
                    let sni = accepted.client_hello().server_name().map(str::to_string);
                    return match sni {
                        Some(sni) if !Host::parse(&sni).is_ok_and(|h| h == *target) => {
                            Err(End::Refused {
                                code: "sni_mismatch",
                                reason: format!(
                                    "the TLS ClientHello names {sni:?}, not the target {target}"
                                ),
                            })
                        }
                        _ => Ok(buf),
                    };
                }
                Ok(None) => {
                    if read_more(reader, &mut buf, limits.max_head).await? == 0 {
                        return Err(too_long_or_cut(&buf, limits, "ClientHello"));
                    }
                }
                Err((err, _alert)) => {
                    return Err(End::Refused {
                        code: "bad_tls",
                        reason: format!("not a TLS ClientHello: {err}"),
                    })
                }
            }
        }
    }
    loop {
        match looks_like_http(&buf) {
            Some(false) => return Ok(buf),
            Some(true) => {
                let mut headers = [httparse::EMPTY_HEADER; 64];
                let mut request = httparse::Request::new(&mut headers);
                match request.parse(&buf) {
                    Ok(httparse::Status::Complete(_)) => {
                        let host = request
                            .headers
                            .iter()
                            .find(|h| h.name.eq_ignore_ascii_case("host"));
                        return match host {
                            Some(h) if !authority_matches(h.value, target, port, None) => {
                                Err(End::Refused {
                                    code: "host_mismatch",
                                    reason: format!(
                                        "the request's Host {:?} is not the target {target}",
                                        String::from_utf8_lossy(h.value)
                                    ),
                                })
                            }
                            _ => Ok(buf),
                        };
                    }
                    // A request line of HTTP/1 with a head that does not parse (or more
                    // headers than we judge): refused rather than passed unjudged, since the
                    // server may read it more leniently.
                    Err(err) => {
                        return Err(End::Refused {
                            code: "bad_request",
                            reason: format!("an HTTP request that does not parse: {err}"),
                        })
                    }
                    Ok(httparse::Status::Partial) => {}
                }
            }
            None => {}
        }
        if buf.len() >= limits.max_head {
            return Err(too_long("a request head"));
        }
        if read_more(reader, &mut buf, limits.max_head).await? == 0 {
            // Closed before saying what it is: pass what came (nothing is judged by name).
            return Ok(buf);
        }
    }
}

fn too_long_or_cut(buf: &[u8], limits: &Limits, what: &str) -> End {
    let reason = if buf.len() >= limits.max_head {
        format!("{what} longer than {} bytes", limits.max_head)
    } else {
        format!("{what} cut short")
    };
    End::Refused {
        code: "bad_tls",
        reason,
    }
}

/// Whether `buf` begins with an HTTP/1 request line (a method token of capitals, a target,
/// `HTTP/1.x`): `None` while too few bytes have come to tell. Text protocols whose commands
/// look alike (SMTP's `EHLO host`, FTP's `USER name`) are not HTTP: their lines end otherwise.
fn looks_like_http(buf: &[u8]) -> Option<bool> {
    let Some(space) = buf.iter().position(|b| *b == b' ') else {
        let token = buf.len() <= 16 && buf.iter().all(u8::is_ascii_uppercase);
        return if token { None } else { Some(false) };
    };
    if space == 0 || space > 16 || !buf[..space].iter().all(u8::is_ascii_uppercase) {
        return Some(false);
    }
    let end = buf.iter().position(|b| *b == b'\n')?;
    let line = buf[..end].strip_suffix(b"\r").unwrap_or(&buf[..end]);
    Some(line.ends_with(b" HTTP/1.1") || line.ends_with(b" HTTP/1.0"))
}

/// Append what the reader has (at most up to `max` bytes in `buf`); 0 at its end or when full.
async fn read_more<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<usize> {
    let room = max.saturating_sub(buf.len());
    if room == 0 {
        return Ok(0);
    }
    let start = buf.len();
    buf.resize(start + room.min(8192), 0);
    let n = reader.read(&mut buf[start..]).await;
    buf.truncate(start + *n.as_ref().unwrap_or(&0));
    n
}
