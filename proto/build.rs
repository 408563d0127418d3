//! Generates the tonic client and server for `proto/coordinator.proto`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/coordinator.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/coordinator.proto"], &["proto"])?;
    Ok(())
}
