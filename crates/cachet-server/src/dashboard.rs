//! `GET /dashboard`: the live prefix-cache dashboard, served from the binary.
//!
//! The page, its script and style, and a vendored copy of uPlot (MIT, `assets/dashboard/vendor`)
//! are embedded at build time with `include_bytes!`; nothing is fetched at run time and the page
//! names no other origin (its Content-Security-Policy allows `'self'` only). The page itself
//! holds no data and is open like `/health`; everything it shows comes from the `/v1/cache/*`
//! routes, which sit behind the API key when one is set: the page sends it as an
//! `Authorization` header, reading the stream with `fetch` (see the header of `dashboard.js`).
//!
//! Caching: the page links each asset as `/dashboard/assets/NAME?v=HASH`, HASH being a digest
//! of the asset's bytes computed at compile time. A request carrying the current HASH is answered
//! `Cache-Control: public, max-age=31536000, immutable` (a new build changes the URL); the page
//! itself and an asset asked for without the current HASH are `no-cache`, revalidated by `ETag`
//! (`If-None-Match` gets a 304).

use std::sync::LazyLock;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;

use crate::error::ApiError;

/// FNV-1a, 64 bits: a compile-time digest for cache busting (not a security boundary).
const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    h
}

struct Asset {
    name: &'static str,
    body: &'static [u8],
    content_type: &'static str,
    hash: u64,
}

macro_rules! asset {
    ($name:literal, $path:literal, $ct:expr) => {{
        const BODY: &[u8] = include_bytes!(concat!("../assets/dashboard/", $path));
        Asset {
            name: $name,
            body: BODY,
            content_type: $ct,
            hash: fnv1a(BODY),
        }
    }};
}

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

static ASSETS: [Asset; 4] = [
    asset!("dashboard.js", "dashboard.js", JS),
    asset!("dashboard.css", "dashboard.css", CSS),
    asset!("uPlot.iife.min.js", "vendor/uPlot.iife.min.js", JS),
    asset!("uPlot.min.css", "vendor/uPlot.min.css", CSS),
];

const INDEX_TEMPLATE: &str = include_str!("../assets/dashboard/index.html");

/// Script, style and connections from this origin only; no frames, forms or plugins elsewhere.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

const IMMUTABLE: &str = "public, max-age=31536000, immutable";
const REVALIDATE: &str = "no-cache";

/// The page with every `{{NAME}}` replaced by the asset's versioned URL, and its ETag.
static PAGE: LazyLock<(String, String)> = LazyLock::new(|| {
    let mut html = INDEX_TEMPLATE.to_string();
    for a in &ASSETS {
        html = html.replace(
            &format!("{{{{{}}}}}", a.name),
            &format!("/dashboard/assets/{}?v={:016x}", a.name, a.hash),
        );
    }
    let etag = format!("\"{:016x}\"", fnv1a(html.as_bytes()));
    (html, etag)
});

/// True when `If-None-Match` names `etag` (or is `*`); weak validators compare equal.
fn not_modified(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim())
        .any(|t| t == "*" || t.strip_prefix("W/").unwrap_or(t) == etag)
}

fn respond(
    headers: &HeaderMap,
    body: &'static [u8],
    content_type: &'static str,
    etag: &str,
    cache: &'static str,
    page: bool,
) -> Response {
    let status = if not_modified(headers, etag) {
        StatusCode::NOT_MODIFIED
    } else {
        StatusCode::OK
    };
    let mut resp = Response::new(if status == StatusCode::OK {
        Body::from(body)
    } else {
        Body::empty()
    });
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    if status == StatusCode::OK {
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    if let Ok(v) = HeaderValue::from_str(etag) {
        h.insert(header::ETAG, v);
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if page {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        );
        h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    }
    resp
}

/// `GET /dashboard`: the page (no data in it; open like `/health`).
pub async fn page(headers: HeaderMap) -> Response {
    let (html, etag) = &*PAGE;
    respond(
        &headers,
        html.as_bytes(),
        "text/html; charset=utf-8",
        etag,
        REVALIDATE,
        true,
    )
}

/// `GET /dashboard/assets/{name}`: one embedded asset; immutable when asked for by its
/// current `?v=` digest.
pub async fn asset(Path(name): Path<String>, uri: Uri, headers: HeaderMap) -> Response {
    let Some(a) = ASSETS.iter().find(|a| a.name == name) else {
        return ApiError::NotFound.response_for_path(uri.path());
    };
    let version = format!("{:016x}", a.hash);
    let current = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == format!("v={version}")));
    let etag = format!("\"{version}\"");
    let cache = if current { IMMUTABLE } else { REVALIDATE };
    respond(&headers, a.body, a.content_type, &etag, cache, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::to_bytes;
    use axum::http::Request;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;

    fn app() -> Router {
        Router::new()
            .route("/dashboard", get(page))
            .route("/dashboard/assets/{name}", get(asset))
    }

    async fn send(req: Request<Body>) -> Response {
        app().oneshot(req).await.unwrap()
    }

    async fn get_path(path: &str) -> Response {
        send(Request::get(path).body(Body::empty()).unwrap()).await
    }

    fn header_str(r: &Response, name: header::HeaderName) -> &str {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    async fn body_string(r: Response) -> String {
        String::from_utf8(to_bytes(r.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap()
    }

    /// Every `src="..."`/`href="..."` value in the page but inline `data:` ones (the empty
    /// favicon, which spares the browser a request).
    fn links(html: &str) -> Vec<String> {
        let mut out = Vec::new();
        for attr in ["src=\"", "href=\""] {
            for (i, _) in html.match_indices(attr) {
                let rest = &html[i + attr.len()..];
                let link = &rest[..rest.find('"').unwrap()];
                if !link.starts_with("data:") {
                    out.push(link.to_string());
                }
            }
        }
        out
    }

    #[test]
    fn fnv1a_known_values() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[tokio::test]
    async fn page_is_html_with_a_strict_policy_and_links_every_asset_by_version() {
        let r = get_path("/dashboard").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(
            header_str(&r, header::CONTENT_TYPE),
            "text/html; charset=utf-8"
        );
        assert_eq!(header_str(&r, header::CACHE_CONTROL), "no-cache");
        assert_eq!(header_str(&r, header::CONTENT_SECURITY_POLICY), CSP);
        assert_eq!(header_str(&r, header::X_CONTENT_TYPE_OPTIONS), "nosniff");
        let html = body_string(r).await;
        assert!(!html.contains("{{"), "an unreplaced placeholder");
        let mut found = links(&html);
        found.sort();
        let mut want: Vec<String> = ASSETS
            .iter()
            .map(|a| format!("/dashboard/assets/{}?v={:016x}", a.name, a.hash))
            .collect();
        want.sort();
        assert_eq!(found, want, "the page links exactly the embedded assets");
    }

    #[tokio::test]
    async fn versioned_assets_are_immutable_and_typed() {
        for a in &ASSETS {
            let url = format!("/dashboard/assets/{}?v={:016x}", a.name, a.hash);
            let r = get_path(&url).await;
            assert_eq!(r.status(), StatusCode::OK, "{url}");
            let want_ct = if a.name.ends_with(".js") { JS } else { CSS };
            assert_eq!(header_str(&r, header::CONTENT_TYPE), want_ct, "{url}");
            assert_eq!(header_str(&r, header::CACHE_CONTROL), IMMUTABLE, "{url}");
            assert_eq!(header_str(&r, header::ETAG), format!("\"{:016x}\"", a.hash));
            let body = to_bytes(r.into_body(), 1 << 20).await.unwrap();
            assert_eq!(&body[..], a.body, "{url}");
        }
        // uPlot is the vendored release, not something else by that name.
        let r = get_path("/dashboard/assets/uPlot.iife.min.js").await;
        assert!(body_string(r)
            .await
            .starts_with("/*! https://github.com/leeoniya/uPlot (v1.6.32) */"));
    }

    #[tokio::test]
    async fn unversioned_or_stale_asset_revalidates() {
        for q in ["", "?v=0000000000000000", "?x=1"] {
            let r = get_path(&format!("/dashboard/assets/dashboard.js{q}")).await;
            assert_eq!(r.status(), StatusCode::OK);
            assert_eq!(header_str(&r, header::CACHE_CONTROL), "no-cache", "{q}");
        }
    }

    #[tokio::test]
    async fn if_none_match_gets_304_without_a_body() {
        let r = get_path("/dashboard").await;
        let etag = header_str(&r, header::ETAG).to_string();
        assert_eq!(etag.len(), 18);
        for inm in [etag.clone(), format!("W/{etag}"), format!("\"x\", {etag}")] {
            let r = send(
                Request::get("/dashboard")
                    .header(header::IF_NONE_MATCH, &inm)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
            assert_eq!(r.status(), StatusCode::NOT_MODIFIED, "{inm}");
            assert_eq!(header_str(&r, header::ETAG), etag);
            assert!(body_string(r).await.is_empty());
        }
        let r = send(
            Request::get("/dashboard")
                .header(header::IF_NONE_MATCH, "\"0000000000000000\"")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(r.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn unknown_asset_is_404() {
        for p in [
            "/dashboard/assets/nope.js",
            "/dashboard/assets/..%2Fsrc%2Flib.rs",
            "/dashboard/assets/index.html",
        ] {
            assert_eq!(get_path(p).await.status(), StatusCode::NOT_FOUND, "{p}");
        }
    }

    #[test]
    fn page_names_no_other_origin() {
        for l in links(INDEX_TEMPLATE) {
            assert!(l.starts_with("{{"), "link {l} is not an embedded asset");
        }
        // The scripts fetch only this origin's paths.
        let js = std::str::from_utf8(ASSETS[0].body).unwrap();
        assert!(!js.contains("http://") && !js.contains("https://"));
    }
}
