//! CONNECT: TLS passed through untouched, a ClientHello or Host naming another host refused,
//! the daemon's own listener, IPv6 and IPv4-mapped literals.

use super::*;

#[tokio::test]
async fn connect_passes_tls_through_and_refuses_a_client_hello_naming_another_host() {
    let (port, ca) = tls_server().await;
    let proxy = proxy(&["secure.test", "127.0.0.0/8"], false).await;
    let target = format!("secure.test:{port}");
    let (head, stream) = connect(proxy.addr, &target).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The handshake is end to end: the client verifies the server's own certificate.
    assert_eq!(
        tls_hello(stream, "secure.test", &ca).await.unwrap(),
        "hello tls"
    );
    let record = proxy.sink.find("secure.test", port).await;
    assert_eq!(
        (&record["allowed"], &record["kind"]),
        (&true.into(), &"connect".into()),
        "{record}"
    );
    assert!(record["bytes_up"].as_u64().unwrap() > 100, "{record}");
    assert!(record["bytes_down"].as_u64().unwrap() > 100, "{record}");

    // Denied: an SNI other than the CONNECT host (an allowed tunnel, a fronted name).
    let sneaky = self::proxy(&["secure.test", "127.0.0.0/8"], false).await;
    let (head, stream) = connect(sneaky.addr, &target).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(tls_hello(stream, "other.test", &ca).await.is_err());
    let record = sneaky.sink.find("secure.test", port).await;
    assert_eq!(record["allowed"], false, "{record}");
    assert_eq!(record["code"], "sni_mismatch", "{record}");
    assert!(
        record["reason"].as_str().unwrap().contains("other.test"),
        "{record}"
    );
    assert_eq!(
        record["bytes_up"], 0,
        "the ClientHello was not sent on: {record}"
    );

    // Denied: CONNECT to a name no rule allows, answered 403 with the reason.
    let (head, _) = connect(sneaky.addr, &format!("other.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert_denied(&sneaky.sink.find("other.test", port).await, "not_allowed");
}

#[tokio::test]
async fn connect_to_the_daemons_own_listener_is_refused_unless_a_rule_names_it() {
    let (web_port, _) = web_server().await;
    let proxy = proxy(&["127.0.0.0/8"], true).await;
    let own = proxy.addr;
    let (head, _) = connect(own, &own.to_string()).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let record = proxy.sink.find("127.0.0.1", own.port()).await;
    assert_denied(&record, "own_listener");
    assert_eq!(record["address"], own.to_string());
    // Controls: another port of the same address, and a rule naming the listener exactly.
    let (head, _) = connect(own, &format!("127.0.0.1:{web_port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let named = proxy_with(&["127.0.0.0/8"], true, |own, rules| {
        rules.push(own.to_string())
    })
    .await;
    let (head, _) = connect(named.addr, &named.addr.to_string()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let record = named.sink.find("127.0.0.1", named.addr.port()).await;
    assert_eq!(record["rule"], named.addr.to_string(), "{record}");
}

/// Whether the decision on a CONNECT allowed it, by its record: the tunnel may still fail
/// where the host has no IPv6 (502), which the decision does not depend on.
async fn connect_decision(proxy: &Proxy, target: &str, host: &str, port: u16) -> (String, Value) {
    let (head, _) = connect(proxy.addr, target).await;
    (status(&head).to_string(), proxy.sink.find(host, port).await)
}

#[tokio::test]
async fn ipv6_and_ipv4_mapped_literals_are_judged_like_the_addresses_they_reach() {
    let (port, _) = web_server().await;
    let v4 = proxy(&["web.test", "127.0.0.0/8"], false).await;
    // IPv6 loopback: 127.0.0.0/8 does not cover it, and ::/0 does not name it.
    let (status, record) = connect_decision(&v4, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "not_allowed");
    let all6 = proxy(&["::/0"], false).await;
    let (status, record) = connect_decision(&all6, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "special_address");
    // An IPv6 address no rule covers.
    let (status, record) =
        connect_decision(&v4, &format!("[2001:db8::1]:{port}"), "2001:db8::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "not_allowed");
    // Control: a rule naming ::1 allows it.
    let v6 = proxy(&["::1"], false).await;
    let (_, record) = connect_decision(&v6, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"::1".into()),
        "{record}"
    );

    // 127.0.0.1 written as IPv4-mapped IPv6 is loopback: refused under rules for every
    // public address of both families ...
    let mapped = "::ffff:127.0.0.1";
    let bare = proxy(&["0.0.0.0/0", "::/0"], false).await;
    let (status, record) =
        connect_decision(&bare, &format!("[{mapped}]:{port}"), mapped, port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "special_address");
    // ... and allowed by the rule naming loopback (control).
    let (_, record) = connect_decision(&v4, &format!("[{mapped}]:{port}"), mapped, port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"127.0.0.0/8".into()),
        "{record}"
    );
}

#[tokio::test]
async fn a_connect_whose_host_header_names_another_host_is_refused() {
    let (port, _) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let request = format!("CONNECT web.test:{port} HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert_denied(&proxy.sink.find("web.test", port).await, "host_mismatch");
    // Control: the same CONNECT with its own Host.
    let (head, _) = connect(proxy.addr, &format!("web.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}
