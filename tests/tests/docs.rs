//! The documentation stays true: every relative link in the README and `docs/` resolves (file and
//! heading), every configuration key the code accepts is on `docs/configuration.md`, and every
//! shipped configuration file parses.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// The pages whose links are checked: the README, every page of `docs/`, `bench/RESULTS.md`.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut out = vec![root.join("README.md"), root.join("bench/RESULTS.md")];
    for e in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut fence = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if !fence {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The targets of the inline links `[text](target)` in `text`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("](") {
        let start = i + at + 2;
        let Some(len) = text[start..].find(')') else {
            break;
        };
        let target = &text[start..start + len];
        if !target.contains(char::is_whitespace) && !target.is_empty() {
            out.push(target.to_string());
        }
        i = start;
    }
    out
}

/// GitHub's anchor for a heading: lowercased, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings.
fn anchors(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    prose(&text)
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

/// What is wrong with the link `target` on the page `page`, if anything.
fn broken(page: &Path, target: &str) -> Option<String> {
    if target.starts_with("http://")
        || target.starts_with("https://")
        || target.starts_with("mailto:")
    {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((f, a)) => (f, Some(a)),
        None => (target, None),
    };
    let dir = page.parent().expect("a folder");
    let path = if file.is_empty() {
        page.to_path_buf()
    } else {
        dir.join(file)
    };
    if !path.exists() {
        return Some(format!("{target}: no such file"));
    }
    if let Some(a) = anchor
        && path.extension().is_some_and(|x| x == "md")
        && !anchors(&path).contains(a)
    {
        return Some(format!("{target}: no heading with that anchor"));
    }
    None
}

#[test]
fn every_relative_link_resolves() {
    let mut wrong = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for target in links(&prose(&text)) {
            if let Some(why) = broken(&page, &target) {
                wrong.push(format!("  {}: {why}", page.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "broken links:\n{}", wrong.join("\n"));
}

#[test]
fn the_link_checker_finds_a_broken_link_and_a_missing_anchor() {
    let page = root().join("README.md");
    assert!(broken(&page, "docs/configuration.md").is_none());
    assert!(broken(&page, "docs/nothing-here.md").is_some());
    assert!(broken(&page, "docs/deployment.md#run-on-kubernetes").is_none());
    assert!(broken(&page, "docs/deployment.md#no-such-heading").is_some());
    assert!(broken(&page, "https://example.com/x").is_none());
    assert_eq!(
        slug(" Behind a Gateway (Envoy, Gateway API Inference Extension)"),
        "behind-a-gateway-envoy-gateway-api-inference-extension"
    );
    assert_eq!(
        links("see [a](b.md) and [c](d.md#e) `x`"),
        ["b.md", "d.md#e"]
    );
}

/// The files that define configuration sections: every field of a struct there that derives
/// `Deserialize` is a key of a configuration file.
const CONFIG_SOURCES: &[&str] = &[
    "proxy/core/src/config",
    "proxy/runtime/src/engine_section.rs",
    "proxy/runtime/src/telemetry.rs",
    "proxy/worker/src/config.rs",
];

/// The keys (field names) of the `Deserialize` structs in `text`, less `#[serde(skip)]` ones;
/// a `#[serde(rename = "...")]` gives the key its name.
fn keys_of(text: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        let derives = line.starts_with("#[derive(") && line.contains("Deserialize");
        i += 1;
        if !derives {
            continue;
        }
        // Skip attributes to the item.
        while i < lines.len() && lines[i].trim().starts_with("#[") {
            i += 1;
        }
        if i >= lines.len() || !lines[i].contains("struct ") || !lines[i].trim_end().ends_with('{')
        {
            continue;
        }
        i += 1;
        let mut skip = false;
        let mut rename = None;
        while i < lines.len() && lines[i].trim() != "}" {
            let l = lines[i].trim();
            if l.starts_with("#[serde(") {
                skip |=
                    l.contains("skip)") || l.contains("skip,") || l.contains("skip_deserializing");
                if let Some(r) = l.split("rename = \"").nth(1) {
                    rename = r.split('"').next().map(str::to_string);
                }
            } else if !l.starts_with("//") && !l.starts_with("#[") && l.contains(':') {
                let name = l
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub ")
                    .split(':')
                    .next()
                    .unwrap_or("")
                    .trim();
                if !skip
                    && !name.is_empty()
                    && name.chars().all(|c| c.is_alphanumeric() || c == '_')
                {
                    keys.insert(rename.take().unwrap_or_else(|| name.to_string()));
                }
                skip = false;
                rename = None;
            }
            i += 1;
        }
    }
    keys
}

/// Every key the configuration types accept.
fn accepted_keys() -> BTreeSet<String> {
    let root = root();
    let mut files = Vec::new();
    for s in CONFIG_SOURCES {
        let p = root.join(s);
        if p.is_dir() {
            for e in std::fs::read_dir(&p).expect("folder") {
                files.push(e.expect("entry").path());
            }
        } else {
            files.push(p);
        }
    }
    files
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .flat_map(|p| keys_of(&std::fs::read_to_string(p).expect("source")))
        .collect()
}

/// The identifiers inside the backtick spans of `text`.
fn documented(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .flat_map(|span| {
            span.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .filter(|w| !w.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn every_configuration_key_is_on_the_configuration_page() {
    let page = std::fs::read_to_string(root().join("docs/configuration.md")).expect("page");
    let documented = documented(&page);
    let keys = accepted_keys();
    assert!(keys.len() > 80, "too few keys found: {keys:?}");
    let missing: Vec<&String> = keys.iter().filter(|k| !documented.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "configuration keys the code accepts that docs/configuration.md does not name: {missing:?}"
    );
}

#[test]
fn the_key_finder_reads_fields_renames_and_skips() {
    let text = "#[derive(Debug, Deserialize)]\n#[serde(deny_unknown_fields)]\npub struct S {\n    /// doc: not a key\n    pub a_key: u32,\n    #[serde(default)]\n    b: Option<String>,\n    #[serde(skip)]\n    pub hidden: u8,\n    #[serde(rename = \"c-key\")]\n    pub c: bool,\n}\n#[derive(Debug)]\nstruct T {\n    not_config: u8,\n}\n";
    let keys: Vec<String> = keys_of(text).into_iter().collect();
    assert_eq!(keys, ["a_key", "b", "c-key"]);
    assert!(documented("`server.a_key` and `b`").contains("a_key"));
}

#[test]
fn every_shipped_router_configuration_parses() {
    let dir = root().join("config");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).expect("config/") {
        let p = e.expect("entry").path();
        let name = p.file_name().expect("name").to_string_lossy().to_string();
        if !name.ends_with(".toml") || name == "worker.toml" {
            continue;
        }
        let text = std::fs::read_to_string(&p).expect("file");
        lockstep_core::config::Config::parse(&text)
            .unwrap_or_else(|e| panic!("config/{name}: {e}"));
        seen += 1;
    }
    assert!(seen >= 5, "{seen} files");
}

/// The folders a path written from the workspace root starts with.
const ROOTS: &[&str] = &[
    "proxy/",
    "tests/",
    "gpu-engine/",
    "deploy/",
    "bench/",
    "scripts/",
    "docs/",
    "fuzz/",
    "proto/",
];

#[test]
fn every_path_from_the_workspace_root_in_the_docs_exists() {
    let root = root();
    let mut wrong = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("page");
        for span in prose(&text).split('`').skip(1).step_by(2) {
            let path = span.split([' ', ':', '#']).next().unwrap_or("");
            let looks_like_a_file = path
                .rsplit('/')
                .next()
                .is_some_and(|f| f.contains('.') && !f.starts_with('.'));
            if ROOTS.iter().any(|r| path.starts_with(r))
                && looks_like_a_file
                && !path.contains('*')
                && !root.join(path).exists()
            {
                wrong.push(format!("  {}: {path}", page.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "paths that do not exist:\n{}",
        wrong.join("\n")
    );
}
