//! `agent deploy k8s` writes manifests that Kubernetes' own schemas accept: validated offline
//! with PyPI's kubernetes-validate (`--strict`: unknown fields are errors), since there is no
//! cluster here. agent-sandbox's objects are custom resources the tool has no schema for: the
//! pod inside each is validated as a Pod, and their own fields are checked here against
//! agent-sandbox's API reference.

use std::path::{Path, PathBuf};
use std::process::Command;

use executor_tests::{binary, require};
use serde_json::Value;

/// kubernetes-validate: `$KUBERNETES_VALIDATE` (set by .ci/run), else on PATH.
fn validator() -> Option<PathBuf> {
    let path = std::env::var_os("KUBERNETES_VALIDATE")
        .map(PathBuf::from)
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", "command -v kubernetes-validate"])
                .output()
                .ok()?;
            let found = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (!found.is_empty()).then(|| PathBuf::from(found))
        });
    let ok = path.as_ref().is_some_and(|p| p.exists());
    if !require(
        "kubernetes-validate (pip install kubernetes-validate; .ci/run makes a venv)",
        ok,
    ) {
        return None;
    }
    path
}

fn validate(validator: &Path, doc: &Value, dir: &Path, name: &str) -> (bool, String) {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, serde_norway::to_string(doc).unwrap()).unwrap();
    let out = Command::new(validator)
        .args(["--strict"])
        .arg(&file)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (
        out.status.success() && !text.contains("ERROR") && !text.contains("WARN"),
        text,
    )
}

fn docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    use serde::Deserialize;
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn pods_secrets_and_agent_sandbox_templates_pass_kubernetes_schemas() {
    let Some(validator) = validator() else { return };
    let dir = executor_tests::TempDir::new().unwrap();
    let out = dir.path().join("manifests");
    let instances = dir.path().join("instances.jsonl");
    std::fs::write(
        &instances,
        "{\"instance_id\": \"Django__django-11099\", \"problem_statement\": \"x\"}\n\
         {\"instance_id\": \"astropy__astropy-12907\", \"image_name\": \"example.org/astropy:1\"}\n\
         {\"instance_id\": \"astropy__astropy-13033\", \"image_name\": \"example.org/astropy:1\"}\n",
    )
    .unwrap();
    let status = Command::new(binary("agent"))
        .args(["deploy", "k8s", "--subset"])
        .arg(&instances)
        .args([
            "--executor-image",
            "example.org/executor:1",
            "--workspace",
            "/testbed",
            "-o",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let scratch = dir.path().join("validate");
    std::fs::create_dir(&scratch).unwrap();
    let mut pods = 0;
    for name in [
        "django--django-11099",
        "astropy--astropy-12907",
        "astropy--astropy-13033",
    ] {
        let all = docs(&out.join(format!("{name}.yaml")));
        let kinds: Vec<&str> = all.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["Secret", "Pod"]);
        for (i, doc) in all.iter().enumerate() {
            let (ok, text) = validate(&validator, doc, &scratch, &format!("{name}-{i}"));
            assert!(ok, "{name} {}: {text}", doc["kind"]);
        }
        let pod = &all[1];
        // The executor comes from the init container's copy, read-only in the task's container.
        let task = &pod["spec"]["containers"][0];
        assert_eq!(task["command"][0], "/.executor/executor");
        assert!(task["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["readOnly"] == true));
        assert_eq!(
            pod["spec"]["initContainers"][0]["image"],
            "example.org/executor:1"
        );
        let info: Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert!(info["tls_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"));
        pods += 1;
    }
    assert_eq!(pods, 3);
    // SWE-bench's image naming for an instance without one.
    let django = docs(&out.join("django--django-11099.yaml"));
    assert_eq!(
        django[1]["spec"]["containers"][0]["image"],
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    );

    check_agent_sandbox(&validator, &out, &scratch);
    // A broken manifest fails the same check (the validator is not a rubber stamp).
    let mut broken = django[1].clone();
    broken["spec"]["containers"][0]["imagePullPolicyy"] = Value::from("Always");
    let (ok, _) = validate(&validator, &broken, &scratch, "broken");
    assert!(!ok, "an unknown field passed --strict validation");
}

/// agent-sandbox's objects: a Secret, SandboxTemplate and SandboxWarmPool per distinct image
/// (two images for three instances), and a SandboxClaim per instance naming its image's
/// template. What Kubernetes' schemas cover (Secrets, the pod inside each template, its
/// network policy) is validated; the custom resources' own fields are checked against
/// agent-sandbox's v1alpha1 types (`extensions/api/v1alpha1/*_types.go` upstream).
fn check_agent_sandbox(validator: &Path, out: &Path, scratch: &Path) {
    use std::collections::BTreeMap;
    let django_image = "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest";
    let astropy_image = "example.org/astropy:1";
    let pools = docs(&out.join("agent-sandbox.yaml"));
    let kinds: Vec<&str> = pools.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "Secret",
            "SandboxTemplate",
            "SandboxWarmPool",
            "Secret",
            "SandboxTemplate",
            "SandboxWarmPool"
        ]
    );
    let allowed = |kind: &str| -> &[&str] {
        match kind {
            "SandboxTemplate" => &[
                "podTemplate",
                "volumeClaimTemplates",
                "networkPolicy",
                "networkPolicyManagement",
                "envVarsInjectionPolicy",
                "service",
            ],
            "SandboxWarmPool" => &["replicas", "sandboxTemplateRef", "updateStrategy"],
            "SandboxClaim" => &[
                "sandboxTemplateRef",
                "lifecycle",
                "warmpool",
                "additionalPodMetadata",
                "env",
            ],
            other => panic!("unexpected kind {other}"),
        }
    };
    let check_fields = |doc: &Value| {
        let kind = doc["kind"].as_str().unwrap();
        assert_eq!(doc["apiVersion"], "extensions.agents.x-k8s.io/v1alpha1");
        for key in doc["spec"].as_object().unwrap().keys() {
            assert!(allowed(kind).contains(&key.as_str()), "{kind}.spec.{key}");
        }
    };
    // Template name -> (image, the Secret's token).
    let mut templates: BTreeMap<String, (String, String)> = BTreeMap::new();
    for group in pools.chunks(3) {
        let (secret, template, pool) = (&group[0], &group[1], &group[2]);
        let name = template["metadata"]["name"].as_str().unwrap().to_string();
        let (ok, text) = validate(validator, secret, scratch, &format!("{name}-secret"));
        assert!(ok, "{text}");
        check_fields(template);
        check_fields(pool);
        assert_eq!(pool["spec"]["sandboxTemplateRef"]["name"], name.as_str());
        assert!(pool["spec"]["replicas"].is_u64());
        // The pod template, validated as the Pod it becomes, mounting this Secret.
        let spec = &template["spec"]["podTemplate"]["spec"];
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "from-template",
                "labels": template["spec"]["podTemplate"]["metadata"]["labels"],
            },
            "spec": spec,
        });
        let (ok, text) = validate(validator, &pod, scratch, &name);
        assert!(ok, "{name}: {text}");
        let secret_name = secret["metadata"]["name"].as_str().unwrap();
        assert!(spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["secret"]["secretName"] == secret_name));
        // Its network policy admits the executor's port, as a NetworkPolicy would.
        let mut policy = template["spec"]["networkPolicy"].clone();
        assert_eq!(policy["ingress"][0]["ports"][0]["port"], 7681);
        policy["podSelector"] = serde_json::json!({});
        let policy = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "from-template"},
            "spec": policy,
        });
        let (ok, text) = validate(validator, &policy, scratch, &format!("{name}-policy"));
        assert!(ok, "{name}: {text}");
        let image = spec["containers"][0]["image"].as_str().unwrap().to_string();
        let token = secret["stringData"]["token"].as_str().unwrap().to_string();
        assert!(templates.insert(name, (image, token)).is_none());
    }
    let images: Vec<&str> = templates.values().map(|(i, _)| i.as_str()).collect();
    assert!(
        images.contains(&django_image) && images.contains(&astropy_image),
        "{images:?}"
    );

    // A claim per instance, naming the template of its own image.
    let claims = docs(&out.join("agent-sandbox-claims.yaml"));
    let claimed: BTreeMap<String, String> = claims
        .iter()
        .map(|claim| {
            assert_eq!(claim["kind"], "SandboxClaim");
            check_fields(claim);
            (
                claim["metadata"]["name"].as_str().unwrap().to_string(),
                claim["spec"]["sandboxTemplateRef"]["name"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();
    let image_of = |claim: &str| templates[&claimed[claim]].0.as_str();
    assert_eq!(claimed.len(), 3);
    assert_eq!(image_of("django--django-11099"), django_image);
    assert_eq!(image_of("astropy--astropy-12907"), astropy_image);
    assert_eq!(image_of("astropy--astropy-13033"), astropy_image);
    assert_eq!(
        claimed["astropy--astropy-12907"],
        claimed["astropy--astropy-13033"]
    );
    // What reaches each claim: its template's token and fingerprint.
    let info: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("agent-sandbox.json")).unwrap())
            .unwrap();
    let claim_infos = info["claims"].as_array().unwrap();
    assert_eq!(claim_infos.len(), 3);
    for entry in claim_infos {
        let template = entry["template"].as_str().unwrap();
        assert_eq!(claimed[entry["claim"].as_str().unwrap()], template);
        let token = std::fs::read_to_string(entry["token_file"].as_str().unwrap()).unwrap();
        assert_eq!(token, templates[template].1);
        assert!(entry["tls_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"));
    }
    // The two templates have their own credentials.
    let tokens: Vec<&String> = templates.values().map(|(_, t)| t).collect();
    assert_ne!(tokens[0], tokens[1]);
}

/// The manifests carry the Secret (token, TLS key): every file written is 0600, also one an
/// earlier run left world-readable; an empty subset is a clear error, not a panic.
#[test]
fn k8s_manifests_are_private_files_and_an_empty_subset_is_an_error() {
    use std::os::unix::fs::PermissionsExt;
    let dir = executor_tests::TempDir::new().unwrap();
    let out = dir.path().join("manifests");
    std::fs::create_dir(&out).unwrap();
    // Left by an earlier run (or anyone) with the default mode.
    for stale in ["task.yaml", "agent-sandbox.yaml", "task.json"] {
        let path = out.join(stale);
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let run = |args: &[&str]| {
        Command::new(binary("agent"))
            .args([
                "deploy",
                "k8s",
                "--executor-image",
                "example.org/executor:1",
                "-o",
            ])
            .arg(&out)
            .args(args)
            .output()
            .unwrap()
    };
    let made = run(&["--image", "example.org/task:1"]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&out).unwrap() {
        let path = entry.unwrap().path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is {mode:o}", path.display());
        files.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    files.sort();
    // The template's token is named after it: `executor-<image>-<digest>.token`.
    let template_token = files
        .iter()
        .position(|f| f.starts_with("executor-task-1-") && f.ends_with(".token"))
        .map(|at| files.remove(at));
    assert!(template_token.is_some(), "{files:?}");
    assert_eq!(
        files,
        [
            "agent-sandbox-claims.yaml",
            "agent-sandbox.json",
            "agent-sandbox.yaml",
            "task.json",
            "task.token",
            "task.yaml"
        ]
    );
    // Rewritten, not appended to: the Secret is there.
    let task = docs(&out.join("task.yaml"));
    assert_eq!(task[0]["kind"], "Secret");
    assert!(task[0]["stringData"]["tls.key"]
        .as_str()
        .unwrap()
        .contains("PRIVATE KEY"));

    // An empty subset: refused with a message, no panic.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let refused = run(&["--subset", empty.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("no instances"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
