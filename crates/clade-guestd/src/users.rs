//! Users and groups, read straight from `/etc/passwd` and `/etc/group`.
//!
//! The agent is a static binary, so it must never go through NSS
//! (`getpwnam` and friends would try to load shared modules). The guest's
//! accounts live in those two files only, which is all Debian's base image uses.

use std::path::Path;

/// An account to run a command as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
    /// Supplementary groups, the primary group first.
    pub groups: Vec<u32>,
}

impl User {
    fn root() -> Self {
        Self { name: "root".into(), uid: 0, gid: 0, home: "/root".into(), shell: "/bin/sh".into(), groups: vec![0] }
    }

    /// A uid no passwd entry names: its own group, home `/`.
    fn numeric(uid: u32) -> Self {
        Self { name: uid.to_string(), uid, gid: uid, home: "/".into(), shell: "/bin/sh".into(), groups: vec![uid] }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UsersError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no user {0:?} in /etc/passwd")]
    Unknown(String),
    #[error("no group {0:?} in /etc/group")]
    UnknownGroup(String),
}

/// Looks a user up as a Dockerfile's `USER` names one: a name or a uid,
/// optionally `:group` (a name or a gid); `None` means root. A uid the
/// passwd file lacks is still a user (home `/`), as in Docker; so is root.
pub fn lookup(name: Option<&str>) -> Result<User, UsersError> {
    lookup_in(Path::new("/etc"), name)
}

/// [`lookup`] against the `passwd` and `group` files of another directory.
pub fn lookup_in(etc: &Path, name: Option<&str>) -> Result<User, UsersError> {
    let passwd = read_optional(&etc.join("passwd"))?;
    let mut user = match name {
        // Root works even on an image whose passwd lacks it (or has none).
        None => parse_passwd(&passwd, |e| e.uid == 0).unwrap_or_else(User::root),
        Some(spec) => {
            let name = spec.split_once(':').map_or(spec, |(name, _)| name);
            let numeric = name.parse::<u32>().ok();
            parse_passwd(&passwd, |e| e.name == name || Some(e.uid) == numeric)
                .or_else(|| numeric.map(User::numeric))
                .or_else(|| (name == "root").then(User::root))
                .ok_or_else(|| UsersError::Unknown(name.to_string()))?
        }
    };
    let group = read_optional(&etc.join("group"))?;
    if let Some((_, group_spec)) = name.and_then(|spec| spec.split_once(':')) {
        user.gid = group_spec
            .parse::<u32>()
            .ok()
            .or_else(|| gid_in(&group, group_spec))
            .ok_or_else(|| UsersError::UnknownGroup(group_spec.to_string()))?;
    }
    user.groups = supplementary_groups(&group, &user.name, user.gid);
    Ok(user)
}

/// A missing file reads as empty: a minimal image may have no /etc/group.
fn read_optional(path: &Path) -> Result<String, UsersError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(UsersError::Read { path: path.display().to_string(), source }),
    }
}

/// The first passwd entry matching `pred`; malformed lines are skipped.
fn parse_passwd(text: &str, pred: impl Fn(&User) -> bool) -> Option<User> {
    text.lines().filter_map(parse_passwd_line).find(|u| pred(u))
}

fn parse_passwd_line(line: &str) -> Option<User> {
    let fields: Vec<&str> = line.split(':').collect();
    if fields.len() < 7 || fields[0].is_empty() || line.starts_with('#') {
        return None;
    }
    Some(User {
        name: fields[0].to_string(),
        uid: fields[2].parse().ok()?,
        gid: fields[3].parse().ok()?,
        home: fields[5].to_string(),
        shell: fields[6].to_string(),
        groups: Vec::new(),
    })
}

/// The primary group, then every group listing `name` as a member.
fn supplementary_groups(group_text: &str, name: &str, primary: u32) -> Vec<u32> {
    let mut groups = vec![primary];
    for line in group_text.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 4 {
            continue;
        }
        let Ok(gid) = fields[2].parse::<u32>() else {
            continue;
        };
        if fields[3].split(',').any(|m| m.trim() == name) && !groups.contains(&gid) {
            groups.push(gid);
        }
    }
    groups
}

/// The gid of a group by name, for the owner of terminals (`tty`).
pub fn group_id(name: &str) -> Option<u32> {
    gid_in(&read_optional(Path::new("/etc/group")).ok()?, name)
}

/// The gid of group `name` in a group file's text.
fn gid_in(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        fields.nth(1)?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # a comment\n\
        broken line\n\
        alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash\n\
        nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
    const GROUP: &str = "root:x:0:\nsudo:x:27:alice,bob\nalice:x:1000:\ndocker:x:999:bob, alice\nbad:x:zz:alice\n";

    fn etc() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("passwd"), PASSWD).unwrap();
        std::fs::write(dir.path().join("group"), GROUP).unwrap();
        dir
    }

    #[test]
    fn finds_users_and_their_groups() {
        let dir = etc();
        let alice = lookup_in(dir.path(), Some("alice")).unwrap();
        assert_eq!((alice.uid, alice.gid), (1000, 1000));
        assert_eq!(alice.home, "/home/alice");
        assert_eq!(alice.groups, vec![1000, 27, 999]);
        let root = lookup_in(dir.path(), None).unwrap();
        assert_eq!((root.name.as_str(), root.uid, root.home.as_str()), ("root", 0, "/root"));
    }

    #[test]
    fn unknown_user_is_an_error_and_root_survives_a_missing_passwd() {
        let dir = etc();
        assert!(matches!(lookup_in(dir.path(), Some("mallory")), Err(UsersError::Unknown(_))));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(lookup_in(empty.path(), None).unwrap(), User::root());
    }

    #[test]
    fn users_are_named_as_a_dockerfile_names_them() {
        let dir = etc();
        assert_eq!(lookup_in(dir.path(), Some("1000")).unwrap().name, "alice", "a uid in passwd");
        let stranger = lookup_in(dir.path(), Some("4242")).unwrap();
        assert_eq!((stranger.uid, stranger.gid, stranger.home.as_str()), (4242, 4242, "/"));
        assert_eq!(lookup_in(dir.path(), Some("alice:docker")).unwrap().gid, 999);
        assert_eq!(lookup_in(dir.path(), Some("alice:5")).unwrap().gid, 5);
        assert!(matches!(lookup_in(dir.path(), Some("alice:nogroup")), Err(UsersError::UnknownGroup(_))));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(lookup_in(empty.path(), Some("root")).unwrap(), User::root(), "root without a passwd entry");
    }
}
