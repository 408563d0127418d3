//! Socket options applied to every data-plane TCP connection.

use crate::TransportError;
use socket2::{Socket, TcpKeepalive};
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
    pub send_buffer: Option<usize>,
    /// `SO_RCVBUF` in bytes; `None` leaves the kernel's autotuning alone. Default 4 MiB.
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
            sock.set_send_buffer_size(n).map_err(|e| io_err("SO_SNDBUF", e))?;
        }
        if let Some(n) = self.recv_buffer {
            sock.set_recv_buffer_size(n).map_err(|e| io_err("SO_RCVBUF", e))?;
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

fn io_err(what: &str, e: std::io::Error) -> TransportError {
    TransportError::Io(format!("setting {what}: {e}"))
}
