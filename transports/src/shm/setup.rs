//! Mesh set-up over Unix sockets: rendezvous, the authenticated handshake (the TCP
//! transport's, over a Unix stream), and the hand-over of each pair's segment.
//!
//! Rank `i` listens on the abstract socket `cohort-shm.<its nonce>.g<generation>` (abstract
//! names live in the network namespace and vanish with the socket: nothing to clean up) and
//! dials every shared-memory peer `j < i` at that peer's name, retrying until the peer listens
//! or the connect deadline passes. The exchange on each connection (D = dialer, A = acceptor):
//!
//! 1. The hello / proof / proof / verdict exchange of [`crate::handshake`] (job,
//!    generation, ranks, world size, HMAC proofs of the job token).
//! 2. D creates the pair's sealed segment (two rings) and sends a 16-byte descriptor (magic
//!    `"CHSD"`, slot count u32, slot bytes u32, reserved u32) with the memfd attached
//!    (`SCM_RIGHTS`).
//! 3. A checks the descriptor's numbers against fixed limits, the segment's seals and size,
//!    maps it and answers with a verdict.
//!
//! 4. Each side hands the other its activity board ([`crate::activity`]): D first, then A,
//!    each a 16-byte note (magic `"CHAB"` with the board's memory file attached, or `"CHAN"`:
//!    none). A board that fails its checks is left out (the link then treats a running
//!    peer as before: up to the no-progress ceiling), never a failed set-up.
//!
//! Afterwards the socket carries only doorbell bytes, and its end-of-stream is the peer's
//! death notice.

use super::link::{LinkParams, ShmLink};
use super::ring::{ring_bytes, Ring, SLOT_HEADER};
use super::segment::Mapping;
use crate::activity::PeerBoard;
use crate::handshake::{self, HsIoError, Message, Refused, Session, Verdict};
use crate::mesh_setup::{Arrivals, Backoff, Paired};
use crate::wire::u32_at;
use crate::{Rank, TransportError};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;

/// Magic of the segment descriptor.
const DESC_MAGIC: u32 = u32::from_le_bytes(*b"CHSD");
/// Length of the segment descriptor: magic, slots per ring, slot bytes, reserved (0).
pub const DESC_LEN: usize = 16;
/// Fewest slots per ring a descriptor may announce.
pub const MIN_SLOTS: u32 = 2;
/// Most slots per ring a descriptor may announce.
pub const MAX_SLOTS: u32 = 1024;
/// Smallest slot a descriptor may announce.
pub const MIN_SLOT_BYTES: usize = 4096;
/// Largest slot a descriptor may announce.
pub const MAX_SLOT_BYTES: usize = 16 << 20;
/// Largest segment (both rings) a descriptor may announce.
pub const MAX_SEGMENT_BYTES: usize = 256 << 20;

const DIAL_BACKOFF_MIN: Duration = Duration::from_millis(1);
const DIAL_BACKOFF_MAX: Duration = Duration::from_millis(50);

/// What one pair's set-up needs.
pub(crate) struct PairCtx {
    pub(crate) job: String,
    pub(crate) generation: u64,
    pub(crate) rank: Rank,
    pub(crate) world: u32,
    pub(crate) token: Vec<u8>,
    /// Slots per ring and bytes per slot of the segments this side creates.
    pub(crate) slots: u32,
    pub(crate) slot_bytes: usize,
    /// Longest message accepted from the peer.
    pub(crate) max_message: u64,
    /// How long a waiting side polls its ring before it sleeps.
    pub(crate) busy_poll: Duration,
    pub(crate) deadlines: crate::Deadlines,
    /// The pace shared by the mesh's links (see [`crate::deadline`]).
    pub(crate) pace: Arc<crate::deadline::Pace>,
    pub(crate) deadline: Instant,
    /// More ranks of this mesh on this host than CPUs to run them ([`crate::spin::oversubscribed`]).
    pub(crate) oversubscribed: bool,
    pub(crate) span: tracing::Span,
}

impl PairCtx {
    fn session(&self) -> Session<'_> {
        Session {
            job: &self.job,
            generation: self.generation,
            rank: self.rank,
            world: self.world,
            token: &self.token,
            deadline: self.deadline,
        }
    }
}

/// Checks slot geometry (from our options or a peer's descriptor).
pub(crate) fn check_geometry(slots: u32, slot_bytes: usize) -> Result<(), String> {
    if !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
        return Err(format!("{slots} slots per ring (allowed {MIN_SLOTS}..={MAX_SLOTS})"));
    }
    if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) || slot_bytes % 64 != 0 {
        return Err(format!(
            "slots of {slot_bytes} bytes (allowed {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES}, a multiple of 64)"
        ));
    }
    if 2 * ring_bytes(slots, slot_bytes) > MAX_SEGMENT_BYTES {
        return Err(format!(
            "{slots} slots of {slot_bytes} bytes exceed the segment limit of {MAX_SEGMENT_BYTES} bytes"
        ));
    }
    Ok(())
}

/// The abstract socket name of a worker's listener for one generation.
fn socket_name(nonce: &str, generation: u64) -> String {
    format!("cohort-shm.{nonce}.g{generation}")
}

fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

/// Binds this worker's listener for `generation`.
pub(crate) fn listen(nonce: &str, generation: u64) -> Result<UnixListener, TransportError> {
    let name = socket_name(nonce, generation);
    let io = |e: io::Error| TransportError::Io(format!("binding the shared-memory socket @{name}: {e}"));
    let addr = abstract_addr(&name).map_err(io)?;
    let std_listener = std::os::unix::net::UnixListener::bind_addr(&addr).map_err(io)?;
    std_listener.set_nonblocking(true).map_err(io)?;
    UnixListener::from_std(std_listener).map_err(io)
}

fn hs(peer: Rank, detail: impl Into<String>) -> TransportError {
    TransportError::Handshake { peer, detail: detail.into() }
}

/// Dials `peer` (the nonce of its address) until connected and linked, or the deadline
/// passes. Every failure after the connection is final: the peer's listener exists only
/// while its set-up waits.
pub(crate) async fn dial(ctx: Arc<PairCtx>, peer: Rank, nonce: String) -> Paired<Box<ShmLink>> {
    let name = socket_name(&nonce, ctx.generation);
    let mut backoff = Backoff::new(DIAL_BACKOFF_MIN, DIAL_BACKOFF_MAX);
    let stream = loop {
        let attempt = abstract_addr(&name).and_then(|a| std::os::unix::net::UnixStream::connect_addr(&a));
        match attempt {
            Ok(s) => break s,
            Err(e) => {
                if !backoff.pause_before(ctx.deadline).await {
                    return Paired::Failed(hs(
                        peer,
                        format!("could not reach rank {peer}'s shared-memory socket @{name} before the connect deadline: {e}"),
                    ));
                }
            }
        }
    };
    let linked = async {
        let io = |e: io::Error| hs(peer, format!("shared-memory socket to rank {peer}: {e}"));
        stream.set_nonblocking(true).map_err(io)?;
        let mut stream = UnixStream::from_std(stream).map_err(io)?;
        let link = dial_pair(&ctx, peer, &mut stream).await.map_err(|d| hs(peer, d))?;
        link(stream)
    };
    match linked.await {
        Ok(link) => Paired::Linked(peer, Box::new(link)),
        Err(e) => Paired::Failed(e),
    }
}

type MakeLink = Box<dyn FnOnce(UnixStream) -> Result<ShmLink, TransportError> + Send>;

fn hs_err(e: HsIoError) -> String {
    e.to_string()
}

async fn dial_pair(ctx: &PairCtx, peer: Rank, s: &mut UnixStream) -> Result<MakeLink, String> {
    let deadline = ctx.deadline;
    // Any failure is final here: the peer's listener exists only while its set-up waits.
    handshake::dial(s, &ctx.session(), peer).await.map_err(handshake::DialError::into_detail)?;
    // Authenticated: create and hand over the pair's segment.
    let (slots, slot_bytes) = (ctx.slots, ctx.slot_bytes);
    check_geometry(slots, slot_bytes)?;
    let ring = ring_bytes(slots, slot_bytes);
    let name = format!("cohort-shm-g{}-r{}-r{}", ctx.generation, peer, ctx.rank);
    let (mapping, fd) = Mapping::create(&name, 2 * ring)?;
    let desc = encode_descriptor(slots, slot_bytes);
    let raw = s.as_raw_fd();
    let sent =
        tokio::time::timeout_at(deadline, s.async_io(Interest::WRITABLE, || send_with_fd(raw, &desc, fd.as_raw_fd())))
            .await
            .map_err(|_| "timed out sending the segment".to_owned())?
            .map_err(|e| format!("sending the segment: {e}"))?;
    if sent != DESC_LEN {
        return Err(format!("sent {sent} of {DESC_LEN} descriptor bytes"));
    }
    drop(fd);
    match handshake::read_message(s, deadline).await.map_err(hs_err)? {
        Message::Verdict(Verdict::Ok) => {}
        Message::Verdict(v) => return Err(format!("peer refused the segment: {v:?}")),
        m => return Err(format!("expected a verdict on the segment, got {m:?}")),
    }
    send_board(ctx, s).await?;
    let board = recv_board(s, deadline).await?;
    Ok(make_link(ctx, peer, mapping, slots, slot_bytes, board))
}

/// The link over `mapping`: the ring of the lower rank's sends comes first.
fn make_link(
    ctx: &PairCtx,
    peer: Rank,
    mapping: Mapping,
    slots: u32,
    slot_bytes: usize,
    peer_board: Option<PeerBoard>,
) -> MakeLink {
    let ring = ring_bytes(slots, slot_bytes);
    let mapping = Arc::new(mapping);
    let base = mapping.base();
    // SAFETY: the mapping holds 2 * ring bytes (checked at creation or receipt), is page
    // aligned, and `ring` is a multiple of 64; the link keeps the mapping alive.
    let (low, high) = unsafe { (Ring::new(base, slots, slot_bytes), Ring::new(base.add(ring), slots, slot_bytes)) };
    let (tx, rx) = if ctx.rank < peer { (low, high) } else { (high, low) };
    debug_assert!(mapping.len() == 2 * ring && slot_bytes > SLOT_HEADER);
    let params = LinkParams {
        peer,
        generation: ctx.generation,
        max_message: ctx.max_message,
        deadlines: ctx.deadlines,
        pace: Arc::clone(&ctx.pace),
        busy_poll: ctx.busy_poll,
        oversubscribed: ctx.oversubscribed,
        span: ctx.span.clone(),
        peer_board,
    };
    Box::new(move |sock| ShmLink::new(params, mapping, tx, rx, sock))
}

/// This set-up's listener, if it accepts anyone (a rank with no higher peer on this host
/// binds none).
pub(crate) struct Listener(pub(crate) Option<UnixListener>);

impl Arrivals for Listener {
    type Conn = UnixStream;

    async fn next(&mut self) -> Result<UnixStream, TransportError> {
        let Some(listener) = &self.0 else { return std::future::pending().await };
        loop {
            match listener.accept().await {
                Ok((stream, _)) => return Ok(stream),
                // The connection went before it was accepted: not this listener's problem.
                Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted) => {}
                Err(e) => return Err(TransportError::Io(format!("accepting on the shared-memory socket: {e}"))),
            }
        }
    }
}

/// Completes the set-up of an accepted connection. A failure is fatal only when both sides
/// authenticated (a real disagreement); a stranger's is only noted.
pub(crate) async fn accept(ctx: Arc<PairCtx>, mut s: UnixStream) -> Paired<Box<ShmLink>> {
    match accept_pair(&ctx, &mut s).await {
        Ok((peer, make)) => match make(s) {
            Ok(link) => Paired::Linked(peer, Box::new(link)),
            Err(e) => Paired::Failed(hs(peer, e.to_string())),
        },
        Err((claimed, detail, true)) => Paired::Failed(hs(claimed.unwrap_or(ctx.rank), detail)),
        Err((claimed, detail, false)) => Paired::Noted { claimed, detail },
    }
}

async fn accept_pair(ctx: &PairCtx, s: &mut UnixStream) -> Result<(Rank, MakeLink), (Option<Rank>, String, bool)> {
    let deadline = ctx.deadline;
    let quiet = |d: String| (None, d, false);
    let theirs = match handshake::read_message(s, deadline).await.map_err(|e| quiet(e.to_string()))? {
        Message::Hello(h) => h,
        m => return Err(quiet(format!("expected a hello, got {m:?}"))),
    };
    let claimed = theirs.sender;
    handshake::accept(s, &ctx.session(), theirs, None, |_| true)
        .await
        .map_err(|Refused { claimed, detail, fatal }| (Some(claimed), detail, fatal))?;
    // The segment.
    let fatal = |d: String| (Some(claimed), format!("rank {claimed}: {d}"), true);
    let mut desc = [0u8; DESC_LEN];
    let raw = s.as_raw_fd();
    let (got, fd) = tokio::time::timeout_at(deadline, s.async_io(Interest::READABLE, || recv_with_fd(raw, &mut desc)))
        .await
        .map_err(|_| fatal("timed out waiting for the segment".into()))?
        .map_err(|e| fatal(format!("receiving the segment: {e}")))?;
    if got < DESC_LEN {
        tokio::time::timeout_at(deadline, s.read_exact(&mut desc[got..]))
            .await
            .map_err(|_| fatal("timed out reading the segment descriptor".into()))?
            .map_err(|e| fatal(format!("reading the segment descriptor: {e}")))?;
    }
    let checked = check_descriptor(&desc, fd);
    let verdict = if checked.is_ok() { Verdict::Ok } else { Verdict::Malformed };
    let _ = handshake::write_all(s, &handshake::encode_verdict(verdict), deadline).await;
    let (mapping, slots, slot_bytes) = checked.map_err(fatal)?;
    let board = recv_board(s, deadline).await.map_err(fatal)?;
    send_board(ctx, s).await.map_err(fatal)?;
    Ok((claimed, make_link(ctx, claimed, mapping, slots, slot_bytes, board)))
}

/// Magic of a board note that carries the board's memory file; [`NO_BOARD`]: none.
const BOARD_MAGIC: &[u8; 4] = b"CHAB";
const NO_BOARD: &[u8; 4] = b"CHAN";
const BOARD_NOTE_LEN: usize = 16;

/// Hands this rank's activity board to the peer (step 4 of the module docs).
async fn send_board(ctx: &PairCtx, s: &mut UnixStream) -> Result<(), String> {
    let board = ctx.pace.board();
    let mut note = [0u8; BOARD_NOTE_LEN];
    let raw = s.as_raw_fd();
    let sent = match board.fd() {
        Some(fd) => {
            note[..4].copy_from_slice(BOARD_MAGIC);
            let fd = fd.as_raw_fd();
            tokio::time::timeout_at(ctx.deadline, s.async_io(Interest::WRITABLE, || send_with_fd(raw, &note, fd)))
                .await
                .map_err(|_| "timed out sending the activity board".to_owned())?
                .map_err(|e| format!("sending the activity board: {e}"))?
        }
        None => {
            note[..4].copy_from_slice(NO_BOARD);
            handshake::write_all(s, &note, ctx.deadline).await.map_err(hs_err)?;
            BOARD_NOTE_LEN
        }
    };
    if sent != BOARD_NOTE_LEN {
        return Err(format!("sent {sent} of {BOARD_NOTE_LEN} bytes of the activity board note"));
    }
    Ok(())
}

/// Receives the peer's activity board: `None` if it has none, or if what came fails the
/// board's checks (logged; the link works without it).
async fn recv_board(s: &mut UnixStream, deadline: Instant) -> Result<Option<PeerBoard>, String> {
    let mut note = [0u8; BOARD_NOTE_LEN];
    let raw = s.as_raw_fd();
    let (got, fd) = tokio::time::timeout_at(deadline, s.async_io(Interest::READABLE, || recv_with_fd(raw, &mut note)))
        .await
        .map_err(|_| "timed out waiting for the activity board".to_owned())?
        .map_err(|e| format!("receiving the activity board: {e}"))?;
    if got == 0 {
        return Err("the peer closed the socket before its activity board".into());
    }
    if got < BOARD_NOTE_LEN {
        tokio::time::timeout_at(deadline, s.read_exact(&mut note[got..]))
            .await
            .map_err(|_| "timed out reading the activity board note".to_owned())?
            .map_err(|e| format!("reading the activity board note: {e}"))?;
    }
    match (&note[..4], fd) {
        (m, Some(fd)) if m == BOARD_MAGIC => match PeerBoard::open(&fd) {
            Ok(b) => Ok(Some(b)),
            Err(e) => {
                tracing::debug!("the peer's activity board is left out: {e}");
                Ok(None)
            }
        },
        (m, None) if m == NO_BOARD => Ok(None),
        (m, _) => Err(format!("bad activity board note {m:?}")),
    }
}

/// Decodes a segment descriptor received from the peer (untrusted): the magic, zero reserved
/// bits and a geometry within the limits ([`MIN_SLOTS`]..., [`MAX_SEGMENT_BYTES`]). Returns
/// the slots per ring and the slot size.
pub fn decode_descriptor(desc: &[u8; DESC_LEN]) -> Result<(u32, usize), String> {
    let word = |at: usize| u32_at(desc, at);
    if word(0) != DESC_MAGIC {
        return Err(format!("bad segment descriptor magic {:#010x}", word(0)));
    }
    if word(12) != 0 {
        return Err("reserved segment descriptor bits set".into());
    }
    let (slots, slot_bytes) = (word(4), word(8) as usize);
    check_geometry(slots, slot_bytes).map_err(|e| format!("segment descriptor: {e}"))?;
    Ok((slots, slot_bytes))
}

/// Encodes the segment descriptor of a pair's segment.
pub fn encode_descriptor(slots: u32, slot_bytes: usize) -> [u8; DESC_LEN] {
    let mut desc = [0u8; DESC_LEN];
    desc[0..4].copy_from_slice(&DESC_MAGIC.to_le_bytes());
    desc[4..8].copy_from_slice(&slots.to_le_bytes());
    desc[8..12].copy_from_slice(&(slot_bytes as u32).to_le_bytes());
    desc
}

/// Validates a received descriptor and its segment and maps it.
fn check_descriptor(desc: &[u8; DESC_LEN], fd: Option<OwnedFd>) -> Result<(Mapping, u32, usize), String> {
    let (slots, slot_bytes) = decode_descriptor(desc)?;
    let fd = fd.ok_or("the segment descriptor came without a memory file")?;
    let mapping = Mapping::open(&fd, 2 * ring_bytes(slots, slot_bytes))?;
    Ok((mapping, slots, slot_bytes))
}

/// `sendmsg` of `bytes` with one descriptor attached (non-blocking).
fn send_with_fd(sock: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid; every pointer set below points into live locals.
    unsafe {
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
        let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let mut cbuf = vec![0u8; space];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

/// `recvmsg` into `buf`, taking ownership of every descriptor attached (non-blocking).
/// Returns the bytes read and the descriptor if exactly one came (extra ones are closed).
fn recv_with_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    const MAX_FDS: usize = 8;
    // SAFETY: as in send_with_fd; received descriptors are taken into OwnedFd at once.
    unsafe {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let space = libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize;
        let mut cbuf = vec![0u8; space];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let len = ((*cmsg).cmsg_len as usize).saturating_sub(data.offset_from(cmsg.cast::<u8>()) as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let fd = if fds.len() == 1 { fds.pop() } else { None };
        Ok((n as usize, fd))
    }
}
