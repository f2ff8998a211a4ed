//! ARCHITECTURE.md's crate table says what each crate depends on; this test holds it to the
//! manifests. The rule: a row's "depends on" column names every workspace crate the crate
//! depends on, by its short name (`core` for `cachet-core`), and may name its main external
//! dependencies by crate name; every name it lists must be a real dependency of that crate
//! (`[dependencies]` or a `[target.….dependencies]` section, not dev- or build-dependencies).
//! Every crate under `crates/` has a row.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The crate table of the "## Crates" section: crate name → the names its row lists.
fn table_rows(architecture: &str) -> BTreeMap<String, Vec<String>> {
    let section = architecture
        .split("\n## ")
        .find(|s| s.starts_with("Crates"))
        .expect("ARCHITECTURE.md has a \"## Crates\" section");
    let mut rows = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        assert_eq!(cells.len(), 3, "a crate row has three cells: {line}");
        let name = cells[0].trim().trim_matches('`').to_string();
        let deps = cells[2]
            .split(',')
            .map(|d| d.trim().to_string())
            .filter(|d| !d.is_empty())
            .collect();
        assert!(
            rows.insert(name.clone(), deps).is_none(),
            "{name} has two rows"
        );
    }
    rows
}

/// The names in a manifest's `[dependencies]` and `[target.*.dependencies]` sections.
fn manifest_dependencies(manifest: &str) -> BTreeSet<String> {
    let mut deps = BTreeSet::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            in_deps = header == "dependencies"
                || (header.starts_with("target.") && header.ends_with(".dependencies"));
            continue;
        }
        if !in_deps || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let key = line
            .split(['=', '.'])
            .next()
            .unwrap_or("")
            .trim()
            .trim_matches('"');
        if !key.is_empty() {
            deps.insert(key.to_string());
        }
    }
    deps
}

/// `cachet-core` → `core`; external crates keep their names.
fn short_name(dep: &str) -> &str {
    dep.strip_prefix("cachet-").unwrap_or(dep)
}

#[test]
fn manifest_sections_are_read_as_the_rule_says() {
    let manifest = "[package]\nname = \"x\"\n\n[dependencies]\ncachet-core = { path = \"../cachet-core\" }\n\
                    serde.workspace = true\n# a comment\n\n[target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n\n\
                    [dev-dependencies]\nproptest.workspace = true\n";
    let deps: Vec<String> = manifest_dependencies(manifest).into_iter().collect();
    assert_eq!(deps, ["cachet-core", "libc", "serde"]);
    let rows = table_rows("# A\n\n## Crates\n\n| crate | job | depends on |\n|---|---|---|\n| `a` | x | core, serde |\n| `b` | y | |\n\n## Next\n| `c` | z | w |\n");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows["a"], ["core", "serde"]);
    assert!(rows["b"].is_empty());
}

#[test]
fn the_crate_table_matches_the_manifests() {
    let root = repo_root();
    let architecture =
        std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("reading ARCHITECTURE.md");
    let rows = table_rows(&architecture);

    let mut crates: Vec<String> = std::fs::read_dir(root.join("crates"))
        .expect("reading crates/")
        .filter_map(Result::ok)
        .filter(|e| e.path().join("Cargo.toml").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    let listed: Vec<String> = rows.keys().cloned().collect();
    assert_eq!(
        listed, crates,
        "every crate under crates/ has exactly one row"
    );

    let mut wrong = Vec::new();
    for (name, listed) in &rows {
        let manifest = std::fs::read_to_string(root.join("crates").join(name).join("Cargo.toml"))
            .expect("reading a crate's Cargo.toml");
        let real: BTreeSet<String> = manifest_dependencies(&manifest)
            .iter()
            .map(|d| short_name(d).to_string())
            .collect();
        for dep in listed {
            if !real.contains(dep) {
                wrong.push(format!(
                    "{name} lists {dep}, which its Cargo.toml does not have"
                ));
            }
        }
        for dep in manifest_dependencies(&manifest) {
            if dep.starts_with("cachet-") && !listed.iter().any(|l| l == short_name(&dep)) {
                wrong.push(format!("{name} depends on {dep}, missing from its row"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's crate table: {wrong:#?}"
    );
}
