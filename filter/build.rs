//! Compiles the snapshot schema owned by the filter crate, so both ends share one `.proto`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/snapshot.proto";
    println!("cargo:rerun-if-changed={proto}");
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    prost_build::compile_protos(&[proto], &["proto"])?;
    Ok(())
}
