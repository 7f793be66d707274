//! Compiles the snapshot schema owned by the filter crate, so both ends share one `.proto`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../filter/proto/snapshot.proto";
    println!("cargo:rerun-if-changed={proto}");
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    // Serialize lets `/v1/snapshot.json` render the exact message the filter decodes, field for
    // field, instead of a hand-kept copy that could drift from the schema.
    prost_build::Config::new()
        .type_attribute(".", "#[derive(serde::Serialize)]")
        .compile_protos(&[proto], &["../filter/proto"])?;
    Ok(())
}
