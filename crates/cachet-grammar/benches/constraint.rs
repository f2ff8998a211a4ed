//! Per-token cost of a JSON-schema constraint over the default model's tokenizer (SmolLM2,
//! 49,152 tokens): what the sampler pays per generated token at batch 1 and batch 16.
//!
//! * `allowed`: the sampled token is allowed (`allows` + `accept`): the common case of a model
//!   that follows the schema;
//! * `refused`: every token is first refused (`allows` + `fill_mask` + `accept`): the worst case
//!   (a model that never writes the schema's next token itself);
//! * batch 16: 16 requests with their own constraints, one token each, as one decode step.
//!
//! Compare with the decode step (docs/benchmarks.md: about 4.8 ms at batch 1 and 17.7 ms at
//! batch 16 on the 2-core dev VM). Skipped when the model file is missing.

use std::sync::Arc;

use cachet_core::request::TokenConstraint;
use cachet_grammar::{Grammar, GrammarCompiler};
use cachet_text::TextTokenizer;
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::json;

fn schema() -> serde_json::Value {
    json!({"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
        "age": {"type": "integer"}, "active": {"type": "boolean"}, "score": {"type": "number"},
        "city": {"type": "string"}, "country": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["id", "name", "email", "age", "active", "score", "city", "country", "tags", "role"],
        "additionalProperties": false})
}

const DOC: &str = r#"{"id": 4172, "name": "Ada Lovelace", "email": "ada@example.org", "age": 36, "active": true, "score": 97.5, "city": "London", "country": "United Kingdom", "tags": ["math", "engines"], "role": "admin"}"#;

fn bench(c: &mut Criterion) {
    let path = cachet_model::default_model_path();
    let Ok(file) = cachet_model::gguf::GgufFile::open(&path) else {
        eprintln!("skipped: no model at {}", path.display());
        return;
    };
    let tok: Arc<dyn TextTokenizer> =
        Arc::new(cachet_model::GgufTokenizer::from_gguf(&file).unwrap());
    let t0 = std::time::Instant::now();
    let g = GrammarCompiler::new(Arc::clone(&tok)).unwrap();
    eprintln!(
        "grammar compiler: {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let ids = tok.encode(DOC, false).unwrap();
    let eos = tok.eos_token_ids()[0];
    let n = ids.len() as u64;
    eprintln!("document: {n} tokens");
    let grammar = Grammar::JsonSchema(schema());
    let mut group = c.benchmark_group("constraint");
    group.sample_size(20);
    group.throughput(criterion::Throughput::Elements(n));
    group.bench_function("compile", |b| b.iter(|| g.compile(&grammar).unwrap()));
    group.bench_function("allowed_per_doc", |b| {
        b.iter_batched(
            || g.compile(&grammar).unwrap(),
            |c| {
                for &t in &ids {
                    assert!(c.allows(t));
                    c.accept(t);
                }
                assert!(c.allows(eos));
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let mut mask = Vec::new();
    group.bench_function("refused_per_doc", |b| {
        b.iter_batched(
            || g.compile(&grammar).unwrap(),
            |c| {
                for &t in &ids {
                    let _ = c.allows(t);
                    c.fill_mask(&mut mask);
                    c.accept(t);
                }
            },
            criterion::BatchSize::SmallInput,
        )
    });
    group.throughput(criterion::Throughput::Elements(16 * n));
    group.bench_function("batch16_refused_per_doc", |b| {
        b.iter_batched(
            || {
                (0..16)
                    .map(|_| g.compile(&grammar).unwrap())
                    .collect::<Vec<_>>()
            },
            |cs| {
                for &t in &ids {
                    for c in &cs {
                        let _ = c.allows(t);
                        c.fill_mask(&mut mask);
                        c.accept(t);
                    }
                }
            },
            criterion::BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
