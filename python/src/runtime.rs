//! The tokio runtime behind the extension, and the one way Python code waits on it.
//!
//! One multi-thread runtime per process with a single worker thread: it runs the group's
//! background tasks (heartbeats, the watch stream, commit reports, the SIGTERM listener)
//! while Python computes. A blocking call runs its future on the calling thread through
//! [`wait`], with the GIL released, so a collective's socket work stays on the thread that
//! asked for it (the TCP receive busy-polls its socket before it parks, as the Rust bench
//! does), and other Python threads run meanwhile.
//!
//! Fork: a runtime does not survive `fork()`. Create groups in the process that uses them
//! (torch.multiprocessing's default "spawn" start method is fine).

use pyo3::prelude::*;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::sync::watch;

/// How often a blocking call on the main thread looks for signals (Ctrl-C, or any Python
/// signal handler): well inside the 100 ms a user waits for `KeyboardInterrupt`.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
static SIGTERM: OnceLock<watch::Receiver<bool>> = OnceLock::new();

/// The process's runtime, started on first use.
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("cohort-runtime")
                .enable_all()
                .build()
                .map_err(|e| format!("starting the tokio runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| crate::errors::cohort_error(e.clone()))
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
        return Ok(SIGTERM.get().map(Clone::clone).unwrap_or(rx));
    }
    rt.spawn(async move {
        if term.recv().await.is_some() {
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

/// Whether the calling thread is the process's main thread (the one Python delivers
/// signals to).
fn on_main_thread() -> bool {
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
    let rt = runtime()?;
    let main = on_main_thread();
    py.detach(move || {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            rt.block_on(async move {
                let mut fut = std::pin::pin!(fut);
                if !main {
                    return Ok(fut.await);
                }
                loop {
                    tokio::select! {
                        biased;
                        out = &mut fut => return Ok(out),
                        () = tokio::time::sleep(SIGNAL_POLL) => {
                            Python::attach(|py| py.check_signals())?;
                        }
                    }
                }
            })
        }));
        match outcome {
            Ok(result) => result,
            Err(panic) => Err(crate::errors::panic_error(panic)),
        }
    })
}
