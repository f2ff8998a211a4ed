//! `http_requests_total` and `http_request_duration_seconds` by route, as
//! prometheus-fastapi-instrumentator exports them for vLLM: `handler` is the route template
//! (`none` when no route matched), `status` the class (`2xx`, `4xx`, ...), `/metrics` and
//! `/health` not instrumented. Durations cover the whole response, streaming included.

use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;

use crate::AppState;

/// Route templates, longest prefix patterns last.
const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/models",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/count_tokens",
    "/v1/cache",
    "/v1/cache/events",
    "/v1/cache/reset",
    "/v1/cache/stats/stream",
    "/dashboard",
    "/reset_prefix_cache",
    "/tokenize",
    "/detokenize",
];

/// Not instrumented (as vLLM excludes them).
const EXCLUDED: &[&str] = &["/metrics", "/health"];

/// The route template a path belongs to.
pub fn handler_label(path: &str) -> &'static str {
    if let Some(r) = ROUTES.iter().find(|r| **r == path) {
        return r;
    }
    if let Some(rest) = path.strip_prefix("/v1/cache/requests/") {
        if !rest.is_empty() && !rest.contains('/') {
            return "/v1/cache/requests/{id}";
        }
    }
    if let Some(rest) = path.strip_prefix("/dashboard/assets/") {
        if !rest.is_empty() && !rest.contains('/') {
            return "/dashboard/assets/{name}";
        }
    }
    if let Some(rest) = path.strip_prefix("/v1/sessions/") {
        if !rest.is_empty() && !rest.contains('/') {
            return "/v1/sessions/{id}";
        }
    }
    "none"
}

fn status_class(code: u16) -> String {
    format!("{}xx", code / 100)
}

pub async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if EXCLUDED.contains(&path) {
        return next.run(req).await;
    }
    let handler = handler_label(path);
    // A client may send any token as a method: only the standard ones become label values.
    let method = match *req.method() {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::HEAD
        | Method::OPTIONS
        | Method::PATCH
        | Method::CONNECT
        | Method::TRACE => req.method().as_str().to_string(),
        _ => "other".to_string(),
    };
    let start = Instant::now();
    let resp = next.run(req).await;
    let status = status_class(resp.status().as_u16());
    let metrics = state.metrics().http.clone();
    let observe = move || {
        let secs = start.elapsed().as_secs_f64();
        metrics
            .requests
            .get_or_create(&vec![
                ("method", method.clone()),
                ("status", status.clone()),
                ("handler", handler.to_string()),
            ])
            .inc();
        metrics
            .duration
            .get_or_create(&vec![("method", method), ("handler", handler.to_string())])
            .observe(secs);
        metrics.duration_highr.observe(secs);
    };
    // Observe when the body has been sent (or dropped), so streams count their whole length.
    let (parts, body) = resp.into_parts();
    let guard = OnDrop(Some(observe));
    let body = Body::new(body.map_frame(move |f| {
        let _ = &guard;
        f
    }));
    Response::from_parts(parts, body)
}

/// Runs its closure once, when dropped.
struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handlers_are_route_templates() {
        assert_eq!(
            handler_label("/v1/chat/completions"),
            "/v1/chat/completions"
        );
        assert_eq!(handler_label("/v1/sessions/abc"), "/v1/sessions/{id}");
        assert_eq!(handler_label("/v1/sessions/a/b"), "none");
        assert_eq!(handler_label("/nope"), "none");
        assert_eq!(status_class(503), "5xx");
    }
}
