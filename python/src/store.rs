//! `KeyValueStore`: the job's key-value store on the coordinator (`StoreOp`), the native half
//! of `cohort.torch.Store` (torch's c10d `Store`). Every call releases the GIL while it waits
//! for the coordinator and, on the main thread, looks for signals every 50 ms
//! ([`crate::runtime::wait`]): Ctrl-C interrupts a `get` or `wait` that is still waiting.

use crate::errors::{invalid, Failure};
use crate::group::endpoints;
use crate::runtime;
use cohort::control::{ControlClient, ControlConfig, ControlError, JobStore};
use cohort::elastic::{ElasticError, JobId};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use std::time::Duration;

/// One scope of a job's key-value store on the coordinator.
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct KeyValueStore {
    store: JobStore,
}

/// A refused or failed store call as a Python exception: INVALID_ARGUMENT as
/// `InvalidArgumentError` (nothing was changed), every other failure as `ControlError` with
/// its code.
fn failed(e: ControlError) -> PyErr {
    match e {
        ControlError::Rejected { message, code, .. } if code == ControlError::INVALID_ARGUMENT => {
            Failure::Invalid(format!("coordinator refused StoreOp: {message}")).into()
        }
        other => Failure::Elastic(ElasticError::Control(other)).into(),
    }
}

fn timeout(name: &str, seconds: f64) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(invalid(format!("{name} must be a non-negative number of seconds, got {seconds}")));
    }
    Ok(Duration::from_secs_f64(seconds.min(1e9)))
}

/// `bytes`, or a `str` as its UTF-8 (torch hands values either way).
fn bytes_of(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = value.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = value.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(v) = value.extract::<Vec<u8>>() {
        return Ok(v);
    }
    Err(invalid(format!("{name} must be bytes or str")))
}

#[pymethods]
impl KeyValueStore {
    /// The store of `scope` (empty, or `[A-Za-z0-9._-]`) in `job` at the coordinator's
    /// `coordinator` endpoints (a comma-separated string or a sequence), authenticated with
    /// `token` (the job's credential or the operator secret).
    #[new]
    #[pyo3(signature = (coordinator, job, *, token=None, scope="", tls_ca=None, request_timeout=5.0, retry_budget=30.0))]
    fn new(
        coordinator: &Bound<'_, PyAny>,
        job: &str,
        token: Option<&str>,
        scope: &str,
        tls_ca: Option<std::path::PathBuf>,
        request_timeout: f64,
        retry_budget: f64,
    ) -> PyResult<Self> {
        // The job id is checked here (`InvalidArgumentError`), the scope by the coordinator
        // (INVALID_ARGUMENT).
        let job = JobId::new(job).map_err(|e| invalid(e.to_string()))?;
        let mut config = ControlConfig::new(endpoints(coordinator)?);
        config.token = token.map(str::trim).filter(|t| !t.is_empty()).map(str::to_string);
        config.tls_ca = tls_ca;
        config.request_timeout = timeout("request_timeout", request_timeout)?;
        config.retry_budget = timeout("retry_budget", retry_budget)?;
        // The client's channels are made lazily, on the runtime that first uses them.
        let _entered = runtime::runtime()?.enter();
        let client = ControlClient::new(config).map_err(|e| invalid(e.to_string()))?;
        Ok(Self { store: JobStore::new(client, job, scope) })
    }

    /// The job.
    #[getter]
    fn job(&self) -> String {
        self.store.job().to_string()
    }

    /// The scope.
    #[getter]
    fn scope(&self) -> String {
        self.store.scope().to_string()
    }

    /// Writes `value` under `key`.
    fn set(&self, py: Python<'_>, key: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = bytes_of("value", value)?;
        runtime::wait(py, self.store.set(key, value))?.map_err(failed)
    }

    /// The value of `key`, waiting up to `timeout` seconds for it to exist; `None` if it
    /// still does not.
    fn get<'py>(&self, py: Python<'py>, key: &str, timeout: f64) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let t = self::timeout("timeout", timeout)?;
        let value = runtime::wait(py, self.store.get(key, t))?.map_err(failed)?;
        Ok(value.map(|v| PyBytes::new(py, &v)))
    }

    /// Adds `delta` to the integer under `key` (absent: 0); returns the sum.
    fn add(&self, py: Python<'_>, key: &str, delta: i64) -> PyResult<i64> {
        runtime::wait(py, self.store.add(key, delta))?.map_err(failed)
    }

    /// Appends `value` to the bytes under `key` (absent: empty); concurrent appends are each
    /// applied once.
    fn append(&self, py: Python<'_>, key: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = bytes_of("value", value)?;
        runtime::wait(py, self.store.append(key, value))?.map_err(failed)
    }

    /// torch's compare_set: writes `desired` if `key` holds `expected` (or is absent and
    /// `expected` is empty); returns the value stored now (`expected` for an absent key and a
    /// non-empty `expected`).
    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        expected: &Bound<'py, PyAny>,
        desired: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (expected, desired) = (bytes_of("expected", expected)?, bytes_of("desired", desired)?);
        let now = runtime::wait(py, self.store.compare_set(key, expected, desired))?.map_err(failed)?;
        Ok(PyBytes::new(py, &now))
    }

    /// Whether every key exists now.
    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        runtime::wait(py, self.store.check(&keys))?.map_err(failed)
    }

    /// Deletes `key`; returns whether it existed.
    fn delete_key(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        runtime::wait(py, self.store.delete(key))?.map_err(failed)
    }

    /// How many keys the scope holds.
    fn num_keys(&self, py: Python<'_>) -> PyResult<u64> {
        runtime::wait(py, self.store.num_keys())?.map_err(failed)
    }

    /// Waits up to `timeout` seconds for every key to exist; returns whether they do.
    fn wait(&self, py: Python<'_>, keys: Vec<String>, timeout: f64) -> PyResult<bool> {
        let t = self::timeout("timeout", timeout)?;
        runtime::wait(py, self.store.wait(&keys, t))?.map_err(failed)
    }

    fn __repr__(&self) -> String {
        format!("KeyValueStore(job={:?}, scope={:?})", self.store.job(), self.store.scope())
    }
}
