//! The coordinator's job settings file (`--config`): settings that validate, or a typed error.
#![no_main]
use cohort_coordinator::config::{Overrides, Settings};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(settings) = Settings::from_toml(Some(("fuzz", text)), &Overrides::default()) {
        let _ = settings.for_job("any-job");
    }
});
