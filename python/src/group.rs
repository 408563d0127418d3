//! `Group`: a worker's membership in an elastic job, over the crate's `ElasticGroup`.

use crate::comm::{Communicator, Core};
use crate::errors::{invalid, Failure};
use crate::runtime::{runtime, sigterm, sigterm_received, wait};
use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, ElasticGroup, FailureReporter, TransportChoice};
use cohort::Algorithm;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError, Weak};
use std::time::Duration;

/// Where the membership is: idle, lent to a blocking call, or gone.
enum Slot {
    Idle(Box<ElasticGroup>),
    Busy,
    Closed,
}

/// This worker's membership in an elastic job (see the stub for the Python contract).
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct Group {
    slot: Mutex<Slot>,
    reporter: FailureReporter,
    job: String,
    worker_id: String,
    host: String,
    address: String,
    handle_sigterm: bool,
    /// The communicators this membership made that may still be open: closed with it.
    comms: Mutex<Vec<Weak<Core>>>,
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(invalid(format!("{name} must be a non-negative number of seconds, got {value}")));
    }
    Ok(Duration::from_secs_f64(value))
}

fn endpoints(coordinator: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let list: Vec<String> = if let Ok(s) = coordinator.cast::<PyString>() {
        s.to_str()?.split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect()
    } else {
        coordinator
            .extract()
            .map_err(|_| invalid("coordinator must be a string (comma separated) or a sequence of strings"))?
    };
    if list.is_empty() {
        return Err(invalid("coordinator: at least one endpoint is needed (e.g. http://127.0.0.1:7470)"));
    }
    Ok(list)
}

fn token_of(token: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    let Some(token) = token else { return Ok(None) };
    let text = if let Ok(b) = token.cast::<PyBytes>() {
        String::from_utf8(b.as_bytes().to_vec())
            .map_err(|_| invalid("token: bytes must be UTF-8 (it travels as a bearer token)"))?
    } else {
        token.extract::<String>().map_err(|_| invalid("token must be str or bytes"))?
    };
    Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty()))
}

impl Group {
    /// Lends the membership to one blocking call.
    fn take(&self) -> PyResult<Box<ElasticGroup>> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        match std::mem::replace(&mut *slot, Slot::Busy) {
            Slot::Idle(g) => Ok(g),
            Slot::Busy => {
                Err(invalid("another call is using this group (next_generation or leave runs in another thread)"))
            }
            Slot::Closed => {
                *slot = Slot::Closed;
                Err(invalid("the group is closed (it left the job)"))
            }
        }
    }

    fn give_back(&self, group: Box<ElasticGroup>) {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if matches!(*slot, Slot::Busy) {
            *slot = Slot::Idle(group);
        }
    }

    fn with_idle<T>(&self, f: impl FnOnce(&ElasticGroup) -> T) -> PyResult<T> {
        match &*self.slot.lock().unwrap_or_else(PoisonError::into_inner) {
            Slot::Idle(g) => Ok(f(g)),
            Slot::Busy => Err(invalid("another call is using this group")),
            Slot::Closed => Err(invalid("the group is closed (it left the job)")),
        }
    }

    /// Drops the membership inside the runtime (its sockets and tasks belong there).
    fn drop_group(group: Box<ElasticGroup>) {
        match runtime() {
            Ok(rt) => {
                let _entered = rt.enter();
                drop(group);
            }
            Err(_) => drop(group),
        }
    }
}

#[pymethods]
impl Group {
    #[new]
    #[pyo3(signature = (
        job, coordinator, worker_id=None, *, token=None, host=None, listen="0.0.0.0:0",
        advertise="127.0.0.1", no_progress_timeout=10.0, connect_timeout=30.0, op_timeout=None,
        exclusion_wait=3600.0, rendezvous_poll=10.0, root_cause_wait=0.5, algorithm="auto",
        segment_bytes=1<<20, busy_poll=50e-6, tls_ca=None, request_timeout=5.0, retry_budget=30.0,
        coordinator_wait=3.0, handle_sigterm=true, transport="auto", fixed_deadlines=false, no_progress_floor=0.25
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: String,
        coordinator: &Bound<'_, PyAny>,
        worker_id: Option<String>,
        token: Option<&Bound<'_, PyAny>>,
        host: Option<String>,
        listen: &str,
        advertise: &str,
        no_progress_timeout: f64,
        connect_timeout: f64,
        op_timeout: Option<f64>,
        exclusion_wait: f64,
        rendezvous_poll: f64,
        root_cause_wait: f64,
        algorithm: &str,
        segment_bytes: usize,
        busy_poll: f64,
        tls_ca: Option<std::path::PathBuf>,
        request_timeout: f64,
        retry_budget: f64,
        coordinator_wait: f64,
        handle_sigterm: bool,
        transport: &str,
        fixed_deadlines: bool,
        no_progress_floor: f64,
    ) -> PyResult<Self> {
        if job.trim().is_empty() {
            return Err(invalid("job must be a non-empty id"));
        }
        let token = token_of(token)?;
        let mut control = ControlConfig::new(endpoints(coordinator)?);
        control.token = token.clone();
        control.tls_ca = tls_ca;
        control.request_timeout = seconds("request_timeout", request_timeout)?;
        control.retry_budget = seconds("retry_budget", retry_budget)?;
        control.first_contact_wait = seconds("coordinator_wait", coordinator_wait)?;
        let worker_id =
            worker_id.unwrap_or_else(|| format!("{}-{}", cohort::elastic::local_hostname(), std::process::id()));
        let mut config = ElasticConfig::new(job, worker_id, control);
        if let Some(host) = host {
            config.host = host;
        }
        config.token = token.unwrap_or_default().into_bytes();
        config.listen =
            listen.parse::<SocketAddr>().map_err(|e| invalid(format!("listen {listen:?}: {e} (e.g. 0.0.0.0:0)")))?;
        config.advertise = advertise.to_string();
        config.deadlines.no_progress = seconds("no_progress_timeout", no_progress_timeout)?;
        config.deadlines.connect = seconds("connect_timeout", connect_timeout)?;
        let floor = seconds("no_progress_floor", no_progress_floor)?;
        config.deadlines.learning = (!fixed_deadlines).then_some(cohort_transports::Learning { floor });
        config.comm.op_timeout = op_timeout.map(|t| seconds("op_timeout", t)).transpose()?;
        config.exclusion_wait = seconds("exclusion_wait", exclusion_wait)?;
        config.rendezvous_poll = seconds("rendezvous_poll", rendezvous_poll)?;
        config.root_cause_wait = seconds("root_cause_wait", root_cause_wait)?;
        config.comm.algorithm = algorithm.parse::<Algorithm>().map_err(|e| invalid(e.to_string()))?;
        if segment_bytes == 0 {
            return Err(invalid("segment_bytes must be positive"));
        }
        config.comm.segment_bytes = segment_bytes;
        config.tcp.busy_poll = seconds("busy_poll", busy_poll)?;
        config.shm.busy_poll = config.tcp.busy_poll;
        // As `cohort-worker train --transport`: one TransportChoice, checked here (shm needs a
        // host identity; rdma the `rdma` feature and a device) so that it fails before joining.
        config.transport = transport.parse::<TransportChoice>().map_err(|e| invalid(e.to_string()))?;
        config.transport.check().map_err(|e| invalid(e.to_string()))?;
        let (job, worker_id, host) = (config.job.clone(), config.worker_id.clone(), config.host.clone());

        let leaving = if handle_sigterm { Some(sigterm()?) } else { None };
        let joined = wait(py, async move {
            let join = ElasticGroup::join(config);
            match leaving {
                Some(mut leaving) => tokio::select! {
                    joined = join => Some(joined),
                    _ = leaving.wait_for(|l| *l) => None,
                },
                None => Some(join.await),
            }
        })?;
        let group = match joined {
            Some(Ok(g)) => g,
            Some(Err(e)) => return Err(Failure::Elastic(e).into()),
            None => {
                let cls = PyModule::import(py, "cohort.errors")?.getattr("GracefulLeave")?;
                return Err(PyErr::from_value(cls.call1(("SIGTERM while joining: left before becoming a member",))?));
            }
        };
        let reporter = group.reporter();
        let address = group.advertised_address().to_string();
        Ok(Group {
            slot: Mutex::new(Slot::Idle(Box::new(group))),
            reporter,
            job,
            worker_id,
            host,
            address,
            handle_sigterm,
            comms: Mutex::new(Vec::new()),
        })
    }

    /// The job id.
    #[getter]
    fn job(&self) -> &str {
        &self.job
    }

    /// This worker's id.
    #[getter]
    fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// The host name shown in status and root causes.
    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    /// The data-plane address peers dial.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The current incarnation (changes when the worker had to join again).
    #[getter]
    fn incarnation(&self) -> u64 {
        self.reporter.incarnation()
    }

    /// SIGTERM was received: leave at the next commit point.
    #[getter]
    fn leaving(&self) -> bool {
        self.handle_sigterm && sigterm_received()
    }

    /// Joiners are waiting for a re-formation (as far as this worker has heard).
    #[getter]
    fn reformation_pending(&self) -> bool {
        self.reporter.reformation_pending()
    }

    /// Waits for the next generation and connects its mesh (GIL released).
    fn next_generation(&self, py: Python<'_>) -> PyResult<Communicator> {
        let mut group = self.take()?;
        let result = wait(py, async { group.next_generation().await });
        self.give_back(group);
        let generation = result?.map_err(Failure::Elastic)?;
        let transport = generation.transport.name();
        let comm = Communicator::new(generation.comm, Some(self.reporter.clone()), &generation.members, transport);
        let mut comms = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
        comms.retain(|c| c.strong_count() > 0);
        comms.push(std::sync::Arc::downgrade(&comm.core));
        Ok(comm)
    }

    /// Closes every communicator this membership made (a closed group's communicators refuse
    /// work, as the group itself does).
    fn close_comms(&self, py: Python<'_>) -> PyResult<()> {
        let comms = std::mem::take(&mut *self.comms.lock().unwrap_or_else(PoisonError::into_inner));
        for core in comms.iter().filter_map(Weak::upgrade) {
            core.close(py)?;
        }
        Ok(())
    }

    /// Reports a commit point (in the background); returns whether a re-formation is pending.
    fn commit(&self, generation: u64, step: u64, digest: &[u8]) -> PyResult<bool> {
        self.with_idle(|g| g.commit(generation, step, digest))
    }

    /// Records what this worker is doing (shown by `cohort-coordinator status`).
    fn set_progress(&self, generation: u64, step: u64, activity: &str) -> PyResult<()> {
        self.with_idle(|g| g.set_progress(generation, step, activity))
    }

    /// Leaves the job: `finished` = the work is done; otherwise a graceful leave.
    #[pyo3(signature = (finished=false))]
    fn leave(&self, py: Python<'_>, finished: bool) -> PyResult<()> {
        self.close_comms(py)?;
        let group = self.take()?;
        *self.slot.lock().unwrap_or_else(PoisonError::into_inner) = Slot::Closed;
        let result = wait(py, async move { (*group).leave(finished).await })?;
        result.map_err(|e| Failure::Elastic(e).into())
    }

    /// Stops the background tasks without a leave (the lease expires), and closes the
    /// communicators it made. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.close_comms(py)?;
        let old = std::mem::replace(&mut *self.slot.lock().unwrap_or_else(PoisonError::into_inner), Slot::Closed);
        if let Slot::Idle(group) = old {
            Self::drop_group(group);
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaves gracefully when the block ends normally; closes without a leave when it ends
    /// with an exception (the others learn it from the lease, or from the failure report).
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let open = matches!(&*self.slot.lock().unwrap_or_else(PoisonError::into_inner), Slot::Idle(_));
        if exc_type.is_none() && open {
            return self.leave(py, false);
        }
        self.close(py)
    }

    fn __repr__(&self) -> String {
        format!("Group(job={:?}, worker_id={:?}, address={:?})", self.job, self.worker_id, self.address)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let old = std::mem::replace(&mut *self.slot.lock().unwrap_or_else(PoisonError::into_inner), Slot::Closed);
        if let Slot::Idle(group) = old {
            Self::drop_group(group);
        }
    }
}
