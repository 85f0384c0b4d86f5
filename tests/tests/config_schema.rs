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

/// Taplo (npm `@taplo/cli` 0.7.0, the toolkit VS Code's Even Better TOML runs) reads the schemas
/// through `.taplo.toml`: the shipped files pass, and a misspelt key is flagged at its line.
#[test]
fn taplo_checks_the_shipped_files_against_the_schemas() {
    let taplo = std::env::var_os("LOCKSTEP_TAPLO")
        .map(PathBuf::from)
        .or_else(|| {
            let home = PathBuf::from(std::env::var_os("HOME")?);
            Some(home.join(".cache/lockstep-taplo/node_modules/.bin/taplo"))
        })
        .filter(|p| p.is_file());
    let Some(taplo) = taplo else {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_TAPLO").is_none(),
            "Taplo is required: npm install --prefix ~/.cache/lockstep-taplo @taplo/cli@0.7.0"
        );
        eprintln!(
            "skipped: no Taplo (npm install --prefix ~/.cache/lockstep-taplo @taplo/cli@0.7.0)"
        );
        return;
    };
    let run = |args: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new(&taplo)
            .current_dir(root())
            .args(args)
            .output()
            .expect("taplo runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("config"))
        .expect("config/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    let mut args: Vec<&std::ffi::OsStr> = vec!["check".as_ref()];
    args.extend(files.iter().map(|p| p.as_os_str()));
    let (ok, text) = run(&args);
    assert!(ok, "{text}");
    assert!(
        text.contains(".taplo.toml"),
        "the rules were not read: {text}"
    );
    // The shipped rules, in a copy of the tree's layout: a misspelt key in a file under
    // config/ is flagged at its line.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("config")).expect("mkdir");
    for f in [
        ".taplo.toml",
        "config/lockstep.schema.json",
        "config/worker.schema.json",
    ] {
        std::fs::copy(root().join(f), dir.path().join(f)).expect("copy");
    }
    let good = std::fs::read_to_string(root().join("config/default.toml")).expect("default");
    std::fs::write(
        dir.path().join("config/bad.toml"),
        good.replacen("[server]", "[server]\nhttp_lisen = \"x\"", 1),
    )
    .expect("write");
    let out = std::process::Command::new(&taplo)
        .current_dir(dir.path())
        .args(["check", "config/bad.toml"])
        .output()
        .expect("taplo runs");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("http_lisen"),
        "{text}"
    );
}
