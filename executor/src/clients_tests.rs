//! Tests of the clients file: tokens, profiles, workspaces, identities and the per-client limits.

use super::*;

fn profiles() -> BTreeMap<String, Profile> {
    Profile::all_builtin()
        .unwrap()
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect()
}

fn table(json: &str) -> Result<ClientTable, String> {
    let file: ClientsFile = serde_json::from_str(json).map_err(|e| e.to_string())?;
    ClientTable::from_entries(file.clients, &profiles())
}

const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

#[test]
fn tokens_and_digests_authenticate_their_client_only() {
    let b_digest = hex::encode(Sha256::digest(B.as_bytes()));
    let t = table(&format!(
        r#"{{"clients":[{{"name":"a","token":"{A}"}},{{"name":"b","token_sha256":"{b_digest}"}}]}}"#
    ))
    .unwrap();
    let auth = |token: &str| {
        t.authenticate(format!("Bearer {token}").as_bytes())
            .map(|c| c.name.clone())
    };
    assert_eq!(auth(A).as_deref(), Some("a"));
    assert_eq!(auth(B).as_deref(), Some("b"));
    assert_eq!(auth(&A[1..]), None);
    assert_eq!(auth(&format!("{A}x")), None);
    assert_eq!(auth(&b_digest), None, "the digest is not the token");
    assert!(t.authenticate(A.as_bytes()).is_none(), "no Bearer prefix");
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    let cases = [
        (r#"{"clients":[]}"#.to_string(), "no clients"),
        (r#"{"clients":[{"name":"a"}]}"#.to_string(), "exactly one"),
        (
            r#"{"clients":[{"name":"a","token":"short"}]}"#.to_string(),
            "shorter",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}"}},{{"name":"a","token":"{B}"}}]}}"#),
            "twice",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}"}},{{"name":"b","token":"{A}"}}]}}"#),
            "another client",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a/b","token":"{A}"}}]}}"#),
            "must be",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}","profiles":["nope"]}}]}}"#),
            "no profile",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}","workspace":"per_client"}}]}}"#),
            "trusted",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}","max_concurrent":0}}]}}"#),
            "allows nothing",
        ),
        (
            format!(r#"{{"clients":[{{"name":"a","token":"{A}","tokn":"x"}}]}}"#),
            "tokn",
        ),
    ];
    for (json, needle) in cases {
        let err = table(&json).err().unwrap_or_default();
        assert!(err.contains(needle), "{json}: {err:?} lacks {needle:?}");
    }
    // Control: private workspaces with confining profiles only are fine.
    table(&format!(
        r#"{{"clients":[{{"name":"a","token":"{A}","workspace":"per_client","profiles":["strict","landlock"]}}]}}"#
    ))
    .unwrap();
}

#[test]
fn a_profile_that_writes_what_others_run_cannot_share_a_daemon_with_a_private_workspace() {
    let private = r#"{"name":"p","token":"PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPP","workspace":"per_client","profiles":["strict","landlock"]}"#;
    for other in ["task-container", "trusted"] {
        let err = table(&format!(
            r#"{{"clients":[{private},{{"name":"w","token":"{A}","profiles":["strict","{other}"]}}]}}"#
        ))
        .err()
        .unwrap_or_default();
        assert!(
            err.contains(&format!("client \"w\" may use profile \"{other}\""))
                && err.contains("private workspace"),
            "{other}: {err}"
        );
    }
    // A client with no profiles list may use every profile, task-container included.
    let err = table(&format!(
        r#"{{"clients":[{private},{{"name":"w","token":"{A}"}}]}}"#
    ))
    .err()
    .unwrap_or_default();
    assert!(err.contains("may use profile"), "{err}");
    // Controls: the same writer without any private workspace, and the private client with
    // a neighbour confined to filtered profiles.
    table(&format!(
        r#"{{"clients":[{{"name":"w","token":"{A}","profiles":["task-container"]}},{{"name":"s","token":"{B}"}}]}}"#
    ))
    .unwrap();
    table(&format!(
        r#"{{"clients":[{private},{{"name":"w","token":"{A}","profiles":["strict","landlock"]}}]}}"#
    ))
    .unwrap();
}

#[test]
fn a_client_uid_that_is_a_group_of_the_host_is_refused() {
    // A gid of the host with no user of the same number (ssl-cert, shadow on Debian).
    let accounts = crate::accounts::Accounts::read();
    let Some(gid) = (1..60000u32)
        .find(|n| accounts.group_named(*n).is_some() && accounts.user_named(*n).is_none())
    else {
        return;
    };
    let err = table(&format!(
        r#"{{"clients":[{{"name":"g","token":"{A}","workspace":"per_client","profiles":["strict"],"uid":{gid}}}]}}"#
    ))
    .err()
    .unwrap_or_default();
    assert!(err.contains("group"), "{gid}: {err}");
    // Control: a number nobody uses.
    table(&format!(
        r#"{{"clients":[{{"name":"g","token":"{A}","workspace":"per_client","profiles":["strict"],"uid":61111}}]}}"#
    ))
    .unwrap();
}

#[test]
fn limits_refuse_with_their_own_code_and_free_slots_on_drop() {
    let usage = Arc::new(Usage::default());
    let limits = ClientLimits {
        max_concurrent: Some(2),
        commands_per_minute: Some(3),
        output_quota_bytes: Some(100),
        ..ClientLimits::default()
    };
    let one = usage.admit("c", &limits).unwrap();
    let two = usage.admit("c", &limits).unwrap();
    let busy = usage.admit("c", &limits).unwrap_err();
    assert_eq!((busy.code, busy.limit), (ErrorCode::Busy, "concurrency"));
    assert_eq!(usage.running(), 2, "a refused command holds no slot");
    drop(one);
    let three = usage.admit("c", &limits).unwrap();
    drop((two, three));
    let rate = usage.admit("c", &limits).unwrap_err();
    assert_eq!((rate.code, rate.limit), (ErrorCode::QuotaExceeded, "rate"));
    assert!(rate.message.contains("retry in"), "{}", rate.message);
    usage.add_output(100);
    let quota = usage.admit("c", &limits).unwrap_err();
    assert_eq!(quota.limit, "output_quota");
    assert_eq!(usage.running(), 0);
}

#[test]
fn the_bucket_refills_evenly() {
    let start = Instant::now();
    let mut bucket = Bucket {
        tokens: 0.0,
        at: start,
    };
    let wait = bucket.take(60, start).unwrap_err();
    assert!((wait.as_secs_f64() - 1.0).abs() < 1e-6, "{wait:?}");
    assert!(bucket.take(60, start + Duration::from_millis(1001)).is_ok());
    assert!(bucket
        .take(60, start + Duration::from_millis(1002))
        .is_err());
    // Never more than a minute's worth.
    assert!(bucket.take(60, start + Duration::from_secs(3600)).is_ok());
    assert!(bucket.tokens <= 59.0);
}

#[test]
fn a_disk_quota_is_a_private_workspace_clients_own_and_large_enough_for_ext4() {
    let quota = |extra: &str, workspace: &str| {
        table(&format!(
            r#"{{"clients":[{{"name":"q","token":"{A}","workspace":"{workspace}","profiles":["strict"]{extra}}}]}}"#
        ))
        .map(|t| t.clients[0].limits.disk_quota)
    };
    assert_eq!(
        quota(
            r#","disk_quota_bytes":16777216,"disk_quota_files":100"#,
            "per_client"
        ),
        Ok(Some(crate::disk_quota::DiskQuota {
            bytes: 16 << 20,
            files: 100
        }))
    );
    assert_eq!(quota("", "per_client"), Ok(None));
    let err = |r: Result<_, String>| r.err().unwrap_or_default();
    // Sharing the workspace means sharing its quota (the daemon's flags).
    assert!(err(quota(r#","disk_quota_bytes":16777216"#, "shared")).contains("shares its quota"));
    assert!(err(quota(r#","disk_quota_bytes":1024"#, "per_client")).contains("smallest"));
    assert!(err(quota(r#","disk_quota_files":100"#, "per_connection")).contains("byte quota"));
}

#[test]
fn a_network_entry_is_the_clients_ceiling_and_a_bad_one_is_refused_naming_the_rule() {
    let t = table(&format!(
        r#"{{"clients":[
            {{"name":"open","token":"{A}"}},
            {{"name":"pypi","token":"{B}","network":{{"mode":"policy","allow":["pypi.org:443","files.pythonhosted.org:443"],"deny":["evil.pypi.org"]}}}}
        ]}}"#
    ))
    .unwrap();
    let network = |name: &str| {
        t.clients
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.network.clone())
            .unwrap()
    };
    // The control: no entry, no filter of the client's own.
    assert_eq!(network("open"), Mode::Host);
    let Mode::Policy(policy) = network("pypi") else {
        panic!("{:?}", network("pypi"));
    };
    assert_eq!(policy.allow.len(), 2);
    assert_eq!(policy.deny[0].to_string(), "evil.pypi.org");
    for (entry, expected) in [
        (
            r#"{"mode":"policy","allow":["pypi.org:70000"]}"#,
            "client \"a\": network: rule \"pypi.org:70000\"",
        ),
        (r#"{"mode":"policy","allow":[]}"#, "allows nothing"),
        (
            r#"{"mode":"policy","allow":["a.org"],"deny":["*"]}"#,
            "\"*\"",
        ),
    ] {
        let err = table(&format!(
            r#"{{"clients":[{{"name":"a","token":"{A}","network":{entry}}}]}}"#
        ))
        .unwrap_err();
        assert!(err.contains(expected), "{entry}: {err}");
    }
    // A policy landlock can never enforce still loads: its commands are refused there.
    assert!(table(&format!(
        r#"{{"clients":[{{"name":"a","token":"{A}","profiles":["landlock"],"network":{{"mode":"policy","allow":["pypi.org"]}}}}]}}"#
    ))
    .is_ok());
}
