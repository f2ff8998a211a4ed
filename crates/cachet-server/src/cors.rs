//! Cross-origin requests (CORS): none unless `--allowed-origins` lists origins.
//!
//! A browser sends `Origin` on every cross-origin request and on every POST. Without the flag
//! cachet sends no CORS header at all, so no page can read a response, and [`crate::limits`]
//! refuses what a page could still *send* without reading: a preflight (403) and a POST or
//! DELETE carrying a foreign `Origin` (403; a "simple" cross-site POST needs no preflight, so
//! refusing it is what keeps a page from driving a local, key-less cachet). GET and HEAD from a
//! foreign origin are served without CORS headers (the browser hides the answer).
//!
//! A listed origin gets a preflight answer (204) that allows the API's methods and mirrors the
//! request headers it asks for, and every response to it carries
//! `Access-Control-Allow-Origin: <origin>` with `Vary: Origin`. Origins are compared as
//! browsers serialize them (`scheme://host[:port]`, lower case, no path); `*` allows any.

use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_HEADERS,
    ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

/// Methods the API answers.
const ALLOW_METHODS: &str = "GET, POST, DELETE, OPTIONS";
/// Response headers a page may read besides the CORS-safelisted ones.
const EXPOSE_HEADERS: &str = "x-request-id, retry-after";
/// Seconds a browser may cache a preflight answer.
const MAX_AGE_S: &str = "600";

/// The `--allowed-origins` list.
#[derive(Clone, Debug, Default)]
pub struct Cors {
    any: bool,
    origins: Vec<String>,
}

impl Cors {
    pub fn new(list: &[String]) -> Self {
        let mut cors = Cors::default();
        for o in list {
            let o = o.trim().trim_end_matches('/').to_ascii_lowercase();
            if o == "*" {
                cors.any = true;
            } else if !o.is_empty() && !cors.origins.contains(&o) {
                cors.origins.push(o);
            }
        }
        cors
    }

    /// Whether pages from `origin` may call the API.
    pub fn allows(&self, origin: &HeaderValue) -> bool {
        if self.any {
            return true;
        }
        let Ok(o) = origin.to_str() else {
            return false;
        };
        self.origins.iter().any(|a| a.eq_ignore_ascii_case(o))
    }

    /// The answer to a preflight from an allowed origin.
    pub fn preflight(&self, origin: &HeaderValue, request: &HeaderMap) -> Response {
        let mut resp = StatusCode::NO_CONTENT.into_response();
        let h = resp.headers_mut();
        h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(ALLOW_METHODS),
        );
        if let Some(asked) = request.get(ACCESS_CONTROL_REQUEST_HEADERS) {
            h.insert(ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
        }
        h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static(MAX_AGE_S));
        h.insert(
            VARY,
            HeaderValue::from_static(
                "origin, access-control-request-method, access-control-request-headers",
            ),
        );
        resp
    }

    /// Adds the headers that let a page from an allowed `origin` read `resp`.
    pub fn decorate(&self, origin: &HeaderValue, resp: &mut Response) {
        let h = resp.headers_mut();
        h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.insert(
            ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSE_HEADERS),
        );
        h.append(VARY, HeaderValue::from_static("origin"));
    }
}

/// A CORS preflight: `OPTIONS` with `Origin` and `Access-Control-Request-Method`.
pub fn is_preflight(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::OPTIONS
        && headers.contains_key(ORIGIN)
        && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    #[test]
    fn origins_are_matched_exactly_after_normalisation() {
        let c = Cors::new(&[
            "https://App.example.com/".to_string(),
            " http://localhost:3000 ".to_string(),
        ]);
        assert!(c.allows(&hv("https://app.example.com")));
        assert!(c.allows(&hv("http://localhost:3000")));
        assert!(!c.allows(&hv("http://localhost:3001")));
        assert!(!c.allows(&hv("https://app.example.com.evil.net")));
        assert!(!c.allows(&hv("null")));
        let none = Cors::new(&[]);
        assert!(!none.allows(&hv("http://localhost:3000")));
        let any = Cors::new(&["*".to_string()]);
        assert!(any.allows(&hv("null")));
    }

    #[test]
    fn preflight_mirrors_the_asked_headers() {
        let c = Cors::new(&["http://a.test".to_string()]);
        let mut req = HeaderMap::new();
        req.insert(ORIGIN, hv("http://a.test"));
        req.insert(ACCESS_CONTROL_REQUEST_METHOD, hv("POST"));
        req.insert(
            ACCESS_CONTROL_REQUEST_HEADERS,
            hv("authorization, content-type"),
        );
        assert!(is_preflight(&Method::OPTIONS, &req));
        assert!(!is_preflight(&Method::POST, &req));
        let resp = c.preflight(&hv("http://a.test"), &req);
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
        let h = resp.headers();
        assert_eq!(h[ACCESS_CONTROL_ALLOW_ORIGIN], "http://a.test");
        assert_eq!(
            h[ACCESS_CONTROL_ALLOW_HEADERS],
            "authorization, content-type"
        );
        assert_eq!(h[ACCESS_CONTROL_ALLOW_METHODS], ALLOW_METHODS);
    }
}
