//! The `x-cachet-cache` response header: a request's prompt split (spec §3) on every non-streamed
//! generation response, so a proxy log or `curl -i` shows it without per-request metrics on.
//!
//! `x-cachet-cache: local=96; external=0; computed=4; created=0` — the request's
//! `local_cached_tokens`, `external_cached_tokens`, `computed_tokens` and `cache_creation_tokens`
//! as the engine's `PrefillStats` carry them (a session turn: its own chunk's stats; several
//! prompts in one request: the field-wise sum). Formatting only: nothing here is computed.

use axum::http::HeaderValue;
use axum::response::Response;
use cachet_core::PrefillStats;

use crate::generate::Final;

/// The header's name (lower case, as HTTP/2 sends it).
pub const CACHE_HEADER: &str = "x-cachet-cache";

/// The header's value for one request's (or several requests' summed) prefill stats.
pub fn cache_header_value(p: &PrefillStats) -> String {
    format!(
        "local={}; external={}; computed={}; created={}",
        p.local_cached_tokens, p.external_cached_tokens, p.computed_tokens, p.cache_creation_tokens
    )
}

/// The prefill stats of a finished request, when the engine reported them.
pub fn final_prefill(f: &Final) -> Option<&PrefillStats> {
    f.report.as_ref().and_then(|r| r.prefill_stats.as_ref())
}

/// Sets the header from `stats` (the sum of every request behind the response); a response
/// whose requests reported no prefill stats (none ever admitted) gets no header.
pub fn with_cache_header<'a>(
    mut resp: Response,
    stats: impl IntoIterator<Item = &'a PrefillStats>,
) -> Response {
    let mut total: Option<PrefillStats> = None;
    for p in stats {
        total
            .get_or_insert_with(PrefillStats::default)
            .accumulate(p);
    }
    if let Some(t) = total {
        if let Ok(v) = HeaderValue::from_str(&cache_header_value(&t)) {
            resp.headers_mut().insert(CACHE_HEADER, v);
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    fn stats(local: u64, external: u64, computed: u64, created: u64) -> PrefillStats {
        PrefillStats {
            prompt_tokens: local + external + computed,
            local_cached_tokens: local,
            external_cached_tokens: external,
            cached_tokens: local + external,
            computed_tokens: computed,
            cache_creation_tokens: created,
            ..PrefillStats::default()
        }
    }

    #[test]
    fn the_value_names_the_four_numbers_in_order() {
        assert_eq!(
            cache_header_value(&stats(96, 16, 4, 0)),
            "local=96; external=16; computed=4; created=0"
        );
    }

    #[test]
    fn several_requests_are_summed_and_none_gives_no_header() {
        let a = stats(0, 0, 100, 96);
        let b = stats(96, 0, 4, 0);
        let r = with_cache_header(().into_response(), [&a, &b]);
        assert_eq!(
            r.headers()[CACHE_HEADER],
            "local=96; external=0; computed=104; created=96"
        );
        let r = with_cache_header(().into_response(), []);
        assert!(r.headers().get(CACHE_HEADER).is_none());
    }
}
