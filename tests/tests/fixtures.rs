//! The committed demo tokenizer must equal the one the tests build in code.

#[test]
fn committed_mock_tokenizer_matches_builder() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/mock-tokenizer.json");
    let committed = std::fs::read_to_string(&path).expect("config/mock-tokenizer.json exists");
    let built = lockstep_tests::tokenizer::to_json();
    if std::env::var_os("LOCKSTEP_BLESS").is_some() {
        std::fs::write(&path, &built).expect("write");
        return;
    }
    assert_eq!(
        committed, built,
        "regenerate with LOCKSTEP_BLESS=1 cargo test -p lockstep-tests --test fixtures"
    );
}
