//! Every fuzz target's committed inputs replayed through the code libFuzzer runs
//! (`lockstep_tests::fuzz::run`): the corpus `fuzz/corpus/TARGET/` (grown by `bench/fuzz.sh`) and
//! the crash reproducers `fuzz/regressions/TARGET/` (one per crash found, kept once fixed). Every
//! target must have a corpus; any input that panics fails the test, naming the file.

use std::path::{Path, PathBuf};

use lockstep_tests::fuzz::{TARGETS, run};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn every_corpus_and_regression_input_runs_clean() {
    for target in TARGETS {
        let corpus = inputs(&fuzz_dir().join("corpus").join(target));
        assert!(!corpus.is_empty(), "fuzz target `{target}` has no corpus");
        for file in corpus
            .iter()
            .chain(&inputs(&fuzz_dir().join("regressions").join(target)))
        {
            let data = std::fs::read(file).expect("read input");
            let outcome = std::panic::catch_unwind(|| run(target, &data));
            assert!(outcome.is_ok(), "{target}: {} panicked", file.display());
        }
    }
}
