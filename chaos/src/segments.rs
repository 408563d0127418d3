//! The shared-memory transport's objects a worker process still holds, read from /proc.
//!
//! The transport leaves nothing in any file system: a pair's segment is a memfd named
//! `cohort-shm-g<generation>-r<a>-r<b>` (it shows in `/proc/PID/maps` and as the target of
//! the fd in `/proc/PID/fd`, with " (deleted)"), and a rank's listener is the abstract Unix
//! socket `@cohort-shm.<nonce>.g<generation>` (connections accepted on it carry its name in
//! the namespace's `/proc/PID/net/unix`). A segment lives as long as some process maps it or
//! holds its fd; a killed process's are released by the kernel. So what can be left behind is
//! a survivor still holding a dead generation's segments or sockets after it moved on: this
//! module lists what a process holds, by generation.

use std::collections::BTreeSet;

/// One shared-memory object a process holds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Held {
    /// The generation in its name.
    pub generation: u64,
    /// Its name (`memfd:cohort-shm-g3-r0-r1` or `@cohort-shm.<nonce>.g3`).
    pub name: String,
}

/// The generation in a memfd name as /proc shows it (`/memfd:cohort-shm-g3-r0-r1 (deleted)`).
pub fn memfd_generation(text: &str) -> Option<(u64, String)> {
    let start = text.find("memfd:cohort-shm-g")?;
    let name = text[start..].split_whitespace().next()?.to_string();
    let digits: String = name["memfd:cohort-shm-g".len()..].chars().take_while(char::is_ascii_digit).collect();
    Some((digits.parse().ok()?, name))
}

/// The generation in an abstract socket path as /proc/net/unix shows it
/// (`@cohort-shm.<nonce>.g3`).
pub fn socket_generation(path: &str) -> Option<(u64, String)> {
    let rest = path.strip_prefix("@cohort-shm.")?;
    let (_, g) = rest.rsplit_once(".g")?;
    Some((g.parse().ok()?, path.to_string()))
}

/// The shared-memory segments (mapped or held as fds) and sockets process `pid` holds.
/// Fails if its /proc entries cannot be read (it exited, or no permission).
pub fn held_by(pid: u32) -> std::io::Result<BTreeSet<Held>> {
    let mut held = BTreeSet::new();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    for line in maps.lines() {
        if let Some((generation, name)) = memfd_generation(line) {
            held.insert(Held { generation, name });
        }
    }
    let mut socket_inodes = BTreeSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        // An fd closed while we look is no error.
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        let target = target.to_string_lossy();
        if let Some((generation, name)) = memfd_generation(&target) {
            held.insert(Held { generation, name });
        } else if let Some(inode) = target.strip_prefix("socket:[").and_then(|t| t.strip_suffix(']')) {
            socket_inodes.insert(inode.to_string());
        }
    }
    // Columns: Num RefCount Protocol Flags Type St Inode [Path].
    let unix = std::fs::read_to_string(format!("/proc/{pid}/net/unix"))?;
    for line in unix.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if let (Some(inode), Some(path)) = (cols.get(6), cols.get(7)) {
            if socket_inodes.contains(*inode) {
                if let Some((generation, name)) = socket_generation(path) {
                    held.insert(Held { generation, name });
                }
            }
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_as_proc_shows_them() {
        let map = "7f2c1a000000-7f2c1a200000 rw-s 00000000 00:01 40221   /memfd:cohort-shm-g12-r0-r3 (deleted)";
        assert_eq!(memfd_generation(map), Some((12, "memfd:cohort-shm-g12-r0-r3".into())));
        assert_eq!(memfd_generation("/memfd:cohort-shm-g7-r1-r2 (deleted)").map(|(g, _)| g), Some(7));
        assert_eq!(memfd_generation("/memfd:other (deleted)"), None);
        assert_eq!(memfd_generation("/memfd:cohort-shm-gx-r1-r2"), None);
        assert_eq!(socket_generation("@cohort-shm.0a1b2c3d.g4"), Some((4, "@cohort-shm.0a1b2c3d.g4".into())));
        assert_eq!(socket_generation("@cohort-shm.0a1b2c3d.gx"), None);
        assert_eq!(socket_generation("/run/other.sock"), None);
    }

    #[test]
    fn a_live_memfd_and_abstract_socket_of_this_process_are_found_and_gone_once_closed() {
        // The very objects the transport makes, made here by hand.
        let name = std::ffi::CString::new("cohort-shm-g9-r0-r1").unwrap();
        // SAFETY: a valid C string and valid flags.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just returned by memfd_create and is owned here alone.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let nonce = format!("{:08x}", rand::random::<u32>());
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(format!("cohort-shm.{nonce}.g9")).unwrap();
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let held = held_by(std::process::id()).expect("own /proc");
        let gens: Vec<(u64, &str)> = held.iter().map(|h| (h.generation, h.name.as_str())).collect();
        assert!(gens.contains(&(9, "memfd:cohort-shm-g9-r0-r1")), "{gens:?}");
        let sock = format!("@cohort-shm.{nonce}.g9");
        assert!(gens.contains(&(9, sock.as_str())), "{gens:?}");
        drop((fd, listener));
        let held = held_by(std::process::id()).expect("own /proc");
        assert!(!held.iter().any(|h| h.name.contains(&nonce)), "socket still listed: {held:?}");
    }
}
