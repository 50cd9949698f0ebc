//! The HTTP side of the proxy, on hyper: forward-proxy requests and CONNECT.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::{Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{authority_matches, tunnel, Attempt, CommandContext, Engine, Refusal};

type Body = Either<Incoming, Full<Bytes>>;

/// Headers for one hop only (RFC 9110 §7.6.1), never passed on in either direction.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

pub async fn serve<S>(engine: Arc<Engine>, ctx: Arc<CommandContext>, stream: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = engine.limits.clone();
    let service = hyper::service::service_fn(move |req| {
        let engine = engine.clone();
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(handle(engine, ctx, req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.first_bytes)
        .max_buf_size(limits.max_head.max(8192))
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    if let Err(err) = conn.await {
        tracing::debug!(%err, "egress proxy connection ended with an error");
    }
}

async fn handle(
    engine: Arc<Engine>,
    ctx: Arc<CommandContext>,
    req: Request<Incoming>,
) -> Response<Body> {
    if req.method() == Method::CONNECT {
        connect(engine, ctx, req).await
    } else {
        forward(engine, ctx, req).await
    }
}

async fn connect(
    engine: Arc<Engine>,
    ctx: Arc<CommandContext>,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let authority = req.uri().authority().cloned();
    let (host, port) = match &authority {
        Some(a) => (a.host().to_string(), a.port_u16().unwrap_or(0)),
        None => (req.uri().to_string(), 0),
    };
    let mut attempt = Attempt::new(&ctx, &engine.sink, "connect", &host, port);
    if port == 0 {
        attempt.refuse("bad_request", "CONNECT needs host:port".to_string());
        return refuse(attempt, StatusCode::BAD_REQUEST);
    }
    let Some(target) = attempt.target(&host) else {
        return refuse(attempt, StatusCode::FORBIDDEN);
    };
    if let Some(value) = req.headers().get(header::HOST) {
        if !authority_matches(value.as_bytes(), &target, port, None) {
            attempt.refuse("host_mismatch", host_mismatch(value, &target, port));
            return refuse(attempt, StatusCode::FORBIDDEN);
        }
    }
    let upstream = match engine.dial(&ctx, &mut attempt, &target, port).await {
        Ok(upstream) => upstream,
        Err(Refusal::Denied) => return refuse(attempt, StatusCode::FORBIDDEN),
        Err(Refusal::Failed) => return refuse(attempt, StatusCode::BAD_GATEWAY),
    };
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        // The command's side closes only once the attempt is recorded (dropped last), so a
        // command that ends as soon as it sees the close has it counted in its result.
        let mut client = None;
        match upgrade.await {
            Ok(upgraded) => {
                let io = client.insert(TokioIo::new(upgraded));
                let end = tunnel::relay(io, upstream, &target, port, &engine.limits).await;
                attempt.ended(end);
            }
            Err(err) => attempt.record.error = Some(format!("upgrade: {err}")),
        }
        attempt.finish();
        drop(client);
    });
    Response::new(Either::Right(Full::default()))
}

async fn forward(
    engine: Arc<Engine>,
    ctx: Arc<CommandContext>,
    req: Request<Incoming>,
) -> Response<Body> {
    let uri = req.uri().clone();
    let authority = uri.authority().cloned();
    let host = authority
        .as_ref()
        .map(|a| a.host().to_string())
        .unwrap_or_default();
    let port = authority.as_ref().and_then(|a| a.port_u16()).unwrap_or(80);
    let mut attempt = Attempt::new(&ctx, &engine.sink, "http", &host, port);
    if uri.scheme_str() != Some("http") || authority.is_none() {
        attempt.refuse(
            "bad_request",
            format!("the proxy takes absolute http:// URIs (CONNECT for https), not {uri}"),
        );
        return refuse(attempt, StatusCode::BAD_REQUEST);
    }
    let Some(target) = attempt.target(&host) else {
        return refuse(attempt, StatusCode::FORBIDDEN);
    };
    // The Host header and the URI must name one target: a server that trusts Host would
    // otherwise serve a name the policy never judged.
    if let Some(value) = req.headers().get(header::HOST) {
        if !authority_matches(value.as_bytes(), &target, port, Some(80)) {
            attempt.refuse("host_mismatch", host_mismatch(value, &target, port));
            return refuse(attempt, StatusCode::FORBIDDEN);
        }
    }
    let upstream = match engine.dial(&ctx, &mut attempt, &target, port).await {
        Ok(upstream) => upstream,
        Err(Refusal::Denied) => return refuse(attempt, StatusCode::FORBIDDEN),
        Err(Refusal::Failed) => return refuse(attempt, StatusCode::BAD_GATEWAY),
    };
    let (mut parts, body) = req.into_parts();
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    parts.uri = match path.parse::<Uri>() {
        Ok(path) => path,
        Err(err) => {
            attempt.refuse("bad_request", format!("path {path:?}: {err}"));
            return refuse(attempt, StatusCode::BAD_REQUEST);
        }
    };
    strip_hop_by_hop(&mut parts.headers);
    // The target as dialed, never user info (`http://user:secret@host/` keeps its secret
    // out of the Host header).
    let host_value = match authority.as_ref().and_then(|a| a.port()) {
        Some(p) => format!("{host}:{p}"),
        None => host.clone(),
    };
    if let Ok(value) = HeaderValue::from_str(&host_value) {
        parts.headers.insert(header::HOST, value);
    }
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(err) => {
                attempt.record.error = Some(format!("http handshake: {err}"));
                return refuse(attempt, StatusCode::BAD_GATEWAY);
            }
        };
    // The record is written when the target's connection closes: after the response's last
    // byte, or when either side gives up.
    let (error_tx, error_rx) = tokio::sync::oneshot::channel::<String>();
    tokio::spawn(async move {
        if let Err(err) = conn.await {
            attempt.record.error = Some(err.to_string());
        }
        if let Ok(err) = error_rx.await {
            attempt.record.error.get_or_insert(err);
        }
        attempt.finish();
    });
    let answer = sender.send_request(Request::from_parts(parts, body)).await;
    drop(sender);
    match answer {
        Ok(response) => {
            drop(error_tx);
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, Either::Left(body))
        }
        Err(err) => {
            let _ = error_tx.send(err.to_string());
            text(
                StatusCode::BAD_GATEWAY,
                format!("executor network policy: {err}\n"),
            )
        }
    }
}

fn host_mismatch(value: &HeaderValue, target: &sandbox::network::Host, port: u16) -> String {
    format!(
        "the Host header {:?} is not the target {target}:{port}",
        String::from_utf8_lossy(value.as_bytes())
    )
}

/// Record the attempt and answer with its reason.
fn refuse(attempt: Attempt, status: StatusCode) -> Response<Body> {
    let body = attempt.denial_text();
    attempt.finish();
    text(status, body)
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the Connection header names are for this hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}
