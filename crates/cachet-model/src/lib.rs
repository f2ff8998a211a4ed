//! Llama-family GGUF models for cachet: loading, a paged-KV executor, the GGUF tokenizer and
//! sampling.
//!
//! * [`load_model`] reads a GGUF file (llama / SmolLM / TinyLlama, qwen2, qwen3) into
//!   [`LoadedModel`]: the weights (as `cachet_kernels::QMatrix`), the [`GgufTokenizer`] and the
//!   [`ModelInfo`] (with a BLAKE3 fingerprint of the file).
//! * [`LlamaExecutor`] implements [`cachet_core::Executor`] over a paged KV arena.
//! * [`sampling`] turns logits into tokens (greedy, temperature, top-k/p, min-p, penalties,
//!   seeded draws that do not depend on the batch).

pub mod error;
pub mod executor;
pub mod gguf;
pub mod gguf_header;
pub mod math;
pub mod sampling;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use cachet_text as text;
pub use cachet_text::ChatMessage;
pub use error::ModelError;
pub use executor::{ExecutorConfig, KvDtype, LlamaExecutor};
pub use gguf::{Architecture, LlamaConfig, LlamaWeights, RopeStyle};
pub use tokenizer::GgufTokenizer;

/// File name of the default model in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf` (`$HOME` taken from the environment).
pub fn default_model_path() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("cachet").join(DEFAULT_MODEL_FILE)
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Worker threads for the executor's kernels (0 = all available cores).
    pub threads: usize,
    /// Show a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Compute the BLAKE3 fingerprint of the whole file (otherwise it hashes metadata and tensor
    /// infos only, which is faster but weaker).
    pub full_fingerprint: bool,
    /// Dequantize all weights to f32 at load time: exact f32 matmuls without int8 activation
    /// quantization (an accuracy reference; about 4 bytes per weight, slower).
    pub dequantize_weights: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            threads: 0,
            progress: true,
            full_fingerprint: true,
            dequantize_weights: false,
        }
    }
}

impl LoadOptions {
    /// The number of threads to use: `threads`, or the available parallelism when 0.
    pub fn effective_threads(&self) -> usize {
        if self.threads > 0 {
            self.threads
        } else {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        }
    }
}

/// What a caller may want to know about a loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// `general.name`, or the file stem.
    pub name: String,
    /// `general.architecture` (`llama`, `qwen2`, `qwen3`).
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// BLAKE3 over the GGUF file.
    pub fingerprint: [u8; 32],
    /// Total bytes of weights as stored in the file.
    pub weight_bytes: u64,
    pub path: PathBuf,
}

impl ModelInfo {
    /// The fingerprint as lowercase hex.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// A loaded GGUF model: weights (shared between executors), tokenizer and info.
#[derive(Clone)]
pub struct LoadedModel {
    pub info: ModelInfo,
    pub weights: Arc<LlamaWeights>,
    pub tokenizer: GgufTokenizer,
    /// The thread count requested in [`LoadOptions`].
    pub threads: usize,
}

impl LoadedModel {
    /// Builds an executor over this model's weights with its own KV arena.
    pub fn executor(&self, config: ExecutorConfig) -> Result<LlamaExecutor, ModelError> {
        let pool = cachet_kernels::ThreadPool::new(self.threads);
        let mut exec =
            LlamaExecutor::new(self.weights.clone(), self.info.fingerprint, config, pool)?;
        exec.set_eos_token_ids(self.tokenizer.eos_token_ids());
        Ok(exec)
    }

    /// How many KV blocks of `block_size` tokens fit in `bytes` with `kv_dtype`.
    pub fn num_blocks_for_memory(&self, bytes: u64, block_size: usize, kv_dtype: KvDtype) -> usize {
        self.weights
            .config
            .num_blocks_for_memory(bytes, block_size, kv_dtype)
    }
}

/// Loads a GGUF model file: weights, tokenizer, info. Never touches the network.
pub fn load_model(
    path: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<LoadedModel, ModelError> {
    let path = path.as_ref();
    let file = gguf::GgufFile::open(path)?;
    // An architecture cachet does not run is the first thing said about the file.
    if let Some(arch) = file.meta_str("general.architecture") {
        gguf::Architecture::parse(arch)?;
    }
    let tokenizer = GgufTokenizer::from_gguf(&file)?;
    let mut weights = LlamaWeights::load(&file, options.progress)?;
    if options.dequantize_weights {
        weights.dequantize_all()?;
    }
    let fingerprint = if options.full_fingerprint {
        file.fingerprint_full()
    } else {
        file.fingerprint_header()
    };
    let c = &weights.config;
    let name = file
        .meta_str("general.name")
        .map(str::to_string)
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
    let info = ModelInfo {
        name,
        architecture: c.architecture.as_str().to_string(),
        context_length: c.context_length,
        vocab_size: c.vocab_size,
        num_layers: c.n_layers,
        hidden_size: c.hidden,
        num_heads: c.n_heads,
        num_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        fingerprint,
        weight_bytes: file.tensor_bytes_total(),
        path: path.to_path_buf(),
    };
    Ok(LoadedModel {
        info,
        weights: Arc::new(weights),
        tokenizer,
        threads: options.effective_threads(),
    })
}
