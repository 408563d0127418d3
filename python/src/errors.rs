//! Rust errors to the Python exceptions of `cohort.errors`, with their facts as attributes.
//!
//! The exception classes are defined in Python (python/cohort/errors.py: a hierarchy with
//! builtins.TimeoutError and ValueError as second bases), and built here by keyword.

use cohort::elastic::{ElasticError, SyncError};
use cohort::{CommError, RootCause};
use cohort_transports::TransportError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// A failure computed without the GIL, turned into a Python exception once it is held.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A collective failed (boxed: the variant is large).
    Comm(Box<CommFailure>),
    /// The elastic runtime failed (join, rendezvous, leave).
    Elastic(ElasticError),
    /// Members disagree about the committed state.
    Diverged(String),
    /// A bad argument, found before anything was changed.
    Invalid(String),
    /// Anything else (closed objects, internal errors).
    Other(String),
    /// A Python exception raised while waiting (KeyboardInterrupt).
    Python(PyErr),
}

/// A failed collective and the generation's root cause, where one is known.
#[derive(Debug)]
pub(crate) struct CommFailure {
    pub(crate) error: CommError,
    pub(crate) generation: u64,
    pub(crate) cause: Option<RootCause>,
}

impl Failure {
    /// A failed collective of `generation`.
    pub(crate) fn comm(error: CommError, generation: u64, cause: Option<RootCause>) -> Self {
        Failure::Comm(Box::new(CommFailure { error, generation, cause }))
    }
}

impl From<PyErr> for Failure {
    fn from(e: PyErr) -> Self {
        Failure::Python(e)
    }
}

impl From<SyncError> for Failure {
    fn from(e: SyncError) -> Self {
        match e {
            SyncError::Comm(error) => Failure::comm(error, 0, None),
            SyncError::Diverged(detail) => Failure::Diverged(detail),
        }
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        Python::attach(|py| to_pyerr(py, f))
    }
}

fn module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS.get_or_try_init(py, || PyModule::import(py, "cohort.errors").map(Bound::unbind)).map(|m| m.bind(py))
}

/// Builds `cohort.errors.<class>(message, **facts)`; if that fails, a RuntimeError with the
/// message (never a lost error).
fn build(
    py: Python<'_>,
    class: &str,
    message: String,
    facts: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let cls = module(py)?.getattr(class)?;
        let kwargs = PyDict::new(py);
        facts(&kwargs)?;
        let exc = cls.call((message.clone(),), Some(&kwargs))?;
        Ok(PyErr::from_value(exc))
    })();
    made.unwrap_or_else(|e| PyRuntimeError::new_err(format!("{message} (and building its exception failed: {e})")))
}

fn root_cause(py: Python<'_>, cause: &RootCause) -> PyResult<Py<PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item("rank", cause.rank)?;
    kwargs.set_item("worker_id", &cause.worker_id)?;
    kwargs.set_item("host", &cause.host)?;
    kwargs.set_item("reason", &cause.reason)?;
    Ok(module(py)?.getattr("RootCause")?.call((), Some(&kwargs))?.unbind())
}

/// The exception for a failure.
pub(crate) fn to_pyerr(py: Python<'_>, failure: Failure) -> PyErr {
    match failure {
        Failure::Python(e) => e,
        Failure::Invalid(msg) => build(py, "InvalidArgumentError", msg, |_| Ok(())),
        Failure::Diverged(msg) => build(py, "DivergedError", format!("state diverged: {msg}"), |_| Ok(())),
        Failure::Other(msg) => build(py, "CohortError", msg, |_| Ok(())),
        Failure::Comm(f) => {
            let CommFailure { error, generation, cause } = *f;
            comm_error(py, error, generation, cause)
        }
        Failure::Elastic(e) => elastic_error(py, e),
    }
}

fn comm_error(py: Python<'_>, error: CommError, generation: u64, cause: Option<RootCause>) -> PyErr {
    // A revocation carries its own cause and generation.
    let (generation, cause) = match &error {
        CommError::Revoked { generation, cause: c } => (*generation, cause.or_else(|| Some(c.clone()))),
        _ => (generation, cause),
    };
    let message = match (&error, &cause) {
        (CommError::Revoked { .. }, _) | (_, None) => error.to_string(),
        (_, Some(c)) => format!("{error}; root cause: {c}"),
    };
    let (class, peer, after) = match &error {
        CommError::PeerFailed { rank, .. } => ("PeerFailedError", Some(*rank), None),
        CommError::Timeout { rank, after, .. } => ("TimeoutError", *rank, Some(after.as_secs_f64())),
        CommError::Revoked { .. } => ("RevokedError", None, None),
        CommError::Transport(_) => ("TransportError", None, None),
        CommError::InvalidArgument(_) => return build(py, "InvalidArgumentError", message, |_| Ok(())),
        CommError::Mismatch { rank, .. } => ("MismatchError", Some(*rank), None),
    };
    build(py, class, message, |kw| {
        kw.set_item("generation", generation)?;
        kw.set_item("peer", peer)?;
        match &cause {
            Some(c) => kw.set_item("cause", root_cause(py, c)?)?,
            None => kw.set_item("cause", py.None())?,
        }
        if let Some(after) = after {
            kw.set_item("after", after)?;
        }
        Ok(())
    })
}

fn elastic_error(py: Python<'_>, e: ElasticError) -> PyErr {
    let message = e.to_string();
    match e {
        ElasticError::JobEnded { outcome, reason } => build(py, "JobEndedError", message, |kw| {
            kw.set_item("outcome", outcome)?;
            kw.set_item("reason", reason)
        }),
        ElasticError::Excluded { retry_after, waited, limit, .. } => build(py, "ExcludedError", message, |kw| {
            kw.set_item("retry_after", retry_after.as_secs_f64())?;
            kw.set_item("waited", waited.as_secs_f64())?;
            kw.set_item("limit", limit.as_secs_f64())
        }),
        ElasticError::StateDiverged(_) => build(py, "DivergedError", message, |_| Ok(())),
        ElasticError::Control(c) => {
            let code = match c.code() {
                Some(code) => format!("{code:?}").to_lowercase(),
                None => "unavailable".to_string(),
            };
            build(py, "ControlError", message, |kw| kw.set_item("code", code))
        }
        ElasticError::Protocol(_) => build(py, "ControlError", message, |kw| kw.set_item("code", "protocol")),
        ElasticError::Credential(_) => {
            build(py, "ControlError", message, |kw| kw.set_item("code", "permission_denied"))
        }
        ElasticError::Comm(error) => comm_error(py, error, 0, None),
        ElasticError::DataPlane(TransportError::InvalidArgument(_))
        | ElasticError::TransportUnavailable(_)
        | ElasticError::InvalidId(_)
        | ElasticError::InvalidConfig(_) => build(py, "InvalidArgumentError", message, |_| Ok(())),
        ElasticError::DataPlane(_) | ElasticError::RdmaEndpoint { .. } => build(py, "CohortError", message, |_| Ok(())),
    }
}

/// A plain `CohortError` (needs no GIL until raised).
pub(crate) fn cohort_error(message: String) -> PyErr {
    Failure::Other(message).into()
}

/// An `InvalidArgumentError` (nothing was changed).
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    Failure::Invalid(message.into()).into()
}

/// A Rust panic caught at the boundary, as a `CohortError`.
pub(crate) fn panic_error(panic: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    cohort_error(format!("internal error in cohort (a bug; please report it): {what}"))
}
