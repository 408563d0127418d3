//! Commit, restore and sync of application state across re-formations.
//!
//! In the spirit of Horovod Elastic's `State` and torchft: the application keeps its state
//! in something that implements [`ElasticState`]; at step boundaries it calls
//! [`Checkpoint::commit`]; after a failed step it calls [`Checkpoint::restore`]; after every
//! re-formation it calls [`Checkpoint::sync`], which makes every member (joiners included)
//! hold the newest commit any member has, and checks that they all agree.

use super::ElasticError;
use crate::{CommError, Communicator};
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

/// The last committed state of this member: step, snapshot bytes and digest.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
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

    /// Snapshots `state` as the commit of `step`.
    pub fn commit<S: ElasticState + ?Sized>(&mut self, state: &S, step: u64) {
        self.snapshot.clear();
        state.save(&mut self.snapshot);
        self.step = Some(step);
        self.digest = digest_of(self.step, &self.snapshot);
    }

    /// Loads the committed snapshot back into `state` (after a failed step).
    pub fn restore<S: ElasticState + ?Sized>(&self, state: &mut S) -> Result<(), ElasticError> {
        state.load(&self.snapshot).map_err(ElasticError::StateDiverged)
    }

    /// Makes every member hold the newest commit of the generation, then checks digests.
    ///
    /// 1. allgather every member's committed step; the source is the lowest rank among
    ///    those with the newest step (every rank computes the same choice); when nobody has
    ///    committed yet, the source's current state is taken as the initial state;
    /// 2. broadcast the source's snapshot length, then its bytes;
    /// 3. allgather every member's digest and compare: any difference is
    ///    [`ElasticError::StateDiverged`].
    ///
    /// On success `state` holds the synchronised snapshot.
    ///
    /// # Cancel safety
    /// Not cancel safe (it runs collectives); a failure poisons the communicator like any
    /// collective failure, and the checkpoint itself is unchanged unless the sync completed.
    pub async fn sync<T: Transport, S: ElasticState + ?Sized>(
        &mut self,
        comm: &mut Communicator<T>,
        state: &mut S,
    ) -> Result<SyncOutcome, SyncError> {
        let size = comm.size() as usize;
        let mine = [self.step.map_or(-1, |s| s as i64)];
        let mut steps = vec![0i64; size];
        comm.allgather(&mine, &mut steps).await?;
        let newest = steps.iter().copied().max().unwrap_or(-1);
        let source = steps.iter().position(|&s| s == newest).unwrap_or(0) as u32;

        if newest < 0 && comm.rank() == source {
            // Nobody has committed yet: the source's current state is the job's initial state,
            // and every member starts from it (as DDP and Horovod broadcast initial parameters).
            self.snapshot.clear();
            state.save(&mut self.snapshot);
        }
        let mut len = [self.snapshot.len() as i64];
        comm.broadcast(&mut len, source).await?;
        let len = usize::try_from(len[0]).map_err(|_| SyncError::Diverged(format!("source announced length {}", len[0])))?;
        let changed = comm.rank() != source && (self.step.map_or(-1, |s| s as i64) != newest || self.snapshot.len() != len);
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
        for (rank, theirs) in digests.chunks_exact(32).enumerate() {
            if theirs != digest {
                return Err(SyncError::Diverged(format!("rank {rank}'s state digest differs from rank {}'s", comm.rank())));
            }
        }
        if let Some(snapshot) = received {
            self.snapshot = snapshot;
        }
        state.load(&self.snapshot).map_err(SyncError::Diverged)?;
        self.step = step;
        self.digest = digest;
        Ok(SyncOutcome { step, source, changed })
    }
}

/// Why [`Checkpoint::sync`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A collective of the sync failed (handle it like any failed step: re-form).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Members hold different state after the broadcast.
    #[error("state diverged: {0}")]
    Diverged(String),
}
