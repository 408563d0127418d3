//! `Group`: a worker's membership in an elastic job, over the crate's `ElasticGroup`.

use crate::comm::{Communicator, Core};
use crate::errors::{invalid, Failure};
use crate::runtime::{graceful_leave, runtime, sigterm, sigterm_received, wait, SigtermPolicy};
use cohort::control::ControlConfig;
use cohort::elastic::{ElasticConfig, ElasticGroup, FailureReporter, JobId, TransportChoice, WorkerId};
use cohort::Algorithm;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

/// Where the membership is: idle, lent to a blocking call, or gone.
pub(crate) enum Slot {
    Idle(Box<ElasticGroup>),
    Busy,
    Closed,
}

/// This worker's membership in an elastic job (see the stub for the Python contract).
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct Group {
    /// Shared (weakly) with its communicators, which leave through it on SIGTERM.
    slot: Arc<Mutex<Slot>>,
    sigterm: Arc<SigtermPolicy>,
    reporter: FailureReporter,
    job: JobId,
    worker_id: WorkerId,
    host: String,
    address: String,
    handle_sigterm: bool,
    /// The `cohort.GroupConfig` it joined with.
    config: Py<PyAny>,
    /// The communicators this membership made that may still be open: closed with it.
    comms: Mutex<Vec<Weak<Core>>>,
}

/// What a group's communicators know of it: its SIGTERM policy, and the membership to leave
/// when a call of theirs stopped for SIGTERM.
#[derive(Clone)]
pub(crate) struct GroupLink {
    /// The group's SIGTERM policy (ignored for a communicator of no group).
    pub(crate) sigterm: Arc<SigtermPolicy>,
    slot: Weak<Mutex<Slot>>,
    job: JobId,
}

impl GroupLink {
    /// Leaves the job gracefully after a call stopped for SIGTERM (`GracefulLeave` follows),
    /// unless the membership is gone or lent to another call; what happens is said on stderr.
    pub(crate) fn leave_on_sigterm(&self, py: Python<'_>) {
        let Some(slot) = self.slot.upgrade() else { return };
        let group = {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            match std::mem::replace(&mut *slot, Slot::Closed) {
                Slot::Idle(g) => Some(g),
                other => {
                    *slot = other;
                    None
                }
            }
        };
        let Some(group) = group else {
            eprintln!("cohort: SIGTERM: left the call; job {} is left by the call that holds the membership", self.job);
            return;
        };
        match wait(py, async move { (*group).leave(false).await }) {
            Ok(Ok(())) => eprintln!("cohort: SIGTERM: left job {} gracefully", self.job),
            Ok(Err(e)) => {
                eprintln!("cohort: SIGTERM: leaving job {} failed ({e}); its lease ends the membership", self.job)
            }
            Err(e) => eprintln!("cohort: SIGTERM: leaving job {} was interrupted ({e})", self.job),
        }
    }
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(invalid(format!("{name} must be a non-negative number of seconds, got {value}")));
    }
    Ok(Duration::from_secs_f64(value))
}

/// The coordinator endpoints of a `coordinator` argument: a comma-separated string or a
/// sequence of strings (shared by `Group` and `KeyValueStore`).
pub(crate) fn endpoints(coordinator: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
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

/// One field of a `cohort.GroupConfig`, of the type the join needs.
fn field<'py, T: FromPyObjectOwned<'py>>(config: &Bound<'py, PyAny>, name: &str) -> PyResult<T> {
    let value = config.getattr(name)?;
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        invalid(format!("GroupConfig.{name}: {e}"))
    })
}

/// A number of seconds in `GroupConfig.<name>`.
fn seconds_of(config: &Bound<'_, PyAny>, name: &str) -> PyResult<Duration> {
    seconds(name, field(config, name)?)
}

/// The crate's configuration from a `cohort.GroupConfig`, every value checked (a bad one
/// raises `InvalidArgumentError` before anything is bound or sent), and whether to handle
/// SIGTERM.
fn elastic_config(config: &Bound<'_, PyAny>) -> PyResult<(ElasticConfig, bool)> {
    // Ids are checked here, by cohort's one rule (`InvalidArgumentError` naming the field).
    let job = JobId::new(field::<String>(config, "job")?).map_err(|e| invalid(e.to_string()))?;
    let token = token_of(Some(&config.getattr("token")?).filter(|t| !t.is_none()))?;
    let mut control = ControlConfig::new(endpoints(&config.getattr("coordinator")?)?);
    control.token = token.clone();
    control.tls_ca = field(config, "tls_ca")?;
    control.request_timeout = seconds_of(config, "request_timeout")?;
    control.retry_budget = seconds_of(config, "retry_budget")?;
    control.first_contact_wait = seconds_of(config, "coordinator_wait")?;
    let worker_id = field::<Option<String>>(config, "worker_id")?
        .unwrap_or_else(|| format!("{}-{}", cohort::elastic::local_hostname(), std::process::id()));
    let worker_id = WorkerId::new(worker_id).map_err(|e| invalid(e.to_string()))?;
    let mut elastic = ElasticConfig::new(job, worker_id, control);
    if let Some(host) = field::<Option<String>>(config, "host")? {
        elastic.host = host;
    }
    elastic.token = token.unwrap_or_default().into_bytes();
    let listen: String = field(config, "listen")?;
    elastic.listen =
        listen.parse::<SocketAddr>().map_err(|e| invalid(format!("listen {listen:?}: {e} (e.g. 0.0.0.0:0)")))?;
    elastic.advertise = field(config, "advertise")?;
    elastic.deadlines.no_progress = seconds_of(config, "no_progress_timeout")?;
    elastic.deadlines.connect = seconds_of(config, "connect_timeout")?;
    let floor = seconds_of(config, "no_progress_floor")?;
    let late_rank = seconds_of(config, "late_rank_timeout")?;
    let fixed: bool = field(config, "fixed_deadlines")?;
    elastic.deadlines.learning = (!fixed).then_some(cohort_transports::Learning { floor, late_rank });
    elastic.comm.op_timeout =
        field::<Option<f64>>(config, "op_timeout")?.map(|t| seconds("op_timeout", t)).transpose()?;
    elastic.exclusion_wait = seconds_of(config, "exclusion_wait")?;
    elastic.rendezvous_poll = seconds_of(config, "rendezvous_poll")?;
    elastic.root_cause_wait = seconds_of(config, "root_cause_wait")?;
    let algorithm: String = field(config, "algorithm")?;
    elastic.comm.algorithm = algorithm.parse::<Algorithm>().map_err(|e| invalid(e.to_string()))?;
    let segment_bytes: usize = field(config, "segment_bytes")?;
    if segment_bytes == 0 {
        return Err(invalid("segment_bytes must be positive"));
    }
    elastic.comm.segment_bytes = segment_bytes;
    elastic.tcp.busy_poll = seconds_of(config, "busy_poll")?;
    elastic.shm.busy_poll = elastic.tcp.busy_poll;
    // As `cohort-worker train --transport`: one TransportChoice, checked here (shm needs a
    // host identity; rdma the `rdma` feature and a device) so that it fails before joining.
    let transport: String = field(config, "transport")?;
    elastic.transport = transport.parse::<TransportChoice>().map_err(|e| invalid(e.to_string()))?;
    elastic.transport.check().map_err(|e| invalid(e.to_string()))?;
    if let Some(relay) = field::<Option<bool>>(config, "heartbeat_relay")? {
        elastic.heartbeat_relay = relay;
    }
    // A str or an os.PathLike.
    if let Some(dir) = field::<Option<std::path::PathBuf>>(config, "relay_dir")? {
        elastic.relay_dir = Some(dir);
    }
    Ok((elastic, field(config, "handle_sigterm")?))
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
    /// Joins with a `cohort.GroupConfig`, or with the arguments of one
    /// (`Group(job, coordinator, worker_id, **options)`).
    #[new]
    #[pyo3(signature = (config, coordinator=None, worker_id=None, **options))]
    fn new(
        py: Python<'_>,
        config: &Bound<'_, PyAny>,
        coordinator: Option<&Bound<'_, PyAny>>,
        worker_id: Option<&Bound<'_, PyAny>>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let class = PyModule::import(py, "cohort.config")?.getattr("GroupConfig")?;
        let config = if config.is_instance(&class)? {
            let extra = options.map_or(0, |o| o.len());
            if coordinator.is_some() || worker_id.is_some() || extra > 0 {
                return Err(invalid("Group(config) takes no other arguments: set them in the GroupConfig"));
            }
            config.clone()
        } else {
            let kwargs = options.map_or_else(|| Ok(PyDict::new(py)), |o| o.copy())?;
            if let Some(coordinator) = coordinator {
                kwargs.set_item("coordinator", coordinator)?;
            }
            if let Some(worker_id) = worker_id {
                kwargs.set_item("worker_id", worker_id)?;
            }
            class.call((config,), Some(&kwargs))?
        };
        let (elastic, handle_sigterm) = elastic_config(&config)?;
        let (job, worker_id, host) = (elastic.job.clone(), elastic.worker_id.clone(), elastic.host.clone());

        let leaving = if handle_sigterm { Some(sigterm()?) } else { None };
        let joined = wait(py, async move {
            let join = ElasticGroup::join(elastic);
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
            slot: Arc::new(Mutex::new(Slot::Idle(Box::new(group)))),
            sigterm: Arc::new(SigtermPolicy::new(handle_sigterm)),
            reporter,
            job,
            worker_id,
            host,
            address,
            handle_sigterm,
            config: config.unbind(),
            comms: Mutex::new(Vec::new()),
        })
    }

    /// The `GroupConfig` this group joined with.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAny> {
        self.config.clone_ref(py)
    }

    /// The job id.
    #[getter]
    fn job(&self) -> &str {
        self.job.as_str()
    }

    /// This worker's id.
    #[getter]
    fn worker_id(&self) -> &str {
        self.worker_id.as_str()
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

    /// SIGTERM was received: leave at the next commit point. A program that reads it has
    /// commit points: from the first read on, SIGTERM is left to them (as
    /// [`Group::leave_at_commit_points`]).
    #[getter]
    fn leaving(&self) -> bool {
        self.sigterm.defer_to_commit_points();
        self.handle_sigterm && sigterm_received()
    }

    /// The caller leaves at its commit points when `leaving` turns true (`cohort.elastic`'s
    /// states and `cohort.hsdp` call it; reading `leaving` or reporting a commit does it too):
    /// the group's collectives no longer raise `GracefulLeave` on SIGTERM. Without it they do,
    /// at the next blocking call.
    fn leave_at_commit_points(&self) {
        self.sigterm.defer_to_commit_points();
    }

    /// Joiners are waiting for a re-formation (as far as this worker has heard).
    #[getter]
    fn reformation_pending(&self) -> bool {
        self.reporter.reformation_pending()
    }

    /// Waits for the next generation and connects its mesh (GIL released). SIGTERM (where
    /// handled) ends the wait: the worker leaves the job and `GracefulLeave` is raised.
    fn next_generation(&self, py: Python<'_>) -> PyResult<Communicator> {
        let mut group = self.take()?;
        let leaving = if self.handle_sigterm { Some(sigterm()?) } else { None };
        let result = wait(py, async {
            match leaving {
                Some(mut leaving) => tokio::select! {
                    generation = group.next_generation() => Some(generation),
                    _ = leaving.wait_for(|l| *l) => None,
                },
                None => Some(group.next_generation().await),
            }
        });
        let generation = match result {
            Ok(Some(generation)) => {
                self.give_back(group);
                generation
            }
            Ok(None) => {
                *self.slot.lock().unwrap_or_else(PoisonError::into_inner) = Slot::Closed;
                self.close_comms(py)?;
                let left = wait(py, async move { (*group).leave(false).await })?;
                let how = match left {
                    Ok(()) => "left the job gracefully".to_string(),
                    Err(e) => format!("leaving failed ({e}); its lease ends the membership"),
                };
                eprintln!("cohort: SIGTERM while waiting for a generation of job {}: {how}", self.job);
                return Err(graceful_leave(py, &format!("SIGTERM while waiting for a generation: {how}")));
            }
            Err(interrupted) => {
                self.give_back(group);
                return Err(interrupted);
            }
        };
        let generation = generation.map_err(Failure::Elastic)?;
        let transport = generation.transport.name();
        let link =
            GroupLink { sigterm: Arc::clone(&self.sigterm), slot: Arc::downgrade(&self.slot), job: self.job.clone() };
        let comm = Communicator::new(
            generation.comm,
            Some(self.reporter.clone()),
            generation.members.known(),
            transport,
            link,
        );
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
        // A program that reports commits leaves at them on SIGTERM (it reads `leaving` there).
        self.sigterm.defer_to_commit_points();
        // The deadlines in force on the generation's links go with the next heartbeat (and to
        // the metrics), as `cohort-worker train` reports its own.
        let links = {
            let comms = self.comms.lock().unwrap_or_else(PoisonError::into_inner);
            comms.iter().rev().filter_map(Weak::upgrade).find_map(|core| core.links_of(generation))
        };
        self.with_idle(|g| {
            if let Some(links) = &links {
                g.report_deadlines(links.as_ref());
            }
            g.commit(generation, step, digest)
        })
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
        format!(
            "Group(job={:?}, worker_id={:?}, address={:?})",
            self.job.as_str(),
            self.worker_id.as_str(),
            self.address
        )
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
