//! GGUF files: metadata, raw tensor bytes (memory-mapped), the llama-family config and weights.
//!
//! The header is parsed by [`crate::gguf_header`]; tensor data is taken as raw bytes from a
//! memory map and handed to `cachet_kernels::QMatrix::from_gguf_bytes`.
//!
//! A crafted or truncated file is an error, never a panic or a read out of bounds: the header
//! parser bounds every count by the bytes left, every tensor's size and extent are checked
//! against the file ([`check_tensors`]), and [`LlamaConfig::from_gguf`] refuses dimensions no
//! model has ([`MAX_LAYERS`] and the like), so the sizes computed from them cannot overflow.

use std::collections::HashMap;
use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use cachet_kernels::{QMatrix, WeightType};

use crate::executor::KvDtype;
pub use crate::gguf_header::Value;
use crate::gguf_header::{self as header, Header, HeaderError};
use crate::ModelError;

/// An open GGUF file: parsed header and a memory map of the whole file.
pub struct GgufFile {
    path: PathBuf,
    header: Header,
    mmap: memmap2::Mmap,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let io_err = |source| ModelError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        // SAFETY: the file is opened read-only; cachet never writes model files while serving.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        let bad = |e: String| ModelError::Gguf(format!("{}: {e}", path.display()));
        let header = header::parse(&mmap).map_err(|e| match e {
            HeaderError::Format(m) => bad(m),
            HeaderError::UnsupportedType { tensor, ggml_name } => {
                ModelError::UnsupportedTensorType {
                    name: tensor,
                    dtype: ggml_name,
                }
            }
        })?;
        check_tensors(&header, mmap.len()).map_err(bad)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            mmap,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.header.metadata
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    pub fn meta_str(&self, key: &str) -> Option<&str> {
        match self.meta(key) {
            Some(Value::String(s)) => Some(s.as_str()),
            _ => None,
        }
    }

    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta(key).and_then(header::integer)
    }

    pub fn meta_f32(&self, key: &str) -> Option<f32> {
        match self.meta(key)? {
            Value::F32(v) => Some(*v),
            Value::F64(v) => Some(*v as f32),
            v => header::integer(v).map(|x| x as f32),
        }
    }

    pub fn meta_bool(&self, key: &str) -> Option<bool> {
        match self.meta(key)? {
            Value::Bool(b) => Some(*b),
            v => header::integer(v).map(|x| x != 0),
        }
    }

    pub fn meta_array(&self, key: &str) -> Option<&[Value]> {
        match self.meta(key)? {
            Value::Array(a) => Some(a.as_slice()),
            _ => None,
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// Names of every tensor the file declares.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.header.tensors.keys().map(String::as_str)
    }

    /// Dimensions in row-major order (`[rows, cols]` for a matrix), type and raw bytes.
    pub fn tensor_raw(&self, name: &str) -> Result<(Vec<usize>, WeightType, &[u8]), ModelError> {
        let info = self
            .header
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let dims = info.dims.clone();
        let size = tensor_size(&dims, info.weight_type).ok_or_else(|| {
            ModelError::Gguf(format!(
                "tensor '{name}': shape {dims:?} is not whole blocks of {} or overflows",
                info.weight_type.ggml_name()
            ))
        })?;
        let start = self.header.data_offset.saturating_add(info.offset);
        let start = usize::try_from(start)
            .map_err(|_| ModelError::Gguf(format!("tensor '{name}' offset overflow")))?;
        let end = start
            .checked_add(size)
            .filter(|&e| e <= self.mmap.len())
            .ok_or_else(|| {
                ModelError::Gguf(format!(
                    "tensor '{name}' needs bytes {start}..{} beyond the file end {}",
                    start + size,
                    self.mmap.len()
                ))
            })?;
        Ok((dims, info.weight_type, &self.mmap[start..end]))
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes_total(&self) -> u64 {
        self.header
            .tensors
            .values()
            .filter_map(|i| tensor_size(&i.dims, i.weight_type))
            .fold(0u64, |a, b| a.saturating_add(b as u64))
    }

    /// BLAKE3 over the whole file: metadata, tensor infos and tensor data.
    pub fn fingerprint_full(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"cachet-gguf-v1");
        h.update(&self.mmap[..]);
        *h.finalize().as_bytes()
    }

    /// BLAKE3 over the header part of the file (metadata + tensor infos) only.
    pub fn fingerprint_header(&self) -> [u8; 32] {
        let end = (self.header.data_offset as usize).min(self.mmap.len());
        let mut h = blake3::Hasher::new();
        h.update(b"cachet-gguf-header-v1");
        h.update(&self.mmap[..end]);
        *h.finalize().as_bytes()
    }
}

/// Bytes of a tensor of `dims` and type `dt`; `None` when the element count overflows or is
/// not a whole number of blocks.
fn tensor_size(dims: &[usize], wt: WeightType) -> Option<usize> {
    let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    if !elems.is_multiple_of(wt.block_len()) {
        return None;
    }
    (elems / wt.block_len()).checked_mul(wt.block_bytes())
}

/// Every tensor's size is computable and its bytes lie inside the file.
fn check_tensors(header: &Header, file_len: usize) -> Result<(), String> {
    for (name, info) in &header.tensors {
        let name: String = name.chars().take(80).collect();
        let dims = &info.dims;
        let size = tensor_size(dims, info.weight_type).ok_or_else(|| {
            format!(
                "tensor '{name}': shape {dims:?} is not whole blocks of {} or overflows",
                info.weight_type.ggml_name()
            )
        })?;
        let end = header
            .data_offset
            .checked_add(info.offset)
            .and_then(|s| usize::try_from(s).ok())
            .and_then(|s| s.checked_add(size));
        if end.is_none_or(|e| e > file_len) {
            return Err(format!(
                "tensor '{name}' ({size} bytes at offset {}) lies beyond the file end {file_len}",
                info.offset
            ));
        }
    }
    Ok(())
}

/// Most layers a model may declare.
pub const MAX_LAYERS: usize = 4096;
/// Widest hidden or feed-forward dimension.
pub const MAX_WIDTH: usize = 1 << 22;
/// Most attention heads (and KV heads).
pub const MAX_HEADS: usize = 4096;
/// Widest attention head.
pub const MAX_HEAD_DIM: usize = 1 << 16;
/// Largest vocabulary.
pub const MAX_VOCAB: usize = 1 << 24;
/// Longest context.
pub const MAX_CONTEXT: usize = 1 << 26;

/// The model families this crate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    /// Gemma 3: local (sliding-window) and global layers, Q/K norms, post-norms, GELU FFN.
    Gemma3,
}

impl Architecture {
    pub fn parse(s: &str) -> Result<Self, ModelError> {
        match s {
            "llama" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            "gemma3" => Ok(Architecture::Gemma3),
            other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
        }
    }
}

/// How rotary embeddings pair up dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: llama GGUFs (Q/K are permuted at conversion).
    Normal,
    /// Halves `(i, i + d/2)`: qwen2/qwen3.
    Neox,
}

/// Which positions a layer's attention sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// The whole causal context.
    Full,
    /// The last `W` positions, the token's own included (Gemma 3's local layers).
    Sliding(usize),
}

impl AttnKind {
    /// The kernels' `PagedAttnArgs::window` (0: no window).
    pub fn window(self) -> usize {
        match self {
            AttnKind::Full => 0,
            AttnKind::Sliding(w) => w,
        }
    }
}

/// How one layer attends: its kind and its rotary embedding. Layers with equal descriptions
/// could share a KV cache group (today every layer's KV lives in the one paged arena).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttn {
    pub kind: AttnKind,
    /// RoPE base frequency (`rope.freq_base`; Gemma 3's local layers `rope.freq_base_swa`).
    pub rope_base: f32,
    /// Linear RoPE scaling: positions are multiplied by this (1: none).
    pub rope_scale: f32,
}

/// The feed-forward activation of the gated FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// `silu(gate) * up` (llama, qwen).
    SwiGlu,
    /// `gelu_tanh(gate) * up`, GELU through ggml's f16 table (Gemma).
    GeGlu,
}

/// Hyper-parameters of a llama-family model.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub context_length: usize,
    /// One description per layer.
    pub layers: Vec<LayerAttn>,
    /// Scale of Q·K (`1/sqrt(head_dim)`; Gemma 3 27B `1/sqrt(hidden/heads)`).
    pub attn_scale: f32,
    /// Embeddings multiplied by this (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f32>,
    pub ffn_act: FfnAct,
    /// Final logits soft-capped to `cap * tanh(x / cap)` (`final_logit_softcapping`).
    pub logit_softcap: Option<f32>,
}

impl LlamaConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        let arch_s = f
            .meta_str("general.architecture")
            .ok_or_else(|| ModelError::MissingMetadata("general.architecture".into()))?;
        let architecture = Architecture::parse(arch_s)?;
        let a = arch_s;
        let req = |k: &str| -> Result<usize, ModelError> {
            let key = format!("{a}.{k}");
            f.meta_u64(&key)
                .map(|v| v as usize)
                .ok_or(ModelError::MissingMetadata(key))
        };
        let n_layers = req("block_count")?;
        let hidden = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = f
            .meta_u64(&format!("{a}.attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        let ffn = req("feed_forward_length")?;
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "bad head counts: {n_heads} heads, {n_kv_heads} kv heads"
            )));
        }
        let head_dim = f
            .meta_u64(&format!("{a}.attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads);
        let rms_eps = f
            .meta_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5);
        let rope_theta = f
            .meta_f32(&format!("{a}.rope.freq_base"))
            .unwrap_or(10_000.0);
        let rope_dim = f
            .meta_u64(&format!("{a}.rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "bad rope dimension {rope_dim} for head dim {head_dim}"
            )));
        }
        let context_length = f
            .meta_u64(&format!("{a}.context_length"))
            .map(|v| v as usize)
            .unwrap_or(2048);
        let vocab_size = match f.meta_u64(&format!("{a}.vocab_size")) {
            Some(v) => v as usize,
            None => f
                .meta_array("tokenizer.ggml.tokens")
                .map(|t| t.len())
                .ok_or_else(|| ModelError::MissingMetadata(format!("{a}.vocab_size")))?,
        };
        let rope_style = match architecture {
            Architecture::Llama => RopeStyle::Normal,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Gemma3 => RopeStyle::Neox,
        };
        let rope_scale = match f.meta_str(&format!("{a}.rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = f
                    .meta_f32(&format!("{a}.rope.scaling.factor"))
                    .unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(ModelError::Config(format!(
                        "{a}.rope.scaling.factor {factor} is not positive"
                    )));
                }
                1.0 / factor
            }
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "{a}.rope.scaling.type '{other}' is not supported (supported: none, linear)"
                )))
            }
        };
        let global = LayerAttn {
            kind: AttnKind::Full,
            rope_base: rope_theta,
            rope_scale,
        };
        let mut layers = vec![global; n_layers.min(MAX_LAYERS)];
        let mut attn_scale = 1.0 / (head_dim as f32).sqrt();
        let mut embed_scale = None;
        let mut ffn_act = FfnAct::SwiGlu;
        let mut logit_softcap = None;
        if architecture == Architecture::Gemma3 {
            gemma3_layers(f, &mut layers)?;
            // llama.cpp (after gemma_pytorch's config): query_pre_attn_scalar is
            // hidden/heads for the 27B (62 layers), head_dim otherwise.
            if n_layers == 62 {
                attn_scale = 1.0 / ((hidden / n_heads) as f32).sqrt();
            }
            embed_scale = Some((hidden as f32).sqrt());
            ffn_act = FfnAct::GeGlu;
            logit_softcap = f
                .meta_f32(&format!("{a}.final_logit_softcapping"))
                .filter(|&c| c > 0.0);
        }
        // Dimensions no model has mean a crafted or broken file; within these, every size
        // computed from them (weights, KV bytes per token) fits in 64 bits.
        for (key, v, max) in [
            ("block_count", n_layers, MAX_LAYERS),
            ("embedding_length", hidden, MAX_WIDTH),
            ("attention.head_count", n_heads, MAX_HEADS),
            ("attention.head_count_kv", n_kv_heads, MAX_HEADS),
            ("attention.key_length", head_dim, MAX_HEAD_DIM),
            ("feed_forward_length", ffn, MAX_WIDTH),
            ("vocab_size", vocab_size, MAX_VOCAB),
            ("context_length", context_length, MAX_CONTEXT),
        ] {
            if v > max || (v == 0 && key != "block_count") {
                return Err(ModelError::Config(format!(
                    "{a}.{key} = {v} is outside 1..={max}"
                )));
            }
        }
        Ok(LlamaConfig {
            architecture,
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab_size,
            rms_eps,
            rope_theta,
            rope_dim,
            rope_style,
            context_length,
            layers,
            attn_scale,
            embed_scale,
            ffn_act,
            logit_softcap,
        })
    }

    /// Bytes of K+V for one token over all layers.
    pub fn kv_bytes_per_token(&self, kv_dtype: KvDtype) -> u64 {
        [
            self.n_layers as u64,
            self.n_kv_heads as u64,
            self.head_dim as u64,
            kv_dtype.elem_bytes() as u64,
        ]
        .iter()
        .fold(2u64, |a, &b| a.saturating_mul(b))
    }

    /// How many KV blocks of `block_size` tokens fit in `bytes`.
    pub fn num_blocks_for_memory(&self, bytes: u64, block_size: usize, kv_dtype: KvDtype) -> usize {
        let per_block = self
            .kv_bytes_per_token(kv_dtype)
            .saturating_mul(block_size.max(1) as u64);
        (bytes / per_block.max(1)) as usize
    }
}

/// Gemma 3's layer pattern (as llama.cpp's `load_swa_pattern(ml, 6)`): with a positive
/// `attention.sliding_window` W, layer `il` is local (window W, RoPE base
/// `rope.freq_base_swa`, 10,000 when absent, no scaling) unless it is the last of each run of
/// `attention.sliding_window_pattern` layers (6 when absent: layers 5, 11, 17, ... are
/// global); an array of booleans in that key names the local layers itself.
fn gemma3_layers(f: &GgufFile, layers: &mut [LayerAttn]) -> Result<(), ModelError> {
    let a = "gemma3";
    let window = f
        .meta_u64(&format!("{a}.attention.sliding_window"))
        .unwrap_or(0) as usize;
    if window == 0 {
        return Ok(());
    }
    let local = LayerAttn {
        kind: AttnKind::Sliding(window),
        rope_base: f
            .meta_f32(&format!("{a}.rope.freq_base_swa"))
            .unwrap_or(10_000.0),
        rope_scale: 1.0,
    };
    let key = format!("{a}.attention.sliding_window_pattern");
    if let Some(arr) = f.meta_array(&key) {
        if arr.len() < layers.len() {
            return Err(ModelError::Config(format!(
                "{key} names {} layers, the model has {}",
                arr.len(),
                layers.len()
            )));
        }
        for (l, v) in layers.iter_mut().zip(arr) {
            if header::integer(v).is_some_and(|x| x != 0) {
                *l = local;
            }
        }
        return Ok(());
    }
    let n = f.meta_u64(&key).unwrap_or(6) as usize;
    for (il, l) in layers.iter_mut().enumerate() {
        if n == 0 || il % n < n - 1 {
            *l = local;
        }
    }
    Ok(())
}

/// A dense f32 vector tensor (norm weights, biases).
fn load_vec(f: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let (dims, dt, bytes) = f.tensor_raw(name)?;
    let n: usize = dims.iter().product();
    if n != len {
        return Err(ModelError::BadShape {
            name: name.to_string(),
            got: dims,
            expected: vec![len],
        });
    }
    match dt {
        WeightType::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        WeightType::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        _ => {
            let m = load_matrix(f, name, &[1, len])?;
            let mut out = vec![0.0; len];
            m.dequantize_row(0, &mut out);
            Ok(out)
        }
    }
}

/// A matrix `[rows][cols]` (`rows` outputs, `cols` inputs). `expected` may give `[rows, cols]`.
fn load_matrix(f: &GgufFile, name: &str, expected: &[usize]) -> Result<QMatrix, ModelError> {
    let (dims, dt, bytes) = f.tensor_raw(name)?;
    let (rows, cols) = match dims.as_slice() {
        [c] => (1, *c),
        [r, c] => (*r, *c),
        _ => {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                got: dims,
                expected: expected.to_vec(),
            })
        }
    };
    if expected != [rows, cols] {
        return Err(ModelError::BadShape {
            name: name.to_string(),
            got: dims,
            expected: expected.to_vec(),
        });
    }
    QMatrix::from_gguf_bytes(dt, rows, cols, bytes)
        .map_err(|e| ModelError::Kernel(format!("{name}: {e}")))
}

/// Several matrices with the same input width stacked along their rows into one `QMatrix` when
/// they share a type (one matmul instead of several); separate otherwise.
pub enum Fused {
    One(QMatrix),
    Many(Vec<QMatrix>),
}

impl Fused {
    fn load(f: &GgufFile, names: &[&str], rows: &[usize], cols: usize) -> Result<Self, ModelError> {
        let mut parts = Vec::with_capacity(names.len());
        for (name, &r) in names.iter().zip(rows) {
            let (dims, dt, bytes) = f.tensor_raw(name)?;
            if dims != [r, cols] {
                return Err(ModelError::BadShape {
                    name: name.to_string(),
                    got: dims,
                    expected: vec![r, cols],
                });
            }
            parts.push((name, dt, bytes, r));
        }
        let same = parts.iter().all(|p| p.1 == parts[0].1);
        if same {
            let wt = parts[0].1;
            let total: usize = rows.iter().sum();
            let mut buf = Vec::with_capacity(parts.iter().map(|p| p.2.len()).sum());
            for p in &parts {
                buf.extend_from_slice(p.2);
            }
            let m = QMatrix::from_gguf_bytes(wt, total, cols, &buf)
                .map_err(|e| ModelError::Kernel(format!("{}: {e}", names.join("+"))))?;
            Ok(Fused::One(m))
        } else {
            let mut v = Vec::new();
            for p in parts {
                v.push(
                    QMatrix::from_gguf_bytes(p.1, p.3, cols, p.2)
                        .map_err(|e| ModelError::Kernel(format!("{}: {e}", p.0)))?,
                );
            }
            Ok(Fused::Many(v))
        }
    }
}

/// One transformer block.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Q, K, V stacked: rows `n_heads*hd + 2*n_kv_heads*hd`.
    pub qkv: Fused,
    /// Bias of the stacked QKV output (qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMS norms of Q and K (qwen3, gemma3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: QMatrix,
    /// Norm of the attention output before the residual add (gemma3).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Norm of the feed-forward output before the residual add (gemma3).
    pub post_ffn_norm: Option<Vec<f32>>,
    /// Gate and up stacked: rows `2*ffn`.
    pub gate_up: Fused,
    pub down: QMatrix,
}

/// All weights of a llama-family model.
pub struct LlamaWeights {
    pub config: LlamaConfig,
    /// `[vocab][hidden]`.
    pub tok_embd: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// `None`: tied to `tok_embd`.
    pub output: Option<QMatrix>,
    /// Llama-3 style per-frequency divisors (`rope_freqs.weight`).
    pub rope_freqs: Option<Vec<f32>>,
}

impl LlamaWeights {
    pub fn load(f: &GgufFile, progress: bool) -> Result<Self, ModelError> {
        let c = LlamaConfig::from_gguf(f)?;
        let (h, hd, nh, nkv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads);
        let qd = nh * hd;
        let kvd = nkv * hd;
        let bar = progress_bar(progress, c.n_layers as u64 + 2);
        bar.set_message(format!("loading {}", f.path().display()));
        let tok_embd = load_matrix(f, "token_embd.weight", &[c.vocab_size, h])?;
        bar.inc(1);
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let qkv = Fused::load(
                f,
                &[
                    &n("attn_q.weight"),
                    &n("attn_k.weight"),
                    &n("attn_v.weight"),
                ],
                &[qd, kvd, kvd],
                h,
            )?;
            let qkv_bias = if f.has_tensor(&n("attn_q.bias")) {
                let mut b = load_vec(f, &n("attn_q.bias"), qd)?;
                b.extend(load_vec(f, &n("attn_k.bias"), kvd)?);
                b.extend(load_vec(f, &n("attn_v.bias"), kvd)?);
                Some(b)
            } else {
                None
            };
            let (q_norm, k_norm) = if f.has_tensor(&n("attn_q_norm.weight")) {
                (
                    Some(load_vec(f, &n("attn_q_norm.weight"), hd)?),
                    Some(load_vec(f, &n("attn_k_norm.weight"), hd)?),
                )
            } else {
                (None, None)
            };
            // Gemma 3 requires both post-norms; other families have none.
            let post = |name: &str| -> Result<Option<Vec<f32>>, ModelError> {
                if c.architecture == Architecture::Gemma3 {
                    load_vec(f, &n(name), h).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: load_vec(f, &n("attn_norm.weight"), h)?,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                wo: load_matrix(f, &n("attn_output.weight"), &[h, qd])?,
                post_attn_norm: post("post_attention_norm.weight")?,
                ffn_norm: load_vec(f, &n("ffn_norm.weight"), h)?,
                post_ffn_norm: post("post_ffw_norm.weight")?,
                gate_up: Fused::load(
                    f,
                    &[&n("ffn_gate.weight"), &n("ffn_up.weight")],
                    &[c.ffn, c.ffn],
                    h,
                )?,
                down: load_matrix(f, &n("ffn_down.weight"), &[h, c.ffn])?,
            });
            bar.inc(1);
        }
        let output_norm = load_vec(f, "output_norm.weight", h)?;
        let output = if f.has_tensor("output.weight") {
            Some(load_matrix(f, "output.weight", &[c.vocab_size, h])?)
        } else {
            None
        };
        let rope_freqs = if f.has_tensor("rope_freqs.weight") {
            Some(load_vec(f, "rope_freqs.weight", c.rope_dim / 2)?)
        } else {
            None
        };
        bar.inc(1);
        bar.finish_and_clear();
        Ok(LlamaWeights {
            config: c,
            tok_embd,
            layers,
            output_norm,
            output,
            rope_freqs,
        })
    }

    /// Replaces every quantized matrix by its exact f32 dequantization: the matmuls then run
    /// in f32 without activation quantization (slower, more memory; an accuracy reference).
    pub fn dequantize_all(&mut self) -> Result<(), ModelError> {
        fn deq(q: &mut QMatrix) -> Result<(), ModelError> {
            if q.weight_type() == WeightType::F32 {
                return Ok(());
            }
            let (rows, cols) = (q.rows(), q.cols());
            let mut bytes = Vec::with_capacity(rows * cols * 4);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                q.dequantize_row(r, &mut row);
                for v in &row {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
            *q = QMatrix::from_gguf_bytes(WeightType::F32, rows, cols, &bytes)
                .map_err(|e| ModelError::Kernel(e.to_string()))?;
            Ok(())
        }
        fn deq_fused(f: &mut Fused) -> Result<(), ModelError> {
            match f {
                Fused::One(q) => deq(q),
                Fused::Many(v) => v.iter_mut().try_for_each(deq),
            }
        }
        deq(&mut self.tok_embd)?;
        if let Some(o) = &mut self.output {
            deq(o)?;
        }
        for l in &mut self.layers {
            deq_fused(&mut l.qkv)?;
            deq(&mut l.wo)?;
            deq_fused(&mut l.gate_up)?;
            deq(&mut l.down)?;
        }
        Ok(())
    }

    /// The lm_head: `output.weight`, or the tied embedding.
    pub fn lm_head(&self) -> &QMatrix {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }
}

fn progress_bar(enabled: bool, len: u64) -> indicatif::ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(len),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
