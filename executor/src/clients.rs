//! Who may connect and what each client may do: the clients file, or the single token.
//!
//! Tokens are kept only as SHA-256 digests. A presented token is hashed and compared with every
//! client's digest in constant time, so neither its content nor which client it nearly matched
//! leaks through timing. Usage (running commands, the rate bucket, output used) is kept per
//! client name, apart from the table, so a reload changes limits without resetting usage.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use protocol::ErrorCode;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use sandbox::network::Mode;
use sandbox::profile::Profile;

/// Name of the one client of single-token mode.
pub const DEFAULT_CLIENT: &str = "default";
/// Shortest plain token accepted in a clients file: 128 bits of hex, as for the token file.
const MIN_TOKEN_CHARS: usize = 32;

/// Where a client's commands run by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkspacePolicy {
    /// The daemon's workspace, seen by every client that shares it (a prepared sandbox).
    #[default]
    Shared,
    /// A directory of the client's own that persists across its connections.
    PerClient,
    /// Scratch made for one session and removed when the session ends.
    PerConnection,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientsFile {
    clients: Vec<ClientEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientEntry {
    name: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    token_sha256: Option<String>,
    /// Profiles the client may use; absent: every profile the daemon offers.
    #[serde(default)]
    profiles: Option<Vec<String>>,
    #[serde(default)]
    max_concurrent: Option<usize>,
    #[serde(default)]
    commands_per_minute: Option<u32>,
    #[serde(default)]
    output_quota_bytes: Option<u64>,
    /// Size of the filesystem holding the client's workspace, home and temporary space.
    #[serde(default)]
    disk_quota_bytes: Option<u64>,
    /// Files (inodes) of that filesystem.
    #[serde(default)]
    disk_quota_files: Option<u64>,
    /// Bytes the daemon keeps for this client at most (process output, queued stdin, replies
    /// kept for a resume); default `--client-memory-budget-mb`, else only the daemon's.
    #[serde(default)]
    memory_budget_bytes: Option<u64>,
    #[serde(default)]
    workspace: WorkspacePolicy,
    /// Overrides the daemon's `--resume-grace` for this client, in seconds.
    #[serde(default)]
    resume_grace: Option<f64>,
    /// May read `/metrics`, which names every client.
    #[serde(default)]
    metrics: bool,
    /// uid (and gid) this client's commands run as, instead of the profile's unprivileged
    /// identity, under a root daemon. Default: one derived from the name when the client has a
    /// private workspace, none (the profile's) when it shares the daemon's.
    #[serde(default)]
    uid: Option<u32>,
    /// The most network this client's commands get (docs/profiles.md, "network"); requests
    /// narrow it. Absent: `host`, no filter of its own (each profile's default).
    #[serde(default)]
    network: Option<protocol::RequestNetwork>,
}

/// One authenticated identity and its policy.
#[derive(Debug)]
pub struct Client {
    pub name: String,
    digest: [u8; 32],
    /// Profiles it may use, in the order given; `None`: all.
    pub profiles: Option<Vec<String>>,
    pub limits: ClientLimits,
    pub workspace: WorkspacePolicy,
    pub resume_grace: Option<Duration>,
    pub metrics: bool,
    /// Identity of its commands in profiles that run as an unprivileged uid (see
    /// [`ClientEntry::uid`]); `None`: the profile's.
    pub uid: Option<u32>,
    /// Its network ceiling: `host` (no filter of its own), `none` or a policy.
    pub network: Mode,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClientLimits {
    pub max_concurrent: Option<usize>,
    pub commands_per_minute: Option<u32>,
    pub output_quota_bytes: Option<u64>,
    /// Its own disk quota; `None`: the daemon's (`--disk-quota-bytes`), if any.
    pub disk_quota: Option<crate::disk_quota::DiskQuota>,
    pub memory_budget_bytes: Option<u64>,
}

impl Client {
    /// Same name and same token: the same client, whatever a reload changed in between.
    pub fn same_identity(&self, other: &Client) -> bool {
        self.name == other.name && bool::from(self.digest.ct_eq(&other.digest))
    }

    pub fn may_use(&self, profile: &str) -> bool {
        self.profiles
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|p| p == profile))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientsError {
    #[error("cannot read clients file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("clients file {path} holds plain tokens and is readable by group or others; chmod 600 it (or store token_sha256 instead)")]
    Permissions { path: PathBuf },
    #[error("clients file {path} may be changed by someone other than root or the daemon's user (owner or group/other write permission); whoever can write it can add a client")]
    Writable { path: PathBuf },
    #[error("clients file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The clients the daemon knows, as loaded.
#[derive(Debug, Default)]
pub struct ClientTable {
    clients: Vec<Arc<Client>>,
}

impl ClientTable {
    /// Single-token mode: one client, every profile, the daemon's limits, the shared
    /// workspace, and `network` as its network ceiling (`serve --allow-net`; `host` without).
    pub fn single(token: &[u8], network: Mode) -> Self {
        Self {
            clients: vec![Arc::new(Client {
                name: DEFAULT_CLIENT.into(),
                digest: Sha256::digest(token).into(),
                profiles: None,
                limits: ClientLimits::default(),
                workspace: WorkspacePolicy::Shared,
                resume_grace: None,
                metrics: true,
                uid: None,
                network,
            })],
        }
    }

    /// Read and check a clients file against the profiles the daemon offers.
    pub fn load(path: &Path, profiles: &BTreeMap<String, Profile>) -> Result<Self, ClientsError> {
        use std::os::unix::fs::PermissionsExt;
        let read = |source| ClientsError::Read {
            path: path.to_path_buf(),
            source,
        };
        use std::io::Read;
        use std::os::unix::fs::MetadataExt;
        // One open file for both the checks and the contents, so they are about the same file.
        let mut file = std::fs::File::open(path).map_err(read)?;
        let meta = file.metadata().map_err(read)?;
        let mode = meta.permissions().mode();
        let owner_ok = meta.uid() == 0 || meta.uid() == nix::unistd::geteuid().as_raw();
        if !owner_ok || mode & 0o022 != 0 {
            // Whoever can write it can add a client of their own.
            return Err(ClientsError::Writable {
                path: path.to_path_buf(),
            });
        }
        let mut text = String::new();
        file.read_to_string(&mut text).map_err(read)?;
        let invalid = |message: String| ClientsError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let file: ClientsFile =
            serde_json::from_str(&text).map_err(|err| invalid(err.to_string()))?;
        if file.clients.iter().any(|c| c.token.is_some()) && mode & 0o077 != 0 {
            return Err(ClientsError::Permissions {
                path: path.to_path_buf(),
            });
        }
        Self::from_entries(file.clients, profiles).map_err(invalid)
    }

    fn from_entries(
        entries: Vec<ClientEntry>,
        profiles: &BTreeMap<String, Profile>,
    ) -> Result<Self, String> {
        if entries.is_empty() {
            return Err("no clients: nobody could connect".into());
        }
        let mut names = BTreeSet::new();
        let mut digests = BTreeSet::new();
        let mut clients = Vec::new();
        for entry in entries {
            let name = entry.name;
            let valid_name = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
            if !valid_name || name.starts_with('.') {
                return Err(format!(
                    "client name {name:?} must be 1 to 64 of [A-Za-z0-9._-], not starting with a dot"
                ));
            }
            if !names.insert(name.clone()) {
                return Err(format!("client {name:?} is listed twice"));
            }
            let digest: [u8; 32] = match (entry.token, entry.token_sha256) {
                (Some(token), None) if token.len() >= MIN_TOKEN_CHARS => {
                    Sha256::digest(token.as_bytes()).into()
                }
                (Some(_), None) => {
                    return Err(format!(
                        "client {name:?}: token shorter than {MIN_TOKEN_CHARS} characters"
                    ))
                }
                (None, Some(hex)) => parse_digest(&hex).ok_or_else(|| {
                    format!("client {name:?}: token_sha256 must be 64 hex digits")
                })?,
                _ => {
                    return Err(format!(
                        "client {name:?}: give exactly one of token and token_sha256"
                    ))
                }
            };
            if !digests.insert(digest) {
                return Err(format!("client {name:?} has the token of another client"));
            }
            if let Some(allowed) = &entry.profiles {
                if allowed.is_empty() {
                    return Err(format!("client {name:?}: an empty profiles list allows nothing; leave it out to allow every profile"));
                }
                if let Some(unknown) = allowed.iter().find(|p| !profiles.contains_key(*p)) {
                    let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
                    return Err(format!(
                        "client {name:?}: no profile {unknown:?} (this daemon offers: {})",
                        known.join(", ")
                    ));
                }
            }
            if entry.workspace != WorkspacePolicy::Shared {
                // A private workspace means nothing if a profile shows the whole filesystem.
                let open = profiles
                    .values()
                    .filter(|p| {
                        entry
                            .profiles
                            .as_ref()
                            .is_none_or(|allowed| allowed.contains(&p.name))
                    })
                    .find(|p| !p.confines_filesystem());
                if let Some(open) = open {
                    return Err(format!(
                        "client {name:?}: a private workspace cannot be kept from profile {:?}, which does not confine the filesystem; list the profiles this client may use without it",
                        open.name
                    ));
                }
            }
            if entry.max_concurrent == Some(0) || entry.commands_per_minute == Some(0) {
                return Err(format!(
                    "client {name:?}: a limit of 0 allows nothing; remove the client instead"
                ));
            }
            let resume_grace = match entry.resume_grace {
                None => None,
                Some(secs) if secs.is_finite() && (0.0..=86_400.0).contains(&secs) => {
                    Some(Duration::from_secs_f64(secs))
                }
                Some(secs) => {
                    return Err(format!(
                        "client {name:?}: resume_grace must be 0 to 86400 seconds, got {secs}"
                    ))
                }
            };
            let disk_quota =
                match crate::disk_quota::DiskQuota::from_limits(entry.disk_quota_bytes, entry.disk_quota_files) {
                    None => None,
                    Some(Err(why)) => return Err(format!("client {name:?}: {why}")),
                    Some(Ok(_)) if entry.workspace == WorkspacePolicy::Shared => {
                        return Err(format!(
                            "client {name:?}: a client sharing the workspace shares its quota too (the daemon's --disk-quota-bytes); give it a workspace of its own (per_client or per_connection) to give it a quota of its own"
                        ))
                    }
                    Some(Ok(quota)) => Some(quota),
                };
            // Checked here, whatever the profiles: a policy no profile of this daemon can
            // enforce still loads (the hello says where it cannot be), and its commands are
            // refused there, never run with another network.
            let network = match &entry.network {
                None => Mode::Host,
                Some(network) => crate::network_policy::parse(network)
                    .map_err(|err| format!("client {name:?}: network: {err}"))?,
            };
            if matches!(&network, Mode::Policy(p) if p.allow.is_empty()) {
                return Err(format!(
                    "client {name:?}: network: a policy with no allow rule allows nothing; write {{\"mode\": \"none\"}}"
                ));
            }
            let uid = match entry.uid {
                Some(uid) => Some(uid),
                None if entry.workspace != WorkspacePolicy::Shared => Some(derived_uid(&name)),
                None => None,
            };
            clients.push(Arc::new(Client {
                name,
                digest,
                profiles: entry.profiles,
                limits: ClientLimits {
                    max_concurrent: entry.max_concurrent,
                    commands_per_minute: entry.commands_per_minute,
                    output_quota_bytes: entry.output_quota_bytes,
                    disk_quota,
                    memory_budget_bytes: entry.memory_budget_bytes,
                },
                workspace: entry.workspace,
                resume_grace,
                metrics: entry.metrics,
                uid,
                network,
            }));
        }
        check_isolation(&clients, profiles)?;
        check_uids(&clients)?;
        Ok(Self { clients })
    }

    /// The client whose token is in `header` (`Bearer <token>`), if any.
    pub fn authenticate(&self, header: &[u8]) -> Option<Arc<Client>> {
        let token = header.strip_prefix(b"Bearer ")?;
        let digest: [u8; 32] = Sha256::digest(token).into();
        let mut found = None;
        // Every digest is compared, matched or not.
        for client in &self.clients {
            if bool::from(client.digest.ct_eq(&digest)) {
                found = Some(client.clone());
            }
        }
        found
    }

    /// The current entry of a client with this name and token, if it still has both.
    pub fn current(&self, client: &Client) -> Option<Arc<Client>> {
        self.clients
            .iter()
            .find(|c| c.same_identity(client))
            .cloned()
    }

    /// Whether any client has a disk quota of its own.
    pub fn any_disk_quota(&self) -> bool {
        self.clients.iter().any(|c| c.limits.disk_quota.is_some())
    }

    /// Whether any client has a workspace of its own (which other clients must not reach).
    pub fn any_private_workspace(&self) -> bool {
        self.clients
            .iter()
            .any(|c| c.workspace != WorkspacePolicy::Shared)
    }

    #[cfg(test)]
    pub fn current_by_name(&self, name: &str) -> Option<Arc<Client>> {
        self.clients.iter().find(|c| c.name == name).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        self.clients.iter().map(|c| c.name.clone()).collect()
    }
}

/// Clients with a private workspace are promised isolation from every other client. A profile
/// that writes files other profiles' commands run (task-container writes the host's `/usr`,
/// which strict and landlock execute from; `trusted` writes anything) would let its client
/// plant code that runs in theirs: no client may be allowed one while any client has a
/// private workspace.
fn check_isolation(
    clients: &[Arc<Client>],
    profiles: &BTreeMap<String, Profile>,
) -> Result<(), String> {
    let Some(private) = clients
        .iter()
        .find(|c| c.workspace != WorkspacePolicy::Shared)
    else {
        return Ok(());
    };
    for client in clients {
        let writer = profiles
            .values()
            .filter(|p| client.may_use(&p.name))
            .find(|p| p.writes_shared_files(profiles.values()));
        if let Some(writer) = writer {
            return Err(format!(
                "client {:?} may use profile {:?}, which writes files that other clients' \
                 commands run, while client {:?} has a private workspace: {:?} could plant code \
                 that runs in {:?}'s commands. List {:?}'s profiles without {:?}, or serve it \
                 from a daemon on a machine of its own (a second daemon here would share the \
                 same host files)",
                client.name,
                writer.name,
                private.name,
                client.name,
                private.name,
                client.name,
                writer.name
            ));
        }
    }
    Ok(())
}

/// First uid of the range client identities are derived in: 3840 uids below systemd's dynamic
/// range (61184-65519), inside the 16-bit range every container's user namespace maps.
const DERIVED_UID_BASE: u32 = 57344;
const DERIVED_UID_SPAN: u32 = 3840;
/// The identity profiles use for commands of clients without one of their own.
const SHARED_UID: u32 = 65534;

/// A stable uid for a client: the same name gives the same uid on every start, so its
/// workspace keeps belonging to it.
fn derived_uid(name: &str) -> u32 {
    let digest = Sha256::digest(format!("executor client uid:{name}").as_bytes());
    let n = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    DERIVED_UID_BASE + n % DERIVED_UID_SPAN
}

/// Each client's identity is its own: not root, not the daemon's, not the shared one, not
/// another client's, and not a user or group of this host (whose files and processes it would
/// reach), as `/etc/passwd` and `/etc/group` name them (`accounts`).
fn check_uids(clients: &[Arc<Client>]) -> Result<(), String> {
    if clients.iter().all(|c| c.uid.is_none()) {
        return Ok(());
    }
    let unread = crate::accounts::unread_sources();
    if !unread.is_empty() {
        tracing::warn!(
            sources = %unread.join(","),
            "clients' uids are checked against /etc/passwd and /etc/group only: users and \
             groups that /etc/nsswitch.conf's other sources know are not seen; give clients \
             uids none of them uses"
        );
    }
    let daemon = nix::unistd::geteuid().as_raw();
    let mut seen: BTreeMap<u32, &str> = BTreeMap::new();
    let accounts = crate::accounts::Accounts::read();
    for client in clients {
        let Some(uid) = client.uid else { continue };
        let name = client.name.as_str();
        if uid == 0 || uid == daemon || uid == SHARED_UID || uid == u32::MAX {
            return Err(format!(
                "client {name:?}: uid {uid} is root's, the daemon's or the shared identity; give it a uid of its own"
            ));
        }
        if let Some(other) = seen.insert(uid, name) {
            return Err(format!(
                "clients {other:?} and {name:?} would both run as uid {uid}; set \"uid\" for one of them"
            ));
        }
        if let Some(user) = accounts.user_named(uid) {
            return Err(format!(
                "client {name:?}: uid {uid} belongs to user {user:?} on this host; set \"uid\" to an unused one"
            ));
        }
        // Its commands run with gid = uid: a group of the host would hand them its files
        // (103 ssl-cert: the host's TLS keys; shadow; disk).
        if let Some(group) = accounts.group_named(uid) {
            return Err(format!(
                "client {name:?}: its commands would run with gid {uid}, which is group {group:?} on \
                 this host; set \"uid\" to a number that is neither a user nor a group"
            ));
        }
    }
    Ok(())
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(hex.trim()).ok()?;
    bytes.try_into().ok()
}

/// The live table (swapped on reload) and every client's usage.
pub struct Registry {
    file: Option<PathBuf>,
    table: RwLock<Arc<ClientTable>>,
    usage: Mutex<HashMap<String, Arc<Usage>>>,
    /// Bumped on every reload, so connections can check whether their client still exists.
    reloads: tokio::sync::watch::Sender<u64>,
}

impl Registry {
    pub fn new(table: ClientTable, file: Option<PathBuf>) -> Self {
        Self {
            file,
            table: RwLock::new(Arc::new(table)),
            usage: Mutex::new(HashMap::new()),
            reloads: tokio::sync::watch::Sender::new(0),
        }
    }

    pub fn table(&self) -> Arc<ClientTable> {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Read the clients file again; on any error the old table stays in force.
    pub fn reload(
        &self,
        profiles: &BTreeMap<String, Profile>,
    ) -> Result<Vec<String>, ClientsError> {
        let Some(file) = &self.file else {
            return Ok(self.table().names());
        };
        let table = ClientTable::load(file, profiles)?;
        let names = table.names();
        *self.table.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(table);
        self.reloads.send_modify(|n| *n += 1);
        Ok(names)
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloads.subscribe()
    }

    pub fn usage(&self, name: &str) -> Arc<Usage> {
        self.usage
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_string())
            .or_default()
            .clone()
    }
}

/// What a client is using now.
#[derive(Debug, Default)]
pub struct Usage {
    running: AtomicUsize,
    output_used: AtomicU64,
    bucket: Mutex<Option<Bucket>>,
}

/// A command refused by a client limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub code: ErrorCode,
    /// `concurrency`, `rate` or `output_quota`, for metrics and the audit log.
    pub limit: &'static str,
    pub message: String,
}

/// Holds one of a client's concurrent-command slots until dropped.
#[derive(Debug)]
pub struct Slot(Arc<Usage>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Usage {
    /// Take a slot for one command within `limits`, or say which limit refuses it. The rate
    /// is charged only for commands that pass every other check.
    pub fn admit(self: &Arc<Self>, name: &str, limits: &ClientLimits) -> Result<Slot, Refusal> {
        let running = self.running.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.clone());
        if let Some(max) = limits.max_concurrent {
            if running >= max {
                return Err(Refusal {
                    code: ErrorCode::Busy,
                    limit: "concurrency",
                    message: format!("client {name} already runs {max} commands, its limit"),
                });
            }
        }
        if let Some(quota) = limits.output_quota_bytes {
            let used = self.output_used.load(Ordering::Acquire);
            if used >= quota {
                return Err(Refusal {
                    code: ErrorCode::QuotaExceeded,
                    limit: "output_quota",
                    message: format!(
                        "client {name} has used its output quota ({used} of {quota} bytes)"
                    ),
                });
            }
        }
        if let Some(per_minute) = limits.commands_per_minute {
            let mut bucket = self.bucket.lock().unwrap_or_else(PoisonError::into_inner);
            let bucket = bucket.get_or_insert_with(|| Bucket::full(per_minute));
            if let Err(wait) = bucket.take(per_minute, Instant::now()) {
                return Err(Refusal {
                    code: ErrorCode::QuotaExceeded,
                    limit: "rate",
                    message: format!(
                        "client {name} may start {per_minute} commands per minute; retry in {:.1} s",
                        wait.as_secs_f64()
                    ),
                });
            }
        }
        Ok(slot)
    }

    /// Count a finished command's output against the quota.
    pub fn add_output(&self, bytes: u64) {
        self.output_used.fetch_add(bytes, Ordering::AcqRel);
    }

    #[cfg(test)]
    fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }
}

/// A token bucket: `per_minute` tokens at most, refilled evenly over a minute.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(per_minute: u32) -> Self {
        Self {
            tokens: f64::from(per_minute),
            at: Instant::now(),
        }
    }

    /// Take one token, or return how long until one is there.
    fn take(&mut self, per_minute: u32, now: Instant) -> Result<(), Duration> {
        let rate = f64::from(per_minute) / 60.0;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(f64::from(per_minute));
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
        }
    }
}

#[cfg(test)]
#[path = "clients_tests.rs"]
mod tests;
