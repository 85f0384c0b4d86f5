//! The configuration file's JSON Schema (`lockstep config schema`, generated from the config
//! types): the shipped `config/lockstep.schema.json` is exactly what the types generate, every
//! shipped router configuration validates against it with an independent validator (Python's
//! `jsonschema`), and a misspelt key, a wrong type or an unknown value fails
//! (`tests/python/config_schema.py`).

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

#[test]
fn the_shipped_schema_is_what_the_config_types_generate() {
    let path = root().join("config/lockstep.schema.json");
    let shipped: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config/lockstep.schema.json"))
            .expect("JSON");
    assert_eq!(
        shipped,
        lockstep_core::config::json_schema(),
        "config/lockstep.schema.json is stale: lockstep config schema > config/lockstep.schema.json"
    );
    let worker: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("config/worker.schema.json"))
            .expect("config/worker.schema.json"),
    )
    .expect("JSON");
    assert_eq!(
        worker,
        lockstep_worker::config::json_schema(),
        "config/worker.schema.json is stale: lockstep config schema --worker > config/worker.schema.json"
    );
    // Tables refuse unknown keys, as the configuration loader does.
    assert_eq!(shipped["additionalProperties"], false);
    assert_eq!(
        shipped["$defs"]["ServerConfig"]["additionalProperties"],
        false
    );
}

#[test]
fn every_shipped_configuration_validates_and_a_misspelt_key_fails() {
    let out = std::process::Command::new("python3")
        .arg(root().join("tests/python/config_schema.py"))
        .arg(root())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("wrong ones refused"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
