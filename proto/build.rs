//! Generates the `lockstep.v1` messages and services with tonic-prost-build, running the vendored
//! `protoc` so a fresh machine needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // KV page bytes are shared buffers: decoded without a copy, handed to the importer as is.
    config.bytes([".lockstep.v1.KvPage.data"]);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("lockstep_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                "proto/lockstep/v1/lockstep.proto",
                "proto/lockstep/v1/worker.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
