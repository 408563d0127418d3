//! The committed seed corpus of the `scenario_toml` fuzz target (`fuzz/seeds/scenario_toml/`),
//! replayed through the target's own body (`fuzz/bodies/scenario_toml.rs`): what `cargo fuzz`
//! runs, without nightly or libFuzzer.

#[path = "../../fuzz/bodies/replay.rs"]
mod replay;

#[path = "../../fuzz/bodies/scenario_toml.rs"]
mod scenario_toml;

#[test]
fn scenario_toml_seeds() {
    replay::replay("scenario_toml", scenario_toml::run);
}
