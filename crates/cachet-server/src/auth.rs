//! API-key check for the `/v1` routes, and the tenant a key names.
//!
//! `--api-key` takes one key or a comma-separated list; an entry `NAME:KEY` names its tenant
//! (split at the first `:`, so a key that itself contains `:` must be given with a name). A
//! request's key is compared with every configured key in constant time; the matching entry's
//! name is the request's tenant for the per-tenant cache numbers (spec: a tenant is the key's
//! name, else a digest of the `cache_salt`, else "default" — never the salt itself).
//!
//! Named keys are tenants; an unnamed key is the operator's. The operator routes (the cache
//! inspector, its event and stats streams, the resets: [`operator_route`]) read or drop every
//! tenant's cache — the event stream carries every stored block's token ids — so a named key
//! gets 403 there. With no named key configured every key is the operator's, as before.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::AppState;

/// The configured keys, each with the tenant name it carries.
#[derive(Clone, Debug, Default)]
pub struct ApiKeys {
    keys: Vec<(Option<Arc<str>>, String)>,
}

impl ApiKeys {
    /// Parse `--api-key`: `KEY`, `NAME:KEY`, or a comma-separated list of them (empty
    /// entries ignored; no entries: no key required).
    pub fn parse(spec: Option<&str>) -> Self {
        let keys = spec
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .filter_map(|e| match e.split_once(':') {
                Some((name, key)) if !key.is_empty() => {
                    let name = name.trim();
                    Some(((!name.is_empty()).then(|| Arc::from(name)), key.to_string()))
                }
                Some(_) => None,
                None => Some((None, e.to_string())),
            })
            .collect();
        ApiKeys { keys }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The entry `provided` matches: `Some(name)` (the name may be absent), `None` for no
    /// match. Every key is compared, in constant time each.
    pub fn check(&self, provided: Option<&str>) -> Option<Option<Arc<str>>> {
        let p = provided?;
        let mut found = None;
        for (name, key) in &self.keys {
            if bool::from(p.as_bytes().ct_eq(key.as_bytes())) && found.is_none() {
                found = Some(name.clone());
            }
        }
        found
    }
}

fn provided_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        if let (Some(scheme), Some(token)) = (v.get(..7), v.get(7..)) {
            if scheme.eq_ignore_ascii_case("bearer ") {
                return Some(token.trim());
            }
        }
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

tokio::task_local! {
    /// The tenant name of the key that authorized the request being handled.
    static TENANT: Option<Arc<str>>;
    /// Which key authorized it: a digest of the key (never the key itself).
    static KEY_ID: Arc<str>;
}

/// The digest that names an API key in what the server keeps per key (stored responses):
/// hex BLAKE3 of the key, so nothing kept (or later written to disk) holds a key.
pub fn key_id(key: &str) -> Arc<str> {
    Arc::from(blake3::hash(key.as_bytes()).to_hex().as_str())
}

/// The key that authorized the request this task handles ([`key_id`]); `""` when the server
/// requires no key (then every caller is the same owner).
pub fn current_key_id() -> Arc<str> {
    KEY_ID
        .try_with(Clone::clone)
        .unwrap_or_else(|_| Arc::from(""))
}

/// The tenant name of the request this task handles (its API key's name), if any.
pub fn current_tenant() -> Option<Arc<str>> {
    TENANT.try_with(Clone::clone).ok().flatten()
}

/// Whether `path` is an operator route: one that shows or drops every tenant's cache.
pub fn operator_route(path: &str) -> bool {
    path == "/v1/cache" || path.starts_with("/v1/cache/") || path == "/reset_prefix_cache"
}

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let keys = state.api_keys();
    if keys.is_empty() {
        return next.run(req).await;
    }
    let provided = provided_key(req.headers()).map(key_id);
    let err = match (keys.check(provided_key(req.headers())), provided) {
        (Some(Some(_)), _) if operator_route(req.uri().path()) => ApiError::OperatorOnly,
        (Some(name), Some(id)) => return TENANT.scope(name, KEY_ID.scope(id, next.run(req))).await,
        _ => ApiError::Unauthorized,
    };
    if req.uri().path().starts_with("/v1/messages") {
        err.anthropic_response()
    } else {
        err.openai_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_and_x_api_key() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer sk-1".parse().unwrap());
        assert_eq!(provided_key(&h), Some("sk-1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "sk-2".parse().unwrap());
        assert_eq!(provided_key(&h), Some("sk-2"));
        let k = ApiKeys::parse(Some("abc"));
        assert_eq!(k.check(Some("abc")), Some(None));
        assert_eq!(k.check(Some("abd")), None);
        assert_eq!(k.check(Some("ab")), None);
        assert_eq!(k.check(None), None);
    }

    #[test]
    fn operator_routes_are_the_cache_routes() {
        for p in [
            "/v1/cache",
            "/v1/cache/events",
            "/v1/cache/requests/r1",
            "/v1/cache/reset",
            "/v1/cache/stats/stream",
            "/reset_prefix_cache",
        ] {
            assert!(operator_route(p), "{p}");
        }
        for p in [
            "/v1/cachex",
            "/v1/completions",
            "/v1/messages",
            "/v1/sessions/s",
        ] {
            assert!(!operator_route(p), "{p}");
        }
    }

    #[test]
    fn named_keys_name_their_tenant() {
        let k = ApiKeys::parse(Some("alice:sk-a, sk-plain ,bob:sk:b,:sk-anon,broken:"));
        assert_eq!(k.check(Some("sk-a")), Some(Some(Arc::from("alice"))));
        assert_eq!(k.check(Some("sk-plain")), Some(None));
        // Split at the first ':': bob's key is "sk:b".
        assert_eq!(k.check(Some("sk:b")), Some(Some(Arc::from("bob"))));
        assert_eq!(k.check(Some("sk-anon")), Some(None));
        assert_eq!(k.check(Some("alice:sk-a")), None);
        assert_eq!(k.check(Some("broken:")), None);
        assert_eq!(k.check(None), None);
        assert!(ApiKeys::parse(None).is_empty());
        assert!(ApiKeys::parse(Some(" , ")).is_empty());
    }
}
