//! The bearer token: read from a file, or generated and written 0600 on first start.
//!
//! The token only ever lives in this process's memory and in its file. It is never put on a
//! command line, into a command's environment, or into a log line; `Debug` prints a placeholder.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Shortest token accepted from a file: 128 bits of hex.
const MIN_TOKEN_CHARS: usize = 32;

pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read token file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write token file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {0} holds fewer than {MIN_TOKEN_CHARS} characters")]
    TooShort(PathBuf),
    #[error("token file {0} is readable by group or others; chmod 600 it")]
    Permissions(PathBuf),
    #[error("token file {path} belongs to uid {owner}, not to root or the daemon's user; whoever owns it can change the token")]
    Owner { path: PathBuf, owner: u32 },
    #[error("cannot get random bytes for a token: {0}")]
    Random(String),
}

impl Token {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Check a presented `Authorization` header value in constant time.
    #[cfg(test)]
    pub fn matches_header(&self, header: &[u8]) -> bool {
        let Some(presented) = header.strip_prefix(b"Bearer ") else {
            return false;
        };
        use subtle::ConstantTimeEq;
        // ct_eq on slices of different lengths is false without comparing contents, so only
        // the length can leak, and a prefix of the token never matches.
        bool::from(presented.ct_eq(&self.0))
    }

    /// Load the token from `path`, creating it with a fresh random token if it does not exist
    /// and `create` is allowed. Returns the token and whether it was generated.
    pub fn load_or_create(path: &Path, create: bool) -> Result<(Self, bool), TokenError> {
        use std::io::Read;
        use std::os::unix::fs::MetadataExt;
        let read_err = |source| TokenError::Read {
            path: path.to_path_buf(),
            source,
        };
        // One open file for the checks and the contents, so they are about the same file (a
        // path checked and then read could be swapped in between). A symlink is followed:
        // what counts is the file it leads to (Kubernetes mounts secrets as links).
        let file = match std::fs::File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                return Ok((Self::create(path)?, true));
            }
            Err(source) => return Err(read_err(source)),
        };
        let meta = file.metadata().map_err(read_err)?;
        let owner = meta.uid();
        if owner != 0 && owner != nix::unistd::geteuid().as_raw() {
            // Its owner could change the token under us.
            return Err(TokenError::Owner {
                path: path.to_path_buf(),
                owner,
            });
        }
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(TokenError::Permissions(path.to_path_buf()));
        }
        let mut text = String::new();
        file.take(64 * 1024)
            .read_to_string(&mut text)
            .map_err(read_err)?;
        let token = text.trim();
        if token.len() < MIN_TOKEN_CHARS {
            return Err(TokenError::TooShort(path.to_path_buf()));
        }
        Ok((Self(token.as_bytes().to_vec()), false))
    }

    fn create(path: &Path) -> Result<Self, TokenError> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| TokenError::Random(e.to_string()))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let write_err = |source| TokenError::Write {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(write_err)?;
        }
        // create_new + O_NOFOLLOW: never follow a planted symlink, never reuse a planted file.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(write_err)?;
        file.write_all(hex.as_bytes())
            .and_then(|()| file.write_all(b"\n"))
            .and_then(|()| file.sync_all())
            .map_err(write_err)?;
        Ok(Self(hex.into_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("executor-token-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn generated_token_is_private_and_accepted_only_whole() {
        let dir = temp_dir("gen");
        let path = dir.join("sub/token");
        let (token, created) = Token::load_or_create(&path, true).unwrap();
        assert!(created);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.trim();
        assert_eq!(text.len(), 64);
        assert!(token.matches_header(format!("Bearer {text}").as_bytes()));
        assert!(!token.matches_header(format!("Bearer {}", &text[..63]).as_bytes()));
        assert!(!token.matches_header(format!("Bearer {text}x").as_bytes()));
        assert!(!token.matches_header(text.as_bytes()));
        // A second start reads the same token instead of replacing it.
        let (again, created) = Token::load_or_create(&path, true).unwrap();
        assert!(!created);
        assert!(again.matches_header(format!("Bearer {text}").as_bytes()));
        assert_eq!(format!("{again:?}"), "Token(<redacted>)");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn world_readable_or_short_token_files_are_refused() {
        let dir = temp_dir("bad");
        let path = dir.join("token");
        std::fs::write(&path, "x".repeat(40)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            Token::load_or_create(&path, true),
            Err(TokenError::Permissions(_))
        ));
        std::fs::write(&path, "short").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            Token::load_or_create(&path, true),
            Err(TokenError::TooShort(_))
        ));
        assert!(matches!(
            Token::load_or_create(&dir.join("missing"), false),
            Err(TokenError::Read { .. })
        ));
        // Owned by someone else (only root can make that here).
        if nix::unistd::geteuid().is_root() {
            std::fs::write(&path, "y".repeat(40)).unwrap();
            nix::unistd::chown(&path, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            assert!(matches!(
                Token::load_or_create(&path, true),
                Err(TokenError::Owner { owner: 65534, .. })
            ));
            nix::unistd::chown(&path, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
        }
        // Control: a private file of ours, reached through a symlink, is read.
        std::fs::write(&path, "z".repeat(40)).unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let (token, created) = Token::load_or_create(&link, true).unwrap();
        assert!(!created && token.as_bytes() == "z".repeat(40).as_bytes());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
