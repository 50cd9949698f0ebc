//! `GET /metrics`: only for the token's holder, and every number in it matches what the
//! clients saw (results, errors, connections), read from the parsed exposition.

use std::collections::BTreeMap;
use std::time::Duration;

use executor_tests::{eventually, http_get, req, Client, Daemon, PATIENCE};
use protocol::{CancelRequest, ClientMessage, Ending, ErrorCode, ExecResult, ServerMessage};

/// One scrape, parsed: every sample as (name, labels, value).
struct Scrape(Vec<(String, BTreeMap<String, String>, f64)>);

impl Scrape {
    async fn of(daemon: &Daemon) -> Self {
        let auth = format!("Bearer {}", daemon.token);
        let resp = http_get(daemon.addr, "/metrics", Some(&auth))
            .await
            .unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{resp}");
        Self::parse(body)
    }

    /// Parse the OpenMetrics text `name{k="v",...} value` lines, checking it ends with `# EOF`.
    fn parse(text: &str) -> Self {
        assert!(text.ends_with("# EOF\n"), "no EOF marker:\n{text}");
        let mut samples = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let value: f64 = match value {
                "+Inf" => f64::INFINITY,
                v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
            };
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), BTreeMap::new()),
                Some((name, rest)) => (name.to_string(), parse_labels(rest, line)),
            };
            samples.push((name, labels, value));
        }
        Self(samples)
    }

    /// Value of the sample `name` with exactly `labels`; fails the test if there is none.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.0
            .iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|(_, _, v)| *v)
            .unwrap_or_else(|| panic!("no sample {name}{want:?} in {:#?}", self.0))
    }

    /// Every sample named `name`.
    fn all(&self, name: &str) -> Vec<(&BTreeMap<String, String>, f64)> {
        self.0
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, l, v)| (l, *v))
            .collect()
    }

    fn sum(&self, name: &str) -> f64 {
        self.all(name).iter().map(|(_, v)| v).sum()
    }
}

/// `k="v",k2="v2"}` -> map, undoing the escapes of label values (`\\`, `\"`, `\n`).
fn parse_labels(rest: &str, line: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut chars = rest.chars();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "{line}");
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => panic!("{line}"),
                },
                c => value.push(c),
            }
        }
        labels.insert(key, value);
        match chars.next() {
            Some(',') => continue,
            Some('}') => return labels,
            other => panic!("{line}: unexpected {other:?}"),
        }
    }
}

/// Scrape until `cond` holds; fails the test after [`PATIENCE`].
async fn scrape_until(daemon: &Daemon, cond: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let scrape = Scrape::of(daemon).await;
        if cond(&scrape) {
            return scrape;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the metrics never got there: {:#?}",
            scrape.0
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn metrics_status(daemon: &Daemon, auth: Option<&str>) -> String {
    http_get(daemon.addr, "/metrics", auth).await.unwrap()
}

#[tokio::test]
async fn metrics_need_the_bearer_token_and_health_checks_still_do_not() {
    let daemon = Daemon::start();
    let token = &daemon.token;
    for auth in [
        None,
        Some(format!("Bearer {}", &token[..32])),
        Some(format!("Bearer {token}x")),
        Some(format!("Basic {token}")),
        Some(token.clone()),
    ] {
        let resp = metrics_status(&daemon, auth.as_deref()).await;
        assert!(resp.starts_with("HTTP/1.1 401"), "{auth:?}: {resp}");
        assert!(!resp.contains("executor_"), "{auth:?}: {resp}");
    }
    // Allowed twin: the exact token gets the exposition, typed as OpenMetrics.
    let resp = metrics_status(&daemon, Some(&format!("Bearer {token}"))).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let head = resp.split_once("\r\n\r\n").unwrap().0.to_ascii_lowercase();
    assert!(
        head.contains(
            "\r\ncontent-type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\n"
        ),
        "{head}"
    );
    let scrape = Scrape::of(&daemon).await;
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        scrape.get("executor_build_info", &[("version", version)]),
        1.0
    );
    // The health checks stay open, and the token never reaches the log.
    for path in ["/healthz", "/readyz"] {
        let resp = http_get(daemon.addr, path, None).await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{path}: {resp}");
    }
    // The log is written by a thread of its own: wait for the line (a fast build answers
    // before the line is written).
    assert!(
        eventually(PATIENCE, || daemon
            .log()
            .contains("rejected metrics scrape"))
        .await
    );
    assert!(!daemon.log().contains(token.as_str()));
}

#[tokio::test]
async fn metrics_count_every_outcome_connection_byte_and_limit_exactly() {
    // A profile with a cgroup limit of 4 processes, to hit a limit the result reports.
    let profiles = executor_tests::TempDir::new().unwrap();
    let trusted = include_str!("../../../sandbox-profiles/trusted.json");
    let mut few: serde_json::Value = serde_json::from_str(trusted).unwrap();
    few["name"] = "few".into();
    few["limits"]["processes"] = 4.into();
    std::fs::write(profiles.path().join("few.json"), few.to_string()).unwrap();
    let daemon = Daemon::start_with(&[
        "--profiles-dir",
        profiles.path().to_str().unwrap(),
        "--allow-profile",
        "strict",
        "--allow-profile",
        "few",
        "--max-output-bytes",
        "1000",
    ]);
    let client = [("client", "default")];

    // Before any connection: the known client is shown at zero.
    let scrape = Scrape::of(&daemon).await;
    assert_eq!(scrape.get("executor_connections_open", &[]), 0.0);
    assert_eq!(scrape.get("executor_connections_total", &client), 0.0);
    assert_eq!(scrape.get("executor_commands_in_flight", &client), 0.0);
    assert_eq!(scrape.get("executor_output_bytes_total", &client), 0.0);

    let mut a = daemon.connect().await;
    let default = a.hello.default_profile.clone();
    assert!(!default.is_empty(), "{:?}", a.hello.profiles);
    let scrape = Scrape::of(&daemon).await;
    assert_eq!(scrape.get("executor_connections_open", &[]), 1.0);
    assert_eq!(scrape.get("executor_connections_total", &client), 1.0);

    let mut results: Vec<ExecResult> = Vec::new();
    // Exited, twice; the second writes 3000 bytes, more than the 1000 kept.
    let one = a.run("one", "echo one").await;
    assert_eq!(one.extra.ended, Ending::Exited);
    results.push(one);
    let long = a
        .run("long", "head -c 3000 /dev/zero | tr '\\0' x; exit 3")
        .await;
    assert_eq!(
        (long.extra.ended, long.returncode, long.extra.output_bytes),
        (Ending::Exited, 3, 3000)
    );
    assert!(long.extra.truncated);
    results.push(long);
    // Timed out.
    let mut r = req("slow", "sleep 30");
    r.timeout = Some(0.3);
    let slow = a.exec(r).await.result.unwrap();
    assert_eq!(slow.extra.ended, Ending::TimedOut);
    results.push(slow);
    // Cancelled once it has started.
    let mut r = req("stop", "echo started; sleep 30");
    r.stream = true;
    a.send(&ClientMessage::Exec(r)).await;
    match a.recv().await {
        Some(ServerMessage::Output(chunk)) => assert_eq!(chunk.data, "started\n"),
        other => panic!("expected output, got {other:?}"),
    }
    a.send(&ClientMessage::Cancel(CancelRequest { id: "stop".into() }))
        .await;
    let stop = a.collect("stop").await.result.unwrap();
    assert_eq!(stop.extra.ended, Ending::Cancelled);
    results.push(stop);
    // Signaled.
    let killed = a.run("killed", "kill -9 $$").await;
    assert_eq!(killed.extra.ended, Ending::Signaled);
    results.push(killed);
    // Ran into the profile's process limit: bash retries the refused forks until the
    // earlier sleeps are gone, so it still exits.
    let mut r = req(
        "forks",
        "for i in 1 2 3 4 5 6 7 8; do sleep 0.3 & done; wait",
    );
    r.profile = Some("few".into());
    let forks = a.exec(r).await.result.unwrap();
    assert_eq!(forks.extra.ended, Ending::Exited, "{forks:?}");
    assert_eq!(forks.extra.limits_hit, ["processes"], "{forks:?}");
    results.push(forks);
    // Refused: a profile that does not exist, an id over the limit.
    let mut r = req("nope", "true");
    r.profile = Some("no-such-profile".into());
    let err = a.exec(r).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::ProfileDenied);
    let long_id = "x".repeat(a.hello.limits.max_id_bytes + 1);
    let err = a.exec(req(&long_id, "true")).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);

    // A second client leaves while its command runs: the command ends as disconnected, and the
    // connection and the command leave the gauges.
    let mut b = Client::connect(&daemon.url, Some(&daemon.token))
        .await
        .unwrap();
    b.send(&ClientMessage::Exec(req("orphan", "sleep 30")))
        .await;
    let scrape = Scrape::of(&daemon).await;
    assert_eq!(scrape.get("executor_connections_open", &[]), 2.0);
    assert_eq!(scrape.get("executor_connections_total", &client), 2.0);
    scrape_until(&daemon, |s| {
        s.get("executor_commands_in_flight", &client) == 1.0
    })
    .await;
    drop(b);
    let disconnected = [
        ("client", "default"),
        ("profile", default.as_str()),
        ("outcome", "disconnected"),
    ];
    let scrape = scrape_until(&daemon, |s| {
        s.get("executor_connections_open", &[]) == 1.0
            && s.all("executor_commands_total")
                .iter()
                .any(|(l, _)| l.get("outcome").is_some_and(|o| o == "disconnected"))
    })
    .await;

    // Commands by outcome: exactly these series, with exactly these counts.
    let commands = |profile: &str, outcome: &str| {
        scrape.get(
            "executor_commands_total",
            &[
                ("client", "default"),
                ("profile", profile),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(commands(&default, "exited"), 2.0);
    assert_eq!(commands("few", "exited"), 1.0);
    assert_eq!(commands(&default, "timed_out"), 1.0);
    assert_eq!(commands(&default, "cancelled"), 1.0);
    assert_eq!(commands(&default, "signaled"), 1.0);
    assert_eq!(scrape.get("executor_commands_total", &disconnected), 1.0);
    assert_eq!(commands("", "refused"), 2.0);
    assert_eq!(scrape.sum("executor_commands_total"), 9.0);
    for (code, n) in [("profile_denied", 1.0), ("bad_request", 1.0)] {
        let labels = [("client", "default"), ("code", code)];
        assert_eq!(scrape.get("executor_refusals_total", &labels), n);
    }
    assert_eq!(scrape.sum("executor_refusals_total"), 2.0);
    assert!(scrape.all("executor_command_errors_total").is_empty());

    // Nothing in flight; the true output bytes of every result (the orphan wrote none).
    assert_eq!(scrape.get("executor_commands_in_flight", &client), 0.0);
    let bytes: u64 = results.iter().map(|r| r.extra.output_bytes).sum();
    assert!(bytes >= 3004, "{bytes}");
    assert_eq!(
        scrape.get("executor_output_bytes_total", &client),
        bytes as f64
    );

    // One duration per finished command (seven, the orphan's included), none for refusals.
    let count = |profile: &str| {
        scrape.get(
            "executor_command_duration_seconds_count",
            &[("profile", profile)],
        )
    };
    assert_eq!(count(&default), 6.0);
    assert_eq!(count("few"), 1.0);
    assert_eq!(scrape.sum("executor_command_duration_seconds_count"), 7.0);
    let inf = [("profile", default.as_str()), ("le", "+Inf")];
    assert_eq!(
        scrape.get("executor_command_duration_seconds_bucket", &inf),
        6.0
    );
    let seen: f64 = results
        .iter()
        .filter(|r| r.extra.isolation.profile == default)
        .map(|r| r.extra.duration_ms / 1000.0)
        .sum();
    let sum = scrape.get(
        "executor_command_duration_seconds_sum",
        &[("profile", &default)],
    );
    // The orphan's duration is in the sum too, and it ran for a moment at least.
    assert!(
        sum > seen && sum < seen + PATIENCE.as_secs_f64(),
        "{sum} {seen}"
    );

    // Limits: the timeout, the process limit, the output cut; nothing else.
    for limit in ["timeout", "processes", "output"] {
        let labels = [("client", "default"), ("limit", limit)];
        assert_eq!(scrape.get("executor_limit_hits_total", &labels), 1.0);
    }
    assert_eq!(scrape.sum("executor_limit_hits_total"), 3.0);

    // The last client leaves.
    drop(a);
    let scrape = scrape_until(&daemon, |s| s.get("executor_connections_open", &[]) == 0.0).await;
    assert_eq!(scrape.get("executor_connections_total", &client), 2.0);
    assert_eq!(scrape.sum("executor_commands_total"), 9.0);
}
