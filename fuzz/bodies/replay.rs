//! Replays a fuzz target's committed seed corpus (`fuzz/seeds/TARGET/`) through the target's
//! body, as `cargo test` does in the crate that owns the parser.
use std::path::{Path, PathBuf};

/// Runs `body` over every file in `fuzz/seeds/<target>/` (there must be some); a panic names
/// the file that caused it.
pub(crate) fn replay(target: &str, body: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the seed corpus of {target} ({}): {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no seeds for {target} in {}", dir.display());
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        if std::panic::catch_unwind(|| body(&data)).is_err() {
            panic!("{target} panicked on {}", file.display());
        }
    }
}
