//! The configuration file's JSON Schema (`lockstep config schema`), generated from the types the
//! file is read into, so it cannot drift from them: every table and key with its doc comment as
//! its description, its type and default; tables that refuse unknown keys (all of lockstep's)
//! have `additionalProperties: false`, so an editor flags a misspelt key as the start would.
//! Taplo and VS Code's Even Better TOML read it (`#:schema` at the top of a file, or
//! `.taplo.toml`); `config/lockstep.schema.json` is this output, kept equal by a test.

use super::Config;

/// The JSON Schema (draft 2020-12) of a configuration file.
pub fn json_schema() -> serde_json::Value {
    let mut schema = serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default();
    schema["title"] = "lockstep configuration (lockstep.toml)".into();
    schema
}
