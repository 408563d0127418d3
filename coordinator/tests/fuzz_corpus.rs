//! The committed seed corpus of the `settings_toml` fuzz target (`fuzz/seeds/settings_toml/`),
//! replayed through the target's own body (`fuzz/bodies/settings_toml.rs`): what `cargo fuzz`
//! runs, without nightly or libFuzzer.

#[path = "../../fuzz/bodies/replay.rs"]
mod replay;

#[path = "../../fuzz/bodies/settings_toml.rs"]
mod settings_toml;

#[test]
fn settings_toml_seeds() {
    replay::replay("settings_toml", settings_toml::run);
}
