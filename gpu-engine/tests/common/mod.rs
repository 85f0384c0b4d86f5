//! Shared by the tests that use the real SmolLM2 GGUF.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use lockstep_engine::engine::ModelBundle;

/// The test model: `$LOCKSTEP_MODEL`, or the cache `scripts/fetch-model.sh` fills. `None` when
/// absent, which fails the caller's test when `LOCKSTEP_REQUIRE_MODEL` is set (as in CI).
pub fn model_path() -> Option<PathBuf> {
    let p = std::env::var_os("LOCKSTEP_MODEL")
        .map(PathBuf::from)
        .or_else(|| {
            let p = PathBuf::from(std::env::var_os("HOME")?)
                .join(".cache/lockstep/models/SmolLM2-135M-Instruct.Q4_1.gguf");
            p.exists().then_some(p)
        });
    if p.is_none() {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_MODEL").is_none(),
            "LOCKSTEP_REQUIRE_MODEL is set but the model is missing: run scripts/fetch-model.sh"
        );
        eprintln!("test model not fetched (scripts/fetch-model.sh)");
    }
    p
}

/// The test model loaded once per test binary; `None` as [`model_path`].
#[allow(dead_code)] // Not every test binary that shares this module loads the model.
pub fn bundle() -> Option<Arc<ModelBundle>> {
    static B: OnceLock<Option<Arc<ModelBundle>>> = OnceLock::new();
    B.get_or_init(|| {
        let p = model_path()?;
        Some(Arc::new(ModelBundle::open(&p).expect("model loads")))
    })
    .clone()
}
