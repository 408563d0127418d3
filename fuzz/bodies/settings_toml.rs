//! The coordinator's job settings file (`--config`): settings that validate, or a typed error.
use cohort_coordinator::config::{Overrides, Settings};

/// One input: the file's text (not UTF-8: nothing to parse).
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(settings) = Settings::from_toml(Some(("fuzz", text)), &Overrides::default()) {
        let _ = settings.for_job("any-job");
    }
}
