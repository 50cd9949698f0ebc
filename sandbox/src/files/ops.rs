//! The file operations themselves, run in the confined payload (see the module above).
//!
//! Only ordinary file syscalls: no threads, no processes, so the payload's seccomp filter and
//! landlock rules judge each open, rename and unlink exactly as they would a command's.
//!
//! Framing: the first bytes on `output` are one [`Header`] line. A write consumes all of its
//! input before that line; a read writes the line, then the bytes it announced. A failure before
//! the header becomes an `Error` header; one after it (the reader went away, the file shrank)
//! can only cut the stream short, and the exit code 1 says so.

use std::error::Error as StdError;
use std::ffi::{OsStr, OsString};
use std::fs::{self, DirBuilder, Metadata, OpenOptions, Permissions};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use protocol::FileStat;

use super::{ErrorKind, FileOp, Header, MAX_LIST_ENTRIES};

/// Copy buffer for uploads and downloads.
const CHUNK: usize = 64 * 1024;
/// Mode of parent directories a write or unpack creates (before the umask, as `mkdir -p`).
const DIR_MODE: u32 = 0o755;
/// Bytes of the destination's name kept in a temporary file's name: the rest of
/// `.<name>.upload-<16 hex>` must fit NAME_MAX (255) too.
const TEMP_NAME_BYTES: usize = 200;

/// Carry out `op` with `input` as stdin and `output` as stdout; returns the exit code.
pub fn serve(op: &FileOp, input: &mut dyn Read, output: &mut dyn Write) -> i32 {
    // An upload's content is framed: end-of-file before its commit is a cut-off upload.
    let mut framed = super::Framed::new(input);
    let input: &mut dyn Read = &mut framed;
    let outcome = match op {
        FileOp::Write {
            path,
            mode,
            parents,
            max_bytes,
        } => write_file(Path::new(path), *mode, *parents, *max_bytes, input)
            .map_err(Failure::Refused)
            .and_then(|header| send_header(output, &header)),
        FileOp::Unpack {
            path,
            parents,
            max_bytes,
        } => unpack(Path::new(path), *parents, *max_bytes, input)
            .map_err(Failure::Refused)
            .and_then(|header| send_header(output, &header)),
        FileOp::Read {
            path,
            offset,
            length,
        } => read_file(Path::new(path), *offset, *length, output),
        FileOp::Pack { path } => pack(Path::new(path), output),
        FileOp::Stat { path } => stat(Path::new(path))
            .map_err(Failure::Refused)
            .and_then(|header| send_header(output, &header)),
        FileOp::List { path } => list(Path::new(path))
            .map_err(Failure::Refused)
            .and_then(|header| send_header(output, &header)),
    };
    match outcome {
        Ok(()) => 0,
        Err(Failure::Refused(error)) => {
            let header = Header::Error {
                kind: error.kind,
                message: error.message,
            };
            // Nothing more to do if even this cannot be written: the exit code tells.
            let _ = send_header(output, &header);
            1
        }
        Err(Failure::Broken(reason)) => {
            // The header went out already, so stderr is the only place left for the reason.
            let _ = writeln!(io::stderr(), "{reason}");
            1
        }
    }
}

/// An operation that failed before its header: the error becomes the header.
#[derive(Debug)]
struct OpError {
    kind: ErrorKind,
    message: String,
}

impl OpError {
    /// `cannot <doing> <path>: <the OS error and its causes>`.
    fn io(doing: &str, path: &Path, error: &io::Error) -> Self {
        Self {
            kind: kind_of(error),
            message: format!("cannot {doing} {}: {}", path.display(), chain(error)),
        }
    }

    fn invalid(message: String) -> Self {
        Self {
            kind: ErrorKind::Invalid,
            message,
        }
    }
}

enum Failure {
    /// Before the header: answered with an `Error` header.
    Refused(OpError),
    /// After the header (or while writing it): the stream stops short.
    Broken(String),
}

/// How an OS error is reported. Looks at the errno first; errors wrapped by the tar crate keep
/// only the `io::ErrorKind`, so that is the fallback.
fn kind_of(error: &io::Error) -> ErrorKind {
    match error.raw_os_error() {
        Some(libc::ENOENT) => return ErrorKind::NotFound,
        Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::EXDEV) => return ErrorKind::Denied,
        Some(_) => return ErrorKind::Invalid,
        None => {}
    }
    match error.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        io::ErrorKind::PermissionDenied
        | io::ErrorKind::ReadOnlyFilesystem
        | io::ErrorKind::CrossesDevices => ErrorKind::Denied,
        _ => ErrorKind::Invalid,
    }
}

/// An error and its sources, `: `-separated (the tar crate's errors name the entry on top and
/// keep the OS error as their source).
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// One JSON line.
fn send_header(output: &mut dyn Write, header: &Header) -> Result<(), Failure> {
    let mut line = serde_json::to_vec(header)
        .map_err(|error| Failure::Broken(format!("cannot encode the header: {error}")))?;
    line.push(b'\n');
    output
        .write_all(&line)
        .and_then(|()| output.flush())
        .map_err(|error| Failure::Broken(format!("cannot write the header: {error}")))
}

fn ok(path: &Path) -> Header {
    Header::Ok {
        path: path.to_string_lossy().into_owned(),
        bytes: None,
        stat: None,
        entries: None,
        truncated: false,
    }
}

/// `path` as an absolute path without following its last component: the canonical parent
/// joined with the final name (so a symbolic link at `path` is named, not its target). A path
/// without a final name (`/`, `..`) is canonicalized whole; if the parent cannot be resolved,
/// the current directory is joined lexically.
fn absolute(path: &Path) -> PathBuf {
    let resolved = match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            parent.canonicalize().map(|parent| parent.join(name))
        }
        _ => path.canonicalize(),
    };
    resolved.unwrap_or_else(|_| lexical(path))
}

/// `path` joined to the current directory, for naming a path that may not exist yet.
fn lexical(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A parent to write in: `.` for a bare name.
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

fn kind_name(metadata: &Metadata) -> &'static str {
    let file_type = metadata.file_type();
    if file_type.is_file() {
        "file"
    } else if file_type.is_dir() {
        "dir"
    } else if file_type.is_symlink() {
        "symlink"
    } else if file_type.is_fifo() {
        "fifo"
    } else if file_type.is_socket() {
        "socket"
    } else if file_type.is_char_device() {
        "char"
    } else {
        "block"
    }
}

/// `metadata` as the protocol describes a path; `path` is read as a link if it is one.
fn file_stat(name: String, path: &Path, metadata: &Metadata) -> FileStat {
    let target = if metadata.file_type().is_symlink() {
        fs::read_link(path)
            .ok()
            .map(|target| target.to_string_lossy().into_owned())
    } else {
        None
    };
    FileStat {
        name,
        kind: kind_name(metadata).to_owned(),
        size: metadata.len(),
        mode: metadata.mode() & 0o7777,
        uid: metadata.uid(),
        gid: metadata.gid(),
        mtime: metadata.mtime(),
        target,
    }
}

/// Reads at most `max` bytes of `inner`: one more is an error (and `exceeded` set), so a
/// stream is refused as soon as it is too long rather than after it has been taken in.
struct Limited<'a> {
    inner: &'a mut dyn Read,
    max: u64,
    count: u64,
    exceeded: bool,
}

impl<'a> Limited<'a> {
    fn new(inner: &'a mut dyn Read, max: u64) -> Self {
        Self {
            inner,
            max,
            count: 0,
            exceeded: false,
        }
    }

    fn too_large(&self, doing: &str, path: &Path) -> OpError {
        OpError {
            kind: ErrorKind::TooLarge,
            message: format!(
                "cannot {doing} {}: more than {} bytes",
                path.display(),
                self.max
            ),
        }
    }
}

impl Read for Limited<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.exceeded {
            return Err(io::Error::other("input over the limit"));
        }
        // Room for one byte past the limit, to tell "exactly max" from "more".
        let room = self.max.saturating_sub(self.count).saturating_add(1);
        let want = usize::try_from(room).map_or(buf.len(), |room| room.min(buf.len()));
        let got = self.inner.read(&mut buf[..want])?;
        self.count += got as u64;
        if self.count > self.max {
            self.exceeded = true;
            return Err(io::Error::other("input over the limit"));
        }
        Ok(got)
    }
}

/// Unlinks the temporary file unless the rename took it.
struct TempFile {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// `.<name>.upload-<16 random hex>` beside the destination: the same directory, so the final
/// rename stays within one filesystem and is atomic.
fn temp_path(dir: &Path, name: &OsStr, shown: &Path) -> Result<PathBuf, OpError> {
    let mut random = [0u8; 8];
    getrandom::fill(&mut random)
        .map_err(|error| OpError::invalid(format!("cannot write {}: {error}", shown.display())))?;
    let name = name.as_bytes();
    let mut temp = b".".to_vec();
    temp.extend_from_slice(&name[..name.len().min(TEMP_NAME_BYTES)]);
    temp.extend_from_slice(b".upload-");
    temp.extend_from_slice(hex::encode(random).as_bytes());
    Ok(dir.join(OsString::from_vec(temp)))
}

/// Upload: stdin to a temporary file, renamed over `path`. The rename replaces whatever
/// `path` was (a symbolic link, a hard link to another file) instead of writing through it,
/// and a reader never sees half a file.
fn write_file(
    path: &Path,
    mode: u32,
    parents: bool,
    max_bytes: u64,
    input: &mut dyn Read,
) -> Result<Header, OpError> {
    if mode & !0o7777 != 0 {
        return Err(OpError::invalid(format!(
            "cannot write {}: mode {mode:#o} has bits beyond 0o7777",
            path.display()
        )));
    }
    let Some(name) = path.file_name() else {
        return Err(OpError::invalid(format!(
            "cannot write {}: not a file name",
            path.display()
        )));
    };
    let dir = parent_of(path);
    if parents {
        DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(|error| OpError::io("create directory", &lexical(dir), &error))?;
    }
    let shown = absolute(path);
    // rename(2) would refuse too (EISDIR), but only after the whole upload was taken in.
    if fs::symlink_metadata(path).is_ok_and(|metadata| metadata.is_dir()) {
        return Err(OpError::invalid(format!(
            "cannot write {}: it is a directory",
            shown.display()
        )));
    }

    let temp_path = temp_path(dir, name, &shown)?;
    // O_EXCL: never reuse (or follow a link at) a name someone else made. std adds O_CLOEXEC.
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temp_path)
        .map_err(|error| OpError::io("write", &shown, &error))?;
    let mut temp = TempFile {
        path: temp_path,
        armed: true,
    };

    let mut limited = Limited::new(input, max_bytes);
    let mut buf = vec![0u8; CHUNK];
    loop {
        let got = match limited.read(&mut buf) {
            Ok(0) => break,
            Ok(got) => got,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) if limited.exceeded => return Err(limited.too_large("write", &shown)),
            Err(error) => return Err(OpError::io("read the upload for", &shown, &error)),
        };
        file.write_all(&buf[..got])
            .map_err(|error| OpError::io("write", &shown, &error))?;
    }
    // open(2)'s mode went through the umask; fchmod(2) does not.
    file.set_permissions(Permissions::from_mode(mode))
        .map_err(|error| OpError::io("set the mode of", &shown, &error))?;
    drop(file);
    fs::rename(&temp.path, path).map_err(|error| OpError::io("write", &shown, &error))?;
    temp.armed = false;

    let mut header = ok(&shown);
    if let Header::Ok { bytes, .. } = &mut header {
        *bytes = Some(limited.count);
    }
    Ok(header)
}

/// Upload of a tar stream into the directory `path`.
fn unpack(
    path: &Path,
    parents: bool,
    max_bytes: u64,
    input: &mut dyn Read,
) -> Result<Header, OpError> {
    match DirBuilder::new()
        .recursive(parents)
        .mode(DIR_MODE)
        .create(path)
    {
        Ok(()) => {}
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
        Err(error) => return Err(OpError::io("create directory", &lexical(path), &error)),
    }
    let shown = absolute(path);
    // The tar crate checks each entry's parent against this, canonical, path.
    let dst = path
        .canonicalize()
        .map_err(|error| OpError::io("unpack into", &shown, &error))?;
    if !dst.is_dir() {
        return Err(OpError::invalid(format!(
            "cannot unpack into {}: not a directory",
            shown.display()
        )));
    }

    let mut limited = Limited::new(input, max_bytes);
    let unpacked = unpack_entries(&mut limited, &dst, &shown);
    if limited.exceeded {
        return Err(limited.too_large("unpack into", &shown));
    }
    unpacked?;
    // The archive ends at its first zero block; the rest (the second zero block, a writer's
    // padding to a whole record) is read too, so the sender is never left blocked or cut off.
    match io::copy(&mut limited, &mut io::sink()) {
        Ok(_) => {}
        Err(_) if limited.exceeded => return Err(limited.too_large("unpack into", &shown)),
        Err(error) => return Err(OpError::io("read the upload for", &shown, &error)),
    }

    let mut header = ok(&shown);
    if let Header::Ok { bytes, .. } = &mut header {
        *bytes = Some(limited.count);
    }
    Ok(header)
}

/// `tar::Archive::unpack`, except that an entry it would skip (one with a `..` component) fails
/// the upload instead of vanishing silently. Each entry goes through `unpack_in`, which strips
/// a leading `/`, refuses `..`, replaces (never writes through) what is at the entry's path,
/// and checks that the entry's parent, links resolved, is inside `dst`.
fn unpack_entries(input: &mut dyn Read, dst: &Path, shown: &Path) -> Result<(), OpError> {
    let failed = |error: io::Error| OpError::io("unpack into", shown, &error);
    let mut archive = tar::Archive::new(input);
    // Permission bits only (mode & 0o777), as a plain upload takes them: no set-uid or
    // set-gid file comes out of an archive (under task-container it would be root's).
    archive.set_preserve_permissions(false);
    archive.set_preserve_ownerships(false);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_unpack_xattrs(false);

    // Directories last, deepest first, as the tar crate does: a read-only directory in the
    // archive must not stop its own entries from being written.
    let mut directories = Vec::new();
    for entry in archive.entries().map_err(failed)? {
        let mut entry = entry.map_err(failed)?;
        if entry.header().entry_type() == tar::EntryType::Directory {
            directories.push(entry);
            continue;
        }
        if !entry.unpack_in(dst).map_err(failed)? {
            return Err(refused_entry(&entry, shown));
        }
    }
    directories.sort_by(|a, b| b.path_bytes().cmp(&a.path_bytes()));
    for mut entry in directories {
        if !entry.unpack_in(dst).map_err(failed)? {
            return Err(refused_entry(&entry, shown));
        }
    }
    Ok(())
}

fn refused_entry<R: Read>(entry: &tar::Entry<'_, R>, shown: &Path) -> OpError {
    OpError::invalid(format!(
        "cannot unpack into {}: entry {} leaves the directory",
        shown.display(),
        String::from_utf8_lossy(&entry.path_bytes())
    ))
}

/// Download of a byte range of a regular file.
fn read_file(
    path: &Path,
    offset: u64,
    length: Option<u64>,
    output: &mut dyn Write,
) -> Result<(), Failure> {
    let shown = absolute(path);
    let refused = |error: io::Error| Failure::Refused(OpError::io("read", &shown, &error));
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below anyway);
    // it changes nothing for a regular file.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(refused)?;
    let metadata = file.metadata().map_err(refused)?;
    if !metadata.is_file() {
        return Err(Failure::Refused(OpError::invalid(format!(
            "cannot read {}: not a regular file (a {})",
            shown.display(),
            kind_name(&metadata)
        ))));
    }
    let count = metadata
        .len()
        .saturating_sub(offset)
        .min(length.unwrap_or(u64::MAX));
    let mut file = file;
    if count > 0 {
        io::Seek::seek(&mut file, io::SeekFrom::Start(offset)).map_err(refused)?;
    }

    let name = shown.to_string_lossy().into_owned();
    let mut header = ok(&shown);
    if let Header::Ok { bytes, stat, .. } = &mut header {
        *bytes = Some(count);
        *stat = Some(file_stat(name, &shown, &metadata));
    }
    send_header(output, &header)?;

    let mut body = file.take(count);
    let mut buf = vec![0u8; CHUNK];
    let mut sent = 0u64;
    loop {
        let got = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(got) => got,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                return Err(Failure::Broken(format!(
                    "cannot read {}: {error}",
                    shown.display()
                )))
            }
        };
        output.write_all(&buf[..got]).map_err(|error| {
            Failure::Broken(format!("cannot send {}: {error}", shown.display()))
        })?;
        sent += got as u64;
    }
    output
        .flush()
        .map_err(|error| Failure::Broken(format!("cannot send {}: {error}", shown.display())))?;
    if sent < count {
        return Err(Failure::Broken(format!(
            "{} shrank while it was read: {sent} of {count} bytes sent",
            shown.display()
        )));
    }
    Ok(())
}

/// Download of a directory as a tar stream.
fn pack(path: &Path, output: &mut dyn Write) -> Result<(), Failure> {
    let shown = absolute(path);
    let refused = |error: io::Error| Failure::Refused(OpError::io("pack", &shown, &error));
    // The directory itself is followed if it is a link (as `tar -C path .` would); nothing
    // inside it is.
    let root = path.canonicalize().map_err(refused)?;
    let metadata = fs::metadata(&root).map_err(refused)?;
    if !metadata.is_dir() {
        return Err(Failure::Refused(OpError::invalid(format!(
            "cannot pack {}: not a directory",
            shown.display()
        ))));
    }
    // An unreadable top directory is an error header, not an empty archive.
    fs::read_dir(&root).map_err(refused)?;
    send_header(output, &ok(&shown))?;

    let mut out = BufWriter::with_capacity(CHUNK, output);
    pack_tree(&root, &mut out)
        .and_then(|()| out.flush())
        .map_err(|error| {
            Failure::Broken(format!(
                "cannot pack {}: {}",
                shown.display(),
                chain(&error)
            ))
        })
}

/// Every entry under `root`, named relative to it (`.`, `a`, `sub/b`), parents before their
/// children, siblings sorted. Symbolic links are stored as links; sockets, which tar cannot
/// hold, are left out.
fn pack_tree(root: &Path, out: &mut dyn Write) -> io::Result<()> {
    let mut builder = tar::Builder::new(out);
    let mut stack = vec![(PathBuf::from("."), root.to_path_buf())];
    while let Some((name, source)) = stack.pop() {
        let metadata = fs::symlink_metadata(&source)?;
        let file_type = metadata.file_type();
        let mut header = tar::Header::new_gnu();
        header.set_metadata_in_mode(&metadata, tar::HeaderMode::Complete);
        header.set_mode(metadata.mode() & 0o7777);
        header.set_size(0);
        if file_type.is_dir() {
            builder.append_data(&mut header, &name, io::empty())?;
            let mut children = fs::read_dir(&source)?
                .map(|entry| entry.map(|entry| entry.file_name()))
                .collect::<io::Result<Vec<_>>>()?;
            children.sort();
            for child in children.into_iter().rev() {
                stack.push((name.join(&child), source.join(&child)));
            }
        } else if file_type.is_symlink() {
            let target = fs::read_link(&source)?;
            builder.append_link(&mut header, &name, &target)?;
        } else if file_type.is_file() {
            // O_NOFOLLOW and O_NONBLOCK: if the file was swapped for a link or a FIFO since
            // the lstat, fail or go on rather than follow it or wait for a writer.
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(&source)?;
            let metadata = file.metadata()?;
            if !metadata.is_file() {
                continue;
            }
            let size = metadata.len();
            header.set_metadata_in_mode(&metadata, tar::HeaderMode::Complete);
            header.set_mode(metadata.mode() & 0o7777);
            header.set_size(size);
            // Exactly `size` bytes whatever the file does meanwhile (zeros if it shrinks),
            // so the archive stays well formed.
            let body = file.take(size).chain(io::repeat(0)).take(size);
            builder.append_data(&mut header, &name, body)?;
        } else if file_type.is_socket() {
            continue;
        } else {
            // FIFO, character or block device: a header alone.
            let device = metadata.rdev();
            header.set_device_major(device_number(nix::sys::stat::major(device))?)?;
            header.set_device_minor(device_number(nix::sys::stat::minor(device))?)?;
            builder.append_data(&mut header, &name, io::empty())?;
        }
    }
    builder.into_inner()?;
    Ok(())
}

fn device_number(number: u64) -> io::Result<u32> {
    u32::try_from(number).map_err(|_| io::Error::other("device number too large for tar"))
}

/// Facts about `path` itself (a link is not followed).
fn stat(path: &Path) -> Result<Header, OpError> {
    let shown = absolute(path);
    let metadata =
        fs::symlink_metadata(path).map_err(|error| OpError::io("stat", &shown, &error))?;
    let name = shown.to_string_lossy().into_owned();
    let mut header = ok(&shown);
    if let Header::Ok { stat, .. } = &mut header {
        *stat = Some(file_stat(name, path, &metadata));
    }
    Ok(header)
}

/// A directory's entries, sorted by name, the first [`MAX_LIST_ENTRIES`].
fn list(path: &Path) -> Result<Header, OpError> {
    let shown = absolute(path);
    let failed = |error: io::Error| OpError::io("list", &shown, &error);
    // Names first, sorted, cut; only the entries kept are stat'ed.
    let mut names = fs::read_dir(path)
        .map_err(failed)?
        .map(|entry| entry.map(|entry| entry.file_name()))
        .collect::<io::Result<Vec<_>>>()
        .map_err(failed)?;
    names.sort();
    let mut truncated = names.len() > MAX_LIST_ENTRIES;
    names.truncate(MAX_LIST_ENTRIES);

    let mut listed = Vec::with_capacity(names.len());
    // The answer must fit the header line the daemon reads: names and link targets of up to
    // 4 KiB each would not, 10,000 of them (JSON escaping can make a byte six).
    let mut room = super::MAX_HEADER_BYTES / 2;
    for name in names {
        let child = path.join(&name);
        match fs::symlink_metadata(&child) {
            Ok(metadata) => {
                let stat = file_stat(name.to_string_lossy().into_owned(), &child, &metadata);
                let size =
                    6 * (stat.name.len() + stat.target.as_ref().map_or(0, String::len)) + 160;
                if size > room {
                    truncated = true;
                    break;
                }
                room -= size;
                listed.push(stat);
            }
            // Removed since the directory was read.
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(failed(error)),
        }
    }

    let mut header = ok(&shown);
    if let Header::Ok {
        entries,
        truncated: cut,
        ..
    } = &mut header
    {
        *entries = Some(listed);
        *cut = truncated;
    }
    Ok(header)
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
