//! Replacing a marked section of `docs/benchmarks.md`.

use std::path::Path;

use crate::error::BenchError;

/// Replaces the text between `<!-- BEGIN {id} -->` and `<!-- END {id} -->` (markers kept), or
/// appends a new marked section when absent.
pub fn replace_section(doc: &str, id: &str, body: &str) -> String {
    let begin = format!("<!-- BEGIN {id} -->");
    let end = format!("<!-- END {id} -->");
    let block = format!("{begin}\n{}\n{end}", body.trim_end());
    if let (Some(b), Some(e)) = (doc.find(&begin), doc.find(&end)) {
        if b < e {
            let mut out = String::with_capacity(doc.len() + body.len());
            out.push_str(&doc[..b]);
            out.push_str(&block);
            out.push_str(&doc[e + end.len()..]);
            return out;
        }
    }
    let mut out = doc.trim_end().to_string();
    if !out.is_empty() {
        out.push_str("\n\n");
    }
    out.push_str(&block);
    out.push('\n');
    out
}

pub fn update_file(path: &Path, id: &str, body: &str) -> Result<(), BenchError> {
    let doc = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::from("# Benchmarks\n"),
        Err(e) => return Err(BenchError::io(format!("reading {}", path.display()), e)),
    };
    let new = replace_section(&doc, id, body);
    std::fs::write(path, new).map_err(|e| BenchError::io(format!("writing {}", path.display()), e))
}

/// Where a benchmark report goes: optionally a JSON file, and (unless `no_doc`) the generated
/// section `section` of `doc`, rendered by `markdown` only then. `tag` prefixes the progress
/// line (`[compare]`, `[kernel]`).
pub fn publish<R: serde::Serialize>(
    report: &R,
    output_json: Option<&Path>,
    doc: &Path,
    no_doc: bool,
    section: &str,
    markdown: impl FnOnce(&R) -> String,
    tag: &str,
) -> Result<(), BenchError> {
    if let Some(p) = output_json {
        let json = serde_json::to_string_pretty(report)?;
        std::fs::write(p, json)
            .map_err(|e| BenchError::io(format!("writing {}", p.display()), e))?;
    }
    if !no_doc {
        update_file(doc, section, &markdown(report))?;
        eprintln!("[{tag}] wrote section {section} of {}", doc.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_or_appends() {
        let d = "# B\n\nintro\n";
        let a = replace_section(d, "x", "one");
        assert_eq!(a, "# B\n\nintro\n\n<!-- BEGIN x -->\none\n<!-- END x -->\n");
        let b = replace_section(&(a.clone() + "\n## after\n"), "x", "two\n");
        assert_eq!(
            b,
            "# B\n\nintro\n\n<!-- BEGIN x -->\ntwo\n<!-- END x -->\n\n## after\n"
        );
    }
}
