//! A client's disk quota as configured (flags, clients file): a value checked once, apart from
//! the volumes that enforce it (`workspaces/volumes.rs`), so the clients table and the
//! workspaces each depend on it and not on each other.

/// A client's disk quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskQuota {
    /// Size of its filesystem (usable: this less ext4's metadata and journal).
    pub bytes: u64,
    /// Inodes of its filesystem (files, directories, symlinks), less the few ext4 keeps.
    pub files: u64,
}

/// Smallest quota accepted: ext4 needs room for its metadata and journal.
pub const MIN_BYTES: u64 = 8 * 1024 * 1024;
/// Fewest inodes accepted: the directories the daemon makes in a volume, and some to spare.
pub const MIN_FILES: u64 = 64;
/// Files of a quota given in bytes only: one per 16 KiB, mkfs.ext4's own default ratio.
const BYTES_PER_FILE: u64 = 16 * 1024;

impl DiskQuota {
    /// The quota from a byte and a file limit, either of which may be absent.
    pub fn from_limits(bytes: Option<u64>, files: Option<u64>) -> Option<Result<Self, String>> {
        let (bytes, files) = match (bytes, files) {
            (None, None) => return None,
            (Some(b), f) => (b, f.unwrap_or((b / BYTES_PER_FILE).max(MIN_FILES))),
            (None, Some(_)) => {
                return Some(Err(
                    "a file quota needs a byte quota too (the size of the client's filesystem)"
                        .into(),
                ))
            }
        };
        if bytes < MIN_BYTES {
            return Some(Err(format!(
                "a disk quota of {bytes} bytes is below the smallest, {MIN_BYTES} (ext4's metadata and journal)"
            )));
        }
        if files < MIN_FILES {
            return Some(Err(format!(
                "a file quota of {files} is below the smallest, {MIN_FILES}"
            )));
        }
        Some(Ok(Self { bytes, files }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_needs_bytes_and_room_for_ext4() {
        assert_eq!(DiskQuota::from_limits(None, None), None);
        assert!(matches!(
            DiskQuota::from_limits(None, Some(100)),
            Some(Err(_))
        ));
        assert!(matches!(
            DiskQuota::from_limits(Some(1024), None),
            Some(Err(_))
        ));
        assert_eq!(
            DiskQuota::from_limits(Some(64 << 20), None),
            Some(Ok(DiskQuota {
                bytes: 64 << 20,
                files: 4096
            }))
        );
        assert_eq!(
            DiskQuota::from_limits(Some(64 << 20), Some(100)),
            Some(Ok(DiskQuota {
                bytes: 64 << 20,
                files: 100
            }))
        );
    }
}
