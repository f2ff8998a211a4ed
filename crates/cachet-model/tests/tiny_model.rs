//! A tiny random llama GGUF written by the test itself, run through the paged, batched, chunked
//! executor and checked against a plain dense forward (all weights dequantized by candle, full
//! causal attention over the whole sequence) written here.

mod common;

use std::path::PathBuf;

use cachet_core::exec::SampleSpec;
use cachet_core::{ExecBatch, Executor, SamplingParams, SeqChunk};
use cachet_kernels::WeightType;
use cachet_model::{load_model, ExecutorConfig, KvDtype, LlamaExecutor, LoadOptions, LoadedModel};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

const VOCAB: usize = 64;
const HIDDEN: usize = 64;
const FFN: usize = 128;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const EPS: f32 = 1e-5;
const THETA: f32 = 10_000.0;
const BLOCK: usize = 4;
/// Weight scale: small enough that int8 activation quantization (as in ggml) is not amplified
/// chaotically by the random network.
const W_SCALE: f32 = 0.2;

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

fn tensor_names() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![("token_embd.weight".to_string(), vec![VOCAB, HIDDEN])];
    for l in 0..LAYERS {
        let kvd = KV_HEADS * HEAD_DIM;
        for (n, s) in [
            ("attn_norm.weight", vec![HIDDEN]),
            ("attn_q.weight", vec![HIDDEN, HIDDEN]),
            ("attn_k.weight", vec![kvd, HIDDEN]),
            ("attn_v.weight", vec![kvd, HIDDEN]),
            ("attn_output.weight", vec![HIDDEN, HIDDEN]),
            ("ffn_norm.weight", vec![HIDDEN]),
            ("ffn_gate.weight", vec![FFN, HIDDEN]),
            ("ffn_up.weight", vec![FFN, HIDDEN]),
            ("ffn_down.weight", vec![HIDDEN, FFN]),
        ] {
            v.push((format!("blk.{l}.{n}"), s));
        }
    }
    v.push(("output_norm.weight".to_string(), vec![HIDDEN]));
    v
}

/// Writes the tiny model; `dtype` for matrices (norms stay F32); `tied`: no output.weight.
fn write_tiny(dtype: GgmlDType, tied: bool, seed: u64) -> PathBuf {
    write_tiny_arch("llama", dtype, tied, seed)
}

/// `arch`: `llama`, `qwen2` (adds Q/K/V biases) or `qwen3` (adds per-head Q/K norms).
fn write_tiny_arch(arch: &str, dtype: GgmlDType, tied: bool, seed: u64) -> PathBuf {
    let mut rng = Rng(seed);
    let dev = Device::Cpu;
    let mut names = tensor_names();
    if !tied {
        names.push(("output.weight".to_string(), vec![VOCAB, HIDDEN]));
    }
    for l in 0..LAYERS {
        let kvd = KV_HEADS * HEAD_DIM;
        if arch == "qwen2" {
            names.push((format!("blk.{l}.attn_q.bias"), vec![HIDDEN]));
            names.push((format!("blk.{l}.attn_k.bias"), vec![kvd]));
            names.push((format!("blk.{l}.attn_v.bias"), vec![kvd]));
        }
        if arch == "qwen3" {
            names.push((format!("blk.{l}.attn_q_norm.weight"), vec![HEAD_DIM]));
            names.push((format!("blk.{l}.attn_k_norm.weight"), vec![HEAD_DIM]));
        }
    }
    let mut tensors = Vec::new();
    for (name, shape) in &names {
        let n: usize = shape.iter().product();
        let data = if name.ends_with(".bias") {
            rng.vec(n, 0.3)
        } else if shape.len() == 1 {
            rng.vec(n, 0.2).into_iter().map(|x| 1.0 + x).collect()
        } else {
            rng.vec(n, W_SCALE)
        };
        let t = Tensor::from_vec(data, shape.clone(), &dev).expect("tensor");
        let dt = if shape.len() == 1 {
            GgmlDType::F32
        } else {
            dtype
        };
        tensors.push((name.clone(), QTensor::quantize(&t, dt).expect("quantize")));
    }
    let mut tokens: Vec<Value> = vec![Value::String("<|endoftext|>".into())];
    for i in 1..VOCAB {
        tokens.push(Value::String(char::from(b'!' + i as u8).to_string()));
    }
    let mut types = vec![Value::I32(1); VOCAB];
    types[0] = Value::I32(3);
    let s = |x: &str| Value::String(x.to_string());
    let mut meta: Vec<(&str, Value)> = vec![
        ("general.architecture", s(arch)),
        ("general.name", s("tiny-test")),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.context_length", Value::U32(256)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(FFN as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(EPS)),
        ("llama.rope.freq_base", Value::F32(THETA)),
        ("llama.vocab_size", Value::U32(VOCAB as u32)),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("default")),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(vec![])),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ];
    let keys: Vec<String> = meta
        .iter()
        .map(|(k, _)| {
            k.strip_prefix("llama.")
                .map(|r| format!("{arch}.{r}"))
                .unwrap_or(k.to_string())
        })
        .collect();
    let meta: Vec<(&str, Value)> = keys
        .iter()
        .map(String::as_str)
        .zip(meta.drain(..).map(|(_, v)| v))
        .collect();
    let dir = std::env::temp_dir().join(format!("cachet-model-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join(format!("tiny-{arch}-{dtype:?}-{tied}-{seed}.gguf"));
    // Tests run in parallel and several write the same model: write a private file and rename
    // it into place, so a reader never sees one half written.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("{n}.partial"));
    let mut f = std::fs::File::create(&tmp).expect("create");
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &meta_refs, &t_refs).expect("write gguf");
    drop(f);
    std::fs::rename(&tmp, &path).expect("rename gguf into place");
    path
}

/// Dense f32 weights read back by candle.
struct Dense {
    t: std::collections::HashMap<String, Vec<f32>>,
}

impl Dense {
    fn read(path: &PathBuf) -> Dense {
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
        Dense { t }
    }
    fn w(&self, name: &str) -> &[f32] {
        &self.t[name]
    }
    /// y[rows] = W[rows][cols] · x
    fn mv(&self, name: &str, x: &[f32]) -> Vec<f32> {
        let w = self.w(name);
        let cols = x.len();
        w.chunks(cols)
            .map(|r| {
                r.iter()
                    .zip(x)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum::<f64>() as f32
            })
            .collect()
    }

    /// Logits at every position of `tokens`.
    fn forward(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let n = tokens.len();
        let rms = |x: &[f32], w: &[f32]| -> Vec<f32> {
            let ss = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
            let r = 1.0 / (ss + EPS as f64).sqrt();
            x.iter()
                .zip(w)
                .map(|(v, g)| (*v as f64 * r) as f32 * g)
                .collect()
        };
        // llama GGUFs: interleaved ("normal") rope, pairs (2i, 2i+1); qwen: NeoX halves.
        let neox = self.t.contains_key("blk.0.attn_q.bias")
            || self.t.contains_key("blk.0.attn_q_norm.weight");
        let rope = |x: &mut [f32], pos: usize| {
            let half = HEAD_DIM / 2;
            for i in 0..half {
                let theta = (pos as f64) * (THETA as f64).powf(-((2 * i) as f64) / HEAD_DIM as f64);
                let (c, s) = (theta.cos(), theta.sin());
                let (ia, ib) = if neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (a, b) = (x[ia] as f64, x[ib] as f64);
                x[ia] = (a * c - b * s) as f32;
                x[ib] = (a * s + b * c) as f32;
            }
        };
        let add = |x: &mut Vec<f32>, name: &str| {
            if let Some(b) = self.t.get(name) {
                x.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        };
        let head_norm = |x: &mut [f32], name: &str| {
            if let Some(w) = self.t.get(name) {
                for hx in x.chunks_mut(HEAD_DIM) {
                    let y = rms(hx, w);
                    hx.copy_from_slice(&y);
                }
            }
        };
        let emb = self.w("token_embd.weight");
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| emb[t as usize * HIDDEN..(t as usize + 1) * HIDDEN].to_vec())
            .collect();
        for l in 0..LAYERS {
            let p = |s: &str| format!("blk.{l}.{s}");
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (pos, x) in xs.iter().enumerate() {
                let h = rms(x, self.w(&p("attn_norm.weight")));
                let mut q = self.mv(&p("attn_q.weight"), &h);
                let mut k = self.mv(&p("attn_k.weight"), &h);
                add(&mut q, &p("attn_q.bias"));
                add(&mut k, &p("attn_k.bias"));
                head_norm(&mut q, &p("attn_q_norm.weight"));
                head_norm(&mut k, &p("attn_k_norm.weight"));
                for hh in 0..HEADS {
                    rope(&mut q[hh * HEAD_DIM..(hh + 1) * HEAD_DIM], pos);
                }
                for hh in 0..KV_HEADS {
                    rope(&mut k[hh * HEAD_DIM..(hh + 1) * HEAD_DIM], pos);
                }
                qs.push(q);
                ks.push(k);
                let mut v = self.mv(&p("attn_v.weight"), &h);
                add(&mut v, &p("attn_v.bias"));
                vs.push(v);
            }
            for i in 0..n {
                let mut att = vec![0f32; HIDDEN];
                for hh in 0..HEADS {
                    let g = hh / (HEADS / KV_HEADS);
                    let q = &qs[i][hh * HEAD_DIM..(hh + 1) * HEAD_DIM];
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = &ks[j][g * HEAD_DIM..(g + 1) * HEAD_DIM];
                            q.iter()
                                .zip(k)
                                .map(|(a, b)| (*a as f64) * (*b as f64))
                                .sum::<f64>()
                                / (HEAD_DIM as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..HEAD_DIM {
                        let v: f64 = (0..=i)
                            .map(|j| e[j] / z * vs[j][g * HEAD_DIM + d] as f64)
                            .sum();
                        att[hh * HEAD_DIM + d] = v as f32;
                    }
                }
                let o = self.mv(&p("attn_output.weight"), &att);
                for (x, d) in xs[i].iter_mut().zip(o) {
                    *x += d;
                }
                let h = rms(&xs[i], self.w(&p("ffn_norm.weight")));
                let g = self.mv(&p("ffn_gate.weight"), &h);
                let u = self.mv(&p("ffn_up.weight"), &h);
                let a: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                let d = self.mv(&p("ffn_down.weight"), &a);
                for (x, d) in xs[i].iter_mut().zip(d) {
                    *x += d;
                }
            }
        }
        let head = if self.t.contains_key("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        xs.iter()
            .map(|x| self.mv(head, &rms(x, self.w("output_norm.weight"))))
            .collect()
    }
}

struct Case {
    model: LoadedModel,
    dense: Dense,
    tol: f32,
}

/// Tolerances are relative to the largest reference logit. F32 weights: exact up to float
/// rounding. Quantized weights: the kernels quantize activations to int8 (like ggml), about 0.3%
/// per matmul, which compounds to a few percent through 2 random layers; an indexing or
/// dequantization bug gives errors of order 100%.
fn case(dtype: GgmlDType, tied: bool, tol: f32) -> Case {
    case_arch("llama", dtype, tied, tol)
}

fn case_arch(arch: &str, dtype: GgmlDType, tied: bool, tol: f32) -> Case {
    let path = write_tiny_arch(arch, dtype, tied, 7 + dtype as u64);
    let model = load_model(
        &path,
        &LoadOptions {
            threads: 2,
            progress: false,
            full_fingerprint: true,
            ..Default::default()
        },
    )
    .expect("load tiny");
    let dense = Dense::read(&path);
    Case { model, dense, tol }
}

fn exec(c: &Case, kv: KvDtype) -> LlamaExecutor {
    c.model
        .executor(ExecutorConfig {
            block_size: BLOCK,
            num_blocks: 64,
            kv_dtype: kv,
        })
        .expect("executor")
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    if std::env::var_os("CACHET_TEST_VERBOSE").is_some() {
        eprintln!("{what}: max abs error {err} (scale {scale})");
    }
    assert!(
        err <= tol * scale,
        "{what}: max abs error {err} > {tol} * {scale}"
    );
}

fn prompt(len: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..len)
        .map(|_| ((r.next_f32() + 1.0) * 0.5 * (VOCAB as f32 - 1.0)) as u32 % VOCAB as u32)
        .collect()
}

/// A chunk whose last row is sampled (for logits).
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

fn run_scenarios(c: &Case, kv: KvDtype) {
    let params = SamplingParams::default();
    let p = prompt(19, 1);
    let want = c.dense.forward(&p);
    let table_a: Vec<u32> = (0..8).collect();

    // (a) the whole prompt at once.
    let mut e = exec(c, kv);
    let got = e
        .execute_logits(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&p, 0, &table_a, &params)],
        })
        .expect("exec");
    assert_close(&got[0], &want[18], c.tol, "whole prompt");
    let whole = got[0].clone();

    // (b) chunks of 5, 7, 1, 6 tokens over several calls (each chunk end compared).
    let mut e = exec(c, kv);
    let mut start = 0;
    for n in [5, 7, 1, 6] {
        let got = e
            .execute_logits(&ExecBatch {
                copies: Vec::new(),
                loads: Vec::new(),
                seqs: vec![chunk(&p[start..start + n], start, &table_a, &params)],
            })
            .expect("exec");
        assert_close(
            &got[0],
            &want[start + n - 1],
            c.tol,
            &format!("chunk ending at {}", start + n),
        );
        start += n;
        if start == p.len() {
            // Chunked and whole computations agree far more tightly than either does with the
            // dense reference (activation quantization is per row, independent of the batch).
            assert_close(&got[0], &whole, 1e-4, "chunked vs whole");
        }
    }

    // (c) a second request whose table starts with the first one's blocks: 12 cached positions
    // (3 full blocks), only the suffix is computed.
    let mut q = p[..12].to_vec();
    q.extend(prompt(9, 2));
    let want_q = c.dense.forward(&q);
    let table_b: Vec<u32> = [0, 1, 2, 20, 21, 22].to_vec();
    let got = e
        .execute_logits(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&q[12..], 12, &table_b, &params)],
        })
        .expect("exec");
    assert_close(&got[0], &want_q[20], c.tol, "prefix hit suffix");

    // (d) one batch: a decode of request A (position 19), another prefix-hit request sharing
    // A's first 2 blocks, a fresh prompt, and a 1-token prompt.
    let mut a_next = p.clone();
    a_next.push(5);
    let want_a = c.dense.forward(&a_next);
    let mut r = p[..8].to_vec();
    r.extend(prompt(6, 3));
    let want_r = c.dense.forward(&r);
    let fresh = prompt(11, 4);
    let want_f = c.dense.forward(&fresh);
    let one = vec![9u32];
    let want_o = c.dense.forward(&one);
    let table_r: Vec<u32> = vec![0, 1, 30, 31];
    let table_f: Vec<u32> = vec![40, 41, 42];
    let table_o: Vec<u32> = vec![50];
    let batch = ExecBatch {
        copies: Vec::new(),
        loads: Vec::new(),
        seqs: vec![
            chunk(&a_next[19..], 19, &table_a, &params),
            chunk(&r[8..], 8, &table_r, &params),
            chunk(&fresh, 0, &table_f, &params),
            SeqChunk {
                prompt_logprobs: None,
                slot: 3,
                tokens: &one,
                start_pos: 0,
                block_table: &table_o,
                sample: None,
            },
        ],
    };
    let got = e.execute_logits(&batch).expect("exec");
    assert_eq!(got.len(), 3, "only sampled rows get logits");
    assert_close(&got[0], &want_a[19], c.tol, "batched decode");
    assert_close(&got[1], &want_r[13], c.tol, "batched prefix hit");
    assert_close(&got[2], &want_f[10], c.tol, "batched fresh prompt");
    // The unsampled 1-token prompt's KV is in block 50: decode after it.
    let two = [9u32, 17];
    let want_two = c.dense.forward(&two);
    let got = e
        .execute_logits(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&two[1..], 1, &table_o, &params)],
        })
        .expect("exec");
    assert_close(
        &got[0],
        &want_two[1],
        c.tol,
        "decode after unsampled prefill",
    );
    let _ = want_o;
}

#[test]
fn f32_weights_match_dense_reference() {
    let c = case(GgmlDType::F32, false, 2e-4);
    run_scenarios(&c, KvDtype::F32);
    let c16 = Case { tol: 5e-3, ..c };
    run_scenarios(&c16, KvDtype::F16);
}

#[test]
fn q8_0_tied_weights_match_dense_reference() {
    let c = case(GgmlDType::Q8_0, true, 4e-2);
    run_scenarios(&c, KvDtype::F32);
    run_scenarios(&c, KvDtype::F16);
}

#[test]
fn q4_1_weights_match_dense_reference() {
    let c = case(GgmlDType::Q4_1, false, 5e-2);
    run_scenarios(&c, KvDtype::F16);
}

#[test]
fn q4_0_and_f16_weights_match_dense_reference() {
    for (dt, tol) in [(GgmlDType::Q4_0, 5e-2), (GgmlDType::F16, 2e-3)] {
        let c = case(dt, true, tol);
        run_scenarios(&c, KvDtype::F32);
    }
}

/// The 5-bit types and BF16: the dense reference dequantizes them with candle. BF16 weights
/// widen to f32 exactly, so they take the F32 case's tolerance.
#[test]
fn q5_and_bf16_weights_match_dense_reference() {
    for (dt, tol) in [
        (GgmlDType::Q5_0, 4e-2),
        (GgmlDType::Q5_1, 4e-2),
        (GgmlDType::BF16, 2e-4),
    ] {
        let c = case(dt, false, tol);
        run_scenarios(&c, KvDtype::F32);
    }
}

/// Offsets of the ggml type id of every tensor info in `bytes` (a file candle wrote: GGUF v3,
/// tensor names from [`tensor_names`] and `output.weight`) whose type is `id`, by name.
fn type_id_offsets(bytes: &[u8], names: &[String], id: u32) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for name in names {
        // The info: name length (u64), name, n_dims (u32), dims (u64 each), type id (u32).
        let mut needle = (name.len() as u64).to_le_bytes().to_vec();
        needle.extend_from_slice(name.as_bytes());
        let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) else {
            continue;
        };
        let dims_at = at + needle.len();
        let n_dims = u32::from_le_bytes(bytes[dims_at..dims_at + 4].try_into().expect("u32"));
        let ty = dims_at + 4 + 8 * n_dims as usize;
        if bytes[ty..ty + 4] == id.to_le_bytes() {
            out.push((name.clone(), ty));
        }
    }
    out
}

/// IQ4_NL weights, which candle cannot read: a Q4_0 model (IQ4_NL blocks are the same 18 bytes
/// per 32 values: an f16 scale and 16 bytes of nibbles) with its matrices' type ids set to
/// IQ4_NL (20), so the same bytes now mean IQ4_NL's non-linear levels. The dense reference
/// decodes those bytes with `dequantize_row_bytes` (checked against ggml's tables by the
/// kernels' `ggml_blocks` tests); norms stay F32 and are read by candle.
#[test]
fn iq4_nl_weights_match_dense_reference() {
    let path = write_tiny(GgmlDType::Q4_0, false, 41);
    let mut bytes = std::fs::read(&path).expect("read");
    let mut names: Vec<String> = tensor_names().into_iter().map(|(n, _)| n).collect();
    names.push("output.weight".into());
    let patched = type_id_offsets(&bytes, &names, 2);
    assert_eq!(patched.len(), 1 + 7 * LAYERS + 1, "every matrix is Q4_0");
    let mut dense = Dense::read(&path);
    for (name, ty) in &patched {
        bytes[*ty..*ty + 4].copy_from_slice(&20u32.to_le_bytes());
        let mut raw = {
            let mut f = std::fs::File::open(&path).expect("open");
            let c = gguf_file::Content::read(&mut f).expect("read");
            let q = c.tensor(&mut f, name, &Device::Cpu).expect("tensor");
            q.data().expect("bytes").into_owned()
        };
        let at = bytes
            .windows(raw.len())
            .position(|w| w == raw)
            .expect("the tensor's bytes in the file");
        // IQ4_NL's levels reach ±127 where Q4_0's reach ±8: a sixteenth of each block's scale
        // keeps the weights as large as the Q4_0 model's (exact in f16).
        for block in raw.chunks_exact_mut(18) {
            let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32() / 16.0;
            block[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        }
        bytes[at..at + raw.len()].copy_from_slice(&raw);
        let mut w = vec![f32::NAN; dense.t[name].len()];
        cachet_kernels::quant::dequantize_row_bytes(WeightType::IQ4NL, &raw, &mut w)
            .expect("IQ4_NL decode");
        dense.t.insert(name.clone(), w);
    }
    let p2 = path.with_extension("iq4nl.gguf");
    std::fs::write(&p2, &bytes).expect("write");
    let model = load_model(
        &p2,
        &LoadOptions {
            threads: 2,
            progress: false,
            full_fingerprint: true,
            ..Default::default()
        },
    )
    .expect("an IQ4_NL model loads");
    let c = Case {
        model,
        dense,
        tol: 5e-2,
    };
    run_scenarios(&c, KvDtype::F32);
}

/// A tensor of a type the kernels do not run (IQ2_XXS's id patched into the header) is one
/// error line naming the tensor, its type and the supported types.
#[test]
fn unsupported_tensor_type_is_named() {
    let path = write_tiny(GgmlDType::Q4_0, true, 98);
    let mut bytes = std::fs::read(&path).expect("read");
    let names = vec!["blk.0.attn_q.weight".to_string()];
    let [(_, ty)] = type_id_offsets(&bytes, &names, 2)[..] else {
        panic!("blk.0.attn_q.weight is Q4_0");
    };
    bytes[ty..ty + 4].copy_from_slice(&16u32.to_le_bytes());
    let p2 = path.with_extension("iq2.gguf");
    std::fs::write(&p2, &bytes).expect("write");
    let opts = LoadOptions {
        threads: 1,
        progress: false,
        full_fingerprint: false,
        ..Default::default()
    };
    let err = match load_model(&p2, &opts) {
        Ok(_) => panic!("an IQ2_XXS tensor must not load"),
        Err(e) => e.to_string(),
    };
    assert!(!err.contains('\n'), "{err}");
    assert!(
        err.ends_with(
            "tensor 'blk.0.attn_q.weight' has unsupported type IQ2_XXS (supported: F32, F16, \
             BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)"
        ),
        "{err}"
    );
}

#[test]
fn metadata_layout_and_fingerprint() {
    let c = case(GgmlDType::F32, false, 0.0);
    let e = exec(&c, KvDtype::F16);
    assert_eq!(
        e.kv_layout(),
        format!("f16:L{LAYERS}:KV{KV_HEADS}:D{HEAD_DIM}")
    );
    assert_eq!(e.model_fingerprint(), c.model.info.fingerprint);
    assert_eq!(c.model.info.architecture, "llama");
    assert_eq!(c.model.info.vocab_size, VOCAB);
    assert_eq!(c.model.info.name, "tiny-test");
    // Same file loaded twice: same fingerprint; other weights: another one.
    let again = load_model(
        &c.model.info.path,
        &LoadOptions {
            threads: 1,
            progress: false,
            full_fingerprint: true,
            ..Default::default()
        },
    )
    .expect("load");
    assert_eq!(again.info.fingerprint, c.model.info.fingerprint);
    let other = case(GgmlDType::F32, true, 0.0);
    assert_ne!(other.model.info.fingerprint, c.model.info.fingerprint);
    // KV sizing: 2 (K,V) * layers * kv heads * head dim * 2 bytes per token.
    let per_block = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 * BLOCK;
    assert_eq!(
        c.model
            .num_blocks_for_memory((per_block * 10 + 1) as u64, BLOCK, KvDtype::F16),
        10
    );
}

#[test]
fn invalid_batches_are_errors_not_panics() {
    let c = case(GgmlDType::F32, false, 0.0);
    let mut e = exec(&c, KvDtype::F32);
    let params = SamplingParams::default();
    let toks = [1u32, 2, 3, 4, 5];
    let short = [0u32];
    assert!(
        e.execute(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&toks, 0, &short, &params)]
        })
        .is_err(),
        "table too short"
    );
    let far = [1000u32, 1001];
    assert!(
        e.execute(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&toks, 0, &far, &params)]
        })
        .is_err(),
        "block outside arena"
    );
    let bad = [VOCAB as u32];
    assert!(
        e.execute(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&bad, 0, &short, &params)]
        })
        .is_err(),
        "token outside vocab"
    );
    let empty: [u32; 0] = [];
    assert!(
        e.execute(&ExecBatch {
            copies: Vec::new(),
            loads: Vec::new(),
            seqs: vec![chunk(&empty, 0, &short, &params)]
        })
        .is_err(),
        "sample of empty chunk"
    );
    assert!(e
        .execute(&ExecBatch::default())
        .expect("empty batch")
        .sampled
        .is_empty());
}

#[test]
fn unsupported_architecture_is_named() {
    let path = write_tiny(GgmlDType::F32, true, 99);
    let mut bytes = std::fs::read(&path).expect("read");
    // Patch "llama" in general.architecture's value to "gemma" (same length).
    let needle = b"general.architecture";
    let key = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("key");
    let pos = key
        + bytes[key..]
            .windows(5)
            .position(|w| w == b"llama")
            .expect("value");
    bytes[pos..pos + 5].copy_from_slice(b"gemma");
    let p2 = path.with_extension("gemma.gguf");
    std::fs::write(&p2, &bytes).expect("write");
    let err = match load_model(
        &p2,
        &LoadOptions {
            threads: 1,
            progress: false,
            full_fingerprint: false,
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("gemma must not load"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("gemma"), "{err}");
}

#[test]
fn qwen2_biases_and_neox_rope_match_dense_reference() {
    let c = case_arch("qwen2", GgmlDType::F32, true, 2e-4);
    assert_eq!(c.model.info.architecture, "qwen2");
    run_scenarios(&c, KvDtype::F32);
}

#[test]
fn qwen3_qk_norms_match_dense_reference() {
    let c = case_arch("qwen3", GgmlDType::Q8_0, false, 4e-2);
    assert_eq!(c.model.info.architecture, "qwen3");
    run_scenarios(&c, KvDtype::F16);
    let c = case_arch("qwen3", GgmlDType::F32, false, 2e-4);
    run_scenarios(&c, KvDtype::F32);
}

#[test]
fn thread_safety_of_public_types() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<LlamaExecutor>();
    send_sync::<cachet_model::GgufTokenizer>();
    send_sync::<LoadedModel>();
    send_sync::<cachet_model::text::IncrementalDetokenizer>();
}

/// Prompt logprobs are the model's own: for every prompt token after the first, the logprob
/// the executor returns equals the log-softmax, at that token, of the logits the same executor
/// computes directly for the prefix before it — with the prompt split over two chunks.
#[test]
fn prompt_logprobs_are_the_models_own() {
    use cachet_core::exec::PromptLogprobsSpec;
    let c = case(GgmlDType::F32, false, 1e-3);
    let params = SamplingParams::default();
    let p = prompt(14, 7);
    let table: Vec<u32> = (0..8).collect();
    let mut e = exec(&c, KvDtype::F32);
    let mut got = Vec::new();
    for (start, end) in [(0usize, 9usize), (9, 14)] {
        let mut ch = chunk(&p[start..end], start, &table, &params);
        ch.prompt_logprobs = Some(PromptLogprobsSpec {
            targets: &p[start + 1..(end + 1).min(p.len())],
            top: 3,
        });
        if end < p.len() {
            ch.sample = None;
        }
        let out = e
            .execute(&ExecBatch {
                copies: Vec::new(),
                loads: Vec::new(),
                seqs: vec![ch],
            })
            .expect("exec");
        got.extend(out.prompt_logprobs.into_iter().flat_map(|(_, v)| v));
    }
    assert_eq!(got.len(), 13);
    for (j, lp) in got.iter().enumerate() {
        // Logits at position j, computed directly from the prefix p[..=j].
        let mut fresh = exec(&c, KvDtype::F32);
        let logits = fresh
            .execute_logits(&ExecBatch {
                copies: Vec::new(),
                loads: Vec::new(),
                seqs: vec![chunk(&p[..=j], 0, &table, &params)],
            })
            .expect("exec")
            .remove(0);
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + logits.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
        let want = logits[p[j + 1] as usize] - lse;
        assert_eq!(lp.token, p[j + 1]);
        assert!(
            (lp.logprob - want).abs() < 1e-4,
            "token {}: {} vs {want}",
            j + 1,
            lp.logprob
        );
        assert_eq!(lp.top_logprobs.len(), 3);
        assert!(lp.top_logprobs[0].1 >= lp.logprob - 1e-6);
    }
}
