//! The tokio runtime behind the extension, and the one way Python code waits on it.
//!
//! A current-thread runtime whose core moves to whoever needs it. A blocking call runs its
//! future through [`block_on`] on the calling thread, with the GIL released: that thread then
//! drives the sockets, timers and tasks itself, as `cohort-worker bench` and `train` do on
//! their current-thread runtimes, and a receive that parks wakes the same thread (a
//! multi-thread runtime, whose worker drives the reactor, measured 6-11% slower at 16 MiB:
//! docs/benchmarks-journal.md). While no call runs, a driver thread holds the core so that the
//! group's background tasks (heartbeats, the watch stream, commit reports, the SIGTERM
//! listener) keep running while Python computes. It takes the core back only after
//! [`DRIVER_GRACE`] without calls, so back-to-back collectives never wait for a hand-over.
//!
//! Fork: a runtime does not survive `fork()`. Create groups in the process that uses them
//! (torch.multiprocessing's default "spawn" start method is fine).

use pyo3::prelude::*;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// How often a blocking call on the main thread looks for signals (Ctrl-C, or any Python
/// signal handler, and SIGTERM for a group without commit points): well inside the 100 ms a
/// user waits for `KeyboardInterrupt`. Every blocking wait of the package on the main thread
/// looks at most this long apart (docs/python.md states it).
pub(crate) const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// How long the driver thread stays away after the last call ended.
const DRIVER_GRACE: Duration = Duration::from_millis(2);

/// The runtime and the hand-over of its core between callers and the driver thread.
pub(crate) struct Driver {
    rt: tokio::runtime::Runtime,
    /// Calls that hold or wait for the core.
    wanted: AtomicUsize,
    /// Wakes the driver's idle future when a call wants the core.
    call_waiting: Notify,
    /// When the last call ended, in ns since `epoch` (written by callers, read by the driver,
    /// which checks back every grace period instead of being woken by every call's end).
    last_release_ns: AtomicU64,
    epoch: Instant,
}

static DRIVER: OnceLock<Result<&'static Driver, String>> = OnceLock::new();
static SIGTERM: OnceLock<watch::Receiver<bool>> = OnceLock::new();

fn driver() -> PyResult<&'static Driver> {
    DRIVER
        .get_or_init(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("starting the tokio runtime: {e}"))?;
            let driver: &'static Driver = Box::leak(Box::new(Driver {
                rt,
                wanted: AtomicUsize::new(0),
                call_waiting: Notify::new(),
                last_release_ns: AtomicU64::new(0),
                epoch: Instant::now(),
            }));
            std::thread::Builder::new()
                .name("cohort-driver".into())
                .spawn(move || drive(driver))
                .map_err(|e| format!("starting the runtime's driver thread: {e}"))?;
            Ok(driver)
        })
        .as_ref()
        .map(|d| *d)
        .map_err(|e| crate::errors::cohort_error(e.clone()))
}

/// The driver thread: holds the core while no call wants it.
fn drive(d: &'static Driver) {
    loop {
        d.rt.block_on(async {
            while d.wanted.load(Ordering::SeqCst) == 0 {
                d.call_waiting.notified().await;
            }
        });
        // Stay away while calls run and for a grace period after the last one: look again
        // every grace period (waking the driver at each call's end costs two context
        // switches per call, a 4 KiB allreduce's whole budget on a small machine).
        loop {
            std::thread::sleep(DRIVER_GRACE);
            let now_ns = d.epoch.elapsed().as_nanos() as u64;
            let idle = Duration::from_nanos(now_ns.saturating_sub(d.last_release_ns.load(Ordering::SeqCst)));
            if d.wanted.load(Ordering::SeqCst) == 0 && idle >= DRIVER_GRACE {
                break;
            }
        }
    }
}

/// Marks a call's end (also on panic).
struct CallGuard(&'static Driver);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.last_release_ns.store(self.0.epoch.elapsed().as_nanos() as u64, Ordering::SeqCst);
        self.0.wanted.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `fut` on the calling thread, which takes the runtime's core for the duration (see
/// the module docs). No GIL handling: callers hold no GIL or release it first.
pub(crate) fn block_on<F: Future>(fut: F) -> PyResult<F::Output> {
    let d = driver()?;
    d.wanted.fetch_add(1, Ordering::SeqCst);
    let _guard = CallGuard(d);
    d.call_waiting.notify_one();
    Ok(d.rt.block_on(fut))
}

/// The process's runtime (for spawning and entering its context).
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    driver().map(|d| &d.rt)
}

/// A receiver that turns `true` once SIGTERM arrives. The first call installs the handler
/// (process-wide; from then on SIGTERM no longer ends the process by itself: the worker
/// leaves at its next commit point, as `cohort-worker train` does).
pub(crate) fn sigterm() -> PyResult<watch::Receiver<bool>> {
    if let Some(rx) = SIGTERM.get() {
        return Ok(rx.clone());
    }
    let rt = runtime()?;
    let _entered = rt.enter();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| crate::errors::cohort_error(format!("installing the SIGTERM handler: {e}")))?;
    let (tx, rx) = watch::channel(false);
    if SIGTERM.set(rx.clone()).is_err() {
        // Another thread installed it first; use that one.
        return Ok(SIGTERM.get().cloned().unwrap_or(rx));
    }
    rt.spawn(async move {
        if term.recv().await.is_some() {
            // Said where the operator looks (a pod's log, a Slurm job's stderr): the process
            // goes on until it leaves, so the signal must not look swallowed.
            eprintln!(
                "cohort: SIGTERM received (pid {}): leaving the job at the next commit point, or at the next \
                 cohort call where the group reports none (docs/python.md)",
                std::process::id()
            );
            tracing::info!("SIGTERM: leaving at the next commit point");
            let _ = tx.send(true);
        }
    });
    Ok(rx)
}

/// Whether SIGTERM has been received (false when the handler was never installed).
pub(crate) fn sigterm_received() -> bool {
    SIGTERM.get().is_some_and(|rx| *rx.borrow())
}

/// What SIGTERM does to a group's blocking calls (shared by the group and the communicators it
/// makes).
#[derive(Debug, Default)]
pub(crate) struct SigtermPolicy(AtomicU8);

impl SigtermPolicy {
    const IGNORED: u8 = 0;
    const NEXT_CALL: u8 = 1;
    const COMMIT_POINTS: u8 = 2;

    /// `handle_sigterm`: leave at the next blocking call (until commit points are declared);
    /// otherwise SIGTERM is not this group's business.
    pub(crate) fn new(handle_sigterm: bool) -> Self {
        SigtermPolicy(AtomicU8::new(if handle_sigterm { Self::NEXT_CALL } else { Self::IGNORED }))
    }

    /// The caller's commit points read `Group.leaving` and leave there: blocking calls no
    /// longer raise `GracefulLeave` (a group that ignores SIGTERM keeps ignoring it).
    pub(crate) fn defer_to_commit_points(&self) {
        let _ = self.0.compare_exchange(Self::NEXT_CALL, Self::COMMIT_POINTS, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Whether a blocking call should stop now and leave: SIGTERM arrived and no commit point
    /// will act on it.
    pub(crate) fn leave_now(&self) -> bool {
        self.0.load(Ordering::SeqCst) == Self::NEXT_CALL && sigterm_received()
    }
}

/// The exception of a blocking call that stopped for SIGTERM (`cohort.GracefulLeave`).
pub(crate) fn graceful_leave(py: Python<'_>, message: &str) -> PyErr {
    let built = PyModule::import(py, "cohort.errors")
        .and_then(|m| m.getattr("GracefulLeave"))
        .and_then(|cls| cls.call1((message,)));
    match built {
        Ok(value) => PyErr::from_value(value),
        Err(e) => e,
    }
}

/// Whether `err` is a `cohort.GracefulLeave`.
pub(crate) fn is_graceful_leave(py: Python<'_>, err: &PyErr) -> bool {
    PyModule::import(py, "cohort.errors")
        .and_then(|m| m.getattr("GracefulLeave"))
        .is_ok_and(|cls| err.value(py).is_instance(&cls).unwrap_or(false))
}

/// What a blocking call that stopped for SIGTERM says.
pub(crate) const SIGTERM_IN_CALL: &str = "SIGTERM: this worker left the job during a cohort call (its group \
     reports no commit points, so the call did not wait for one)";

/// Whether the calling thread is the process's main thread (the one Python delivers
/// signals to).
pub(crate) fn on_main_thread() -> bool {
    // SAFETY: getpid and gettid have no preconditions.
    unsafe { libc::getpid() == libc::gettid() }
}

/// Runs `fut` to completion on the calling thread with the GIL released.
///
/// On the main thread it looks for signals every [`SIGNAL_POLL`]: when a Python signal
/// handler raises (Ctrl-C's `KeyboardInterrupt`), the future is dropped (a collective's
/// cancel guard then aborts its transport) and the exception is returned. A Rust panic
/// becomes a `CohortError`, never an abort.
pub(crate) fn wait<F, T>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: Future<Output = T> + Send,
    T: Send,
{
    wait_or_leave(py, fut, None)
}

/// [`wait`] for a call of a group whose SIGTERM `policy` may say to leave now: then (on the
/// main thread, before the call and at every look for signals) the future is dropped and
/// `cohort.GracefulLeave` returned ([`SIGTERM_IN_CALL`]); the caller leaves the job.
pub(crate) fn wait_or_leave<F, T>(py: Python<'_>, fut: F, policy: Option<&SigtermPolicy>) -> PyResult<T>
where
    F: Future<Output = T> + Send,
    T: Send,
{
    let main = on_main_thread();
    let leave_now = || main && policy.is_some_and(SigtermPolicy::leave_now);
    if leave_now() {
        return Err(graceful_leave(py, SIGTERM_IN_CALL));
    }
    let leave_now = &leave_now;
    py.detach(move || {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            block_on(async move {
                let mut fut = std::pin::pin!(fut);
                if !main {
                    return Ok(fut.await);
                }
                loop {
                    tokio::select! {
                        biased;
                        out = &mut fut => return Ok(out),
                        () = tokio::time::sleep(SIGNAL_POLL) => {
                            Python::attach(|py| {
                                py.check_signals()?;
                                if leave_now() {
                                    return Err(graceful_leave(py, SIGTERM_IN_CALL));
                                }
                                Ok(())
                            })?;
                        }
                    }
                }
            })
        }));
        match outcome {
            Ok(Ok(result)) => result,
            Ok(Err(no_runtime)) => Err(no_runtime),
            Err(panic) => Err(crate::errors::panic_error(panic)),
        }
    })
}
