//! `cohort._native`: the Python extension over the `cohort` crate (PyO3, stable ABI 3.11+).
//!
//! A thin layer: collectives, rendezvous, revocation and state sync are the crate's; this
//! crate views Python buffers in place (`buffer`), releases the GIL while Rust works
//! (`runtime`), and turns typed errors into the exceptions of `cohort.errors` (`errors`).
//! The Python contract is python/cohort/_native.pyi.

mod buffer;
mod checkpoint;
mod comm;
mod errors;
mod group;
mod ops;
mod runtime;
mod store;

use pyo3::prelude::*;

/// Routes the crate's tracing to stderr; `COHORT_LOG` (an EnvFilter, e.g. `info` or
/// `cohort=debug`) overrides `level`. Later calls change nothing.
#[pyfunction]
#[pyo3(signature = (level="warn"))]
fn init_logging(level: &str) {
    let filter = std::env::var("COHORT_LOG")
        .ok()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<group::Group>()?;
    m.add_class::<comm::Communicator>()?;
    m.add_class::<comm::Member>()?;
    m.add_class::<comm::Work>()?;
    m.add_class::<checkpoint::Checkpoint>()?;
    m.add_class::<checkpoint::SyncOutcome>()?;
    m.add_class::<store::KeyValueStore>()?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    init_logging("warn");
    Ok(())
}
