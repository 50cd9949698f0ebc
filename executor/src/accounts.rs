//! The host's users and groups by number, read from `/etc/passwd` and `/etc/group` themselves.
//!
//! Not through libc's `getpwuid`/`getgrgid`: those consult every source `/etc/nsswitch.conf`
//! names, and for a source other than `files` glibc loads a module (`libnss_systemd.so.2`,
//! `libnss_sss.so.2`) into the daemon. The executor that ships is one static binary (glibc
//! linked in), which would load the machine's own modules, built against another libc; and a
//! command that may write `/etc` (task-container) could name a module of its own for the
//! root daemon to load at its next look. Users only another source knows (LDAP, systemd's
//! dynamic users) are therefore not seen (docs/operating.md, clients file, `uid`).

/// `/etc/passwd` and `/etc/group` as read once (either unreadable: empty, naming nobody).
pub(crate) struct Accounts {
    passwd: String,
    group: String,
}

impl Accounts {
    pub(crate) fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        Self {
            passwd: read("/etc/passwd"),
            group: read("/etc/group"),
        }
    }

    /// The name of the user whose uid is `uid`, if any.
    pub(crate) fn user_named(&self, uid: u32) -> Option<String> {
        name_with_id(&self.passwd, uid)
    }

    /// The name of the group whose gid is `gid`, if any.
    pub(crate) fn group_named(&self, gid: u32) -> Option<String> {
        name_with_id(&self.group, gid)
    }
}

/// The sources `/etc/nsswitch.conf` names for users or groups that these functions do not read:
/// all but `files`, `compat` (the files, with NIS entries this host would not have) and
/// `systemd` (its dynamic users, which have no files and are not a host's people). A
/// client's `uid` that one of them knows (an LDAP or sssd user) is not refused; the daemon
/// says so at start (`clients::check_uids`).
pub(crate) fn unread_sources() -> Vec<String> {
    std::fs::read_to_string("/etc/nsswitch.conf")
        .map(|text| unread_sources_in(&text))
        .unwrap_or_default()
}

fn unread_sources_in(nsswitch: &str) -> Vec<String> {
    let mut unread: Vec<String> = Vec::new();
    for line in nsswitch.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let Some((database, sources)) = line.split_once(':') else {
            continue;
        };
        if !matches!(database.trim(), "passwd" | "group") {
            continue;
        }
        // Actions in brackets (`[NOTFOUND=return]`) are not sources.
        for source in sources.split_whitespace().filter(|s| !s.starts_with('[')) {
            if !matches!(source, "files" | "compat" | "systemd")
                && !unread.iter().any(|u| u == source)
            {
                unread.push(source.to_string());
            }
        }
    }
    unread
}

/// The first field of the first line of `text` (colon-separated, as passwd(5) and group(5))
/// whose third field is `id`.
fn name_with_id(text: &str, id: u32) -> Option<String> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        let _password = fields.next()?;
        let number = fields.next()?.trim().parse::<u32>().ok()?;
        (number == id && !name.is_empty() && !name.starts_with('#')).then(|| name.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_name_by_the_third_field_and_skips_what_is_not_an_entry() {
        let file = "# comment:x:7:7\nroot:x:0:0:root:/root:/bin/bash\n\nbroken\n+:::\n\
                    ssl-cert:x:103:\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
        assert_eq!(name_with_id(file, 0).as_deref(), Some("root"));
        assert_eq!(name_with_id(file, 103).as_deref(), Some("ssl-cert"));
        assert_eq!(name_with_id(file, 65534).as_deref(), Some("nobody"));
        assert_eq!(name_with_id(file, 7), None);
        assert_eq!(name_with_id(file, 1000), None);
        assert_eq!(name_with_id("", 0), None);
    }

    #[test]
    fn sources_other_than_the_files_are_named_once_and_other_databases_ignored() {
        let conf = "# passwd: ldap\npasswd:   files systemd\ngroup: files [NOTFOUND=return] sss ldap # x\n\
                    hosts: files mdns4_minimal dns\nshadow: files sss\ngroup: sss\n";
        assert_eq!(unread_sources_in(conf), ["sss", "ldap"]);
        // Control: Debian's default, and compat.
        assert!(unread_sources_in("passwd: files systemd\ngroup: compat systemd\n").is_empty());
        assert!(unread_sources_in("").is_empty());
    }

    #[test]
    fn this_hosts_root_user_and_group_are_found() {
        let accounts = Accounts::read();
        assert_eq!(accounts.user_named(0).as_deref(), Some("root"));
        assert_eq!(accounts.group_named(0).as_deref(), Some("root"));
    }
}
