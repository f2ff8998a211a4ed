//! Text work whose cost grows with the request, kept off the async runtime's worker threads.
//!
//! Tokenizing a 15 MB prompt takes about 23 s on one core; two such requests used to hold both
//! of the server's runtime threads, and `/health` (and every other connection) waited the whole
//! time. [`OffRuntime`] wraps the server's tokenizer: a call on a large input (encode of more
//! than [`INLINE_TEXT_BYTES`], decode of more than [`INLINE_IDS`] ids, a chat of more than
//! [`INLINE_TEXT_BYTES`] of content) runs in `tokio::task::block_in_place`, which hands the
//! worker's other tasks to another thread first, and at most [`heavy_permits`] such calls run
//! at once (the others wait, blocking only their own request). Small inputs, the common case,
//! run inline as before. The per-token work of a running request (incremental detokenizing,
//! stop matching) is bounded by construction in `cachet-text` and stays inline.

use std::sync::{Arc, Condvar, Mutex};

use cachet_text::{ChatMessage, ChatRequest, TemplateCaps, TextTokenizer, TokenizerError};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Largest text (bytes) tokenized or rendered on the runtime thread.
pub const INLINE_TEXT_BYTES: usize = 32 * 1024;
/// Most ids detokenized on the runtime thread in one call.
pub const INLINE_IDS: usize = 8 * 1024;

/// How many large text calls run at once: all cores but one (at least one), so a flood of
/// large prompts leaves a core to the engine and the small requests.
pub fn heavy_permits() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get().saturating_sub(1))
        .max(1)
}

/// A counting semaphore for blocking threads.
struct Gate {
    free: Mutex<usize>,
    cv: Condvar,
}

struct Permit<'a>(&'a Gate);

impl Gate {
    fn new(n: usize) -> Self {
        Gate {
            free: Mutex::new(n.max(1)),
            cv: Condvar::new(),
        }
    }

    fn enter(&self) -> Permit<'_> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.cv.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
        Permit(self)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut free = self.0.free.lock().unwrap_or_else(|p| p.into_inner());
        *free += 1;
        self.0.cv.notify_one();
    }
}

/// The server's tokenizer with large calls moved off the runtime's worker threads.
pub struct OffRuntime {
    inner: Arc<dyn TextTokenizer>,
    gate: Gate,
}

impl OffRuntime {
    pub fn new(inner: Arc<dyn TextTokenizer>, permits: usize) -> Self {
        OffRuntime {
            inner,
            gate: Gate::new(permits),
        }
    }

    fn run<R>(&self, large: bool, f: impl FnOnce(&dyn TextTokenizer) -> R) -> R {
        if !large {
            return f(&*self.inner);
        }
        let gated = || {
            let _permit = self.gate.enter();
            f(&*self.inner)
        };
        match Handle::try_current() {
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(gated)
            }
            _ => gated(),
        }
    }
}

fn chat_bytes(chat: &ChatRequest<'_>) -> usize {
    let messages: usize = chat
        .messages
        .iter()
        .map(|m| {
            m.content.len()
                + m.tool_calls
                    .iter()
                    .map(|c| c.function.name.len() + c.function.arguments.len())
                    .sum::<usize>()
        })
        .sum();
    let tools: usize = chat
        .tools
        .map_or(0, |t| t.iter().map(|v| v.to_string().len()).sum());
    messages + tools
}

impl TextTokenizer for OffRuntime {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.run(text.len() > INLINE_TEXT_BYTES, |t| {
            t.encode(text, add_special_tokens)
        })
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.run(ids.len() > INLINE_IDS, |t| {
            t.decode(ids, skip_special_tokens)
        })
    }

    fn eos_token_ids(&self) -> &[u32] {
        self.inner.eos_token_ids()
    }

    fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id()
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.inner.token_bytes(id)
    }

    fn is_special(&self, id: u32) -> bool {
        self.inner.is_special(id)
    }

    fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, TokenizerError> {
        self.run(chat_bytes(chat) > INLINE_TEXT_BYTES, |t| {
            t.render_chat(chat)
        })
    }

    fn chat_caps(&self) -> TemplateCaps {
        self.inner.chat_caps()
    }

    fn token_to_piece(&self, id: u32) -> Option<String> {
        self.inner.token_to_piece(id)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let bytes: usize = messages.iter().map(|m| m.content.len()).sum();
        self.run(bytes > INLINE_TEXT_BYTES, |t| {
            t.apply_chat_template(messages, add_generation_prompt)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_text::ByteTokenizer;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Counts the calls running at once, and where they ran.
    struct Slow {
        running: AtomicUsize,
        peak: AtomicUsize,
    }

    impl TextTokenizer for Slow {
        fn encode(&self, text: &str, _add: bool) -> Result<Vec<u32>, TokenizerError> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(if text.len() > INLINE_TEXT_BYTES {
                200
            } else {
                0
            }));
            self.running.fetch_sub(1, Ordering::SeqCst);
            Ok(vec![text.len() as u32])
        }
        fn decode(&self, ids: &[u32], skip: bool) -> Result<String, TokenizerError> {
            ByteTokenizer.decode(ids, skip)
        }
        fn eos_token_ids(&self) -> &[u32] {
            &[]
        }
        fn bos_token_id(&self) -> Option<u32> {
            None
        }
        fn vocab_size(&self) -> usize {
            256
        }
        fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
            ByteTokenizer.token_bytes(id)
        }
        fn is_special(&self, _id: u32) -> bool {
            false
        }
        fn render_chat(&self, chat: &ChatRequest<'_>) -> Result<String, TokenizerError> {
            ByteTokenizer.render_chat(chat)
        }
        fn chat_caps(&self) -> TemplateCaps {
            TemplateCaps::default()
        }
    }

    /// Four large encodes at once on a two-thread runtime: one at a time (one permit), and a
    /// timer task on the same runtime keeps ticking meanwhile (the workers stay free).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_calls_leave_the_workers_free_and_are_gated() {
        let slow = Arc::new(Slow {
            running: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        });
        let tok = Arc::new(OffRuntime::new(slow.clone(), 1));
        let big = "x".repeat(INLINE_TEXT_BYTES + 1);
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let (tok, big) = (tok.clone(), big.clone());
            tasks.push(tokio::spawn(
                async move { tok.encode(&big, false).unwrap() },
            ));
        }
        // 4 x 200 ms in sequence: ticks every 10 ms must keep coming.
        let started = std::time::Instant::now();
        let mut worst = Duration::ZERO;
        let mut last = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(600) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            worst = worst.max(last.elapsed());
            last = std::time::Instant::now();
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), vec![(INLINE_TEXT_BYTES + 1) as u32]);
        }
        assert_eq!(
            slow.peak.load(Ordering::SeqCst),
            1,
            "gated to one at a time"
        );
        assert!(
            worst < Duration::from_millis(150),
            "a runtime tick waited {worst:?}"
        );
        // Small calls run inline.
        assert_eq!(tok.encode("small", false).unwrap(), vec![5]);
    }

    #[test]
    fn without_a_multi_thread_runtime_calls_run_inline() {
        let tok = OffRuntime::new(Arc::new(ByteTokenizer), 1);
        let big = "y".repeat(INLINE_TEXT_BYTES + 10);
        assert_eq!(tok.encode(&big, false).unwrap().len(), big.len());
        let hi = tok.encode("hi", false).unwrap();
        assert_eq!(tok.decode(&hi, false).unwrap(), "hi");
        assert_eq!(tok.vocab_size(), ByteTokenizer.vocab_size());
    }
}
