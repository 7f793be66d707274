//! Compiles the snapshot schema owned by the filter crate, so both ends share one `.proto`,
//! and names the build (`PD_ROUTER_BUILD`) by its sources, so gateways running different
//! filters can be told apart without a git checkout at build time.
use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/snapshot.proto";
    println!("cargo:rerun-if-changed={proto}");
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    prost_build::compile_protos(&[proto], &["proto"])?;

    for watched in ["src", "proto", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={watched}");
    }
    let mut files = Vec::new();
    for root in ["src", "proto"] {
        collect(Path::new(root), &mut files)?;
    }
    files.push(PathBuf::from("Cargo.toml"));
    files.sort();
    // FNV-1a 64 over every source file's path and bytes, in path order.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for file in &files {
        let name = file.to_string_lossy().replace('\\', "/");
        for byte in name.bytes().chain([0]).chain(std::fs::read(file)?) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!(
        "cargo:rustc-env=PD_ROUTER_BUILD={}+{:012x}",
        std::env::var("CARGO_PKG_VERSION")?,
        hash >> 16
    );
    Ok(())
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}
