//! The README's metric table is generated from the declarations (`metrics::markdown_table`):
//! this test fails when they differ. `CACHET_UPDATE_README=1 cargo test -p cachet-server --test
//! readme` rewrites the table in place.

const BEGIN: &str = "<!-- metrics-table:begin (generated: CACHET_UPDATE_README=1 cargo test -p cachet-server --test readme) -->\n";
const END: &str = "<!-- metrics-table:end -->";

#[test]
fn readme_metric_table_is_generated_from_the_declarations() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(path).expect("README.md");
    let want = cachet_server::metrics::markdown_table();
    let start = readme.find(BEGIN).map(|i| i + BEGIN.len());
    let end = readme.find(END);
    let (Some(start), Some(end)) = (start, end) else {
        panic!("README.md lacks the metric-table markers");
    };
    let have = &readme[start..end];
    if have != want {
        if std::env::var("CACHET_UPDATE_README").as_deref() == Ok("1") {
            let updated = format!("{}{}{}", &readme[..start], want, &readme[end..]);
            std::fs::write(path, updated).expect("write README.md");
            return;
        }
        panic!("README.md's metric table is stale; regenerate it with CACHET_UPDATE_README=1.\nwant:\n{want}");
    }
}
