//! Forward-proxy requests: allowed names, IP literals, names that resolve (or rebind) to
//! special addresses, and a Host header that disagrees with the URI.

use super::*;

#[tokio::test]
async fn an_http_request_reaches_an_allowed_name_and_another_name_is_refused() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    let url = format!("http://web.test:{port}/hello?x=1");
    let answer = exchange(proxy.addr, &get(&url, &format!("web.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert!(answer.ends_with("hello"), "{answer}");
    let head = heads.lock().unwrap()[0].clone();
    // Sent on in origin form, without the proxy's own headers.
    assert!(head.starts_with("GET /hello?x=1 HTTP/1.1\r\n"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("proxy-connection"),
        "{head}"
    );
    let record = proxy.sink.find("web.test", port).await;
    assert_eq!(record["allowed"], true, "{record}");
    assert_eq!(record["code"], "allowed");
    assert_eq!(record["kind"], "http");
    assert_eq!(record["rule"], "web.test");
    assert_eq!(record["layer"], "profile");
    assert_eq!(record["address"], format!("127.0.0.1:{port}"));
    assert_eq!(
        (&record["client"], &record["session"], &record["command"]),
        (&"alice".into(), &"s1".into(), &"c7".into())
    );
    assert!(record["bytes_up"].as_u64().unwrap() > 20, "{record}");
    assert!(record["bytes_down"].as_u64().unwrap() > 20, "{record}");
    assert!(record["duration_ms"].as_f64().unwrap() >= 0.0);
    assert!(record["ts"].as_str().unwrap().ends_with('Z'), "{record}");

    // User info in the URI stays out of the Host sent on.
    let url = format!("http://user:secret@web.test:{port}/");
    let answer = exchange(proxy.addr, &get(&url, &format!("web.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    let head = heads.lock().unwrap()[1].clone();
    assert!(!head.contains("secret"), "{head}");

    // Denied: a name no rule allows (it resolves to the same server). Nothing reaches it.
    let url = format!("http://other.test:{port}/");
    let answer = exchange(proxy.addr, &get(&url, &format!("other.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert!(answer.contains("no allow rule covers"), "{answer}");
    assert_eq!(heads.lock().unwrap().len(), 2);
    let record = proxy.sink.find("other.test", port).await;
    assert_denied(&record, "not_allowed");
    assert_eq!(record["kind"], "http");
}

#[tokio::test]
async fn an_ip_literal_is_reached_only_through_a_cidr_rule() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    // Denied: an address no rule covers (TEST-NET-1, never dialed).
    let answer = exchange(
        proxy.addr,
        &get(
            &format!("http://192.0.2.1:{port}/"),
            &format!("192.0.2.1:{port}"),
        ),
    )
    .await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert_denied(&proxy.sink.find("192.0.2.1", port).await, "not_allowed");
    // Control: the loopback address the CIDR rule names.
    let answer = exchange(
        proxy.addr,
        &get(
            &format!("http://127.0.0.1:{port}/"),
            &format!("127.0.0.1:{port}"),
        ),
    )
    .await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    let record = proxy.sink.find("127.0.0.1", port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"127.0.0.0/8".into()),
        "{record}"
    );
    assert_eq!(heads.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_name_resolving_to_loopback_is_refused_without_the_cidr_rule() {
    let (port, heads) = web_server().await;
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    let bare = proxy(&["web.test"], false).await;
    let answer = exchange(bare.addr, &request).await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert!(answer.contains("loopback"), "{answer}");
    let record = bare.sink.find("web.test", port).await;
    assert_denied(&record, "special_address");
    assert_eq!(record["address"], format!("127.0.0.1:{port}"));
    assert!(heads.lock().unwrap().is_empty());
    // Control: the same name with loopback named by CIDR.
    let named = proxy(&["web.test", "127.0.0.0/8"], false).await;
    assert_eq!(
        status(&exchange(named.addr, &request).await),
        "HTTP/1.1 200 OK"
    );
    assert_eq!(named.sink.find("web.test", port).await["allowed"], true);
}

#[tokio::test]
async fn a_host_header_naming_another_host_than_the_uri_is_refused() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "other.test", "127.0.0.0/8"], false).await;
    let url = format!("http://web.test:{port}/");
    for host in [
        format!("other.test:{port}"),
        "web.test".to_string(),
        format!("web.test:{}", port + 1),
    ] {
        let answer = exchange(proxy.addr, &get(&url, &host)).await;
        assert_eq!(
            status(&answer),
            "HTTP/1.1 403 Forbidden",
            "Host {host}: {answer}"
        );
        assert!(answer.contains("Host header"), "{answer}");
    }
    assert_denied(&proxy.sink.find("web.test", port).await, "host_mismatch");
    assert!(heads.lock().unwrap().is_empty());
    // Control: the Host the URI names (case and trailing dot aside).
    let answer = exchange(proxy.addr, &get(&url, &format!("WEB.test.:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert_eq!(heads.lock().unwrap().len(), 1);
}

/// Generic over the stream: the proxy serves a Unix socket as it serves TCP.
#[tokio::test]
async fn the_proxy_serves_a_unix_socket() {
    let (port, _) = web_server().await;
    let allow = ["web.test", "127.0.0.0/8"];
    let s = setup(&allow, names(&["web.test"]), Vec::new(), Limits::default());
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    let answer = s.proxied(&request).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert_eq!(s.sink.find("web.test", port).await["allowed"], true);
}

/// Answers 127.0.0.1 and 10.0.0.1 by turns, as a name that rebinds between lookups.
struct Rebinding(std::sync::atomic::AtomicBool);

impl Resolver for Rebinding {
    fn resolve<'a>(&'a self, _: &'a str, _: u16) -> crate::egress::resolve::Lookup<'a> {
        let second = self.0.fetch_xor(true, std::sync::atomic::Ordering::SeqCst);
        let addr = if !second {
            LOOPBACK
        } else {
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))
        };
        Box::pin(async move { Ok(vec![addr]) })
    }
}

#[tokio::test]
async fn every_lookup_is_judged_so_a_name_that_rebinds_is_refused_at_its_new_address() {
    let (port, heads) = web_server().await;
    let rebinding = Arc::new(Rebinding(Default::default()));
    let s = setup(
        &["web.test", "127.0.0.0/8"],
        rebinding,
        Vec::new(),
        Limits::default(),
    );
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(status(&s.proxied(&request).await).to_string());
    }
    // The first lookup (loopback, named) is the control; the second (private) is refused.
    assert_eq!(answers, ["HTTP/1.1 200 OK", "HTTP/1.1 403 Forbidden"]);
    assert_eq!(heads.lock().unwrap().len(), 1);
    let records = s.sink.all(2).await;
    assert_eq!(records.len(), 2, "{records:?}");
    let refused = records.iter().find(|r| r["allowed"] == false).unwrap();
    assert_eq!(refused["code"], "special_address", "{refused}");
    assert_eq!(refused["address"], format!("10.0.0.1:{port}"));
}
