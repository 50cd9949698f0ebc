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
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("manifests");
    let instances = dir.path().join("instances.jsonl");
    std::fs::write(
        &instances,
        "{\"instance_id\": \"Django__django-11099\", \"problem_statement\": \"x\"}\n\
         {\"instance_id\": \"astropy__astropy-12907\", \"image_name\": \"example.org/astropy:1\"}\n",
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
    for name in ["django--django-11099", "astropy--astropy-12907"] {
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
    assert_eq!(pods, 2);
    // SWE-bench's image naming for an instance without one.
    let django = docs(&out.join("django--django-11099.yaml"));
    assert_eq!(
        django[1]["spec"]["containers"][0]["image"],
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    );

    let sandbox = docs(&out.join("agent-sandbox.yaml"));
    let kinds: Vec<&str> = sandbox
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["Secret", "SandboxTemplate", "SandboxWarmPool", "Sandbox"]
    );
    let (ok, text) = validate(&validator, &sandbox[0], &scratch, "sandbox-secret");
    assert!(ok, "{text}");
    for doc in &sandbox[1..] {
        let kind = doc["kind"].as_str().unwrap();
        let group = doc["apiVersion"].as_str().unwrap();
        match kind {
            "Sandbox" => assert_eq!(group, "agents.x-k8s.io/v1alpha1"),
            _ => assert_eq!(group, "extensions.agents.x-k8s.io/v1alpha1"),
        }
        if kind == "SandboxWarmPool" {
            assert_eq!(
                doc["spec"]["sandboxTemplateRef"]["name"],
                sandbox[1]["metadata"]["name"]
            );
            assert!(doc["spec"]["replicas"].is_u64());
            continue;
        }
        // The pod template, validated as the Pod it becomes.
        let template = &doc["spec"]["podTemplate"];
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "from-template", "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        });
        let (ok, text) = validate(&validator, &pod, &scratch, kind);
        assert!(ok, "{kind}: {text}");
    }
    // A broken manifest fails the same check (the validator is not a rubber stamp).
    let mut broken = django[1].clone();
    broken["spec"]["containers"][0]["imagePullPolicyy"] = Value::from("Always");
    let (ok, _) = validate(&validator, &broken, &scratch, "broken");
    assert!(!ok, "an unknown field passed --strict validation");
}

/// The manifests carry the Secret (token, TLS key): every file written is 0600, also one an
/// earlier run left world-readable; an empty subset is a clear error, not a panic.
#[test]
fn k8s_manifests_are_private_files_and_an_empty_subset_is_an_error() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
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
    assert_eq!(
        files,
        [
            "agent-sandbox.json",
            "agent-sandbox.token",
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
