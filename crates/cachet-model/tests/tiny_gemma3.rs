//! A tiny random Gemma 3 GGUF written by the test itself (3 layers, pattern 3: layers 0 and 1
//! local with a window of 5 and RoPE base 10,000, layer 2 global with base 1e6), run through
//! the paged executor and checked against a dense forward written here from llama.cpp's
//! gemma3 graph: embeddings × sqrt(hidden), per-head Q/K RMS norms, NeoX RoPE with the layer's
//! base, attention over the last W positions on local layers, post-attention and post-FFN
//! norms, GELU(tanh)-gated FFN, tied output, final-logit soft-capping.

use std::path::PathBuf;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, SamplingParams, SeqChunk};
use cachet_model::gguf::{AttnKind, FfnAct};
use cachet_model::{load_model, ExecutorConfig, KvDtype, LoadOptions, LoadedModel};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const FFN: usize = 128;
const LAYERS: usize = 3;
const HEADS: usize = 4;
const HEAD_DIM: usize = 32;
const EPS: f32 = 1e-6;
const WINDOW: usize = 5;
const PATTERN: u32 = 3;
const BASE_LOCAL: f64 = 10_000.0;
const BASE_GLOBAL: f64 = 1_000_000.0;
const SOFTCAP: f32 = 8.0;
const BLOCK: usize = 4;

struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

fn write_tiny_gemma3(softcap: bool, seed: u64) -> PathBuf {
    let mut rng = Rng(seed);
    let dev = Device::Cpu;
    let mut names = vec![
        ("token_embd.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("output_norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..LAYERS {
        for (n, s) in [
            ("attn_norm.weight", vec![HIDDEN]),
            ("attn_q.weight", vec![HEADS * HEAD_DIM, HIDDEN]),
            ("attn_k.weight", vec![HEAD_DIM, HIDDEN]),
            ("attn_v.weight", vec![HEAD_DIM, HIDDEN]),
            ("attn_q_norm.weight", vec![HEAD_DIM]),
            ("attn_k_norm.weight", vec![HEAD_DIM]),
            ("attn_output.weight", vec![HIDDEN, HEADS * HEAD_DIM]),
            ("post_attention_norm.weight", vec![HIDDEN]),
            ("ffn_norm.weight", vec![HIDDEN]),
            ("ffn_gate.weight", vec![FFN, HIDDEN]),
            ("ffn_up.weight", vec![FFN, HIDDEN]),
            ("ffn_down.weight", vec![HIDDEN, FFN]),
            ("post_ffw_norm.weight", vec![HIDDEN]),
        ] {
            names.push((format!("blk.{l}.{n}"), s));
        }
    }
    let mut tensors = Vec::new();
    for (name, shape) in &names {
        let n: usize = shape.iter().product();
        let data = if shape.len() == 1 {
            // As the converter stores them: 1 + w.
            rng.vec(n, 0.2).into_iter().map(|x| 1.0 + x).collect()
        } else if name == "token_embd.weight" {
            // Gemma scales embeddings up by sqrt(hidden) = 8.
            rng.vec(n, 0.1)
        } else {
            rng.vec(n, 0.2)
        };
        let t = Tensor::from_vec(data, shape.clone(), &dev).expect("tensor");
        tensors.push((
            name.clone(),
            QTensor::quantize(&t, GgmlDType::F32).expect("quantize"),
        ));
    }
    let mut tokens: Vec<Value> = vec![
        Value::String("<pad>".into()),
        Value::String("<eos>".into()),
        Value::String("<bos>".into()),
    ];
    for i in 3..VOCAB {
        tokens.push(Value::String(char::from(b'!' + i as u8).to_string()));
    }
    let mut types = vec![Value::I32(1); VOCAB];
    for t in types.iter_mut().take(3) {
        *t = Value::I32(3);
    }
    let s = |x: &str| Value::String(x.to_string());
    let mut meta: Vec<(&str, Value)> = vec![
        ("general.architecture", s("gemma3")),
        ("general.name", s("tiny-gemma3")),
        ("gemma3.block_count", Value::U32(LAYERS as u32)),
        ("gemma3.context_length", Value::U32(256)),
        ("gemma3.embedding_length", Value::U32(HIDDEN as u32)),
        ("gemma3.feed_forward_length", Value::U32(FFN as u32)),
        ("gemma3.attention.head_count", Value::U32(HEADS as u32)),
        ("gemma3.attention.head_count_kv", Value::U32(1)),
        ("gemma3.attention.key_length", Value::U32(HEAD_DIM as u32)),
        ("gemma3.attention.value_length", Value::U32(HEAD_DIM as u32)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(EPS)),
        ("gemma3.rope.freq_base", Value::F32(BASE_GLOBAL as f32)),
        ("gemma3.attention.sliding_window", Value::U32(WINDOW as u32)),
        (
            "gemma3.attention.sliding_window_pattern",
            Value::U32(PATTERN),
        ),
        ("tokenizer.ggml.model", s("llama")),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        (
            "tokenizer.ggml.scores",
            Value::Array(vec![Value::F32(0.0); VOCAB]),
        ),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.bos_token_id", Value::U32(2)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
    ];
    if softcap {
        meta.push(("gemma3.final_logit_softcapping", Value::F32(SOFTCAP)));
    }
    let dir = std::env::temp_dir().join(format!("cachet-gemma3-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join(format!("tiny-gemma3-{softcap}-{seed}.gguf"));
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).expect("create");
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &meta_refs, &t_refs).expect("write gguf");
    drop(f);
    std::fs::rename(&tmp, &path).expect("rename");
    path
}

/// Dense f64 forward of the tiny Gemma 3 (weights read back by candle).
struct Dense {
    t: std::collections::HashMap<String, Vec<f32>>,
    softcap: bool,
    /// The local layers' window (`WINDOW`; `usize::MAX` for a model without one).
    window: usize,
}

impl Dense {
    fn read(path: &PathBuf, softcap: bool) -> Dense {
        let mut f = std::fs::File::open(path).expect("open");
        let c = gguf_file::Content::read(&mut f).expect("read");
        let mut t = std::collections::HashMap::new();
        for name in c.tensor_infos.keys() {
            let q = c.tensor(&mut f, name, &Device::Cpu).expect("tensor");
            let v = q
                .dequantize(&Device::Cpu)
                .and_then(|x| x.flatten_all())
                .and_then(|x| x.to_vec1::<f32>())
                .expect("deq");
            t.insert(name.clone(), v);
        }
        Dense {
            t,
            softcap,
            window: WINDOW,
        }
    }

    fn w(&self, name: &str) -> &[f32] {
        &self.t[name]
    }

    fn mv(&self, name: &str, x: &[f64]) -> Vec<f64> {
        self.w(name)
            .chunks(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| *a as f64 * b).sum())
            .collect()
    }

    fn rms(&self, x: &[f64], name: &str) -> Vec<f64> {
        let ss = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ss + EPS as f64).sqrt();
        x.iter()
            .zip(self.w(name))
            .map(|(v, g)| v * r * *g as f64)
            .collect()
    }

    /// Logits at every position of `tokens`.
    fn forward(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let n = tokens.len();
        let emb = self.w("token_embd.weight");
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| {
                emb[t as usize * HIDDEN..(t as usize + 1) * HIDDEN]
                    .iter()
                    .map(|v| *v as f64 * (HIDDEN as f64).sqrt())
                    .collect()
            })
            .collect();
        for l in 0..LAYERS {
            let p = |s: &str| format!("blk.{l}.{s}");
            // Layers 0 and 1 of each run of 3 are local; layer 2 global.
            let local = (l as u32) % PATTERN < PATTERN - 1;
            let base = if local { BASE_LOCAL } else { BASE_GLOBAL };
            let rope = |x: &mut [f64], pos: usize| {
                let half = HEAD_DIM / 2;
                for i in 0..half {
                    let th = pos as f64 * base.powf(-((2 * i) as f64) / HEAD_DIM as f64);
                    let (a, b) = (x[i], x[i + half]);
                    x[i] = a * th.cos() - b * th.sin();
                    x[i + half] = a * th.sin() + b * th.cos();
                }
            };
            let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
            for (pos, x) in xs.iter().enumerate() {
                let h = self.rms(x, &p("attn_norm.weight"));
                let mut q = self.mv(&p("attn_q.weight"), &h);
                let mut k = self.mv(&p("attn_k.weight"), &h);
                for qh in q.chunks_mut(HEAD_DIM) {
                    let y = self.rms(qh, &p("attn_q_norm.weight"));
                    qh.copy_from_slice(&y);
                    rope(qh, pos);
                }
                let y = self.rms(&k, &p("attn_k_norm.weight"));
                k.copy_from_slice(&y);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(self.mv(&p("attn_v.weight"), &h));
            }
            for i in 0..n {
                let lo = if local {
                    (i + 1).saturating_sub(self.window)
                } else {
                    0
                };
                let mut att = vec![0f64; HEADS * HEAD_DIM];
                for hh in 0..HEADS {
                    let q = &qs[i][hh * HEAD_DIM..(hh + 1) * HEAD_DIM];
                    let sc: Vec<f64> = (lo..=i)
                        .map(|j| {
                            q.iter().zip(&ks[j]).map(|(a, b)| a * b).sum::<f64>()
                                / (HEAD_DIM as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..HEAD_DIM {
                        att[hh * HEAD_DIM + d] =
                            (lo..=i).zip(&e).map(|(j, w)| w / z * vs[j][d]).sum();
                    }
                }
                let o = self.mv(&p("attn_output.weight"), &att);
                let o = self.rms(&o, &p("post_attention_norm.weight"));
                for (x, d) in xs[i].iter_mut().zip(o) {
                    *x += d;
                }
                let h = self.rms(&xs[i], &p("ffn_norm.weight"));
                let g = self.mv(&p("ffn_gate.weight"), &h);
                let u = self.mv(&p("ffn_up.weight"), &h);
                let a: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
                    })
                    .collect();
                let d = self.mv(&p("ffn_down.weight"), &a);
                let d = self.rms(&d, &p("post_ffw_norm.weight"));
                for (x, d) in xs[i].iter_mut().zip(d) {
                    *x += d;
                }
            }
        }
        xs.iter()
            .map(|x| {
                self.mv("token_embd.weight", &self.rms(x, "output_norm.weight"))
                    .into_iter()
                    .map(|v| {
                        let c = SOFTCAP as f64;
                        (if self.softcap { c * (v / c).tanh() } else { v }) as f32
                    })
                    .collect()
            })
            .collect()
    }
}

fn load(path: &PathBuf) -> LoadedModel {
    load_model(
        path,
        &LoadOptions {
            threads: 2,
            progress: false,
            ..Default::default()
        },
    )
    .expect("load tiny gemma3")
}

/// Max |a - b| over the row, relative to the largest reference logit. The executor's GELU
/// goes through ggml's f16 table (about 1e-3 relative per activation); a wrong window, RoPE
/// base, norm or scale gives errors of order 10-100 %.
fn max_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn chunk<'a>(
    tokens: &'a [u32],
    start: usize,
    table: &'a [u32],
    params: &'a SamplingParams,
) -> SeqChunk<'a> {
    SeqChunk {
        prompt_logprobs: None,
        slot: 0,
        tokens,
        start_pos: start,
        block_table: table,
        sample: Some(SampleSpec {
            forks: &[],
            drafts: &[],
            params,
            prompt: &[],
            output: &[],
        }),
    }
}

fn prompt(len: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..len)
        .map(|_| 3 + ((r.next_f32() + 1.0) * 0.5 * (VOCAB as f32 - 4.0)) as u32)
        .collect()
}

#[test]
fn gemma3_config_reads_the_layer_pattern() {
    let path = write_tiny_gemma3(false, 3);
    let m = load(&path);
    let c = &m.weights.config;
    let kinds: Vec<AttnKind> = c.layers.iter().map(|l| l.kind).collect();
    assert_eq!(
        kinds,
        vec![
            AttnKind::Sliding(WINDOW),
            AttnKind::Sliding(WINDOW),
            AttnKind::Full
        ]
    );
    let bases: Vec<f32> = c.layers.iter().map(|l| l.rope_base).collect();
    assert_eq!(bases, vec![10_000.0, 10_000.0, 1_000_000.0]);
    assert_eq!(c.attn_scale, 1.0 / (HEAD_DIM as f32).sqrt());
    assert_eq!(c.embed_scale, Some(8.0));
    assert_eq!(c.ffn_act, FfnAct::GeGlu);
    assert_eq!(c.logit_softcap, None);
    assert!(m.weights.output.is_none(), "tied output");
    assert!(m
        .weights
        .layers
        .iter()
        .all(|l| l.post_attn_norm.is_some() && l.post_ffn_norm.is_some() && l.q_norm.is_some()));
}

/// 14 tokens (well past the window of 5) at once, in chunks, and decoded one by one, on f32
/// and f16 KV: every sampled row within tolerance of the dense forward, and the chunked and
/// token-by-token runs within 1e-5 of the whole prompt.
#[test]
fn tiny_gemma3_matches_dense_reference() {
    for softcap in [false, true] {
        let path = write_tiny_gemma3(softcap, 11);
        let m = load(&path);
        let dense = Dense::read(&path, softcap);
        let params = SamplingParams::default();
        let p = prompt(14, 5);
        let want = dense.forward(&p);
        let table: Vec<u32> = vec![3, 0, 7, 1, 5];
        for kv in [KvDtype::F32, KvDtype::F16] {
            let tol = if kv == KvDtype::F32 { 4e-3 } else { 8e-3 };
            let mut e = m
                .executor(ExecutorConfig {
                    block_size: BLOCK,
                    num_blocks: 8,
                    kv_dtype: kv,
                })
                .expect("executor");
            // The whole prompt (its last row), then again in chunks, then one token at a time.
            let whole = e
                .execute_logits(&ExecBatch {
                    copies: Vec::new(),
                    loads: Vec::new(),
                    seqs: vec![chunk(&p, 0, &table, &params)],
                })
                .expect("exec");
            let err = max_err(&whole[0], &want[13]);
            assert!(
                err < tol,
                "{kv:?} softcap={softcap}: whole prompt error {err}"
            );
            let mut start = 0;
            let mut last = Vec::new();
            for n in [3, 6, 1, 4] {
                let got = e
                    .execute_logits(&ExecBatch {
                        copies: Vec::new(),
                        loads: Vec::new(),
                        seqs: vec![chunk(&p[start..start + n], start, &table, &params)],
                    })
                    .expect("exec");
                let err = max_err(&got[0], &want[start + n - 1]);
                assert!(
                    err < tol,
                    "{kv:?} softcap={softcap}: chunk ending at {} error {err}",
                    start + n
                );
                start += n;
                last = got[0].clone();
            }
            // The paths differ only in how the matmuls group rows: far tighter than either is
            // to the reference (the kernels' tests check the windowed attention to the bit).
            let d = max_err(&last, &whole[0]);
            assert!(d < 1e-5, "{kv:?}: chunked vs whole {d}");
            for (i, tok) in p.iter().enumerate() {
                let got = e
                    .execute_logits(&ExecBatch {
                        copies: Vec::new(),
                        loads: Vec::new(),
                        seqs: vec![chunk(std::slice::from_ref(tok), i, &table, &params)],
                    })
                    .expect("exec");
                let err = max_err(&got[0], &want[i]);
                assert!(
                    err < tol,
                    "{kv:?} softcap={softcap}: decode {i} error {err}"
                );
                if i == 13 {
                    let d = max_err(&got[0], &whole[0]);
                    assert!(d < 1e-5, "{kv:?}: decoded vs whole {d}");
                }
            }
        }
    }
}

/// The window matters: the dense forward with every layer global agrees with the windowed one
/// up to position 4 (the first 5 positions lie inside the window) and differs at position 13,
/// where the executor follows the windowed one; so the test above cannot pass by ignoring it.
#[test]
fn the_window_changes_late_logits() {
    let path = write_tiny_gemma3(false, 11);
    let windowed = Dense::read(&path, false);
    let mut global = Dense::read(&path, false);
    global.window = usize::MAX;
    let p = prompt(14, 5);
    let (want, full) = (windowed.forward(&p), global.forward(&p));
    for i in 0..WINDOW {
        assert_eq!(full[i], want[i], "row {i} inside the window");
    }
    assert!(
        max_err(&full[13], &want[13]) > 2e-2,
        "the window changed nothing at position 13"
    );
}
