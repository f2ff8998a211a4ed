//! The crate's layering (see the crate docs): a module may import only from its own layer or
//! the layers below it, so there is no import circle between formats, micro-kernels and
//! drivers. This test reads the sources and fails on an upward `crate::` path, and on a
//! source file longer than 800 lines.

use std::path::{Path, PathBuf};

/// Layer of a top-level module of the crate: 0 bottom, 1 formats, 2 micro-kernels,
/// 3 drivers, 4 the facade (`lib.rs`, `quant.rs`).
fn module_layer(name: &str) -> Option<usize> {
    Some(match name {
        "error" | "util" | "pool" | "isa" => 0,
        "formats" => 1,
        "micro" => 2,
        "drivers" | "act" | "attention" | "probe" => 3,
        "quant" => 4,
        _ => return None,
    })
}

/// Layer of a source file, from its path under `src/`.
fn file_layer(rel: &Path) -> usize {
    let first = rel
        .components()
        .next()
        .and_then(|c| c.as_os_str().to_str())
        .unwrap_or("");
    let stem = first.trim_end_matches(".rs");
    if stem == "lib" {
        return 4;
    }
    module_layer(stem).unwrap_or_else(|| panic!("{}: not in any layer", rel.display()))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The first segment after every `crate::` in the code (comments skipped).
fn crate_refs(src: &str) -> Vec<(usize, String)> {
    let mut refs = Vec::new();
    for (n, line) in src.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let seg: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !seg.is_empty() {
                refs.push((n + 1, seg));
            }
        }
    }
    refs
}

#[test]
fn imports_only_go_down_and_files_stay_small() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    assert!(
        files.len() > 10,
        "sources not found under {}",
        src.display()
    );
    let mut problems = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let text = std::fs::read_to_string(f).unwrap();
        let lines = text.lines().count();
        if lines > 800 {
            problems.push(format!("{}: {lines} lines (> 800)", rel.display()));
        }
        let own = file_layer(rel);
        for (line, seg) in crate_refs(&text) {
            match module_layer(&seg) {
                Some(l) if l > own => problems.push(format!(
                    "{}:{line}: layer {own} imports crate::{seg} (layer {l})",
                    rel.display()
                )),
                Some(_) => {}
                None => problems.push(format!(
                    "{}:{line}: crate::{seg} is in no layer",
                    rel.display()
                )),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checker_sees_upward_imports() {
    let refs = crate_refs("use crate::drivers::matmul; // crate::micro in a comment\n");
    assert_eq!(refs, vec![(1, "drivers".to_string())]);
    assert_eq!(file_layer(Path::new("formats/packed.rs")), 1);
    assert_eq!(file_layer(Path::new("micro/avx2.rs")), 2);
    assert_eq!(file_layer(Path::new("lib.rs")), 4);
    assert!(module_layer("drivers").unwrap() > file_layer(Path::new("formats/act.rs")));
}
