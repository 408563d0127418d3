//! A deterministic in-memory network for tests: a [`Transport`] without sockets, plus a fault
//! controller that cuts, stalls, delays and crashes links and ranks on demand.
//!
//! [`SimNetwork::new`] builds one [`SimTransport`] per rank of a generation and a
//! [`SimNetwork`] handle that injects faults. Every wait uses tokio's clock, so under
//! `tokio::time::pause()` deadlines fire deterministically and without real waiting.
//!
//! # Model
//! - Each ordered pair of ranks has a mailbox keyed by `(tag.seq, tag.step)`. `send` copies the
//!   caller's bytes into the receiver's mailbox and returns at once (the network buffers without
//!   bound; there is no flow control). `recv` takes the message with its tag, checks length and
//!   signature ([`TransportError::Mismatch`] on disagreement, the message is consumed) and copies
//!   it into the caller's buffer.
//! - Progress: a directed link "moves bytes" when a message is handed to it while it is not
//!   stalled, and when a receiver takes a message from it. A `recv` that sees no progress on its
//!   link for [`Deadlines::no_progress`] fails with [`TransportError::Timeout`]. A delayed
//!   message counts as sent when it is sent, so a delay longer than the deadline times out.
//! - Faults act on the unordered link `a <-> b`: [`SimNetwork::cut`] closes it for good (both
//!   sides' pending and future operations on it fail with [`TransportError::PeerClosed`] and
//!   queued messages are dropped); [`SimNetwork::stall`] holds every message on it, queued ones
//!   included, until [`SimNetwork::heal`]; [`SimNetwork::delay`] delivers each later message the
//!   given time after it is sent. A cut link cannot be healed (a closed TCP connection does not
//!   come back either).
//! - [`SimNetwork::crash`] is a process death: the rank's own operations fail with
//!   [`TransportError::Aborted`] and every peer sees its links close. [`Transport::abort`] does
//!   the same from the inside, with the caller's reason. Messages the rank sent before it died
//!   are still delivered (a TCP close delivers data written before the FIN); once a peer needs
//!   one that is not there, it gets [`TransportError::PeerClosed`].

use cohort_transports::{AbortReason, Deadlines, Rank, Tag, Transport, TransportError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// State of the unordered link between two ranks.
#[derive(Debug, Default)]
struct Link {
    /// Why the link closed, once it has.
    closed: Option<String>,
    /// Messages on the link are held (not delivered) while set.
    stalled: bool,
    /// Added to the delivery time of every message sent while set.
    delay: Duration,
}

/// One message waiting in a mailbox.
#[derive(Debug)]
struct Message {
    signature: u32,
    data: Vec<u8>,
    /// Not visible to the receiver before this instant.
    deliver_at: Instant,
}

/// Everything the ranks share, behind one lock (never held across an await).
#[derive(Debug)]
struct State {
    /// Unordered links, indexed by [`Shared::link_index`].
    links: Vec<Link>,
    /// Directed mailboxes `src -> dst`, indexed by `src * world + dst`.
    mailboxes: Vec<HashMap<(u32, u32), Message>>,
    /// Last time each directed link moved bytes, indexed like `mailboxes`.
    progress: Vec<Instant>,
    /// Per rank: set once the rank aborted or crashed.
    aborted: Vec<Option<AbortReason>>,
}

#[derive(Debug)]
struct Shared {
    world: u32,
    generation: u64,
    deadlines: Deadlines,
    state: Mutex<State>,
    /// Per rank: bumped whenever something a waiter of that rank may care about changed.
    wake: Vec<watch::Sender<u64>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock can only come from a bug in this module; the state is
        // still consistent between statements, so keep using it rather than poisoning tests.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn link_index(&self, a: Rank, b: Rank) -> usize {
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        lo as usize * self.world as usize + hi as usize
    }

    fn box_index(&self, src: Rank, dst: Rank) -> usize {
        src as usize * self.world as usize + dst as usize
    }

    fn wake(&self, rank: Rank) {
        if let Some(w) = self.wake.get(rank as usize) {
            w.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    fn wake_all(&self) {
        for r in 0..self.world {
            self.wake(r);
        }
    }

    fn check_rank(&self, rank: Rank) {
        assert!(rank < self.world, "rank {rank} out of range for a world of {}", self.world);
    }

    /// Closes the link `a <-> b` (if open). Messages queued from `a` to `b` are dropped; those
    /// from `b` to `a` are dropped too unless `keep_from_b` (a process that dies or aborts has
    /// already handed its sent messages to the network, as a TCP close delivers the data
    /// written before the FIN).
    fn close_link(&self, st: &mut State, a: Rank, b: Rank, why: &str, keep_from_b: bool) {
        let li = self.link_index(a, b);
        if st.links[li].closed.is_none() {
            st.links[li].closed = Some(why.to_owned());
        }
        let ab = self.box_index(a, b);
        st.mailboxes[ab].clear();
        if !keep_from_b {
            let ba = self.box_index(b, a);
            st.mailboxes[ba].clear();
        }
    }

    /// Marks `rank` aborted with `reason` and closes all its links.
    fn kill(&self, rank: Rank, reason: AbortReason, why: &str) {
        {
            let mut st = self.lock();
            if st.aborted[rank as usize].is_none() {
                st.aborted[rank as usize] = Some(reason);
            }
            for peer in 0..self.world {
                if peer != rank {
                    self.close_link(&mut st, peer, rank, why, true);
                }
            }
        }
        self.wake_all();
    }
}

/// Fault controller of a simulated network: a cheap, cloneable handle.
///
/// Its methods take effect at once and wake every affected waiter.
///
/// # Panics
/// Every fault method panics if a rank is outside the world or `a == b`: that is a bug in the
/// test that calls it, never something the network produces.
#[derive(Clone, Debug)]
pub struct SimNetwork {
    shared: Arc<Shared>,
}

impl SimNetwork {
    /// Builds a fully connected network of `world_size` ranks for `generation`, returning the
    /// controller and the transports, indexed by rank.
    pub fn new(world_size: u32, generation: u64, deadlines: Deadlines) -> (SimNetwork, Vec<SimTransport>) {
        let n = world_size as usize;
        let now = Instant::now();
        let state = State {
            links: (0..n * n).map(|_| Link::default()).collect(),
            mailboxes: (0..n * n).map(|_| HashMap::new()).collect(),
            progress: vec![now; n * n],
            aborted: vec![None; n],
        };
        let shared = Arc::new(Shared {
            world: world_size,
            generation,
            deadlines,
            state: Mutex::new(state),
            wake: (0..n).map(|_| watch::channel(0u64).0).collect(),
        });
        let transports = (0..world_size).map(|rank| SimTransport { shared: shared.clone(), rank }).collect();
        (SimNetwork { shared }, transports)
    }

    /// Number of ranks in the simulated generation.
    pub fn world_size(&self) -> u32 {
        self.shared.world
    }

    fn pair(&self, a: Rank, b: Rank) {
        self.shared.check_rank(a);
        self.shared.check_rank(b);
        assert_ne!(a, b, "a link joins two different ranks");
    }

    /// Closes the link `a <-> b` for good: pending and future operations on it, on both sides,
    /// fail with [`TransportError::PeerClosed`]; messages queued on it are lost.
    pub fn cut(&self, a: Rank, b: Rank) {
        self.pair(a, b);
        {
            let mut st = self.shared.lock();
            self.shared.close_link(&mut st, a, b, &format!("link {a}<->{b} cut"), false);
        }
        self.shared.wake(a);
        self.shared.wake(b);
    }

    /// Stops messages moving on `a <-> b` (queued ones included) until [`SimNetwork::heal`]:
    /// receivers waiting on it fail with [`TransportError::Timeout`] after the deadline.
    pub fn stall(&self, a: Rank, b: Rank) {
        self.pair(a, b);
        let li = self.shared.link_index(a, b);
        self.shared.lock().links[li].stalled = true;
        self.shared.wake(a);
        self.shared.wake(b);
    }

    /// Stalls every link of `rank` (a network partition around one host).
    pub fn isolate(&self, rank: Rank) {
        self.shared.check_rank(rank);
        {
            let mut st = self.shared.lock();
            for peer in (0..self.shared.world).filter(|&p| p != rank) {
                let li = self.shared.link_index(rank, peer);
                st.links[li].stalled = true;
            }
        }
        self.shared.wake_all();
    }

    /// Lifts a stall and a delay on `a <-> b`; held messages are delivered at once. A cut link
    /// stays closed.
    pub fn heal(&self, a: Rank, b: Rank) {
        self.pair(a, b);
        {
            let now = Instant::now();
            let mut st = self.shared.lock();
            let li = self.shared.link_index(a, b);
            let was_stalled = st.links[li].stalled;
            st.links[li].stalled = false;
            st.links[li].delay = Duration::ZERO;
            if was_stalled {
                for (s, d) in [(a, b), (b, a)] {
                    let bi = self.shared.box_index(s, d);
                    if !st.mailboxes[bi].is_empty() {
                        st.progress[bi] = now;
                    }
                }
            }
        }
        self.shared.wake(a);
        self.shared.wake(b);
    }

    /// Delivers every message sent on `a <-> b` from now on `by` after it is sent.
    pub fn delay(&self, a: Rank, b: Rank, by: Duration) {
        self.pair(a, b);
        let li = self.shared.link_index(a, b);
        self.shared.lock().links[li].delay = by;
    }

    /// Kills `rank`: its own operations fail with [`TransportError::Aborted`] and all its links
    /// close, so peers see [`TransportError::PeerClosed`].
    pub fn crash(&self, rank: Rank) {
        self.shared.check_rank(rank);
        self.shared.kill(
            rank,
            AbortReason::new(format!("rank {rank} crashed (simulated)")),
            &format!("rank {rank} crashed"),
        );
    }
}

/// One rank's end of a [`SimNetwork`]; implements [`Transport`].
#[derive(Clone, Debug)]
pub struct SimTransport {
    shared: Arc<Shared>,
    rank: Rank,
}

impl SimTransport {
    fn check_peer(&self, peer: Rank) -> Result<(), TransportError> {
        if peer >= self.shared.world {
            return Err(TransportError::InvalidArgument(format!(
                "peer {peer} out of range for a world of {}",
                self.shared.world
            )));
        }
        if peer == self.rank {
            return Err(TransportError::InvalidArgument(format!("rank {peer} cannot send to or receive from itself")));
        }
        Ok(())
    }

    fn send_now(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.check_peer(peer)?;
        let sh = &self.shared;
        {
            let mut st = sh.lock();
            if let Some(reason) = &st.aborted[self.rank as usize] {
                return Err(TransportError::Aborted(reason.clone()));
            }
            let link = &st.links[sh.link_index(self.rank, peer)];
            if let Some(why) = &link.closed {
                return Err(TransportError::PeerClosed { peer, detail: why.clone() });
            }
            let (stalled, delay) = (link.stalled, link.delay);
            let now = Instant::now();
            let bi = sh.box_index(self.rank, peer);
            let key = (tag.seq, tag.step);
            if st.mailboxes[bi].contains_key(&key) {
                return Err(TransportError::InvalidArgument(format!(
                    "a message with seq {} step {} to rank {peer} is already in flight",
                    tag.seq, tag.step
                )));
            }
            st.mailboxes[bi]
                .insert(key, Message { signature: tag.signature, data: data.to_vec(), deliver_at: now + delay });
            if !stalled {
                st.progress[bi] = now;
            }
        }
        sh.wake(peer);
        Ok(())
    }

    /// Checks a taken message against the receive and copies it out.
    fn deliver(peer: Rank, tag: Tag, msg: Message, buf: &mut [u8]) -> Result<(), TransportError> {
        if msg.signature != tag.signature {
            return Err(TransportError::Mismatch {
                peer,
                detail: format!(
                    "seq {} step {}: signature {:#010x} expected, {:#010x} received",
                    tag.seq, tag.step, tag.signature, msg.signature
                ),
                signatures: Some(cohort_transports::Signatures { received: msg.signature, expected: tag.signature }),
            });
        }
        if msg.data.len() != buf.len() {
            return Err(TransportError::Mismatch {
                peer,
                detail: format!(
                    "seq {} step {}: {} bytes expected, {} received",
                    tag.seq,
                    tag.step,
                    buf.len(),
                    msg.data.len()
                ),
                signatures: None,
            });
        }
        buf.copy_from_slice(&msg.data);
        Ok(())
    }

    async fn recv_wait(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.check_peer(peer)?;
        let sh = &self.shared;
        let mut woken = sh.wake[self.rank as usize].subscribe();
        let start = Instant::now();
        let bi = sh.box_index(peer, self.rank);
        let li = sh.link_index(self.rank, peer);
        let key = (tag.seq, tag.step);
        loop {
            let wake_at = {
                let mut st = sh.lock();
                if let Some(reason) = &st.aborted[self.rank as usize] {
                    return Err(TransportError::Aborted(reason.clone()));
                }
                let now = Instant::now();
                let stalled = st.links[li].stalled;
                let mut ready_at = None;
                match st.mailboxes[bi].get(&key).map(|m| m.deliver_at) {
                    Some(at) if !stalled && at <= now => {
                        if let Some(msg) = st.mailboxes[bi].remove(&key) {
                            st.progress[bi] = now;
                            return Self::deliver(peer, tag, msg, buf);
                        }
                    }
                    Some(at) if !stalled => ready_at = Some(at),
                    _ => {}
                }
                if ready_at.is_none() {
                    if let Some(why) = &st.links[li].closed {
                        return Err(TransportError::PeerClosed { peer, detail: why.clone() });
                    }
                }
                let deadline = start.max(st.progress[bi]) + sh.deadlines.no_progress;
                if now >= deadline {
                    return Err(TransportError::Timeout {
                        peer,
                        after: sh.deadlines.no_progress,
                        silence: cohort_transports::Silence::Unprobed,
                    });
                }
                ready_at.map_or(deadline, |r| r.min(deadline))
            };
            tokio::select! {
                _ = woken.changed() => {}
                _ = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }
}

impl Transport for SimTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.shared.world
    }

    fn generation(&self) -> u64 {
        self.shared.generation
    }

    async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.send_now(peer, tag, data)
    }

    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.recv_wait(peer, tag, buf).await
    }

    fn abort(&self, reason: AbortReason) {
        let why = format!("rank {} aborted: {reason}", self.rank);
        self.shared.kill(self.rank, reason, &why);
    }

    fn is_aborted(&self) -> bool {
        let st = self.shared.lock();
        st.aborted[self.rank as usize].is_some()
            || (0..self.shared.world)
                .filter(|&p| p != self.rank)
                .any(|p| st.links[self.shared.link_index(self.rank, p)].closed.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dl(ms: u64) -> Deadlines {
        Deadlines { no_progress: Duration::from_millis(ms), connect: Duration::from_secs(1), learning: None }
    }

    fn tag(step: u32) -> Tag {
        Tag::new(1, step, 7)
    }

    #[tokio::test]
    async fn send_then_recv_copies_bytes() {
        let (_net, t) = SimNetwork::new(2, 3, dl(1000));
        assert_eq!((t[1].rank(), t[1].world_size(), t[1].generation()), (1, 2, 3));
        t[0].send(1, tag(0), b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        t[1].recv(0, tag(0), &mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
    }

    #[tokio::test]
    async fn recv_before_send_waits_and_matches_by_step() {
        let (_net, t) = SimNetwork::new(2, 0, dl(1000));
        let t1 = t[1].clone();
        let h = tokio::spawn(async move {
            let mut a = [0u8; 1];
            let mut b = [0u8; 1];
            t1.recv(0, tag(1), &mut b).await.unwrap();
            t1.recv(0, tag(0), &mut a).await.unwrap();
            (a[0], b[0])
        });
        t[0].send(1, tag(0), &[10]).await.unwrap();
        t[0].send(1, tag(1), &[11]).await.unwrap();
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), h).await.unwrap().unwrap(), (10, 11));
    }

    #[tokio::test]
    async fn length_and_signature_mismatch() {
        let (_net, t) = SimNetwork::new(2, 0, dl(1000));
        t[0].send(1, tag(0), &[1, 2, 3]).await.unwrap();
        let mut buf = [0u8; 2];
        assert!(matches!(t[1].recv(0, tag(0), &mut buf).await, Err(TransportError::Mismatch { peer: 0, .. })));
        t[0].send(1, Tag::new(1, 1, 99), &[1, 2]).await.unwrap();
        assert!(matches!(t[1].recv(0, tag(1), &mut buf).await, Err(TransportError::Mismatch { peer: 0, .. })));
    }

    #[tokio::test]
    async fn bad_peer_is_invalid_argument() {
        let (_net, t) = SimNetwork::new(2, 0, dl(1000));
        assert!(matches!(t[0].send(0, tag(0), &[]).await, Err(TransportError::InvalidArgument(_))));
        assert!(matches!(t[0].send(5, tag(0), &[]).await, Err(TransportError::InvalidArgument(_))));
        t[0].send(1, tag(0), &[]).await.unwrap();
        assert!(matches!(t[0].send(1, tag(0), &[]).await, Err(TransportError::InvalidArgument(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn no_message_times_out_at_the_deadline() {
        let (_net, t) = SimNetwork::new(2, 0, dl(500));
        let start = Instant::now();
        let mut buf = [0u8; 1];
        let err = t[1].recv(0, tag(0), &mut buf).await.unwrap_err();
        assert!(matches!(err, TransportError::Timeout { peer: 0, after, .. } if after == Duration::from_millis(500)));
        assert_eq!(start.elapsed(), Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn stall_times_out_and_heal_delivers() {
        let (net, t) = SimNetwork::new(2, 0, dl(500));
        net.stall(0, 1);
        t[0].send(1, tag(0), &[1]).await.unwrap();
        let mut buf = [0u8; 1];
        assert!(matches!(t[1].recv(0, tag(0), &mut buf).await, Err(TransportError::Timeout { .. })));
        net.heal(1, 0);
        t[1].recv(0, tag(0), &mut buf).await.unwrap();
        assert_eq!(buf[0], 1);
    }

    #[tokio::test(start_paused = true)]
    async fn delay_delivers_late_or_times_out() {
        let (net, t) = SimNetwork::new(2, 0, dl(500));
        net.delay(0, 1, Duration::from_millis(200));
        let start = Instant::now();
        t[0].send(1, tag(0), &[4]).await.unwrap();
        let mut buf = [0u8; 1];
        t[1].recv(0, tag(0), &mut buf).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        net.delay(0, 1, Duration::from_millis(800));
        t[0].send(1, tag(1), &[5]).await.unwrap();
        assert!(matches!(t[1].recv(0, tag(1), &mut buf).await, Err(TransportError::Timeout { .. })));
    }

    #[tokio::test(start_paused = true)]
    async fn cut_fails_pending_and_future_ops_on_both_sides() {
        let (net, t) = SimNetwork::new(3, 0, dl(60_000));
        let t1 = t[1].clone();
        let pending = tokio::spawn(async move {
            let mut buf = [0u8; 1];
            t1.recv(0, tag(0), &mut buf).await
        });
        tokio::task::yield_now().await;
        net.cut(0, 1);
        let start = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(1), pending).await.unwrap().unwrap();
        assert!(matches!(r, Err(TransportError::PeerClosed { peer: 0, .. })));
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(matches!(t[0].send(1, tag(1), &[1]).await, Err(TransportError::PeerClosed { peer: 1, .. })));
        assert!(t[0].is_aborted());
        // Other links still work.
        t[0].send(2, tag(0), &[9]).await.unwrap();
        let mut buf = [0u8; 1];
        t[2].recv(0, tag(0), &mut buf).await.unwrap();
        assert_eq!(buf[0], 9);
    }

    #[tokio::test(start_paused = true)]
    async fn crash_and_abort() {
        let (net, t) = SimNetwork::new(3, 0, dl(60_000));
        net.crash(2);
        let mut buf = [0u8; 1];
        assert!(matches!(t[2].send(0, tag(0), &[1]).await, Err(TransportError::Aborted(_))));
        assert!(matches!(t[0].recv(2, tag(0), &mut buf).await, Err(TransportError::PeerClosed { peer: 2, .. })));
        let t1 = t[1].clone();
        let pending = tokio::spawn(async move {
            let mut buf = [0u8; 1];
            t1.recv(0, tag(0), &mut buf).await
        });
        tokio::task::yield_now().await;
        t[1].abort(AbortReason::new("revoked"));
        let r = tokio::time::timeout(Duration::from_secs(1), pending).await.unwrap().unwrap();
        assert!(matches!(r, Err(TransportError::Aborted(ref why)) if why.to_string() == "revoked"));
        assert!(t[1].is_aborted());
        assert!(matches!(t[0].send(1, tag(0), &[1]).await, Err(TransportError::PeerClosed { peer: 1, .. })));
    }
}
