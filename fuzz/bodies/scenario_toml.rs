//! Chaos scenario files: a checked scenario, or a typed error.
use cohort_chaos::scenario::Scenario;

/// One input: the file's text (not UTF-8: nothing to parse).
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = Scenario::parse("fuzz", text);
}
