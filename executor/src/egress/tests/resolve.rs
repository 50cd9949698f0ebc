//! Resolvers, the decision log file, and how a Host or authority is matched to a target.

use super::*;

use crate::egress::record::JsonLinesFile;
use crate::egress::resolve::SystemResolver;

#[tokio::test]
async fn the_system_resolver_reads_the_hosts_file() {
    let addrs = SystemResolver::default()
        .resolve("localhost", 80)
        .await
        .unwrap();
    assert!(
        addrs.iter().all(|a| a.is_loopback()) && !addrs.is_empty(),
        "{addrs:?}"
    );
    // Control: the override resolver answers only the names it was given.
    let mut resolver = OverrideResolver::new(None);
    resolver.set("Web.Test.", vec![LOOPBACK]);
    assert_eq!(
        resolver.resolve("web.test", 80).await.unwrap(),
        vec![LOOPBACK]
    );
    assert!(resolver.resolve("localhost", 80).await.is_err());
}

#[test]
fn decision_records_are_appended_to_a_file_one_json_line_each() {
    let path = std::env::temp_dir().join(format!("egress-log-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let file = JsonLinesFile::open(&path).unwrap();
    let mut record = DecisionRecord {
        ts: "2026-01-01T00:00:00.000Z".into(),
        client: "alice".into(),
        session: "s1".into(),
        command: "c1".into(),
        kind: "connect",
        host: "pypi.org".into(),
        port: 443,
        address: Some("151.101.0.223:443".into()),
        layer: Some(Layer::Request),
        rule: Some("pypi.org:443".into()),
        allowed: true,
        code: "allowed",
        reason: "allowed by rule".into(),
        error: None,
        bytes_up: 517,
        bytes_down: 4096,
        duration_ms: 12.5,
    };
    file.record(&record);
    record.host = "evil.org".into();
    record.allowed = false;
    file.record(&record);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["host"], "pypi.org");
    assert_eq!(lines[0]["layer"], "request");
    assert_eq!(lines[1]["allowed"], false);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn an_authority_names_the_target_only_with_the_same_host_and_port() {
    use crate::egress::authority_matches;
    use sandbox::network::Host;
    let web = Host::parse("web.test").unwrap();
    let v6 = Host::parse("::1").unwrap();
    assert!(authority_matches(b"web.test:8080", &web, 8080, Some(80)));
    assert!(authority_matches(b"WEB.test.:8080", &web, 8080, Some(80)));
    assert!(authority_matches(b"web.test", &web, 80, Some(80)));
    assert!(
        authority_matches(b"web.test", &web, 8080, None),
        "a tunnel's port is fixed"
    );
    assert!(authority_matches(b"[::1]:443", &v6, 443, None));
    for (value, port) in [
        (&b"web.test"[..], 8080),
        (b"web.test:8081", 8080),
        (b"other.test:8080", 8080),
        (b"user@web.test:8080", 8080),
        (b"web.test:8080/x", 8080),
        (b"\xffweb.test", 8080),
        (b"", 8080),
    ] {
        let text = String::from_utf8_lossy(value);
        assert!(
            !authority_matches(value, &web, port, Some(80)),
            "{text}:{port}"
        );
    }
    assert!(!authority_matches(b"[::2]:443", &v6, 443, None));
}
