//! Socket options applied to every data-plane TCP connection.

use crate::TransportError;
use socket2::{Domain, Socket, TcpKeepalive, Type};
use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::time::Duration;

/// Keepalive probe interval used when [`TcpOptions::keepalive`] is set.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// Unanswered keepalive probes after which the kernel drops the connection.
pub const KEEPALIVE_RETRIES: u32 = 3;

/// Socket options for the TCP transport, applied to dialed and accepted sockets alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Set `TCP_NODELAY` (disable Nagle). Default `true`: the transport writes whole frames,
    /// so coalescing only adds latency.
    pub nodelay: bool,
    /// `SO_SNDBUF` in bytes; `None` leaves the kernel's autotuning alone. Default 4 MiB.
    /// Where `net.core.wmem_max` is lower and the process may not exceed it (no
    /// `CAP_NET_ADMIN`), the kernel's autotuning sizes the buffer instead (a buffer capped
    /// at the kernel's default of 208 KiB costs 1.6-2.5x at 1-16 MiB on loopback:
    /// docs/configuration.md).
    pub send_buffer: Option<usize>,
    /// `SO_RCVBUF` in bytes, as [`TcpOptions::send_buffer`] (`net.core.rmem_max`).
    /// Default 4 MiB.
    pub recv_buffer: Option<usize>,
    /// Keepalive idle time (probes every [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_RETRIES`] of
    /// them); `None` disables keepalive. Default 5 s.
    pub keepalive: Option<Duration>,
    /// `TCP_USER_TIMEOUT`: how long written data may stay unacknowledged before the kernel
    /// resets the connection; `None` keeps the system default. Default 10 s.
    pub user_timeout: Option<Duration>,
    /// Largest payload length accepted from the wire, in bytes. Default 1 GiB.
    pub max_frame: u64,
    /// How long a receive spins on non-blocking reads for the next frame header before it
    /// parks the thread on the socket (as MPI and NCCL spin before they sleep). A frame that
    /// arrives within the window costs no sleep and wake-up, which on loopback is most of a
    /// small message's latency. Zero disables it. Default [`DEFAULT_BUSY_POLL`]; lower it
    /// (or set 0) when ranks share fewer cores than they have threads.
    pub busy_poll: Duration,
}

/// Default of [`TcpOptions::busy_poll`].
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(50);

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            nodelay: true,
            send_buffer: Some(4 << 20),
            recv_buffer: Some(4 << 20),
            keepalive: Some(Duration::from_secs(5)),
            user_timeout: Some(Duration::from_secs(10)),
            max_frame: 1 << 30,
            busy_poll: DEFAULT_BUSY_POLL,
        }
    }
}

impl TcpOptions {
    /// Applies the buffer sizes; called on a socket before `connect`/`listen` so that the
    /// window scale negotiated in the SYN reflects them.
    pub(crate) fn apply_buffers(&self, sock: &Socket) -> Result<(), TransportError> {
        if let Some(n) = self.send_buffer {
            apply_buffer(sock, Direction::Send, n)?;
        }
        if let Some(n) = self.recv_buffer {
            apply_buffer(sock, Direction::Recv, n)?;
        }
        Ok(())
    }

    /// Applies every option to a connected socket.
    pub(crate) fn apply(&self, sock: &Socket) -> Result<(), TransportError> {
        self.apply_buffers(sock)?;
        sock.set_tcp_nodelay(self.nodelay).map_err(|e| io_err("TCP_NODELAY", e))?;
        match self.keepalive {
            Some(idle) => {
                let ka = TcpKeepalive::new()
                    .with_time(idle)
                    .with_interval(KEEPALIVE_INTERVAL)
                    .with_retries(KEEPALIVE_RETRIES);
                sock.set_tcp_keepalive(&ka).map_err(|e| io_err("TCP keepalive", e))?;
            }
            None => sock.set_keepalive(false).map_err(|e| io_err("SO_KEEPALIVE", e))?,
        }
        if let Some(t) = self.user_timeout {
            sock.set_tcp_user_timeout(Some(t)).map_err(|e| io_err("TCP_USER_TIMEOUT", e))?;
        }
        Ok(())
    }
}

/// A socket buffer's direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// `SO_SNDBUF`, capped by `net.core.wmem_max`.
    Send,
    /// `SO_RCVBUF`, capped by `net.core.rmem_max`.
    Recv,
}

impl Direction {
    fn option(self) -> &'static str {
        match self {
            Self::Send => "SO_SNDBUF",
            Self::Recv => "SO_RCVBUF",
        }
    }

    fn sysctl(self) -> &'static str {
        match self {
            Self::Send => "net.core.wmem_max",
            Self::Recv => "net.core.rmem_max",
        }
    }
}

/// How a buffer size asked for reaches a socket.
///
/// Setting `SO_SNDBUF` or `SO_RCVBUF` fixes the buffer (the kernel stops autotuning it) at
/// the size asked for, but silently capped at `net.core.wmem_max` / `rmem_max`: 208 KiB on a
/// kernel left at its defaults, a quarter of the buffer a loopback or datacenter stream
/// needs. Measured (2 ranks over loopback TCP, `bench --transport tcp`, those defaults
/// emulated): the capped buffers took 660-677 us at 1 MiB and 13.8-14.2 ms at 16 MiB, the
/// kernel's autotuning 261-265 us and 8.9-9.6 ms, 4 MiB buffers 266-274 us and 8.2-8.5 ms
/// (docs/configuration.md). So a size above the cap is never applied capped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufferPlan {
    /// The size fits under the cap: `SO_SNDBUF` / `SO_RCVBUF`.
    Set,
    /// Above the cap: `SO_SNDBUFFORCE` / `SO_RCVBUFFORCE`, which ignore it (with
    /// `CAP_NET_ADMIN`); without the capability, [`BufferPlan::Autotune`].
    Force,
    /// Nothing set: the kernel's autotuning sizes the buffer (up to `net.ipv4.tcp_wmem` /
    /// `tcp_rmem`'s maximum).
    Autotune,
}

/// The plan for asking `requested` bytes where the kernel grants `cap` at most (`None`: the
/// cap could not be learned, so the size is set as asked).
pub(crate) fn buffer_plan(requested: usize, cap: Option<usize>) -> BufferPlan {
    match cap {
        Some(cap) if requested > cap => BufferPlan::Force,
        _ => BufferPlan::Set,
    }
}

/// The largest buffer an unprivileged `SO_SNDBUF` / `SO_RCVBUF` grants here, learned once
/// per process on a socket of its own: the kernel caps the value at the sysctl and reports
/// twice the value kept.
fn granted_cap(direction: Direction) -> Option<usize> {
    static SEND: OnceLock<Option<usize>> = OnceLock::new();
    static RECV: OnceLock<Option<usize>> = OnceLock::new();
    let cell = match direction {
        Direction::Send => &SEND,
        Direction::Recv => &RECV,
    };
    *cell.get_or_init(|| {
        let probe = Socket::new(Domain::IPV4, Type::STREAM, None).ok()?;
        let huge = 1 << 30;
        let granted = match direction {
            Direction::Send => probe.set_send_buffer_size(huge).and_then(|()| probe.send_buffer_size()),
            Direction::Recv => probe.set_recv_buffer_size(huge).and_then(|()| probe.recv_buffer_size()),
        };
        granted.ok().map(|doubled| doubled / 2)
    })
}

/// Applies `requested` bytes of buffer in `direction` to `sock` by [`buffer_plan`]; returns
/// the plan carried out ([`BufferPlan::Force`] only when the kernel took it).
pub(crate) fn apply_buffer(
    sock: &Socket,
    direction: Direction,
    requested: usize,
) -> Result<BufferPlan, TransportError> {
    let cap = granted_cap(direction);
    if buffer_plan(requested, cap) == BufferPlan::Force {
        if force_buffer(sock, direction, requested)? {
            return Ok(BufferPlan::Force);
        }
        note_autotuning(direction, requested, cap.unwrap_or(0));
        return Ok(BufferPlan::Autotune);
    }
    match direction {
        Direction::Send => sock.set_send_buffer_size(requested),
        Direction::Recv => sock.set_recv_buffer_size(requested),
    }
    .map_err(|e| io_err(direction.option(), e))?;
    Ok(BufferPlan::Set)
}

/// `SO_SNDBUFFORCE` / `SO_RCVBUFFORCE`: whether the kernel took it (`false`: the process
/// lacks `CAP_NET_ADMIN`, and nothing changed).
fn force_buffer(sock: &Socket, direction: Direction, requested: usize) -> Result<bool, TransportError> {
    let option = match direction {
        Direction::Send => libc::SO_SNDBUFFORCE,
        Direction::Recv => libc::SO_RCVBUFFORCE,
    };
    let value = libc::c_int::try_from(requested).unwrap_or(libc::c_int::MAX);
    // SAFETY: the descriptor is open for the call's duration, and `value` is a c_int of the
    // size passed.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        return Ok(false);
    }
    Err(io_err(direction.option(), e))
}

/// Says once per process and direction that the kernel's autotuning sizes the buffers, and
/// how to give the transport its size.
fn note_autotuning(direction: Direction, requested: usize, cap: usize) {
    static SEND: OnceLock<()> = OnceLock::new();
    static RECV: OnceLock<()> = OnceLock::new();
    let cell = match direction {
        Direction::Send => &SEND,
        Direction::Recv => &RECV,
    };
    cell.get_or_init(|| {
        tracing::info!(
            option = direction.option(),
            requested,
            cap,
            "{} ({cap} bytes) is below the TCP transport's {} ({requested} bytes) and this process may not \
             exceed it (no CAP_NET_ADMIN): the kernel's autotuning sizes these buffers instead; raise {} to \
             {requested} for the full size",
            direction.sysctl(),
            direction.option(),
            direction.sysctl(),
        );
    });
}

fn io_err(what: &str, e: std::io::Error) -> TransportError {
    TransportError::Io(format!("setting {what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_above_the_cap_is_forced_never_set_capped() {
        assert_eq!(buffer_plan(4 << 20, Some(212_992)), BufferPlan::Force);
        assert_eq!(buffer_plan(4 << 20, Some(4 << 20)), BufferPlan::Set);
        assert_eq!(buffer_plan(100_000, Some(212_992)), BufferPlan::Set);
        // The cap unknown: set as asked (what every kernel accepts, capped or not).
        assert_eq!(buffer_plan(4 << 20, None), BufferPlan::Set);
    }

    /// The calling thread's capabilities (`data[0]`: the low 32 effective ones, where
    /// CAP_NET_ADMIN is bit 12) and the header to pass back to `capset`.
    fn capabilities() -> ([u32; 6], [u32; 2]) {
        // _LINUX_CAPABILITY_VERSION_3, for this thread; two of {effective, permitted,
        // inheritable}.
        let mut header = [0x2008_0522u32, 0];
        let mut data = [0u32; 6];
        // SAFETY: capget writes the header and two data structs, both sized here.
        let rc = unsafe { libc::syscall(libc::SYS_capget, header.as_mut_ptr(), data.as_mut_ptr()) };
        assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
        (data, header)
    }

    const CAP_NET_ADMIN: u32 = 1 << 12;

    fn granted(sock: &Socket, direction: Direction) -> usize {
        match direction {
            Direction::Send => sock.send_buffer_size().unwrap(),
            Direction::Recv => sock.recv_buffer_size().unwrap(),
        }
    }

    /// On real sockets: a size under the cap is set; above it, forced where the process may
    /// (the kernel then keeps the whole size), else left to autotuning (the buffer is not the
    /// capped size). The thread drops CAP_NET_ADMIN (capabilities are per thread) to take the
    /// unprivileged path too.
    #[test]
    fn buffers_are_set_forced_or_left_to_autotuning_on_real_sockets() {
        for direction in [Direction::Send, Direction::Recv] {
            let cap = granted_cap(direction).expect("the cap is learned");
            let socket = || Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();

            let small = socket();
            assert_eq!(apply_buffer(&small, direction, cap / 2).unwrap(), BufferPlan::Set);
            assert!(granted(&small, direction) >= cap / 2, "{direction:?}");

            let privileged = capabilities().0[0] & CAP_NET_ADMIN != 0;
            let big = socket();
            let plan = apply_buffer(&big, direction, cap * 4).unwrap();
            if privileged {
                assert_eq!(plan, BufferPlan::Force, "{direction:?}");
                assert_eq!(granted(&big, direction), cap * 8, "{direction:?}: the kernel keeps twice the size");
            } else {
                assert_eq!(plan, BufferPlan::Autotune, "{direction:?}");
            }

            let (plan, size) = std::thread::spawn(move || {
                let (mut data, mut header) = capabilities();
                data[0] &= !CAP_NET_ADMIN;
                // SAFETY: capset reads the header and two data structs; it changes this
                // thread's capabilities only.
                let rc = unsafe { libc::syscall(libc::SYS_capset, header.as_mut_ptr(), data.as_ptr()) };
                assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
                let unprivileged = socket();
                let plan = apply_buffer(&unprivileged, direction, cap * 4).unwrap();
                (plan, granted(&unprivileged, direction))
            })
            .join()
            .unwrap();
            assert_eq!(plan, BufferPlan::Autotune, "{direction:?}");
            assert_ne!(size, cap * 2, "{direction:?}: the buffer was set capped");
        }
    }
}
