//! The locale commands get. The profiles ask for `C.UTF-8` (programs then read and print UTF-8
//! file names and text as the model wrote them); a root without that locale gets `C` instead,
//! since bash, like every glibc program, warns at each start when `LC_ALL` names a locale it
//! cannot load (`bash: warning: setlocale: LC_ALL: cannot change locale (C.UTF-8)`), and
//! that line would come before the command's own output: a submission marker would no longer
//! be the first line.
//!
//! glibc finds `C.UTF-8` (glibc 2.35 added it as a locale to install, not a built-in one;
//! Debian and Fedora shipped it earlier as a file) in its locale archive,
//! `/usr/lib/locale/locale-archive`, or as a directory `/usr/lib/locale/C.UTF-8/` or
//! `C.utf8/` (the codeset normalized), where `LOCPATH` does not say otherwise. musl accepts
//! the name without any file. Checked once per root, with a `stat` or two where the directory
//! exists (every Debian and Ubuntu), reading only the archive's name table otherwise.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The UTF-8 locale the profiles name, and what takes its place where a root lacks it.
pub const UTF8: &str = "C.UTF-8";
pub const FALLBACK: &str = "C";

/// `locarhead.magic` of glibc's `locale/locarchive.h`.
const ARCHIVE_MAGIC: u32 = 0xde02_0109;
/// Bounds for reading an archive's name table: a full `locales-all` archive names about 500
/// locales in a few kilobytes; anything far beyond is not an archive we should trust.
const MAX_NAMES: u64 = 1 << 20;
const MAX_STRINGS: u64 = 16 << 20;

/// Whether the locale `name` (`C.UTF-8`) can be loaded by programs whose root is `root`.
pub fn root_has(root: &Path, name: &str) -> bool {
    let normalized = normalize(name);
    let dir = root.join("usr/lib/locale");
    let as_dir = [name, normalized.as_str()]
        .iter()
        .any(|n| dir.join(n).join("LC_CTYPE").is_file());
    as_dir
        || archive_names(&dir.join("locale-archive")).is_some_and(|names| {
            names
                .iter()
                .any(|n| n == name || normalize(n) == normalized)
        })
        || is_musl(root)
}

/// glibc's normalized name: the codeset lower-cased without punctuation (`C.UTF-8` ->
/// `C.utf8`), as `_nl_normalize_codeset` makes it.
fn normalize(name: &str) -> String {
    match name.split_once('.') {
        Some((lang, rest)) => {
            let (codeset, modifier) = match rest.split_once('@') {
                Some((c, m)) => (c, Some(m)),
                None => (rest, None),
            };
            let codeset: String = codeset
                .chars()
                .filter(char::is_ascii_alphanumeric)
                .map(|c| c.to_ascii_lowercase())
                .collect();
            match modifier {
                Some(m) => format!("{lang}.{codeset}@{m}"),
                None => format!("{lang}.{codeset}"),
            }
        }
        None => name.to_string(),
    }
}

/// A musl root (Alpine): its loader, and no glibc's.
fn is_musl(root: &Path) -> bool {
    let musl = std::fs::read_dir(root.join("lib")).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("ld-musl-"))
        })
    });
    musl && !root.join("lib64/ld-linux-x86-64.so.2").exists()
}

/// The names of the locales in a glibc locale archive, from its header and name hash table
/// (`struct locarhead` and `struct namehashent` of `locale/locarchive.h`, native byte order).
/// `None` when there is no archive or it is not one.
fn archive_names(path: &Path) -> Option<Vec<String>> {
    let file = File::open(path).ok()?;
    let mut head = [0u8; 56];
    file.read_exact_at(&mut head, 0).ok()?;
    let word = |i: usize| -> u64 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&head[i * 4..i * 4 + 4]);
        u64::from(u32::from_ne_bytes(b))
    };
    if word(0) != u64::from(ARCHIVE_MAGIC) {
        return None;
    }
    let (hash_offset, hash_size) = (word(2), word(4));
    let (string_offset, string_used) = (word(5), word(6));
    if hash_size > MAX_NAMES || string_used > MAX_STRINGS {
        return None;
    }
    let mut table = vec![0u8; usize::try_from(hash_size * 12).ok()?];
    file.read_exact_at(&mut table, hash_offset).ok()?;
    let mut strings = vec![0u8; usize::try_from(string_used).ok()?];
    file.read_exact_at(&mut strings, string_offset).ok()?;
    let mut names = Vec::new();
    for entry in table.chunks_exact(12) {
        let field = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&entry[i * 4..i * 4 + 4]);
            u64::from(u32::from_ne_bytes(b))
        };
        let (name_offset, record) = (field(1), field(2));
        if name_offset == 0 || record == 0 {
            continue;
        }
        let Some(start) = name_offset
            .checked_sub(string_offset)
            .and_then(|s| usize::try_from(s).ok())
        else {
            continue;
        };
        let Some(rest) = strings.get(start..) else {
            continue;
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        names.push(String::from_utf8_lossy(&rest[..end]).into_owned());
    }
    Some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A locale archive as glibc's `localedef` lays one out, holding `names`.
    fn archive(names: &[&str]) -> Vec<u8> {
        let hash_offset = 56u32;
        let hash_size = names.len() as u32 + 3;
        let string_offset = hash_offset + hash_size * 12;
        let mut strings = Vec::new();
        let mut entries = Vec::new();
        for name in names {
            entries.push((string_offset + strings.len() as u32, 1000u32));
            strings.extend_from_slice(name.as_bytes());
            strings.push(0);
        }
        let mut out = Vec::new();
        for w in [
            ARCHIVE_MAGIC,
            0,
            hash_offset,
            names.len() as u32,
            hash_size,
            string_offset,
            strings.len() as u32,
            strings.len() as u32,
            0,
            0,
            0,
            0,
            0,
            0,
        ] {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        for i in 0..hash_size as usize {
            let (name, record) = entries.get(i).copied().unwrap_or((0, 0));
            for w in [7u32, name, record] {
                out.extend_from_slice(&w.to_ne_bytes());
            }
        }
        out.extend_from_slice(&strings);
        out
    }

    #[test]
    fn codesets_are_normalized_as_glibc_does() {
        assert_eq!(normalize("C.UTF-8"), "C.utf8");
        assert_eq!(normalize("en_US.UTF-8@euro"), "en_US.utf8@euro");
        assert_eq!(normalize("C"), "C");
    }

    #[test]
    fn a_root_has_c_utf8_as_a_directory_in_an_archive_or_by_musl_and_otherwise_not() {
        let root = tempfile::tempdir().unwrap();
        let locales = root.path().join("usr/lib/locale");
        std::fs::create_dir_all(&locales).unwrap();
        // Nothing: a busybox image, or glibc without the locale installed.
        assert!(!root_has(root.path(), UTF8));
        // An archive of other locales only, and an empty directory without LC_CTYPE.
        std::fs::write(
            locales.join("locale-archive"),
            archive(&["en_US.utf8", "de_DE.utf8"]),
        )
        .unwrap();
        std::fs::create_dir(locales.join("C.utf8")).unwrap();
        assert!(!root_has(root.path(), UTF8));
        // In the archive, by its normalized name (as localedef stores it).
        std::fs::write(
            locales.join("locale-archive"),
            archive(&["en_US.utf8", "C.utf8"]),
        )
        .unwrap();
        assert!(root_has(root.path(), UTF8));
        std::fs::remove_file(locales.join("locale-archive")).unwrap();
        assert!(!root_has(root.path(), UTF8));
        // As a directory (Debian's, Fedora's).
        std::fs::write(locales.join("C.utf8/LC_CTYPE"), b"").unwrap();
        assert!(root_has(root.path(), UTF8));
        // A file that is not an archive is no archive.
        assert_eq!(archive_names(&locales.join("C.utf8/LC_CTYPE")), None);

        // musl needs no file; a root with glibc's loader beside musl's is not musl's.
        let musl = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(musl.path().join("lib")).unwrap();
        std::fs::write(musl.path().join("lib/ld-musl-x86_64.so.1"), b"").unwrap();
        assert!(root_has(musl.path(), UTF8));
        std::fs::create_dir_all(musl.path().join("lib64")).unwrap();
        std::fs::write(musl.path().join("lib64/ld-linux-x86-64.so.2"), b"").unwrap();
        assert!(!root_has(musl.path(), UTF8));
    }
}
