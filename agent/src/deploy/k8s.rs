//! `agent deploy k8s`: Kubernetes manifests, written, not applied (no cluster is reached).
//!
//! - Per task, a Pod running the task's image, the executor copied by an init container into
//!   an emptyDir (mounted read-only for the task's container, as Argo's emissary does) and
//!   started as its command; the token and a TLS certificate made here in a Secret mounted
//!   read-only with mode 0400. The certificate's fingerprint is known before the Pod exists,
//!   so clients pin it: `<name>.json` says how to reach it (the Pod's address is the cluster's
//!   to give).
//! - For kubernetes-sigs/agent-sandbox (`extensions.agents.x-k8s.io/v1alpha1`): per distinct
//!   image a SandboxTemplate with the same pod and a SandboxWarmPool of it, and per task a
//!   SandboxClaim naming its image's template, so each task is served from its image's warm
//!   pool (a claim with the default `warmpool` policy adopts a ready sandbox of a pool of its
//!   template). Sandboxes of a template share its Secret, so one token and one TLS key reach
//!   every sandbox of that template.
//! - Every file written is 0600: the manifests carry the Secret's token and key.
//!
//! The init container's image must hold the static executor at `/executor` and a `cp`
//! (e.g. `FROM busybox` + `COPY executor /executor`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};

use super::containers::{LABEL, TASK_LABEL};

const PORT: u16 = 7681;
const EXECUTOR_DIR: &str = "/.executor";
const SECRET_DIR: &str = "/.executor-secret";
/// agent-sandbox's extensions API (SandboxTemplate, SandboxWarmPool, SandboxClaim). Its
/// v0.5 releases serve v1beta1 too (claims there name a pool, not a template) and still
/// serve v1alpha1, deprecated.
const SANDBOX_EXTENSIONS_API: &str = "extensions.agents.x-k8s.io/v1alpha1";

#[derive(Args)]
pub struct K8sArgs {
    /// The task's image (one Pod); or use --subset for one Pod per instance.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// Name of the one Pod (with --image).
    #[arg(long, default_value = "task")]
    pub name: String,
    /// Instances (as `agent batch --subset`): a Pod per instance, from its image.
    #[arg(long, value_name = "PATH")]
    pub subset: Option<PathBuf>,
    #[arg(long, default_value = "dev")]
    pub split: String,
    /// Image holding the static executor at /executor, and cp.
    #[arg(long, value_name = "IMAGE")]
    pub executor_image: String,
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Working directory of the commands, in the task's image.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<String>,
    /// Sandboxes kept warm by each image's agent-sandbox SandboxWarmPool.
    #[arg(long, default_value_t = 2)]
    pub warm_pool: u32,
    /// Output directory.
    #[arg(short = 'o', long, value_name = "DIR")]
    pub output: PathBuf,
    /// `trusted` also offers that profile (commands unsandboxed, able to read the executor's
    /// token); by default the executor offers every profile but `trusted`.
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
}

/// A name Kubernetes accepts (DNS-1123 label): lowercase alphanumerics and `-`, 63 at most.
pub fn dns_name(text: &str) -> String {
    let mut out: String = text
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    out.truncate(63);
    let out = out.trim_matches('-').to_string();
    if out.is_empty() {
        "task".into()
    } else {
        out
    }
}

/// A label value: alphanumerics, `-`, `_`, `.`, 63 at most, alphanumeric at both ends.
fn label_value(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    out.truncate(63);
    out.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// A certificate, its key and its fingerprint.
struct Credentials {
    token: String,
    cert_pem: String,
    key_pem: String,
    fingerprint: String,
}

fn credentials(name: &str) -> anyhow::Result<Credentials> {
    let key = rcgen::KeyPair::generate().context("cannot generate a TLS key")?;
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()])
        .context("cannot make certificate parameters")?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "executor (self-signed)");
    let cert = params
        .self_signed(&key)
        .context("cannot sign the certificate")?;
    Ok(Credentials {
        token: super::fresh_token()?,
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        fingerprint: crate::tls::Fingerprint::of(cert.der()).to_string(),
    })
}

fn secret(name: &str, namespace: &str, c: &Credentials) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {LABEL: "1"}},
        "type": "Opaque",
        "stringData": {"token": c.token, "tls.crt": c.cert_pem, "tls.key": c.key_pem},
    })
}

/// The pod: the executor copied in by an init container, then started as the command of the
/// task's container from its read-only copy.
fn pod_spec(
    image: &str,
    executor_image: &str,
    secret: &str,
    workspace: Option<&str>,
    profiles: &[&str],
) -> Value {
    let mut serve = vec![
        format!("{EXECUTOR_DIR}/executor"),
        "serve".into(),
        "--listen".into(),
        format!("0.0.0.0:{PORT}"),
        "--tls-cert".into(),
        format!("{SECRET_DIR}/tls.crt"),
        "--tls-key".into(),
        format!("{SECRET_DIR}/tls.key"),
        "--token-file".into(),
        format!("{SECRET_DIR}/token"),
    ];
    for p in profiles {
        serve.extend(["--allow-profile".into(), p.to_string()]);
    }
    if let Some(w) = workspace {
        serve.extend(["--workspace".into(), w.to_string()]);
    }
    json!({
        "restartPolicy": "Never",
        "automountServiceAccountToken": false,
        "initContainers": [{
            "name": "install-executor",
            "image": executor_image,
            "command": ["cp", "/executor", format!("{EXECUTOR_DIR}/executor")],
            "volumeMounts": [{"name": "executor", "mountPath": EXECUTOR_DIR}],
        }],
        "containers": [{
            "name": "task",
            "image": image,
            "command": serve,
            "ports": [{"name": "executor", "containerPort": PORT, "protocol": "TCP"}],
            "readinessProbe": {
                "httpGet": {"path": "/readyz", "port": PORT, "scheme": "HTTPS"},
                "periodSeconds": 2,
            },
            "volumeMounts": [
                {"name": "executor", "mountPath": EXECUTOR_DIR, "readOnly": true},
                {"name": "secret", "mountPath": SECRET_DIR, "readOnly": true},
            ],
        }],
        "volumes": [
            {"name": "executor", "emptyDir": {}},
            {"name": "secret", "secret": {"secretName": secret, "defaultMode": 0o400}},
        ],
    })
}

/// What a client needs besides the Pod's address.
fn connect_info(name: &str, c: &Credentials, token_file: &Path) -> Value {
    json!({
        "url": format!("wss://<address of pod {name}>:{PORT}/v1/ws"),
        "token_file": token_file,
        "tls_fingerprint": c.fingerprint,
        "deployment": "k8s",
        "id": name,
    })
}

fn write_yaml(path: &Path, docs: &[Value]) -> anyhow::Result<()> {
    let mut text = String::new();
    for doc in docs {
        text.push_str("---\n");
        text.push_str(&serde_norway::to_string(doc).context("cannot write YAML")?);
    }
    write_private(path, &text)
}

/// Every file we write holds or sits beside a credential (the manifests carry the Secret:
/// the token and the TLS key), so each is 0600: created with that mode, and an existing
/// file (an earlier run into the same directory) changed to it through its descriptor
/// before anything is written, since `mode` applies only when the file is created.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot make {} private", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

pub async fn command(args: K8sArgs) -> anyhow::Result<u8> {
    let tasks: Vec<(String, String, String)> = match (&args.subset, &args.image) {
        (Some(subset), _) => crate::batch::instances::load(subset, &args.split)?
            .into_iter()
            .map(|i| (dns_name(&i.id), i.id, i.image))
            .collect(),
        (None, Some(image)) => vec![(dns_name(&args.name), args.name.clone(), image.clone())],
        (None, None) => bail!("give --image IMAGE (one Pod) or --subset PATH (a Pod per instance)"),
    };
    if tasks.is_empty() {
        bail!("the subset has no instances: nothing to write");
    }
    std::fs::create_dir_all(&args.output)
        .with_context(|| format!("cannot create {}", args.output.display()))?;
    let ns = &args.namespace;
    let workspace = args.workspace.as_deref();
    let profiles = super::offered_profiles(args.profile.as_deref());
    for (name, task, image) in &tasks {
        let c = credentials(name)?;
        let secret_name = format!("{name}-executor");
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {LABEL: "1", TASK_LABEL: label_value(task)},
            },
            "spec": pod_spec(
                image,
                &args.executor_image,
                &secret_name,
                workspace,
                &profiles,
            ),
        });
        write_yaml(
            &args.output.join(format!("{name}.yaml")),
            &[secret(&secret_name, ns, &c), pod],
        )?;
        let token_file = args.output.join(format!("{name}.token"));
        write_private(&token_file, &c.token)?;
        let info = serde_json::to_string_pretty(&connect_info(name, &c, &token_file))?;
        write_private(&args.output.join(format!("{name}.json")), &info)?;
    }
    let templates = write_agent_sandbox(&args, &tasks, &profiles)?;
    eprintln!(
        "deploy k8s: wrote {} Pod manifest(s), agent-sandbox.yaml ({templates} template(s) with \
         their warm pools) and agent-sandbox-claims.yaml ({} claim(s)) to {} (not applied)",
        tasks.len(),
        tasks.len(),
        args.output.display()
    );
    Ok(0)
}

/// A SandboxTemplate's name for `image`: readable (the image's last path component) and
/// unique (a digest of the whole name), short enough that `<name>-pool` is a DNS-1123 label.
fn template_name(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    let mut readable = dns_name(last);
    readable.truncate(40);
    let readable = readable.trim_matches('-');
    let digest = ring::digest::digest(&ring::digest::SHA256, image.as_bytes());
    let short: String = digest.as_ref()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("executor-{readable}-{short}")
}

/// agent-sandbox's objects: `agent-sandbox.yaml` with a Secret, a SandboxTemplate and a
/// SandboxWarmPool per distinct image (apply it first: the pools warm up), and
/// `agent-sandbox-claims.yaml` with a SandboxClaim per task naming its image's template;
/// `agent-sandbox.json` says which credentials reach which claim. Returns the templates
/// written.
fn write_agent_sandbox(
    args: &K8sArgs,
    tasks: &[(String, String, String)],
    profiles: &[&str],
) -> anyhow::Result<usize> {
    let ns = &args.namespace;
    let mut pools = Vec::new();
    let mut infos = Vec::new();
    // Image -> (template, fingerprint, token file), in the tasks' order.
    let mut by_image: Vec<(String, String, String, PathBuf)> = Vec::new();
    for (_, _, image) in tasks {
        if by_image.iter().any(|(i, ..)| i == image) {
            continue;
        }
        let template = template_name(image);
        // Every sandbox of the template, warm or claimed, mounts this Secret: they share one
        // token and one TLS key, so whoever holds the token reaches all of them (documented).
        let c = credentials(&template)?;
        let pod_template = json!({
            "metadata": {"labels": {LABEL: "1"}},
            "spec": pod_spec(
                image,
                &args.executor_image,
                &template,
                args.workspace.as_deref(),
                profiles,
            ),
        });
        pools.extend([
            secret(&template, ns, &c),
            json!({
                "apiVersion": SANDBOX_EXTENSIONS_API,
                "kind": "SandboxTemplate",
                "metadata": {"name": template, "namespace": ns, "labels": {LABEL: "1"}},
                "spec": {
                    "podTemplate": pod_template,
                    // Managed by default, agent-sandbox's own policy admits only its router:
                    // the agent connects to the executor's port itself. Rules given here
                    // replace that policy whole, so egress (none listed) is denied.
                    "networkPolicy": {
                        "ingress": [{"ports": [{"port": PORT, "protocol": "TCP"}]}],
                    },
                },
            }),
            json!({
                "apiVersion": SANDBOX_EXTENSIONS_API,
                "kind": "SandboxWarmPool",
                "metadata": {
                    "name": format!("{template}-pool"),
                    "namespace": ns,
                    "labels": {LABEL: "1"},
                },
                "spec": {"replicas": args.warm_pool, "sandboxTemplateRef": {"name": template}},
            }),
        ]);
        let token_file = args.output.join(format!("{template}.token"));
        write_private(&token_file, &c.token)?;
        infos.push(json!({
            "template": template,
            "image": image,
            "warm_pool": format!("{template}-pool"),
            "tls_fingerprint": c.fingerprint,
            "token_file": token_file,
        }));
        by_image.push((image.clone(), template, c.fingerprint, token_file));
    }
    let mut claims = Vec::new();
    let mut claim_infos = Vec::new();
    for (name, task, image) in tasks {
        let Some((_, template, fingerprint, token_file)) =
            by_image.iter().find(|(i, ..)| i == image)
        else {
            bail!("no template for {image}");
        };
        claims.push(json!({
            "apiVersion": SANDBOX_EXTENSIONS_API,
            "kind": "SandboxClaim",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {LABEL: "1", TASK_LABEL: label_value(task)},
            },
            "spec": {"sandboxTemplateRef": {"name": template}},
        }));
        claim_infos.push(json!({
            "instance_id": task,
            "claim": name,
            "template": template,
            // The claim adopts a warm sandbox, named by its agents.x-k8s.io/sandbox-name
            // annotation; the address is the cluster's to give.
            "url": format!("wss://<address of the sandbox claim {name} adopts>:{PORT}/v1/ws"),
            "tls_fingerprint": fingerprint,
            "token_file": token_file,
            "deployment": "k8s",
        }));
    }
    write_yaml(&args.output.join("agent-sandbox.yaml"), &pools)?;
    write_yaml(&args.output.join("agent-sandbox-claims.yaml"), &claims)?;
    let info = json!({"templates": infos, "claims": claim_infos});
    write_private(
        &args.output.join("agent-sandbox.json"),
        &serde_json::to_string_pretty(&info)?,
    )?;
    Ok(by_image.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_are_what_kubernetes_accepts() {
        assert_eq!(dns_name("Django__django-11099"), "django--django-11099");
        assert_eq!(label_value("a/b__c-1"), "a_b__c-1");
        assert_eq!(dns_name("__"), "task");
    }

    #[test]
    fn template_names_are_short_labels_distinct_per_image() {
        let long = "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest";
        let a = template_name(long);
        assert!(a.starts_with("executor-sweb-eval-x86-64-django"), "{a}");
        assert!(format!("{a}-pool").len() <= 63, "{a}");
        assert_eq!(a, dns_name(&a));
        // Same readable part, another image: another name; the same image: the same.
        let b = template_name("example.org/other/sweb.eval.x86_64.django_1776_django-11099:latest");
        assert_ne!(a, b);
        assert_eq!(a, template_name(long));
    }
}
