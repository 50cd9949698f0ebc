//! One test per row of the semantics in docs/profiles.md ("network"), each beside the rows it
//! differs from.

use super::*;
use crate::engine::ExecError;
use protocol::ErrorCode;
use sandbox::profile::Network;

fn profile(name: &str) -> Profile {
    Profile::builtin(name)
        .expect("a shipped profile")
        .expect("it parses")
}

fn policy(allow: &[&str], deny: &[&str]) -> Policy {
    let owned = |rules: &[&str]| rules.iter().map(|r| r.to_string()).collect::<Vec<_>>();
    parse_policy(&owned(allow), &owned(deny)).unwrap()
}

fn pypi() -> Policy {
    policy(&["pypi.org:443", "files.pythonhosted.org:443"], &[])
}

fn narrow() -> Policy {
    policy(&["pypi.org:443"], &["files.pythonhosted.org"])
}

fn get(profile: &Profile, client: &Mode, request: Option<&Mode>) -> Granted {
    effective_network(profile, client, request).unwrap()
}

fn none(note: bool) -> impl Fn(Granted) {
    move |granted: Granted| {
        assert_eq!(granted.effective, Effective::None);
        assert_eq!(!granted.note.is_empty(), note, "{granted:?}");
    }
}

#[test]
fn strict_gives_no_network_to_a_client_granted_none_or_host_whatever_the_request_asks() {
    let strict = profile("strict");
    for client in [Mode::None, Mode::Host] {
        none(false)(get(&strict, &client, None));
        none(false)(get(&strict, &client, Some(&Mode::None)));
        // The request asked for more than it got: the result says so.
        none(true)(get(&strict, &client, Some(&Mode::Host)));
        none(true)(get(&strict, &client, Some(&Mode::Policy(pypi()))));
    }
}

#[test]
fn strict_gives_a_client_policy_which_a_request_narrows_and_never_widens() {
    let strict = profile("strict");
    let client = Mode::Policy(pypi());
    // The control: the client's grant alone.
    let alone = get(&strict, &client, None);
    assert_eq!(
        alone.effective,
        Effective::Policy(vec![(Layer::Client, pypi())])
    );
    assert!(alone.note.is_empty());
    // `host` from the request is the client's policy, and the result says so.
    let host = get(&strict, &client, Some(&Mode::Host));
    assert_eq!(host.effective, alone.effective);
    assert!(host.note.contains("asked for host"), "{host:?}");
    // A request's policy is conjoined with the client's.
    assert_eq!(
        get(&strict, &client, Some(&Mode::Policy(narrow()))).effective,
        Effective::Policy(vec![(Layer::Client, pypi()), (Layer::Request, narrow())])
    );
    // And `none` is none.
    none(false)(get(&strict, &client, Some(&Mode::None)));
}

#[test]
fn task_container_gives_the_host_unless_a_client_or_request_policy_narrows_it() {
    let task = profile("task-container");
    // The control: today's behaviour.
    let host = get(&task, &Mode::Host, None);
    assert_eq!(host.effective, Effective::Host);
    assert_eq!(get(&task, &Mode::Host, Some(&Mode::Host)), host);
    assert_eq!(
        get(&task, &Mode::Host, Some(&Mode::Policy(narrow()))).effective,
        Effective::Policy(vec![(Layer::Request, narrow())])
    );
    assert_eq!(
        get(&task, &Mode::Policy(pypi()), None).effective,
        Effective::Policy(vec![(Layer::Client, pypi())])
    );
    assert_eq!(
        get(&task, &Mode::Policy(pypi()), Some(&Mode::Policy(narrow()))).effective,
        Effective::Policy(vec![(Layer::Client, pypi()), (Layer::Request, narrow())])
    );
    none(false)(get(&task, &Mode::Host, Some(&Mode::None)));
    none(false)(get(&task, &Mode::None, None));
    none(true)(get(&task, &Mode::None, Some(&Mode::Host)));
    none(true)(get(&task, &Mode::None, Some(&Mode::Policy(pypi()))));
}

#[test]
fn landlock_refuses_any_policy_with_the_reason_and_keeps_none() {
    let landlock = profile("landlock");
    // The control: none stays none.
    none(false)(get(&landlock, &Mode::Host, None));
    none(true)(get(&landlock, &Mode::Host, Some(&Mode::Host)));
    none(false)(get(&landlock, &Mode::Policy(pypi()), Some(&Mode::None)));
    let client = effective_network(&landlock, &Mode::Policy(pypi()), None).unwrap_err();
    assert_eq!(client.layer, Some(Layer::Client));
    assert!(
        client
            .message
            .contains("\"landlock\" has no network namespace"),
        "{client}"
    );
    assert_eq!(ExecError::from(client).code, ErrorCode::EnvironmentError);
    let request =
        effective_network(&landlock, &Mode::Host, Some(&Mode::Policy(pypi()))).unwrap_err();
    assert_eq!(request.layer, Some(Layer::Request));
    assert!(
        request.message.contains("without a way around it"),
        "{request}"
    );
    assert_eq!(ExecError::from(request).code, ErrorCode::BadRequest);
}

#[test]
fn trusted_has_no_namespace_to_hold_a_policy_either() {
    let trusted = profile("trusted");
    assert_eq!(get(&trusted, &Mode::Host, None).effective, Effective::Host);
    let refused =
        effective_network(&trusted, &Mode::Host, Some(&Mode::Policy(pypi()))).unwrap_err();
    assert!(refused.message.contains("\"trusted\""), "{refused}");
}

#[test]
fn a_profile_policy_is_conjoined_with_the_client_and_the_request() {
    let mut own = profile("task-container");
    own.network = Network::Policy {
        allow: pypi().allow,
        deny: Vec::new(),
        reason: "test".into(),
    };
    assert_eq!(
        get(&own, &Mode::Host, None).effective,
        Effective::Policy(vec![(Layer::Profile, pypi())])
    );
    assert_eq!(
        get(&own, &Mode::Policy(narrow()), Some(&Mode::Host)).effective,
        Effective::Policy(vec![(Layer::Profile, pypi()), (Layer::Client, narrow())])
    );
    assert_eq!(
        get(&own, &Mode::Host, Some(&Mode::Policy(narrow()))).effective,
        Effective::Policy(vec![(Layer::Profile, pypi()), (Layer::Request, narrow())])
    );
    none(false)(get(&own, &Mode::Host, Some(&Mode::None)));
}

#[test]
fn a_policy_can_be_had_where_a_namespace_holds_the_command_and_nowhere_else() {
    assert_eq!(policy_support(&profile("strict")), Ok(()));
    assert_eq!(policy_support(&profile("task-container")), Ok(()));
    for without in ["landlock", "trusted"] {
        let why = policy_support(&profile(without)).unwrap_err();
        assert!(why.contains("no network namespace"), "{without}: {why}");
    }
}

#[test]
fn a_bad_rule_is_named_in_the_error() {
    let bad = RequestNetwork::Policy {
        allow: vec!["pypi.org:443".into(), "pypi.org:99999".into()],
        deny: Vec::new(),
    };
    let err = parse(&bad).unwrap_err().to_string();
    assert!(err.contains("pypi.org:99999"), "{err}");
    let deny = RequestNetwork::Policy {
        allow: vec!["pypi.org".into()],
        deny: vec!["*".into()],
    };
    assert!(parse(&deny).unwrap_err().to_string().contains("\"*\""));
    assert_eq!(parse(&RequestNetwork::Host {}).unwrap(), Mode::Host);
    assert_eq!(parse(&RequestNetwork::None {}).unwrap(), Mode::None);
}

#[test]
fn reports_name_the_mode_and_every_layers_rules() {
    let strict = profile("strict");
    let granted = get(
        &strict,
        &Mode::Policy(pypi()),
        Some(&Mode::Policy(narrow())),
    );
    let report = report(&granted);
    assert_eq!(report.mode, "policy");
    assert_eq!(
        report.layers,
        [
            NetworkLayer {
                layer: "client".into(),
                allow: vec!["pypi.org:443".into(), "files.pythonhosted.org:443".into()],
                deny: Vec::new(),
            },
            NetworkLayer {
                layer: "request".into(),
                allow: vec!["pypi.org:443".into()],
                deny: vec!["files.pythonhosted.org".into()],
            },
        ]
    );
    assert_eq!(client_report(&Mode::Host).mode, "host");
    assert_eq!(client_report(&Mode::None).mode, "none");
    assert_eq!(client_report(&Mode::Policy(pypi())).layers.len(), 1);
    let strict = profile_report(&strict);
    assert_eq!(strict.mode, "none");
    assert!(strict.policy_enforceable, "{strict:?}");
    assert!(strict.policy_reason.is_empty(), "{strict:?}");
    let landlock = profile_report(&profile("landlock"));
    assert!(!landlock.policy_enforceable);
    assert!(landlock.policy_reason.contains("no network namespace"));
    assert_eq!(profile_report(&profile("task-container")).mode, "host");
}

#[test]
fn a_command_granted_none_under_a_host_profile_gets_a_namespace_of_its_own() {
    let task = profile("task-container");
    // The control: the host's network, the profile as it is.
    let host = get(&task, &Mode::Host, None);
    assert_eq!(narrowed_profile(&task, &host).unwrap(), None);
    let none = get(&task, &Mode::None, None);
    let narrowed = narrowed_profile(&task, &none).unwrap().unwrap();
    assert_eq!(narrowed.network, Network::None);
    assert!(narrowed.namespaces.contains(&Namespace::Net));
    // Strict and landlock already have none: unchanged.
    for name in ["strict", "landlock"] {
        let p = profile(name);
        assert_eq!(
            narrowed_profile(&p, &get(&p, &Mode::None, None)).unwrap(),
            None
        );
    }
    // Trusted has no namespace to hold the command: refused rather than run with the host's.
    let trusted = profile("trusted");
    let err =
        ExecError::from(narrowed_profile(&trusted, &get(&trusted, &Mode::None, None)).unwrap_err());
    assert_eq!(err.code, ErrorCode::EnvironmentError);
    assert!(err.message.contains("\"trusted\""), "{err:?}");
}
