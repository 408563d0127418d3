//! A squatter: a process of another user that binds a host relay's abstract socket name
//! before any worker does (anyone can compute the name) and answers whoever connects with
//! forged frames. The relays' tests check that a worker refuses it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// The user the squatter runs as (`nobody`).
pub(crate) const SQUATTER_UID: u32 = 65534;

/// A forked child of uid [`SQUATTER_UID`] serving an abstract socket; killed when dropped.
pub(crate) struct Squatter {
    pid: libc::pid_t,
}

/// A frame as the relays write it: the body's length (u32, little-endian), then the body.
pub(crate) fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

impl Squatter {
    /// Forks a child that becomes uid/gid [`SQUATTER_UID`], binds the abstract socket `name`
    /// and serves every connection, one at a time: it writes `greeting` at once, then
    /// `answer` for every read that returns data, until the peer closes. Returns once the
    /// child listens; `None` when this process is not root (it cannot start a process of
    /// another user).
    pub(crate) fn start(name: &str, greeting: &[u8], answer: &[u8]) -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: only root can start a process of another user");
            return None;
        }
        // Everything the child needs is made before the fork: it only makes system calls.
        // SAFETY: an all-zero sockaddr_un is valid.
        let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        address.sun_family = libc::AF_UNIX as libc::sa_family_t;
        assert!(name.len() < address.sun_path.len() - 1, "name too long");
        for (i, b) in name.bytes().enumerate() {
            // sun_path[0] stays NUL: an abstract name.
            address.sun_path[i + 1] = b as libc::c_char;
        }
        let address_len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for two descriptors.
        assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe");
        // SAFETY: pipe2 returned two new descriptors, owned here.
        let (ready_rx, ready_tx) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
        // SAFETY: the child calls only async-signal-safe functions (set*id, socket calls,
        // read, write, close, _exit) on memory made before the fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: see above.
            unsafe { serve(&address, address_len, ready_tx.as_raw_fd(), greeting, answer) }
        }
        drop(ready_tx);
        let squatter = Self { pid };
        let mut poll = libc::pollfd { fd: ready_rx.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let polled = unsafe { libc::poll(&mut poll, 1, Duration::from_secs(10).as_millis() as i32) };
        let mut byte = 0u8;
        // SAFETY: one byte of writable memory.
        let read = unsafe { libc::read(ready_rx.as_raw_fd(), (&mut byte as *mut u8).cast(), 1) };
        assert!(polled == 1 && read == 1, "the squatter did not come to listen within 10 s");
        Some(squatter)
    }
}

/// The child's life: become another user, listen on the name, say so, serve.
///
/// # Safety
/// Called in a forked child only; everything it touches was made before the fork.
unsafe fn serve(
    address: &libc::sockaddr_un,
    address_len: libc::socklen_t,
    ready: libc::c_int,
    greeting: &[u8],
    answer: &[u8],
) -> ! {
    // SAFETY: the caller's (see above).
    unsafe {
        if libc::setgid(SQUATTER_UID) != 0 || libc::setuid(SQUATTER_UID) != 0 {
            libc::_exit(2);
        }
        let listener = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if listener < 0
            || libc::bind(listener, (address as *const libc::sockaddr_un).cast(), address_len) != 0
            || libc::listen(listener, 16) != 0
        {
            libc::_exit(3);
        }
        libc::write(ready, b"!".as_ptr().cast(), 1);
        libc::close(ready);
        let mut scratch = [0u8; 4096];
        loop {
            let conn = libc::accept(listener, std::ptr::null_mut(), std::ptr::null_mut());
            if conn < 0 {
                continue;
            }
            if greeting.is_empty() || libc::write(conn, greeting.as_ptr().cast(), greeting.len()) > 0 {
                while libc::read(conn, scratch.as_mut_ptr().cast(), scratch.len()) > 0 {
                    if !answer.is_empty() {
                        libc::write(conn, answer.as_ptr().cast(), answer.len());
                    }
                }
            }
            libc::close(conn);
        }
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        // SAFETY: the pid is this process's child, not yet reaped.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}
