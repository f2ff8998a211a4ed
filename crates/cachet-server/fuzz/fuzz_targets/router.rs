//! Whole requests through the server's router over the simulated engine: arbitrary bodies,
//! content types and session paths on every POST route. Never a panic and never a 5xx; every
//! error in the route's shape and bounded; the engine still answers afterwards.
//!
//! Input: `route-byte content-type-byte rest`; `rest` is the body (or, for route 5, the
//! session id of `DELETE /v1/sessions/{id}`, percent-encoded).
#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::Request;
use cachet_engine::step::CoreOptions;
use cachet_engine::sim::{SimConfig, SimExecutor};
use cachet_engine::{start_engine, EngineConfig, ModelInfo, SchedulerConfig};
use cachet_server::{router, AppState, CacheConfigInfo, MetricsHandle, ServerArgs};
use cachet_server_fuzz::check_error_body;
use cachet_text::{ByteTokenizer, TextTokenizer};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const ROUTES: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/tokenize",
    "/detokenize",
];

struct World {
    rt: tokio::runtime::Runtime,
    app: axum::Router,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let tokenizer: Arc<dyn TextTokenizer> = Arc::new(ByteTokenizer);
        let (blocks, block) = (128, 16);
        let model = ModelInfo {
            name: "fuzz".into(),
            max_model_len: 256,
            block_size: block,
            num_kv_blocks: blocks,
        };
        let executor = SimExecutor::new(SimConfig {
            num_blocks: blocks,
            block_size: block,
            ..SimConfig::default()
        });
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                block_size: block,
                num_blocks: blocks,
                max_model_len: 256,
                eos_token_ids: tokenizer.eos_token_ids().to_vec(),
                ..SchedulerConfig::default()
            },
        };
        let metrics = MetricsHandle::new("fuzz", 256, CacheConfigInfo::default());
        let engine = start_engine(
            config,
            executor,
            model,
            CoreOptions {
                loggers: vec![Box::new(metrics.logger())],
                ..Default::default()
            },
        )
        .expect("the engine starts");
        let args = ServerArgs {
            max_body_bytes: 64 * 1024,
            ..ServerArgs::default()
        };
        let app = router(AppState::new(engine, tokenizer, metrics, &args));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        World { rt, app }
    })
}

fn percent_encode(b: &[u8]) -> String {
    b.iter().map(|c| format!("%{c:02X}")).collect()
}

fuzz_target!(|data: &[u8]| {
    let [route, ct, rest @ ..] = data else {
        return;
    };
    let w = world();
    let content_type = match ct % 4 {
        0 | 1 => "application/json",
        2 => "text/plain",
        _ => "application/json; charset=utf-8",
    };
    let (path, req) = if route % 6 == 5 {
        let path = format!(
            "/v1/sessions/{}",
            percent_encode(&rest[..rest.len().min(200)])
        );
        let req = Request::delete(path.as_str()).body(Body::empty());
        (path, req)
    } else {
        let path = ROUTES[(route % 6) as usize].to_string();
        let req = Request::post(path.as_str())
            .header("content-type", content_type)
            // As hyper passes it on: a body is always declared (HTTP/1.1 has no other way).
            .header("content-length", rest.len())
            .body(Body::from(rest.to_vec()));
        (path, req)
    };
    let Ok(req) = req else {
        return;
    };
    w.rt.block_on(async {
        let resp = w.app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        assert!(
            status < 500,
            "{path}: {status} {:?}",
            String::from_utf8_lossy(&bytes)
        );
        if route % 6 != 5 && content_type == "text/plain" && !rest.is_empty() {
            assert_eq!(status, 415, "{path}");
        }
        if status >= 400 {
            check_error_body(&path, status, &bytes);
        }
    });
});
