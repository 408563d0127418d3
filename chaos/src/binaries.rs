//! Finding (and if need be building) the `cohort-coordinator` and `cohort-worker` binaries.

use std::path::{Path, PathBuf};

/// Paths of the binaries a local cluster runs.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `cohort-coordinator`.
    pub coordinator: PathBuf,
    /// `cohort-worker`.
    pub worker: PathBuf,
}

impl Binaries {
    /// Looks in `$COHORT_BIN_DIR`, else next to this executable (`target/<profile>/`). When
    /// they are missing there and this executable lives in a cargo target directory of the
    /// workspace, builds them with the same profile (`cargo build -p cohort-coordinator -p
    /// cohort-worker --bins`), so `cargo run -p cohort-chaos -- demo` works from a fresh clone.
    pub fn locate() -> Result<Self, String> {
        let dir = match std::env::var_os("COHORT_BIN_DIR") {
            Some(d) => PathBuf::from(d),
            None => std::env::current_exe()
                .map_err(|e| format!("locating cohort-chaos: {e}"))?
                .parent()
                .map(Path::to_path_buf)
                .ok_or("cohort-chaos has no parent directory")?,
        };
        // Test binaries live in target/<profile>/deps/; the binaries one level up.
        let dir = if dir.ends_with("deps") { dir.parent().map(Path::to_path_buf).unwrap_or(dir) } else { dir };
        let found = Self { coordinator: dir.join("cohort-coordinator"), worker: dir.join("cohort-worker") };
        if found.coordinator.is_file() && found.worker.is_file() && !stale(&found) {
            return Ok(found);
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().ok_or("no workspace")?;
        let release = dir.ends_with("release");
        eprintln!(
            "cohort-chaos: building cohort-coordinator and cohort-worker ({} profile) in {}",
            if release { "release" } else { "dev" },
            workspace.display()
        );
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.current_dir(workspace).args(["build", "-p", "cohort-coordinator", "-p", "cohort-worker", "--bins"]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().map_err(|e| format!("running cargo: {e}"))?;
        if !status.success() {
            return Err(format!("cargo build of the binaries failed ({status})"));
        }
        if found.coordinator.is_file() && found.worker.is_file() {
            Ok(found)
        } else {
            Err(format!("built, but the binaries are not in {}", dir.display()))
        }
    }
}

/// A binary older than the chaos harness itself may predate source changes; rebuilding is
/// cheap when nothing changed, so treat older binaries as stale only when asked to.
fn stale(b: &Binaries) -> bool {
    std::env::var_os("COHORT_CHAOS_REBUILD").is_some() && b.worker.exists()
}
