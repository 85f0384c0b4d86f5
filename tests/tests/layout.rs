//! The layout rules of the workspace (docs/ARCHITECTURE.md), checked on the source itself:
//!
//! - no import cycle between the files of any crate, counting `crate::` and `super::` references
//!   (a file's references to its own ancestor modules excepted);
//! - no file under a crate's `src/` longer than [`MAX_LINES`] (test code, examples and benchmarks
//!   exempt);
//! - every crate's `Cargo.toml` at most two folders below the workspace root.
//!
//! Files are read as text: comments and string literals are skipped, and `use` trees with braces
//! are expanded, so `use crate::{a, b::{c, d}}` counts as references to `a`, `b::c` and `b::d`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest file allowed under a crate's `src/`.
const MAX_LINES: usize = 600;

/// Folders whose files may be longer: test code, examples, benchmarks (the `tests/` crate is
/// test support through and through).
const EXEMPT: [&str; 3] = ["tests", "examples", "benches"];

/// Deepest a crate's `Cargo.toml` may sit: `a/b/Cargo.toml`.
const MAX_CRATE_DEPTH: usize = 2;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// Every crate folder of the workspace (a folder holding a `Cargo.toml` with a `[package]`).
fn crates(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    stack.push(p);
                }
            } else if name == "Cargo.toml"
                && std::fs::read_to_string(&p).is_ok_and(|t| t.contains("[package]"))
            {
                out.push(dir.clone());
            }
        }
    }
    out.sort();
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file under `src/` (`a/b.rs` and `a/b/mod.rs` are `[a, b]`; the crate
/// roots are `[]`). `None` for files that are crate roots of their own (`src/bin/*`, a `main.rs`
/// beside a `lib.rs`).
fn module_path(src: &Path, file: &Path, has_lib: bool) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().to_string())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    match last.as_str() {
        "lib.rs" if parts.is_empty() => {}
        "main.rs" if parts.is_empty() => {
            if has_lib {
                return None;
            }
        }
        "mod.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_string()),
    }
    Some(parts)
}

/// `text` with comments and the insides of string and char literals blanked out, so braces and
/// paths inside them do not count.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            let start = i;
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            // Doc comments count: an intra-doc link is a reference too.
            let line = &text[start..i];
            if line.starts_with("///") || line.starts_with("//!") {
                out.push_str(&doc_paths(line));
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && is_boundary(b, i)
        {
            // Raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '{') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            // Copy one whole UTF-8 character.
            let len = utf8_len(c);
            out.push_str(&text[i..i + len]);
            i += len;
        }
    }
    out
}

/// The `crate::`/`super::` paths of a doc comment line, each ended by `;` (braces and the rest of
/// the prose dropped).
fn doc_paths(line: &str) -> String {
    let mut out = String::new();
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let rest = &line[i..];
        if is_boundary(b, i) && (rest.starts_with("crate::") || rest.starts_with("super::")) {
            let len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            out.push(' ');
            out.push_str(rest[..len].trim_end_matches(':'));
            out.push_str(" ;");
            i += len;
        } else {
            i += utf8_len(b[i]);
        }
    }
    out
}

fn utf8_len(first: u8) -> usize {
    match first {
        0..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

fn is_boundary(b: &[u8], i: usize) -> bool {
    i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Star,
    Other,
}

fn tokens(code: &str) -> Vec<Tok> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(code[start..i].to_string()));
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let t = match c {
            b':' if b.get(i + 1) == Some(&b':') => {
                i += 1;
                Tok::Colons
            }
            b'{' => Tok::Open,
            b'}' => Tok::Close,
            b',' => Tok::Comma,
            b'*' => Tok::Star,
            _ => Tok::Other,
        };
        out.push(t);
        i += 1;
    }
    out
}

/// Parses a path or use tree at `toks[*i]` (after its leading `crate::`/`super::`), appending
/// every leaf path to `out`, each prefixed with `prefix`.
fn use_tree(toks: &[Tok], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(name)) => {
                if name != "self" {
                    path.push(name.clone());
                }
                *i += 1;
                if toks.get(*i) == Some(&Tok::Colons) {
                    *i += 1;
                    continue;
                }
                out.push(path);
                return;
            }
            Some(Tok::Open) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Close) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Comma) => *i += 1,
                        None => return,
                        _ => {
                            let before = *i;
                            use_tree(toks, i, path.clone(), out);
                            if *i == before {
                                *i += 1;
                            }
                        }
                    }
                }
            }
            _ => {
                out.push(path);
                return;
            }
        }
    }
}

/// The modules `file` refers to through `crate::` and `super::` paths, as absolute module paths
/// (possibly naming items inside a module: resolution trims them).
fn references(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let toks = tokens(&code_only(text));
    let mut out = Vec::new();
    // Inline modules (`mod tests { .. }`): (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Open => depth += 1,
            Tok::Close => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Open)) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth + 1));
                }
            }
            Tok::Ident(kw)
                if (kw == "crate" || kw == "super")
                    && toks.get(i + 1) == Some(&Tok::Colons)
                    && !(i > 0 && toks[i - 1] == Tok::Colons) =>
            {
                let mut here: Vec<String> = module.to_vec();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let mut j = i;
                let base = if kw == "crate" {
                    j += 2;
                    Vec::new()
                } else {
                    while toks.get(j) == Some(&Tok::Ident("super".into()))
                        && toks.get(j + 1) == Some(&Tok::Colons)
                    {
                        here.pop();
                        j += 2;
                    }
                    here
                };
                use_tree(&toks, &mut j, base, &mut out);
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The file-level import graph of one crate: file -> files it refers to.
fn import_graph(krate: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = krate.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let has_lib = src.join("lib.rs").exists();
    let mut by_module: BTreeMap<Vec<String>, String> = BTreeMap::new();
    let mut modules = Vec::new();
    for f in &files {
        if let Some(m) = module_path(&src, f, has_lib) {
            let name = f
                .strip_prefix(krate)
                .expect("under the crate")
                .display()
                .to_string();
            by_module.insert(m.clone(), name.clone());
            modules.push((m, name, f.clone()));
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, name, path) in &modules {
        let text = std::fs::read_to_string(path).expect("readable source");
        let entry = edges.entry(name.clone()).or_default();
        for r in references(&text, module) {
            // The longest prefix of the path that is a file module.
            let target = (0..=r.len())
                .rev()
                .find_map(|n| by_module.get(&r[..n]).map(|f| (n, f)));
            let Some((n, target)) = target else { continue };
            let is_ancestor = module.len() >= n && module[..n] == r[..n];
            if target != name && !is_ancestor {
                entry.insert(target.clone());
            }
        }
    }
    edges
}

#[test]
fn no_import_cycles_between_files_of_any_crate() {
    let root = workspace_root();
    let mut problems = Vec::new();
    for krate in crates(&root) {
        let edges = import_graph(&krate);
        for comp in cycles(&edges) {
            let detail: Vec<String> = comp
                .iter()
                .map(|f| {
                    let into: Vec<&str> = edges[f]
                        .iter()
                        .filter(|t| comp.contains(t))
                        .map(String::as_str)
                        .collect();
                    format!("  {f} -> {}", into.join(", "))
                })
                .collect();
            problems.push(format!(
                "import cycle in {}:\n{}",
                krate.strip_prefix(&root).unwrap_or(&krate).display(),
                detail.join("\n")
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_source_file_over_the_line_limit() {
    let root = workspace_root();
    let mut long = Vec::new();
    for krate in crates(&root) {
        let mut files = Vec::new();
        rust_files(&krate.join("src"), &mut files);
        for f in files {
            let rel = f.strip_prefix(&root).unwrap_or(&f);
            if rel
                .iter()
                .any(|c| EXEMPT.contains(&c.to_string_lossy().as_ref()))
            {
                continue;
            }
            let lines = std::fs::read_to_string(&f)
                .expect("readable source")
                .lines()
                .count();
            if lines > MAX_LINES {
                long.push(format!(
                    "  {}: {lines} lines",
                    f.strip_prefix(&root).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them by concern):\n{}",
        long.join("\n")
    );
}

#[test]
fn every_crate_sits_at_most_two_folders_deep() {
    let root = workspace_root();
    let crates = crates(&root);
    assert!(crates.len() >= 5, "found only {crates:?}");
    for krate in crates {
        let depth = krate
            .strip_prefix(&root)
            .expect("under the root")
            .iter()
            .count();
        assert!(
            (1..=MAX_CRATE_DEPTH).contains(&depth),
            "{} is {depth} folders deep",
            krate.display()
        );
    }
}

/// The checker itself: a two-file cycle through a `use` tree is found, ancestors are exempt,
/// comments and strings do not count, `super::` inside an inline module stays in its file.
#[test]
fn the_checker_finds_cycles_and_skips_what_does_not_count() {
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let refs = references(
        "use crate::{a::{B, c::D}, e};\n// crate::x::Y\nlet s = \"crate::z\";\n/// See [`crate::doc::Link`].\n\
         mod tests { use super::F; use super::super::g::H; }\nfn f() { crate::k::l(); }",
        &m("p::q"),
    );
    assert_eq!(
        refs,
        vec![
            m("a::B"),
            m("a::c::D"),
            m("e"),
            m("doc::Link"),
            m("p::q::F"),
            m("p::g::H"),
            m("k::l")
        ]
    );
    let mut edges = BTreeMap::new();
    edges.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    edges.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    edges.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    edges.insert("d".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(cycles(&edges), vec![vec!["a", "b", "c"]]);
    edges.get_mut("c").expect("c").clear();
    assert!(cycles(&edges).is_empty());
}

/// The crates' arrows (`docs/ARCHITECTURE.md`, the crate map): for each crate, exactly the
/// workspace crates its `[dependencies]` name. Cargo refuses cycles; this keeps the direction:
/// `cli -> gateway -> router -> {prompt, tenancy, routing} -> core -> runtime -> engine`, the
/// worker and the probe beside the router (they meet it only in `lockstep-proto`), and no
/// crate below the gateway naming it. A new crate, or a new arrow, is added here on purpose.
const CRATE_ARROWS: &[(&str, &[&str])] = &[
    (
        "proxy/cli",
        &[
            "lockstep-gateway",
            "lockstep-router",
            "lockstep-worker",
            "lockstep-probe",
            "lockstep-runtime",
            "lockstep-core",
            "lockstep-tenancy",
        ],
    ),
    (
        "proxy/gateway",
        &[
            "lockstep-router",
            "lockstep-routing",
            "lockstep-tenancy",
            "lockstep-core",
        ],
    ),
    (
        "proxy/router",
        &[
            "lockstep-prompt",
            "lockstep-tenancy",
            "lockstep-routing",
            "lockstep-core",
            "lockstep-runtime",
            "lockstep-engine",
            "lockstep-proto",
            "lockstep-state",
        ],
    ),
    ("proxy/state", &["lockstep-core"]),
    (
        "proxy/worker",
        &["lockstep-engine", "lockstep-proto", "lockstep-runtime"],
    ),
    ("proxy/probe", &["lockstep-proto"]),
    ("proxy/prompt", &["lockstep-core", "lockstep-runtime"]),
    ("proxy/tenancy", &["lockstep-core"]),
    (
        "proxy/routing",
        &["lockstep-core", "lockstep-engine", "lockstep-zmtp"],
    ),
    ("proxy/core", &["lockstep-runtime", "lockstep-engine"]),
    ("proxy/runtime", &["lockstep-engine"]),
    ("proxy/zmtp", &[]),
    ("gpu-engine", &[]),
    ("proto", &[]),
];

/// The workspace crates a manifest's `[dependencies]` table names (`name = ...` or
/// `name.workspace = true`); dev- and build-dependencies do not count.
fn workspace_deps(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).expect("manifest");
    let mut names = BTreeSet::new();
    let mut in_deps = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps
            && let Some(name) = line.split(['=', '.']).next().map(str::trim)
            && name.starts_with("lockstep")
        {
            names.insert(name.to_string());
        }
    }
    names
}

#[test]
fn every_crate_depends_on_exactly_its_arrows() {
    let root = workspace_root();
    let mut wrong = Vec::new();
    for dir in crates(&root) {
        let rel = dir
            .strip_prefix(&root)
            .expect("inside")
            .to_string_lossy()
            .to_string();
        if rel == "tests" || rel.starts_with("fuzz") {
            continue;
        }
        let has = workspace_deps(&dir.join("Cargo.toml"));
        match CRATE_ARROWS.iter().find(|(c, _)| *c == rel) {
            None => wrong.push(format!("  {rel}: not in CRATE_ARROWS (add its arrows)")),
            Some((_, allowed)) => {
                let allowed: BTreeSet<String> = allowed.iter().map(|s| s.to_string()).collect();
                if has != allowed {
                    wrong.push(format!(
                        "  {rel}: depends on {has:?}, its arrows are {allowed:?}"
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "crate dependencies off their arrows:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_arrows_run_one_way() {
    // Each crate's arrows point only at crates listed after it: the table is in dependency
    // order, so the arrows have no cycle and no crate below names one above.
    let package = |dir: &str| -> String {
        let text = std::fs::read_to_string(workspace_root().join(dir).join("Cargo.toml"))
            .expect("manifest");
        let line = text
            .lines()
            .find(|l| l.starts_with("name = "))
            .expect("a name");
        line.trim_start_matches("name = ")
            .trim_matches('"')
            .to_string()
    };
    let names: Vec<String> = CRATE_ARROWS.iter().map(|(d, _)| package(d)).collect();
    for (i, (dir, deps)) in CRATE_ARROWS.iter().enumerate() {
        for d in *deps {
            let at = names.iter().position(|n| n == d);
            assert!(
                at.is_some_and(|j| j > i),
                "{dir} -> {d}: an arrow up or sideways in CRATE_ARROWS"
            );
        }
    }
}

/// The router's layers, lowest first (docs/ARCHITECTURE.md): a file may refer to its own
/// layer's modules and those below, never above. `fuzzing` (the fuzz targets' door) and
/// `lib.rs` sit above them all.
const ROUTER_LAYERS: &[&[&str]] = &[
    &["backend", "stored", "idempotency"],
    &["pair"],
    &["state"],
    &["admission", "models", "members", "sidecar"],
    &["http", "admin"],
    &["app"],
    &["fuzzing", "lib"],
];

/// A router file's layer: that of its top module (`src/pair/machine.rs` is `pair`'s).
fn router_layer(file: &str) -> Option<usize> {
    let rest = file.strip_prefix("src/")?;
    let top = rest.split('/').next()?.trim_end_matches(".rs");
    ROUTER_LAYERS.iter().position(|l| l.contains(&top))
}

#[test]
fn the_routers_layers_import_only_downward() {
    let root = workspace_root();
    let edges = import_graph(&root.join("proxy/router"));
    let mut upward = Vec::new();
    for (from, tos) in &edges {
        let Some(lf) = router_layer(from) else {
            upward.push(format!(
                "  {from}: in no layer (add its module to ROUTER_LAYERS)"
            ));
            continue;
        };
        for to in tos {
            match router_layer(to) {
                Some(lt) if lt <= lf => {}
                Some(_) => upward.push(format!("  {from} -> {to}")),
                None => upward.push(format!("  {to}: in no layer")),
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that run up the router's layers (move the shared piece down):\n{}",
        upward.join("\n")
    );
}
