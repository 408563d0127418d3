//! `Communicator` and `Work`: one generation's collectives from Python.
//!
//! A blocking call runs on the calling thread with the GIL released ([`crate::runtime::wait`]).
//! A `*_async` call is queued to the communicator's own thread (started on first use), which
//! runs queued calls one at a time in issue order, so that gradient buckets are reduced while
//! backward goes on. A blocking call first waits for every queued call to finish, keeping the
//! one order all ranks must agree on.
//!
//! When a call fails and the communicator belongs to a `Group`, the failure is reported to the
//! coordinator before the exception is raised, and the exception carries the generation's
//! root cause (the rank that failed first), as `cohort-worker train` prints it.

use crate::buffer::Buf;
use crate::errors::{invalid, to_pyerr, Failure};
use crate::group::GroupLink;
use crate::ops::{execute, parse_op, Prepared, Shape};
use crate::runtime::{graceful_leave, is_graceful_leave, on_main_thread, runtime, wait_or_leave, SIGTERM_IN_CALL};
use cohort::elastic::{FailureReporter, MemberInfo, MeshTransport};
use cohort::{CommError, Communicator as RustCommunicator};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

pub(crate) type Comm = Box<RustCommunicator<MeshTransport>>;

/// A queued call, as the collectives thread runs it.
type Job = Box<dyn FnOnce() + Send>;

/// Where the communicator is: ready, lent to a running call, or closed.
enum Slot {
    Ready(Comm),
    Busy,
    Closed,
}

/// One member of a generation.
#[pyclass(module = "cohort._native", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Member {
    /// Rank in the generation.
    rank: u32,
    /// The worker's id.
    worker_id: String,
    /// Its host name.
    host: String,
    /// Its data-plane address.
    address: String,
}

#[pymethods]
impl Member {
    fn __repr__(&self) -> String {
        format!(
            "Member(rank={}, worker_id={:?}, host={:?}, address={:?})",
            self.rank, self.worker_id, self.host, self.address
        )
    }
}

impl From<&MemberInfo> for Member {
    fn from(m: &MemberInfo) -> Self {
        Member { rank: m.rank, worker_id: m.worker_id.clone(), host: m.host.clone(), address: m.tcp.to_string() }
    }
}

/// What a communicator's calls share (its Python object, queued calls, the executor).
pub(crate) struct Core {
    slot: Mutex<Slot>,
    reporter: Option<FailureReporter>,
    generation: u64,
    shape: Shape,
    /// The executor's queue, started by the first `*_async` call.
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    /// The last queued call.
    tail: Mutex<Option<Arc<Completion>>>,
    /// The subgroups made from this communicator ([`Communicator::subgroup`]), closed with it.
    subgroups: Mutex<Vec<Weak<Core>>>,
    /// The group that made it: its SIGTERM policy, and the membership to leave on SIGTERM.
    link: GroupLink,
    /// The communicator's transport, to abort a queued call whose waiter was interrupted
    /// ([`Core::interrupted`]) while the collectives thread holds the communicator.
    transport: Arc<MeshTransport>,
}

impl Core {
    /// The generation's links, if this is the communicator of `generation` (for the deadlines
    /// reported at a commit point).
    pub(crate) fn links_of(&self, generation: u64) -> Option<Arc<MeshTransport>> {
        (self.generation == generation).then(|| Arc::clone(&self.transport))
    }

    /// Lends the communicator to one call.
    fn take(&self) -> Result<Comm, Failure> {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        match std::mem::replace(&mut *slot, Slot::Busy) {
            Slot::Ready(comm) => Ok(comm),
            Slot::Busy => Err(Failure::Invalid(
                "another call is running on this communicator (its calls run one at a time, in the same order on every rank)".into(),
            )),
            Slot::Closed => {
                *slot = Slot::Closed;
                Err(Failure::Invalid("the communicator is closed".into()))
            }
        }
    }

    /// Returns a lent communicator (unless it was closed meanwhile).
    pub(crate) fn give_back(&self, comm: Comm) {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if matches!(*slot, Slot::Busy) {
            *slot = Slot::Ready(comm);
        }
    }

    /// Runs `op` to completion on `comm` and turns a failure into the root cause.
    ///
    /// # Cancel safety
    /// Not cancel safe (a collective).
    async fn run(&self, comm: &mut RustCommunicator<MeshTransport>, prepared: &Prepared) -> Result<(), Failure> {
        match execute(comm, &prepared.op).await {
            Ok(()) => Ok(()),
            Err(error) => Err(self.failure(error).await),
        }
    }

    /// Reports `error` (when the communicator belongs to a group) and wraps it with the cause.
    ///
    /// # Cancel safety
    /// Cancel safe (reports are idempotent).
    pub(crate) async fn failure(&self, error: CommError) -> Failure {
        let cause = match (&self.reporter, &error) {
            (_, CommError::InvalidArgument(_)) => None,
            (Some(reporter), _) => Some(reporter.on_failure(self.generation, &error).await),
            (None, _) => None,
        };
        Failure::comm(error, self.generation, cause)
    }

    /// Waits for the queued calls, then closes the communicator: later calls raise
    /// `InvalidArgumentError` ("the communicator is closed"). Idempotent.
    pub(crate) fn close(&self, py: Python<'_>) -> PyResult<()> {
        let subgroups = std::mem::take(&mut *self.subgroups.lock().unwrap_or_else(PoisonError::into_inner));
        for sub in subgroups.iter().filter_map(Weak::upgrade) {
            sub.close(py)?;
        }
        self.drain(py)?;
        let old = std::mem::replace(&mut *self.slot.lock().unwrap_or_else(PoisonError::into_inner), Slot::Closed);
        if let Ok(rt) = runtime() {
            let _entered = rt.enter();
            drop(old);
        }
        Ok(())
    }

    /// Waits (GIL released) until every queued call has finished.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        let tail = self.tail.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if let Some(tail) = tail {
            if let Err(interrupted) = tail.wait_interruptibly(py, None, None) {
                return Err(self.interrupted(py, interrupted));
            }
        }
        Ok(())
    }

    /// Runs one blocking call on `bufs`' memory (checked unchanged afterwards).
    pub(crate) fn call(&self, py: Python<'_>, bufs: &[&Buf], prepared: PyResult<Prepared>) -> PyResult<()> {
        let prepared = prepared?;
        self.drain(py)?;
        let mut comm = self.take().map_err(PyErr::from)?;
        let result = wait_or_leave(py, async { self.run(&mut comm, &prepared).await }, Some(&self.link.sigterm));
        self.give_back(comm);
        match result {
            Ok(Ok(())) => bufs.iter().try_for_each(|b| b.check_unchanged(py)),
            Ok(Err(failure)) => Err(to_pyerr(py, failure)),
            Err(interrupted) => Err(self.stopped(py, interrupted)),
        }
    }

    /// A wait on queued calls stopped by a signal (Ctrl-C's `KeyboardInterrupt`, SIGTERM's
    /// `GracefulLeave`): the calls still running are aborted, as a blocking call's collective
    /// is when its wait stops (the communicator is unusable either way), so that nothing goes
    /// on waiting for a peer behind the caller's back (up to the late-rank bound) and a
    /// `close()` that follows returns at once. Then as [`Core::stopped`].
    fn interrupted(&self, py: Python<'_>, interrupted: PyErr) -> PyErr {
        let running = self.tail.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(|t| !t.is_done());
        if running {
            use cohort_transports::Transport;
            let reason = format!("the wait for a queued call stopped: {}", interrupted.value(py));
            self.transport.abort(cohort_transports::AbortReason::new(reason));
        }
        self.stopped(py, interrupted)
    }

    /// A call stopped by a signal: for SIGTERM (`GracefulLeave`), leave the job first.
    fn stopped(&self, py: Python<'_>, interrupted: PyErr) -> PyErr {
        if is_graceful_leave(py, &interrupted) {
            self.link.leave_on_sigterm(py);
        }
        interrupted
    }

    /// Lends the communicator to a caller that runs its own operation (Checkpoint.sync),
    /// after every queued call has finished; hand it back with [`Core::give_back`].
    pub(crate) fn lend(&self, py: Python<'_>) -> PyResult<Comm> {
        self.drain(py)?;
        self.take().map_err(PyErr::from)
    }

    /// Queues one call on the executor thread (on the main thread, SIGTERM for a group without
    /// commit points leaves the job here: a loop of queued calls whose waits never block long,
    /// torch 1.13's among them, stops at its next call).
    fn queue(self: &Arc<Self>, prepared: Prepared, bufs: Vec<Buf>) -> PyResult<Work> {
        if on_main_thread() && self.link.sigterm.leave_now() {
            return Python::attach(|py| Err(self.stopped(py, graceful_leave(py, SIGTERM_IN_CALL))));
        }
        let completion = Arc::new(Completion::default());
        let job = {
            let core = Arc::clone(self);
            let completion = Arc::clone(&completion);
            Box::new(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), Failure> {
                    let mut comm = core.take()?;
                    let result = crate::runtime::block_on(core.run(&mut comm, &prepared));
                    core.give_back(comm);
                    result.map_err(Failure::Python)?
                }));
                let result = result.unwrap_or_else(|_| {
                    Err(Failure::Other("internal error in cohort: a queued collective panicked".into()))
                });
                drop(prepared);
                completion.complete(result);
            }) as Job
        };
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("cohort-collectives-g{}", self.generation))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| crate::errors::cohort_error(format!("starting the collectives thread: {e}")))?;
            *queue = Some(tx);
        }
        *self.tail.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&completion));
        let sent = queue.as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            return Err(crate::errors::cohort_error("the collectives thread is gone".into()));
        }
        Ok(Work { completion, bufs: Mutex::new(bufs), error: Mutex::new(None), core: Arc::clone(self) })
    }
}

/// The end of a queued call: its result, once there.
#[derive(Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<(), Failure>>>,
    done: Condvar,
}

impl Completion {
    fn complete(&self, result: Result<(), Failure>) {
        *self.result.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
        self.done.notify_all();
    }

    fn is_done(&self) -> bool {
        self.result.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    /// Waits until done or `timeout` passes (GIL released; signals checked every
    /// [`SIGNAL_POLL`](crate::runtime::SIGNAL_POLL) on the main thread, and SIGTERM where
    /// `sigterm` says to leave: then `GracefulLeave`). True when done.
    fn wait_interruptibly(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
        sigterm: Option<&crate::runtime::SigtermPolicy>,
    ) -> PyResult<bool> {
        if self.is_done() {
            return Ok(true);
        }
        let leave_now = || sigterm.is_some_and(|s| s.leave_now()) && on_main_thread();
        if leave_now() {
            return Err(graceful_leave(py, SIGTERM_IN_CALL));
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let step = crate::runtime::SIGNAL_POLL;
            let step = deadline.map_or(step, |d| d.saturating_duration_since(Instant::now()).min(step));
            let done = py.detach(|| {
                let guard = self.result.lock().unwrap_or_else(PoisonError::into_inner);
                let (guard, _) =
                    self.done.wait_timeout_while(guard, step, |r| r.is_none()).unwrap_or_else(PoisonError::into_inner);
                guard.is_some()
            });
            if done {
                return Ok(true);
            }
            py.check_signals()?;
            if leave_now() {
                return Err(graceful_leave(py, SIGTERM_IN_CALL));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }
}

/// A queued collective (see the module docs).
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct Work {
    completion: Arc<Completion>,
    /// The buffers, held until the call has finished.
    bufs: Mutex<Vec<Buf>>,
    /// The call's error as raised the first time (raised again on later waits).
    error: Mutex<Option<PyErr>>,
    /// The communicator's shared part (its group's SIGTERM policy).
    core: Arc<Core>,
}

#[pymethods]
impl Work {
    /// Blocks (GIL released) until the call completes; False when `timeout` seconds passed
    /// first. Raises the call's error.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid(format!("timeout must be a non-negative number of seconds, got {t}")))
            }
            Some(t) => Some(Duration::from_secs_f64(t)),
            None => None,
        };
        match self.completion.wait_interruptibly(py, timeout, Some(&self.core.link.sigterm)) {
            Ok(true) => {}
            Ok(false) => return Ok(false),
            Err(interrupted) => return Err(self.core.interrupted(py, interrupted)),
        }
        // Two threads may wait on one Work (cohort.torch's completer and the caller), and what
        // follows runs Python (the error's construction, the tensors' check), during which the
        // interpreter may hand the GIL to the other waiter: these locks are taken detached from
        // the interpreter, or that waiter would block on them holding the GIL (a deadlock,
        // seen in torch 2.x's async all_gather_into_tensor).
        let mut error = self.error.lock_py_attached(py).unwrap_or_else(PoisonError::into_inner);
        let bufs = std::mem::take(&mut *self.bufs.lock_py_attached(py).unwrap_or_else(PoisonError::into_inner));
        if let Some(e) = error.as_ref() {
            return Err(e.clone_ref(py));
        }
        let failure = self
            .completion
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
            .and_then(|r| std::mem::replace(r, Ok(())).err());
        match failure {
            None => match bufs.iter().try_for_each(|b| b.check_unchanged(py)) {
                Ok(()) => Ok(true),
                Err(e) => {
                    *error = Some(e.clone_ref(py));
                    Err(e)
                }
            },
            Some(failure) => {
                let e = to_pyerr(py, failure);
                *error = Some(e.clone_ref(py));
                Err(e)
            }
        }
    }

    /// Whether the call has finished (successfully or not).
    fn is_completed(&self) -> bool {
        self.completion.is_done()
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // The buffers must outlive the call: wait for it before they are released.
        if !self.completion.is_done() {
            let completion = Arc::clone(&self.completion);
            Python::attach(|py| {
                py.detach(|| {
                    let guard = completion.result.lock().unwrap_or_else(PoisonError::into_inner);
                    drop(completion.done.wait_while(guard, |r| r.is_none()));
                })
            });
        }
    }
}

/// The collectives of one generation.
#[pyclass(module = "cohort._native", frozen)]
pub(crate) struct Communicator {
    pub(crate) core: Arc<Core>,
    members: Vec<Member>,
    transport: String,
}

impl Communicator {
    pub(crate) fn new(
        comm: RustCommunicator<MeshTransport>,
        reporter: Option<FailureReporter>,
        members: &[MemberInfo],
        transport: &str,
        link: GroupLink,
    ) -> Self {
        Self::with_members(comm, reporter, members.iter().map(Member::from).collect(), transport.to_string(), link)
    }

    fn with_members(
        comm: RustCommunicator<MeshTransport>,
        reporter: Option<FailureReporter>,
        members: Vec<Member>,
        transport: String,
        link: GroupLink,
    ) -> Self {
        let shape = Shape { rank: comm.rank(), size: comm.size() };
        let generation = comm.generation();
        let mesh = Arc::clone(comm.transport());
        Communicator {
            core: Arc::new(Core {
                slot: Mutex::new(Slot::Ready(Box::new(comm))),
                reporter,
                generation,
                shape,
                queue: Mutex::new(None),
                tail: Mutex::new(None),
                subgroups: Mutex::new(Vec::new()),
                link,
                transport: mesh,
            }),
            members,
            transport,
        }
    }

    fn shape(&self) -> Shape {
        self.core.shape
    }
}

fn prepared(p: Result<Prepared, String>) -> PyResult<Prepared> {
    p.map_err(invalid)
}

fn op_of(name: &str) -> PyResult<cohort::ReduceOp> {
    parse_op(name).map_err(invalid)
}

#[pymethods]
impl Communicator {
    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.shape().rank
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> u32 {
        self.shape().size
    }

    /// The generation number.
    #[getter]
    fn generation(&self) -> u64 {
        self.core.generation
    }

    /// "tcp" or "rdma".
    #[getter]
    fn transport(&self) -> &str {
        &self.transport
    }

    /// The members this rank knows, by rank: every member of a generation answered whole (up
    /// to the job's `whole_answer_up_to`, default 256 members), else its partners and
    /// host-mates.
    #[getter]
    fn members(&self) -> Vec<Member> {
        self.members.clone()
    }

    /// Element-wise reduction of `buf` over every rank, in place.
    #[pyo3(signature = (buf, op="sum"))]
    fn allreduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<()> {
        let buf = Buf::new(buf, true, "allreduce")?;
        self.core.call(py, &[&buf], op_of(op).and_then(|op| prepared(Prepared::allreduce(&buf, op))))
    }

    /// [`Communicator::allreduce`] queued; returns a `Work`.
    #[pyo3(signature = (buf, op="sum"))]
    fn allreduce_async(&self, buf: &Bound<'_, PyAny>, op: &str) -> PyResult<Work> {
        let buf = Buf::new(buf, true, "allreduce")?;
        let p = prepared(Prepared::allreduce(&buf, op_of(op)?))?;
        self.core.queue(p, vec![buf])
    }

    /// Rank r receives the reduction of every rank's block r of `input` in `output`.
    #[pyo3(signature = (input, output, op="sum"))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<()> {
        let (i, o) =
            (Buf::new(input, false, "reduce_scatter input")?, Buf::new(output, true, "reduce_scatter output")?);
        self.core.call(
            py,
            &[&i, &o],
            op_of(op).and_then(|op| prepared(Prepared::reduce_scatter(&i, &o, op, self.shape()))),
        )
    }

    /// [`Communicator::reduce_scatter`] queued; returns a `Work`.
    #[pyo3(signature = (input, output, op="sum"))]
    fn reduce_scatter_async(&self, input: &Bound<'_, PyAny>, output: &Bound<'_, PyAny>, op: &str) -> PyResult<Work> {
        let (i, o) =
            (Buf::new(input, false, "reduce_scatter input")?, Buf::new(output, true, "reduce_scatter output")?);
        let p = prepared(Prepared::reduce_scatter(&i, &o, op_of(op)?, self.shape()))?;
        self.core.queue(p, vec![i, o])
    }

    /// `output` holds every rank's `input`, by rank.
    fn allgather(&self, py: Python<'_>, input: &Bound<'_, PyAny>, output: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, o) = (Buf::new(input, false, "allgather input")?, Buf::new(output, true, "allgather output")?);
        self.core.call(py, &[&i, &o], prepared(Prepared::allgather(&i, &o, self.shape())))
    }

    /// [`Communicator::allgather`] queued; returns a `Work`.
    fn allgather_async(&self, input: &Bound<'_, PyAny>, output: &Bound<'_, PyAny>) -> PyResult<Work> {
        let (i, o) = (Buf::new(input, false, "allgather input")?, Buf::new(output, true, "allgather output")?);
        let p = prepared(Prepared::allgather(&i, &o, self.shape()))?;
        self.core.queue(p, vec![i, o])
    }

    /// Copies the root's `buf` to every rank.
    #[pyo3(signature = (buf, root=0))]
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: u32) -> PyResult<()> {
        let b = Buf::new(buf, true, "broadcast")?;
        self.core.call(py, &[&b], prepared(Prepared::broadcast(&b, root, self.shape())))
    }

    /// [`Communicator::broadcast`] queued; returns a `Work`.
    #[pyo3(signature = (buf, root=0))]
    fn broadcast_async(&self, buf: &Bound<'_, PyAny>, root: u32) -> PyResult<Work> {
        let b = Buf::new(buf, true, "broadcast")?;
        let p = prepared(Prepared::broadcast(&b, root, self.shape()))?;
        self.core.queue(p, vec![b])
    }

    /// The root's `buf` receives the reduction over every rank (others' are left as they are).
    #[pyo3(signature = (buf, root=0, op="sum"))]
    fn reduce(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: u32, op: &str) -> PyResult<()> {
        let b = Buf::new(buf, true, "reduce")?;
        self.core.call(py, &[&b], op_of(op).and_then(|op| prepared(Prepared::reduce(&b, root, op, self.shape()))))
    }

    /// The root's `output` holds every rank's `input`, by rank (`output` may be None elsewhere).
    #[pyo3(signature = (input, output, root=0))]
    fn gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        root: u32,
    ) -> PyResult<()> {
        let i = Buf::new(input, false, "gather input")?;
        let o = match output {
            Some(o) => Buf::new(o, true, "gather output")?,
            None if self.shape().rank == root => return Err(invalid("gather: the root needs an output buffer")),
            None => Buf::empty(i.dtype()),
        };
        self.core.call(py, &[&i, &o], prepared(Prepared::gather(&i, &o, root, self.shape())))
    }

    /// Every rank's `output` receives its block of the root's `input` (`input` may be None
    /// elsewhere).
    #[pyo3(signature = (input, output, root=0))]
    fn scatter(
        &self,
        py: Python<'_>,
        input: Option<&Bound<'_, PyAny>>,
        output: &Bound<'_, PyAny>,
        root: u32,
    ) -> PyResult<()> {
        let o = Buf::new(output, true, "scatter output")?;
        let i = match input {
            Some(i) => Buf::new(i, false, "scatter input")?,
            None if self.shape().rank == root => return Err(invalid("scatter: the root needs an input buffer")),
            None => Buf::empty(o.dtype()),
        };
        self.core.call(py, &[&i, &o], prepared(Prepared::scatter(&i, &o, root, self.shape())))
    }

    /// Block j of rank i's `input` lands in block i of rank j's `output`.
    fn alltoall(&self, py: Python<'_>, input: &Bound<'_, PyAny>, output: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, o) = (Buf::new(input, false, "alltoall input")?, Buf::new(output, true, "alltoall output")?);
        self.core.call(py, &[&i, &o], prepared(Prepared::alltoall(&i, &o, self.shape())))
    }

    /// Returns once every rank has entered it.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.core.call(py, &[], prepared(Prepared::barrier()))
    }

    /// Sends `buf` to rank `dst` (matched with its `recv` in order).
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, dst: u32) -> PyResult<()> {
        let b = Buf::new(buf, false, "send")?;
        self.core.call(py, &[&b], prepared(Prepared::point_to_point(&b, dst, true, self.shape())))
    }

    /// Receives into `buf` from rank `src` (its length must match what was sent).
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, src: u32) -> PyResult<()> {
        let b = Buf::new(buf, true, "recv")?;
        self.core.call(py, &[&b], prepared(Prepared::point_to_point(&b, src, false, self.shape())))
    }

    /// Reports that this generation failed outside cohort's own collectives (torch's gloo or
    /// nccl beneath `cohort.torch.managed`) and returns the exception to raise, whose `cause`
    /// is the generation's root cause as the coordinator recorded it (the first report of a
    /// generation wins, so every rank shares it). `peer` names the rank that failed where the
    /// caller knows it; else every other member this rank knows is asked whether its process
    /// runs (cohort's liveness probe, up to `probe` seconds) and the lowest that does not is
    /// named. `after` (seconds) makes it a timeout. The generation is revoked (every member
    /// learns it within milliseconds) and this communicator aborted. Of a communicator of no
    /// group, the local error.
    #[pyo3(signature = (reason, peer=None, after=None, probe=0.2))]
    fn report_failure(
        &self,
        py: Python<'_>,
        reason: &str,
        peer: Option<u32>,
        after: Option<f64>,
        probe: f64,
    ) -> PyResult<Py<PyAny>> {
        let shape = self.shape();
        if reason.trim().is_empty() {
            return Err(invalid("report_failure: the reason is empty"));
        }
        if let Some(p) = peer {
            if p >= shape.size || p == shape.rank {
                return Err(invalid(format!(
                    "report_failure: peer {p} is not another rank of the generation ({} ranks, this is rank {})",
                    shape.size, shape.rank
                )));
            }
        }
        if !(probe.is_finite() && (0.0..=60.0).contains(&probe)) {
            return Err(invalid(format!("report_failure: probe must be 0 to 60 seconds, not {probe}")));
        }
        let after = match after {
            Some(a) if !(a.is_finite() && a >= 0.0) => {
                return Err(invalid(format!("report_failure: after must be a duration in seconds, not {a}")))
            }
            a => a.map(Duration::from_secs_f64),
        };
        // The coordinator bounds a reason's length; keep the start of a long one.
        let reason: String = reason.chars().take(900).collect();
        let others: Vec<(u32, std::net::SocketAddr)> = self
            .members
            .iter()
            .filter(|m| m.rank != shape.rank)
            .filter_map(|m| m.address.parse().ok().map(|a| (m.rank, a)))
            .collect();
        let within = Duration::from_secs_f64(probe);
        let core = Arc::clone(&self.core);
        let failure = crate::runtime::wait(py, async move {
            let peer = match peer {
                Some(p) => Some(p),
                None if within.is_zero() => None,
                None => {
                    let mut asked = tokio::task::JoinSet::new();
                    for (rank, addr) in others {
                        asked.spawn(
                            async move { (rank, cohort_transports::liveness::endpoint_runs(addr, within).await) },
                        );
                    }
                    let mut silent = Vec::new();
                    while let Some(answer) = asked.join_next().await {
                        if let Ok((rank, Some(false))) = answer {
                            silent.push(rank);
                        }
                    }
                    silent.into_iter().min()
                }
            };
            let error = match (after, peer) {
                (Some(after), rank) => {
                    CommError::Timeout { rank, after, progress: None, silence: cohort_transports::Silence::Unprobed }
                }
                (None, Some(rank)) => CommError::PeerFailed { rank, detail: reason },
                (None, None) => CommError::Transport(cohort_transports::TransportError::Io(reason)),
            };
            core.failure(error).await
        })?;
        Ok(to_pyerr(py, failure).into_value(py).into_any())
    }

    /// Waits (GIL released) until this generation is revoked or the job has ended, and
    /// returns the `RevokedError` carrying the root cause; None when `timeout` seconds passed
    /// first (None: no bound). Of a communicator of no group, None once `timeout` passed.
    #[pyo3(signature = (timeout=None))]
    fn wait_revoked(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let limit = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid(format!("wait_revoked: timeout must be a duration in seconds, not {t}")))
            }
            t => t.map(Duration::from_secs_f64),
        };
        let reporter = self.core.reporter.clone();
        let generation = self.core.generation;
        let cause = crate::runtime::wait(py, async move {
            let revoked = async {
                match &reporter {
                    Some(r) => Some(r.revoked(generation).await),
                    None => std::future::pending().await,
                }
            };
            match limit {
                Some(limit) => tokio::time::timeout(limit, revoked).await.ok().flatten(),
                None => revoked.await,
            }
        })?;
        Ok(cause.map(|cause| {
            let failure = Failure::comm(CommError::Revoked { generation, cause }, generation, None);
            to_pyerr(py, failure).into_value(py).into_any()
        }))
    }

    /// A communicator over this one's ranks `ranks` (its rank `i` being this communicator's
    /// rank `ranks[i]`), for a 2-D device mesh (HSDP's shard and replica groups): it shares
    /// this communicator's links, generation, failures and revocation, on `channel` (1 to
    /// 4095), and its calls may run at the same time as this one's. Every member calls it
    /// with the same `ranks` and `channel`; two subgroups in use at once that share two
    /// members need different channels (the groups of one mesh dimension, being disjoint,
    /// may share one). Errors name ranks of the generation. Closed with this communicator.
    /// Waits for this communicator's queued calls first.
    fn subgroup(&self, py: Python<'_>, ranks: Vec<u32>, channel: u32) -> PyResult<Communicator> {
        let comm = self.core.lend(py)?;
        let sub = comm.mesh_subgroup(&ranks, channel);
        self.core.give_back(comm);
        let sub = sub.map_err(|e| invalid(format!("subgroup {ranks:?} on channel {channel}: {e}")))?;
        let members = ranks
            .iter()
            .enumerate()
            .filter_map(|(i, &r)| {
                let at = self.members.binary_search_by_key(&r, |m| m.rank).ok()?;
                let m = &self.members[at];
                Some(Member { rank: i as u32, ..m.clone() })
            })
            .collect();
        let sub = Communicator::with_members(
            sub,
            self.core.reporter.clone(),
            members,
            self.transport.clone(),
            self.core.link.clone(),
        );
        let mut subgroups = self.core.subgroups.lock().unwrap_or_else(PoisonError::into_inner);
        subgroups.retain(|w| w.strong_count() > 0);
        subgroups.push(Arc::downgrade(&sub.core));
        Ok(sub)
    }

    /// Releases this rank's communicator (idempotent). The links close when the group moves
    /// to the next generation, or at once when the generation was revoked.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.core.close(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, size={}, generation={}, transport={:?})",
            self.shape().rank,
            self.shape().size,
            self.core.generation,
            self.transport
        )
    }
}
