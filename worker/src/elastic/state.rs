//! Commit, restore and sync of application state across re-formations.
//!
//! In the spirit of Horovod Elastic's `State` and torchft: the application keeps its state
//! in something that implements [`ElasticState`]; at step boundaries it calls
//! [`Checkpoint::commit`], then [`Checkpoint::agree`] at the commit point; after a failed step
//! it calls [`Checkpoint::restore`]; after every re-formation it calls [`Checkpoint::sync`],
//! which makes every member (joiners included) hold the newest commit any member has, and
//! checks that they all agree. [`Checkpoint::agree`] checks in-band, in the one small
//! allreduce the commit point runs anyway (the members' flags: re-form here or not), that
//! every member committed the same step with the same state: a divergence is caught on every
//! rank at the commit that caused it.
//!
//! A commit is tentative until its agreement succeeds: when [`Checkpoint::agree`] fails (a
//! collective failure, or a divergence), the checkpoint rolls back to the last agreed commit,
//! so that a restore never loads a step that the members did not agree on (a step whose
//! collective failed may have reached the state with a partial result). Members that did
//! agree keep it, and the next sync hands it to the others (newest wins). The Python
//! package's `State.commit` behaves the same way.

use super::ElasticError;
use crate::{CommError, Communicator, ReduceOp};
use cohort_transports::Transport;
use sha2::{Digest, Sha256};

/// Application state that can be snapshotted to bytes and loaded back.
pub trait ElasticState {
    /// Appends a serialised snapshot of the state to `out` (which is empty on entry).
    fn save(&self, out: &mut Vec<u8>);
    /// Replaces the state with a snapshot made by [`ElasticState::save`].
    fn load(&mut self, snapshot: &[u8]) -> Result<(), String>;
}

impl ElasticState for Vec<u8> {
    fn save(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn load(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.clear();
        self.extend_from_slice(snapshot);
        Ok(())
    }
}

/// The last committed state of this member: step, snapshot bytes and digest, and while that
/// commit awaits its agreement ([`Checkpoint::agree`]), the last agreed one to roll back to.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    step: Option<u64>,
    snapshot: Vec<u8>,
    digest: [u8; 32],
    /// The last agreed commit, while the one above is tentative (committed, not yet agreed).
    agreed: Option<Box<Agreed>>,
}

/// A commit the members agreed on, kept while a newer one awaits its agreement.
#[derive(Clone, Debug, Default)]
struct Agreed {
    step: Option<u64>,
    snapshot: Vec<u8>,
    digest: [u8; 32],
}

/// What [`Checkpoint::sync`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncOutcome {
    /// The step every member now holds (`None`: nobody had committed yet).
    pub step: Option<u64>,
    /// The rank whose commit was broadcast.
    pub source: u32,
    /// Whether this member's state changed (it was behind, or a joiner).
    pub changed: bool,
}

fn digest_of(step: Option<u64>, snapshot: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(step.map_or(u64::MAX, |s| s).to_le_bytes());
    hasher.update(snapshot);
    hasher.finalize().into()
}

impl Checkpoint {
    /// An empty checkpoint (nothing committed yet: a fresh worker or a joiner).
    pub fn new() -> Self {
        Self { digest: digest_of(None, &[]), ..Self::default() }
    }

    /// The committed step, if any.
    pub fn step(&self) -> Option<u64> {
        self.step
    }

    /// SHA-256 over the committed step and snapshot.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// Snapshots `state` as the commit of `step`: tentative until [`Checkpoint::agree`]
    /// succeeds, which rolls it back when it fails. The last agreed commit is kept meanwhile
    /// (a second snapshot in memory); a commit that follows a tentative one replaces it.
    pub fn commit<S: ElasticState + ?Sized>(&mut self, state: &S, step: u64) {
        if self.agreed.is_none() {
            let (step, digest) = (self.step, self.digest);
            let snapshot = std::mem::take(&mut self.snapshot);
            self.agreed = Some(Box::new(Agreed { step, snapshot, digest }));
        }
        self.snapshot.clear();
        state.save(&mut self.snapshot);
        self.step = Some(step);
        self.digest = digest_of(self.step, &self.snapshot);
    }

    /// Whether the newest commit awaits its agreement ([`Checkpoint::agree`]).
    pub fn is_tentative(&self) -> bool {
        self.agreed.is_some()
    }

    /// Drops a tentative commit: the checkpoint holds the last agreed one again.
    fn roll_back(&mut self) {
        if let Some(agreed) = self.agreed.take() {
            let Agreed { step, snapshot, digest } = *agreed;
            (self.step, self.snapshot, self.digest) = (step, snapshot, digest);
        }
    }

    /// Loads the committed snapshot back into `state` (after a failed step).
    pub fn restore<S: ElasticState + ?Sized>(&self, state: &mut S) -> Result<(), ElasticError> {
        state.load(&self.snapshot).map_err(ElasticError::StateDiverged)
    }

    /// Makes every member hold the newest commit of the generation, checking digests before
    /// and after the transfer.
    ///
    /// 1. allgather every member's committed step and digest; the source is the lowest rank
    ///    among those with the newest step (every rank computes the same choice); when nobody
    ///    has committed yet, the source's current state is taken as the initial state;
    /// 2. members that claim the newest step must hold the same digest: a difference means
    ///    their states diverged before this sync, and is [`SyncError::Diverged`] naming the
    ///    ranks, on every member (never silently overwritten by the source's bytes);
    /// 3. broadcast the source's snapshot length, then its bytes;
    /// 4. allgather every member's digest of what it now holds and compare: any difference
    ///    (corruption in transit) is [`SyncError::Diverged`].
    ///
    /// On success `state` holds the synchronised snapshot, and it is this member's agreed
    /// commit (a tentative one is replaced).
    ///
    /// # Cancel safety
    /// Not cancel safe (it runs collectives); a failure poisons the communicator like any
    /// collective failure, and the checkpoint itself is unchanged unless the sync completed.
    pub async fn sync<T: Transport, S: ElasticState + ?Sized>(
        &mut self,
        comm: &mut Communicator<T>,
        state: &mut S,
    ) -> Result<SyncOutcome, SyncError> {
        const CLAIM: usize = 8 + 32;
        let size = comm.size() as usize;
        let mut mine = [0u8; CLAIM];
        mine[..8].copy_from_slice(&self.step.map_or(-1, |s| s as i64).to_le_bytes());
        mine[8..].copy_from_slice(&self.digest);
        let mut claims = vec![0u8; CLAIM * size];
        comm.allgather(&mine[..], &mut claims).await?;
        let claims: Vec<(i64, &[u8])> = claims
            .chunks_exact(CLAIM)
            .map(|c| (i64::from_le_bytes(c[..8].try_into().unwrap_or([0xff; 8])), &c[8..]))
            .collect();
        let newest = claims.iter().map(|c| c.0).max().unwrap_or(-1);
        let source = claims.iter().position(|c| c.0 == newest).unwrap_or(0) as u32;
        if newest >= 0 {
            let source_digest = claims[source as usize].1;
            let differing: Vec<usize> = claims
                .iter()
                .enumerate()
                .filter(|(_, c)| c.0 == newest && c.1 != source_digest)
                .map(|(r, _)| r)
                .collect();
            if !differing.is_empty() {
                let ranks: Vec<String> = differing.iter().map(|r| r.to_string()).collect();
                return Err(SyncError::Diverged(format!(
                    "rank(s) {} committed step {newest} with a state digest that differs from rank {source}'s",
                    ranks.join(", ")
                )));
            }
        }

        if newest < 0 && comm.rank() == source {
            // Nobody has committed yet: the source's current state is the job's initial state,
            // and every member starts from it (as DDP and Horovod broadcast initial parameters).
            self.snapshot.clear();
            state.save(&mut self.snapshot);
        }
        let mut len = [self.snapshot.len() as i64];
        comm.broadcast(&mut len, source).await?;
        let len =
            usize::try_from(len[0]).map_err(|_| SyncError::Diverged(format!("source announced length {}", len[0])))?;
        let changed =
            comm.rank() != source && (self.step.map_or(-1, |s| s as i64) != newest || self.snapshot.len() != len);
        let step = if newest < 0 { None } else { Some(newest as u64) };
        // The source sends from its own snapshot (broadcast leaves the root's buffer as is);
        // the others receive into a fresh buffer that replaces theirs only once all is checked.
        let mut received = None;
        if comm.rank() == source {
            comm.broadcast_bytes(&mut self.snapshot, source).await?;
        } else {
            let mut snapshot = vec![0u8; len];
            comm.broadcast_bytes(&mut snapshot, source).await?;
            received = Some(snapshot);
        }
        let digest = digest_of(step, received.as_deref().unwrap_or(&self.snapshot));

        let mut digests = vec![0u8; 32 * size];
        comm.allgather(&digest[..], &mut digests).await?;
        let source_after = &digests[32 * source as usize..32 * (source as usize + 1)];
        for (rank, theirs) in digests.chunks_exact(32).enumerate() {
            if theirs != source_after {
                return Err(SyncError::Diverged(format!(
                    "after the transfer rank {rank}'s state digest differs from the source's (rank {source})"
                )));
            }
        }
        if let Some(snapshot) = received {
            self.snapshot = snapshot;
        }
        state.load(&self.snapshot).map_err(SyncError::Diverged)?;
        self.step = step;
        self.digest = digest;
        self.agreed = None;
        Ok(SyncOutcome { step, source, changed })
    }
}

/// Bytes of a commit's identity that [`Checkpoint::agree`] compares: the step (8, little
/// endian; `u64::MAX` before any commit) and the first 16 bytes of the digest (which covers the
/// step and the whole snapshot).
const IDENTITY: usize = 8 + 16;

impl Checkpoint {
    /// A commit point's agreement, in-band: every member's `flags` are max-reduced in place
    /// (a flag set on any rank is set on all: "re-form here", "a member leaves"), and in the
    /// same allreduce every member learns whether all of them committed the same step with the
    /// same state.
    ///
    /// One allreduce (max over bytes) of `flags`, this member's commit identity (step and a
    /// 16-byte digest prefix) and the bitwise complement of that identity: the maximum of the
    /// complement is the complement of the minimum, so each byte's minimum and maximum come
    /// back together, and they are equal on every byte exactly when every member holds the
    /// same identity. It costs no extra round: the commit point's flags travel in the same
    /// message (48 bytes in all for two flags).
    ///
    /// On success the newest commit is agreed ([`Checkpoint::is_tentative`] is false). On a
    /// difference every rank gets [`CommitError::Diverged`], at the commit that caused it,
    /// saying whether the steps or the states differ. A collective failure is
    /// [`CommitError::Comm`] (re-form as after any failed step). On either error the commit
    /// was not agreed and is not kept: the checkpoint rolls back to the last agreed commit
    /// (what [`Checkpoint::restore`] then loads), and `flags` are left as they were.
    ///
    /// # Cancel safety
    /// Not cancel safe (it runs a collective); cancelling it poisons the communicator like any
    /// collective, and leaves the commit tentative (the next commit replaces it; a sync
    /// replaces it with the members' newest).
    pub async fn agree<T: Transport>(
        &mut self,
        comm: &mut Communicator<T>,
        flags: &mut [u8],
    ) -> Result<(), CommitError> {
        let agreed = self.agree_in_band(comm, flags).await;
        match &agreed {
            Ok(()) => self.agreed = None,
            Err(_) => self.roll_back(),
        }
        agreed
    }

    /// The agreement itself ([`Checkpoint::agree`]), leaving the checkpoint as it is.
    ///
    /// # Cancel safety
    /// Not cancel safe (it runs a collective).
    async fn agree_in_band<T: Transport>(
        &self,
        comm: &mut Communicator<T>,
        flags: &mut [u8],
    ) -> Result<(), CommitError> {
        let n = flags.len();
        let mut identity = [0u8; IDENTITY];
        identity[..8].copy_from_slice(&self.step.unwrap_or(u64::MAX).to_le_bytes());
        identity[8..].copy_from_slice(&self.digest[..16]);
        let mut buf = Vec::with_capacity(n + 2 * IDENTITY);
        buf.extend_from_slice(flags);
        buf.extend_from_slice(&identity);
        buf.extend(identity.iter().map(|b| !b));
        comm.allreduce(&mut buf, ReduceOp::Max).await?;
        let (max, min_complement) = buf[n..].split_at(IDENTITY);
        let agree = |range: std::ops::Range<usize>| range.clone().all(|i| max[i] == !min_complement[i]);
        let (steps_agree, states_agree) = (agree(0..8), agree(8..IDENTITY));
        if !(steps_agree && states_agree) {
            let what = if steps_agree {
                "every member committed this step, but with different state (their digests differ)".to_string()
            } else {
                "the members committed different steps".to_string()
            };
            tracing::error!(generation = comm.generation(), rank = comm.rank(), step = ?self.step, "{what}");
            return Err(CommitError::Diverged { generation: comm.generation(), step: self.step, detail: what });
        }
        flags.copy_from_slice(&buf[..n]);
        Ok(())
    }
}

/// Why [`Checkpoint::agree`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// The allreduce failed (handle it like any failed step: re-form).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The members' commits differ: not the same step, or the same step with different
    /// state. Every member gets this at the same commit point.
    #[error(
        "state diverged at the commit of {} in generation {generation}: {detail}",
        step.map_or_else(|| "no step (nothing committed)".to_string(), |s| format!("step {s}"))
    )]
    Diverged {
        /// The generation of the commit point.
        generation: u64,
        /// This member's committed step.
        step: Option<u64>,
        /// What differs.
        detail: String,
    },
}

/// Why [`Checkpoint::sync`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A collective of the sync failed (handle it like any failed step: re-form).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Members claim the same commit with different state, or hold different state after
    /// the transfer.
    #[error("state diverged: {0}")]
    Diverged(String),
}
