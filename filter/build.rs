//! Compiles the snapshot schema owned by the filter crate, so both ends share one `.proto`,
//! and names the build (`PD_ROUTER_BUILD`) by what it is made of, so gateways running
//! different filters can be told apart without a git checkout at build time.
use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/snapshot.proto";
    println!("cargo:rerun-if-changed={proto}");
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    prost_build::compile_protos(&[proto], &["proto"])?;

    // What makes the module: its sources, this script, the crate's and the workspace's
    // manifests (dependency versions, the release profile), the lock file (a dependency-only
    // update is a new build too), and the features and profile it is built with.
    let workspace = ["../Cargo.toml", "../Cargo.lock"];
    for watched in ["src", "proto", "Cargo.toml", "build.rs"]
        .into_iter()
        .chain(workspace)
    {
        println!("cargo:rerun-if-changed={watched}");
    }
    let mut files = Vec::new();
    for root in ["src", "proto"] {
        collect(Path::new(root), &mut files)?;
    }
    files.extend(["Cargo.toml", "build.rs"].map(PathBuf::from));
    files.extend(
        workspace
            .map(PathBuf::from)
            .into_iter()
            .filter(|f| f.exists()),
    );
    files.sort();
    let mut settings: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("CARGO_FEATURE_") || k == "PROFILE")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    settings.sort();
    // FNV-1a 64 over every input file's path and bytes, in path order, then the settings.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &byte in bytes.iter().chain(&[0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for file in &files {
        feed(file.to_string_lossy().replace('\\', "/").as_bytes());
        feed(&std::fs::read(file)?);
    }
    for setting in &settings {
        feed(setting.as_bytes());
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
