//! Where a benchmark's report goes: by default a run file of its own under `docs/bench-runs/`
//! (`YYYY-MM-DD-<cpu>-<topic>.md`), or a marked section of a file named with `--doc`.
//! `docs/benchmarks.md` holds the current figures only and is edited by hand.

use std::path::{Path, PathBuf};

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

/// The directory the run files go to, relative to the repository root.
pub const RUNS_DIR: &str = "docs/bench-runs";

/// A short file-name form of a CPU model name: lower case, words of letters and digits joined
/// by `-`, without the trademarks, "CPU", "Processor" and the clock after `@`.
pub fn cpu_slug(model_name: &str) -> String {
    let name = model_name.split('@').next().unwrap_or("");
    let name = name
        .replace("(R)", " ")
        .replace("(TM)", " ")
        .replace("(tm)", " ");
    let words: Vec<String> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .filter(|w| !matches!(w.as_str(), "cpu" | "processor" | "core" | "with"))
        .collect();
    if words.is_empty() {
        "unknown-cpu".into()
    } else {
        words.join("-")
    }
}

/// `dir/YYYY-MM-DD-<cpu>-<topic>.md` for a run on `date` (`YYYY-MM-DD…`) on `cpu`.
pub fn run_file(dir: &Path, date: &str, cpu: &str, topic: &str) -> PathBuf {
    let day = date.get(..10).unwrap_or(date);
    dir.join(format!("{day}-{}-{topic}.md", cpu_slug(cpu)))
}

/// Replaces section `id` of `path` with `body`; a missing file is created with `title` as its
/// first line.
pub fn update_file(path: &Path, title: &str, id: &str, body: &str) -> Result<(), BenchError> {
    let doc = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!("# {title}\n"),
        Err(e) => return Err(BenchError::io(format!("reading {}", path.display()), e)),
    };
    let new = replace_section(&doc, id, body);
    std::fs::write(path, new).map_err(|e| BenchError::io(format!("writing {}", path.display()), e))
}

/// Where a benchmark report goes: optionally a JSON file, and (unless `no_doc`) the generated
/// section `section` of `doc`, or of this run's file under [`RUNS_DIR`] when `doc` is `None`,
/// rendered by `markdown` only then. `tag` names the run file's topic and prefixes the
/// progress line (`[compare]`, `[kernel]`).
pub fn publish<R: serde::Serialize>(
    report: &R,
    output_json: Option<&Path>,
    doc: Option<&Path>,
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
        let date = crate::peer::utc_now();
        let cpu = crate::peer::cpu_model();
        let run;
        let doc = match doc {
            Some(d) => d,
            None => {
                std::fs::create_dir_all(RUNS_DIR)
                    .map_err(|e| BenchError::io(format!("creating {RUNS_DIR}"), e))?;
                run = run_file(Path::new(RUNS_DIR), &date, &cpu, tag);
                &run
            }
        };
        let title = format!("`cachet bench {tag}`, {date}, {cpu}");
        update_file(doc, &title, section, &markdown(report))?;
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

    #[test]
    fn run_files_are_named_by_day_cpu_and_topic() {
        assert_eq!(cpu_slug("AMD EPYC"), "amd-epyc");
        assert_eq!(
            cpu_slug("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"),
            "intel-xeon-platinum-8481c"
        );
        assert_eq!(
            cpu_slug("Intel(R) Xeon(R) Processor @ 2.80GHz"),
            "intel-xeon"
        );
        assert_eq!(cpu_slug(" @ "), "unknown-cpu");
        assert_eq!(
            run_file(
                Path::new("docs/bench-runs"),
                "2026-12-07 19:40 UTC",
                "AMD EPYC 9R14 96-Core Processor",
                "kernel"
            ),
            Path::new("docs/bench-runs/2026-12-07-amd-epyc-9r14-96-kernel.md")
        );
    }

    #[test]
    fn a_new_run_file_starts_with_its_title() {
        let dir = std::env::temp_dir().join(format!("cachet-doc-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("run.md");
        let _ = std::fs::remove_file(&path);
        update_file(&path, "`cachet bench kernel`, today", "k", "body").expect("write");
        update_file(&path, "ignored once the file exists", "k", "again").expect("rewrite");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text,
            "# `cachet bench kernel`, today\n\n<!-- BEGIN k -->\nagain\n<!-- END k -->\n"
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
