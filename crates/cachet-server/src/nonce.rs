//! Claude Code's billing line. Since version 2.1.36 Claude Code puts
//! `x-anthropic-billing-header: cc_version=<v>.<hash>; cc_entrypoint=<e>; cch=<nonce>;` first in
//! the system prompt; the nonce (and the version's hash) change on every request, so the
//! prompt's first block differs each time and no prefix is ever cached. It means nothing to the
//! model: cachet removes the line before the template is rendered (as vLLM's and llama.cpp's
//! Anthropic front ends do), unless `--keep-billing-header` is given, and the per-request
//! metrics say `"billing_header_removed": true` when it did.

/// The line's prefix.
pub const PREFIX: &str = "x-anthropic-billing-header:";

/// `text` without a leading billing line (and the line break after it); `None` when it has
/// none.
pub fn strip(text: &str) -> Option<String> {
    let t = text.trim_start();
    if !t.starts_with(PREFIX) {
        return None;
    }
    let rest = match t.find('\n') {
        Some(i) => &t[i + 1..],
        None => "",
    };
    Some(rest.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_only_a_leading_billing_line() {
        assert_eq!(
            strip(
                "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"
            ),
            Some(String::new())
        );
        assert_eq!(
            strip("x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch=eb6c6;\nYou are Claude Code."),
            Some("You are Claude Code.".into())
        );
        assert_eq!(strip("You are Claude Code."), None);
        assert_eq!(strip("Note: x-anthropic-billing-header: cch=1;"), None);
    }
}
