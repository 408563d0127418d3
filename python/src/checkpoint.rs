//! `Checkpoint` and `SyncOutcome`: the crate's commit/restore/sync over snapshot bytes.

use crate::comm::Communicator;
use crate::errors::{to_pyerr, Failure};
use crate::runtime::wait;
use cohort::elastic::{Checkpoint as RustCheckpoint, CommitError, SyncError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Mutex, MutexGuard};

/// What a sync did.
#[pyclass(module = "cohort._native", frozen, get_all)]
pub(crate) struct SyncOutcome {
    /// The commit every member now holds (None: nothing had been committed).
    step: Option<u64>,
    /// The rank whose commit was broadcast.
    source: u32,
    /// Whether this member's state changed.
    changed: bool,
}

#[pymethods]
impl SyncOutcome {
    fn __repr__(&self) -> String {
        format!(
            "SyncOutcome(step={:?}, source={}, changed={})",
            self.step,
            self.source,
            if self.changed { "True" } else { "False" }
        )
    }
}

/// The last committed state of this member (see the stub for the Python contract).
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct Checkpoint {
    inner: Mutex<RustCheckpoint>,
}

impl Checkpoint {
    fn inner(&self) -> MutexGuard<'_, RustCheckpoint> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl Checkpoint {
    #[new]
    fn new() -> Self {
        Checkpoint { inner: Mutex::new(RustCheckpoint::new()) }
    }

    /// The committed step (None before the first commit).
    #[getter]
    fn step(&self) -> Option<u64> {
        self.inner().step()
    }

    /// SHA-256 over the committed step and snapshot.
    #[getter]
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner().digest())
    }

    /// Makes `snapshot` the commit of `step`.
    fn commit(&self, snapshot: Vec<u8>, step: u64) {
        self.inner().commit(&snapshot, step);
    }

    /// The committed snapshot (what a restore loads).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut state = Vec::new();
        let restored = self.inner().restore(&mut state); // the lock is released before Python runs
        restored.map_err(|e| to_pyerr(py, Failure::Elastic(e)))?;
        Ok(PyBytes::new(py, &state))
    }

    /// Makes every member hold the newest commit (digests compared); returns the snapshot to
    /// load and what happened.
    fn sync<'py>(
        &self,
        py: Python<'py>,
        comm: &Communicator,
        current: Vec<u8>,
    ) -> PyResult<(Bound<'py, PyBytes>, SyncOutcome)> {
        let core = comm.core.clone();
        let mut rust_comm = core.lend(py)?;
        // The checkpoint is moved into the sync and back: it is unchanged unless the sync completed.
        let mut checkpoint = std::mem::take(&mut *self.inner());
        let result = wait(py, async {
            let mut state = current;
            match checkpoint.sync(&mut rust_comm, &mut state).await {
                Ok(outcome) => Ok((state, outcome)),
                Err(SyncError::Comm(error)) => Err(core.failure(error).await),
                Err(SyncError::Diverged(detail)) => Err(Failure::Diverged(detail)),
            }
        });
        core.give_back(rust_comm);
        *self.inner() = checkpoint;
        let (state, outcome) = result?.map_err(|f| to_pyerr(py, f))?;
        Ok((
            PyBytes::new(py, &state),
            SyncOutcome { step: outcome.step, source: outcome.source, changed: outcome.changed },
        ))
    }

    /// A commit point's agreement (the crate's `Checkpoint::agree`): returns `flags` max-reduced
    /// over the members; raises `DivergedError` on every rank when the members' commits differ.
    /// When it raises, the commit was not agreed and the checkpoint holds the last agreed one
    /// again (the crate rolls it back).
    fn agree<'py>(&self, py: Python<'py>, comm: &Communicator, flags: Vec<u8>) -> PyResult<Bound<'py, PyBytes>> {
        let core = comm.core.clone();
        let mut rust_comm = core.lend(py)?;
        // The checkpoint is moved into the agreement and back: it rolls back if that fails.
        let mut checkpoint = std::mem::take(&mut *self.inner());
        let result = wait(py, async {
            let mut flags = flags;
            match checkpoint.agree(&mut rust_comm, &mut flags).await {
                Ok(()) => Ok(flags),
                Err(CommitError::Comm(error)) => Err(core.failure(error).await),
                Err(e @ CommitError::Diverged { .. }) => Err(Failure::Diverged(e.to_string())),
            }
        });
        core.give_back(rust_comm);
        *self.inner() = checkpoint;
        let flags = result?.map_err(|f| to_pyerr(py, f))?;
        Ok(PyBytes::new(py, &flags))
    }

    fn __repr__(&self) -> String {
        format!("Checkpoint(step={:?})", self.inner().step())
    }
}
