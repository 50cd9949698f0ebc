//! `agent cp SRC DST`: copy files and directories between here and an executor, like
//! `docker cp`. The remote side is written `:PATH` (as a command in the sandbox sees it;
//! relative paths start at the workspace), `-` is stdin or stdout. Directories travel as tar
//! streams; nothing is held in memory whole. A download is written beside its destination
//! under a temporary name and renamed into place, so a failed copy leaves nothing behind.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use protocol::{DownloadRequest, ErrorCode, FileStat, UploadRequest};

use crate::agent_loop::{Interrupts, INTERRUPTED};
use crate::command_args::EXEC_FAILED;
use crate::deploy::flags::ExecutorArgs;
use crate::executor_client::{Client, ClientError};
use crate::target::{Reached, Unreached};

/// Transfers at least this large show a progress bar (when stderr is a terminal).
const PROGRESS_FROM_BYTES: u64 = 1 << 20;

#[derive(Args)]
pub struct CpArgs {
    #[command(flatten)]
    pub executor: ExecutorArgs,
    /// Create the destination's missing parent directories.
    #[arg(short, long)]
    pub parents: bool,
    /// Source: a local path, `-` (stdin), or `:PATH` on the executor.
    #[arg(value_name = "SRC")]
    pub source: String,
    /// Destination: a local path, `-` (stdout), or `:PATH` on the executor.
    #[arg(value_name = "DST")]
    pub destination: String,
}

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    Local(PathBuf),
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    /// `:PATH` (`:` alone is the workspace).
    Remote(String),
}

impl Side {
    pub fn parse(word: &str) -> Self {
        match word {
            "-" => Self::Stdio,
            _ => match word.strip_prefix(':') {
                Some("") => Self::Remote(".".into()),
                Some(path) => Self::Remote(path.into()),
                None => Self::Local(PathBuf::from(word)),
            },
        }
    }
}

/// Which way a copy goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Copy {
    Upload { from: Side, to: String },
    Download { from: String, to: Side },
}

/// Read `SRC DST`: exactly one side is on the executor.
pub fn plan(source: &str, destination: &str) -> anyhow::Result<Copy> {
    match (Side::parse(source), Side::parse(destination)) {
        (Side::Remote(_), Side::Remote(_)) => {
            bail!("both {source:?} and {destination:?} are on the executor; one side must be local")
        }
        (Side::Remote(from), to) => Ok(Copy::Download { from, to }),
        (from, Side::Remote(to)) => Ok(Copy::Upload { from, to }),
        _ => bail!(
            "neither {source:?} nor {destination:?} is on the executor: write the remote side \
             as :PATH (e.g. :/work/file or :relative/to/workspace)"
        ),
    }
}

/// Where a copy lands when its destination is an existing directory: inside it, under the
/// source's name (`docker cp` and `cp` do the same). A source ending in `/.` means its
/// contents, which land in the directory itself.
fn inside(dir: &str, source_name: Option<&str>) -> String {
    match source_name {
        None => dir.to_string(),
        Some(name) => format!("{}/{name}", dir.trim_end_matches('/')),
    }
}

/// The last component of a path, `None` for `.`-ended paths (their contents are meant) and `/`.
fn last_component(path: &str) -> Option<&str> {
    if path.ends_with("/.") || path == "." {
        return None;
    }
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty() && *n != "..")
}

pub async fn cp(args: CpArgs) -> anyhow::Result<u8> {
    let copy = match plan(&args.source, &args.destination) {
        Ok(copy) => copy,
        Err(e) => {
            eprintln!("agent cp: {e:#}");
            return Ok(EXEC_FAILED);
        }
    };
    // A missing local source is known before any executor is started.
    if let Copy::Upload {
        from: Side::Local(path),
        ..
    } = &copy
    {
        if let Err(e) = std::fs::metadata(path) {
            eprintln!("agent cp: cannot read {}: {e}", path.display());
            return Ok(EXEC_FAILED);
        }
    }
    let mut interrupts = Interrupts::install()?;
    let reached = match crate::target::reach(&args.executor, "cp", None, &mut interrupts).await {
        Ok(reached) => reached,
        Err(Unreached::Interrupted) => return Ok(INTERRUPTED),
        Err(Unreached::Failed(e)) => {
            eprintln!("agent cp: {e:#}");
            return Ok(EXEC_FAILED);
        }
    };
    // Ctrl-C drops the copy: its connection closes, and the executor discards a partial
    // upload (uploads are renamed into place only when complete); a partial download is a
    // temporary file that is removed.
    let result = tokio::select! {
        result = copy_with(&args, copy, &reached) => Some(result),
        _ = interrupts.recv() => None,
    };
    reached.stop().await;
    match result {
        Some(Ok(())) => Ok(0),
        Some(Err(e)) => {
            eprintln!("agent cp: {e:#}");
            Ok(EXEC_FAILED)
        }
        None => Ok(INTERRUPTED),
    }
}

async fn copy_with(args: &CpArgs, copy: Copy, reached: &Reached) -> anyhow::Result<()> {
    // File operations keep their profile's network: none is asked for.
    let profile = reached
        .profile(args.executor.profile.as_deref(), None)
        .await?;
    let mut client = reached.client().await?;
    crate::target::say_default_profile(&profile, client.hello());
    let result = async {
        client.require("files", "file copies")?;
        match copy {
            Copy::Upload { from, to } => {
                upload(&mut client, from, &to, profile, args.parents).await
            }
            Copy::Download { from, to } => download(&mut client, &from, to, profile).await,
        }
    }
    .await;
    client.close().await;
    result
}

/// `stat`, with a missing path as `None`.
async fn remote_stat(
    client: &mut Client,
    path: &str,
    profile: &Option<String>,
) -> anyhow::Result<Option<FileStat>> {
    match client.stat(path, profile.clone()).await {
        Ok(stat) => Ok(Some(stat)),
        Err(e) if e.code() == Some(ErrorCode::NotFound) => Ok(None),
        Err(e) => Err(remote_error(e, "look at", path)),
    }
}

async fn upload(
    client: &mut Client,
    from: Side,
    to: &str,
    profile: Option<String>,
    parents: bool,
) -> anyhow::Result<()> {
    let existing = remote_stat(client, to, &profile).await?;
    let into_dir = existing.as_ref().is_some_and(|s| s.kind == "dir");
    let id = client.new_id("up");
    let (path, directory) = match &from {
        Side::Stdio => {
            if into_dir {
                bail!(":{to} is a directory on the executor; name the file stdin goes to");
            }
            (to.to_string(), None)
        }
        Side::Local(local) => {
            let meta = std::fs::metadata(local)
                .with_context(|| format!("cannot read {}", local.display()))?;
            let name = local_name(local)?;
            let path = if into_dir {
                inside(to, name.as_deref())
            } else {
                to.to_string()
            };
            if meta.is_dir() {
                if existing.is_some() && !into_dir {
                    bail!(
                        "cannot copy directory {} onto the file :{to}",
                        local.display()
                    );
                }
                (path, Some(local.clone()))
            } else {
                (path, None)
            }
        }
        Side::Remote(_) => bail!("both sides are on the executor"),
    };
    let uploaded = match (from, directory) {
        (_, Some(dir)) => {
            client.require("tar", "copying directories")?;
            let request = UploadRequest {
                id,
                path: path.clone(),
                mode: None,
                parents,
                tar: true,
                profile,
            };
            let progress = Progress::new(None, &format!(":{path}"));
            crate::archive::upload_dir(client, request, &dir, &mut |n| progress.set(n)).await
        }
        (Side::Local(local), None) => {
            let file = tokio::fs::File::open(&local)
                .await
                .with_context(|| format!("cannot open {}", local.display()))?;
            let meta = file
                .metadata()
                .await
                .with_context(|| format!("cannot read {}", local.display()))?;
            let request = UploadRequest {
                id,
                path: path.clone(),
                mode: Some(permission_bits(&meta)),
                parents,
                tar: false,
                profile,
            };
            let progress = Progress::new(Some(meta.len()), &format!(":{path}"));
            let what = local.display().to_string();
            client
                .upload(request, file, &what, &mut |n| progress.set(n))
                .await
        }
        (_, None) => {
            let request = UploadRequest {
                id,
                path: path.clone(),
                mode: None,
                parents,
                tar: false,
                profile,
            };
            let progress = Progress::new(None, &format!(":{path}"));
            client
                .upload(request, tokio::io::stdin(), "stdin", &mut |n| {
                    progress.set(n)
                })
                .await
        }
    };
    uploaded.map_err(|e| remote_error(e, "write", &path))?;
    Ok(())
}

async fn download(
    client: &mut Client,
    from: &str,
    to: Side,
    profile: Option<String>,
) -> anyhow::Result<()> {
    let stat = client
        .stat(from, profile.clone())
        .await
        .map_err(|e| remote_error(e, "read", from))?;
    let directory = stat.kind == "dir";
    if directory {
        client.require("tar", "copying directories")?;
    }
    let id = client.new_id("down");
    let request = DownloadRequest {
        id,
        path: from.to_string(),
        offset: 0,
        length: None,
        tar: directory,
        profile,
    };
    let total = (!directory).then_some(stat.size);
    let done = match to {
        Side::Stdio => {
            let progress = Progress::new(total, "stdout");
            client
                .download(request, tokio::io::stdout(), "stdout", &mut |n| {
                    progress.set(n)
                })
                .await
                .map(|_| ())
        }
        Side::Local(local) => {
            let name = last_component(from).map(str::to_string);
            let name = match name {
                Some(n) => Some(n),
                // `:` or `:dir/.`: the contents (a directory) or the file's own name.
                None if directory => None,
                None => last_component(&stat.name).map(str::to_string),
            };
            let target = if local.is_dir() {
                match &name {
                    Some(name) => local.join(name),
                    None => local.clone(),
                }
            } else {
                local.clone()
            };
            let progress = Progress::new(total, &target.display().to_string());
            if directory {
                crate::archive::download_dir(client, request, &target, &mut |n| progress.set(n))
                    .await
                    .map(|_| ())
            } else {
                download_file(client, request, &target, stat.mode, &mut |n| {
                    progress.set(n)
                })
                .await
            }
        }
        Side::Remote(_) => bail!("both sides are on the executor"),
    };
    done.map_err(|e| remote_error(e, "read", from))?;
    Ok(())
}

/// A file download: into a temporary file beside `target`, renamed over it at the end.
async fn download_file(
    client: &mut Client,
    request: DownloadRequest,
    target: &Path,
    mode: u32,
    progress: &mut dyn FnMut(u64),
) -> Result<(), ClientError> {
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let what = target.display().to_string();
    let local = |action, source| ClientError::Local {
        action,
        what: what.clone(),
        source,
    };
    let partial = tempfile::Builder::new()
        .prefix(".agent-cp-")
        .tempfile_in(&parent)
        .map_err(|e| local("create a file beside", e))?;
    let file = tokio::fs::File::from_std(
        partial
            .as_file()
            .try_clone()
            .map_err(|e| local("write", e))?,
    );
    client.download(request, file, &what, progress).await?;
    set_mode(partial.path(), mode & 0o777).map_err(|e| local("set the mode of", e))?;
    partial
        .persist(target)
        .map_err(|e| local("rename into place", e.error))?;
    Ok(())
}

/// An error of the executor about `:path`: its own message (which names the path as the
/// sandbox sees it) and code (`denied`, `not_found`, ...).
fn remote_error(e: ClientError, action: &str, path: &str) -> anyhow::Error {
    match e {
        ClientError::Refused { code, message } => {
            anyhow::anyhow!("the executor could not {action} :{path}: {message} ({code})")
        }
        other => other.into(),
    }
}

/// The name a local source keeps on the executor: its last component (`.` resolved).
fn local_name(path: &Path) -> anyhow::Result<Option<String>> {
    let text = path.to_string_lossy();
    if text.ends_with("/.") {
        return Ok(None);
    }
    let name = match path.file_name() {
        Some(name) => Some(name.to_owned()),
        None => std::fs::canonicalize(path)
            .with_context(|| format!("cannot resolve {}", path.display()))?
            .file_name()
            .map(|n| n.to_owned()),
    };
    Ok(name.map(|n| n.to_string_lossy().into_owned()))
}

#[cfg(unix)]
fn permission_bits(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    meta.permissions().mode() & 0o777
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// A progress bar on stderr for large transfers, only when stderr is a terminal. It appears
/// once [`PROGRESS_FROM_BYTES`] have moved (so a small copy of unknown size shows nothing).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    shown: std::cell::Cell<bool>,
}

impl Progress {
    fn new(total: Option<u64>, what: &str) -> Self {
        if !std::io::stderr().is_terminal() || total.is_some_and(|t| t < PROGRESS_FROM_BYTES) {
            return Self {
                bar: None,
                shown: std::cell::Cell::new(false),
            };
        }
        let bar = match total {
            Some(total) => indicatif::ProgressBar::with_draw_target(
                Some(total),
                indicatif::ProgressDrawTarget::hidden(),
            )
            .with_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            ),
            None => indicatif::ProgressBar::with_draw_target(
                None,
                indicatif::ProgressDrawTarget::hidden(),
            )
            .with_style(
                indicatif::ProgressStyle::with_template("{msg} {bytes} {bytes_per_sec}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            ),
        };
        bar.set_message(what.to_string());
        Self {
            bar: Some(bar),
            shown: std::cell::Cell::new(false),
        }
    }

    fn set(&self, bytes: u64) {
        let Some(bar) = &self.bar else {
            return;
        };
        bar.set_position(bytes);
        if !self.shown.get() && bytes >= PROGRESS_FROM_BYTES {
            self.shown.set(true);
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leading_colon_is_the_executor_and_dash_is_stdio() {
        assert_eq!(Side::parse(":/work/x"), Side::Remote("/work/x".into()));
        assert_eq!(Side::parse(":out/"), Side::Remote("out/".into()));
        assert_eq!(Side::parse(":"), Side::Remote(".".into()));
        assert_eq!(Side::parse("-"), Side::Stdio);
        assert_eq!(
            Side::parse("./patch.diff"),
            Side::Local("./patch.diff".into())
        );
        // A colon inside a local name is not a remote path (only a leading one is).
        assert_eq!(Side::parse("a:b"), Side::Local("a:b".into()));
        assert_eq!(Side::parse("./:x"), Side::Local("./:x".into()));
    }

    #[test]
    fn exactly_one_side_is_remote() {
        assert_eq!(
            plan("./patch.diff", ":/work/patch.diff").unwrap(),
            Copy::Upload {
                from: Side::Local("./patch.diff".into()),
                to: "/work/patch.diff".into()
            }
        );
        assert_eq!(
            plan(":out/", "./out").unwrap(),
            Copy::Download {
                from: "out/".into(),
                to: Side::Local("./out".into())
            }
        );
        assert_eq!(
            plan("-", ":f").unwrap(),
            Copy::Upload {
                from: Side::Stdio,
                to: "f".into()
            }
        );
        assert_eq!(
            plan(":f", "-").unwrap(),
            Copy::Download {
                from: "f".into(),
                to: Side::Stdio
            }
        );
        let both = plan(":a", ":b").unwrap_err().to_string();
        assert!(both.contains("one side must be local"), "{both}");
        let neither = plan("a", "b").unwrap_err().to_string();
        assert!(neither.contains(":PATH"), "{neither}");
        assert!(plan("-", "-").is_err());
    }

    #[test]
    fn into_a_directory_keeps_the_source_name_unless_its_contents_are_meant() {
        assert_eq!(last_component("out/"), Some("out"));
        assert_eq!(last_component("/work/a/b.txt"), Some("b.txt"));
        assert_eq!(last_component("out/."), None);
        assert_eq!(last_component("."), None);
        assert_eq!(last_component("/"), None);
        assert_eq!(inside("/work/", Some("b.txt")), "/work/b.txt");
        assert_eq!(inside("/work", None), "/work");
    }

    #[test]
    fn a_local_source_is_named_by_its_last_component() {
        assert_eq!(
            local_name(Path::new("./dir/patch.diff")).unwrap(),
            Some("patch.diff".into())
        );
        assert_eq!(local_name(Path::new("dir/.")).unwrap(), None);
        let here = std::env::current_dir().unwrap();
        let expected = here.file_name().map(|n| n.to_string_lossy().into_owned());
        assert_eq!(local_name(Path::new(".")).unwrap(), expected);
    }
}
