//! Constrained decoding for cachet: grammars (JSON schema, Lark, regex) compiled by
//! [`llguidance`] against a token trie built from cachet's own tokenizer, and run as a
//! [`TokenConstraint`] the executor's sampler consults.
//!
//! * [`GrammarCompiler::new`] builds the trie once per tokenizer from
//!   [`TextTokenizer::token_bytes`] and [`TextTokenizer::is_special`] (control tokens are
//!   marked as toktrie's special tokens, so no grammar produces them by their text) and the
//!   parser factory with llguidance's general slices (which make full masks cheap).
//! * [`GrammarCompiler::compile`] turns a [`Grammar`] into a [`GrammarConstraint`]: one
//!   request's matcher. A schema feature llguidance does not implement is a
//!   [`GrammarError::Unsupported`] naming it; any other compile failure is
//!   [`GrammarError::Invalid`].
//! * The sampler protocol ([`TokenConstraint`]): sample, ask `allows(token)` (a cheap check of
//!   one token); only when it is refused compute the full mask with `fill_mask` and sample again
//!   from the masked distribution; then `accept(token)`.
//!
//! Every EOS token of the model counts as the grammar's end: when the grammar is complete the
//! mask allows each of them, and after it stopped nothing else.
//!
//! JSON is generated compactly: `", "` between items, `": "` between a key and its value, and no
//! other whitespace (a flexible-whitespace grammar lets a small model write newlines forever).
//! A schema may override this with llguidance's own `x-guidance` options.

use std::sync::{Arc, Mutex};

use cachet_core::request::{Constraint, TokenConstraint};
use cachet_core::TokenId;
use cachet_text::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use thiserror::Error;
use toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a grammar is written in.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON schema (`{}` or `{"type": "object"}` for any object).
    JsonSchema(Value),
    /// llguidance's Lark dialect (may embed JSON schemas with `%json { ... }`).
    Lark(String),
    /// A regular expression the whole output must match.
    Regex(String),
}

/// Why a grammar could not be compiled.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GrammarError {
    /// The schema uses something llguidance does not implement (`feature` names it, e.g. the
    /// keys it does not know).
    #[error("unsupported JSON schema feature: {feature}")]
    Unsupported { feature: String },
    /// The grammar is malformed or cannot be satisfied.
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The tokenizer could not be turned into a token trie.
    #[error("cannot build the token trie: {0}")]
    Tokenizer(String),
}

/// The compact JSON layout every schema compiles to unless it says otherwise.
pub fn compact_json_options() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// `schema` with [`compact_json_options`] as its `x-guidance` (kept if it has one) and its
/// declared objects closed ([`close_objects`]). A schema that is not an object (`true`)
/// becomes `{}` (anything).
pub fn with_compact_layout(schema: &Value) -> Value {
    let mut s = match schema {
        Value::Object(_) => schema.clone(),
        _ => json!({}),
    };
    close_objects(&mut s);
    if let Value::Object(m) = &mut s {
        m.entry("x-guidance").or_insert_with(compact_json_options);
    }
    s
}

/// Closes every object `schema` declares: one with `properties` that says nothing of
/// `additionalProperties` (or `unevaluatedProperties`) gets `"additionalProperties": false`,
/// so a generated object has only the keys the schema names, as vLLM's default grammar
/// backend (xgrammar's strict mode) generates them; a tool's arguments then never carry a
/// key its function does not take. An object that declares no properties
/// (`{"type": "object"}`) stays open, and so does anything under `allOf` (closing each part
/// would refuse the keys of the others). Walks properties, items, the combinators but
/// `allOf`, and definitions.
pub fn close_objects(schema: &mut Value) {
    let Value::Object(m) = schema else {
        return;
    };
    if m.contains_key("properties")
        && !m.contains_key("additionalProperties")
        && !m.contains_key("unevaluatedProperties")
    {
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "patternProperties", "$defs", "definitions"] {
        if let Some(Value::Object(children)) = m.get_mut(key) {
            children.values_mut().for_each(close_objects);
        }
    }
    for key in ["items", "additionalProperties", "not", "if", "then", "else"] {
        if let Some(child) = m.get_mut(key) {
            match child {
                Value::Array(v) => v.iter_mut().for_each(close_objects),
                v => close_objects(v),
            }
        }
    }
    for key in ["prefixItems", "anyOf", "oneOf"] {
        if let Some(Value::Array(v)) = m.get_mut(key) {
            v.iter_mut().for_each(close_objects);
        }
    }
}

struct Env {
    trie: TokTrie,
    tok: Arc<dyn TextTokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tok
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Grammars for one tokenizer: the token trie and llguidance's parser factory, built once and
/// shared by every request.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    eos: Arc<[TokenId]>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tok` (every id below `vocab_size`; control tokens marked
    /// special) and the parser factory. Costs about a second of CPU for a 150k vocabulary;
    /// done once per model.
    pub fn new(tok: Arc<dyn TextTokenizer>) -> Result<Self, GrammarError> {
        let vocab_size = tok.vocab_size();
        let eos: Arc<[TokenId]> = tok.eos_token_ids().into();
        let Some(&tok_eos) = eos.first() else {
            return Err(GrammarError::Tokenizer(
                "the tokenizer has no EOS token".into(),
            ));
        };
        let n = u32::try_from(vocab_size)
            .map_err(|_| GrammarError::Tokenizer(format!("vocabulary of {vocab_size}")))?;
        let words: Vec<Vec<u8>> = (0..n)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                if tok.is_special(id) {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&bytes);
                    w
                } else {
                    bytes
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n, tok_eos);
        info.tok_bos = tok.bos_token_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            eos,
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// One request's constraint for `grammar`.
    pub fn compile(&self, grammar: &Grammar) -> Result<GrammarConstraint, GrammarError> {
        let top = match grammar {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_compact_layout(s)),
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| classify(&format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(classify(&e));
        }
        Ok(GrammarConstraint {
            matcher: Mutex::new(matcher),
            eos: Arc::clone(&self.eos),
            vocab_size: self.vocab_size,
        })
    }
}

/// llguidance's words to a typed error: its "Unimplemented keys: [..]" (and friends) name the
/// feature.
fn classify(msg: &str) -> GrammarError {
    const MARKERS: &[&str] = &[
        "Unimplemented keys",
        "not supported",
        "Unsupported",
        "unsupported",
    ];
    if MARKERS.iter().any(|m| msg.contains(m)) {
        let feature = msg
            .lines()
            .find(|l| MARKERS.iter().any(|m| l.contains(m)))
            .unwrap_or(msg)
            .trim()
            .to_string();
        return GrammarError::Unsupported { feature };
    }
    GrammarError::Invalid(msg.lines().next().unwrap_or(msg).trim().to_string())
}

/// One request's grammar state (see the crate documentation for the protocol).
pub struct GrammarConstraint {
    matcher: Mutex<Matcher>,
    eos: Arc<[TokenId]>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl GrammarConstraint {
    fn is_eos(&self, t: TokenId) -> bool {
        self.eos.contains(&t)
    }

    /// The grammar's own EOS (the first of the model's).
    fn canonical(&self, t: TokenId) -> TokenId {
        if self.is_eos(t) {
            self.eos[0]
        } else {
            t
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Matcher> {
        // A panic while holding the lock leaves a matcher that is still memory-safe to use;
        // its error state (if any) then ends the request.
        self.matcher.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the output so far is a complete sentence of the grammar (EOS is allowed now).
    pub fn is_accepting(&self) -> bool {
        let mut m = self.lock();
        m.is_stopped() || m.is_accepting().unwrap_or(false)
    }

    /// The matcher's error, if it is in one (a refused token was accepted, or a limit hit).
    pub fn error(&self) -> Option<String> {
        self.lock().get_error()
    }

    fn eos_mask(&self, mask: &mut Vec<u32>) {
        mask.clear();
        mask.resize(self.vocab_size.div_ceil(32), 0);
        for &t in self.eos.iter() {
            if let Some(w) = mask.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
    }
}

impl TokenConstraint for GrammarConstraint {
    fn allows(&self, token: TokenId) -> bool {
        let mut m = self.lock();
        if m.is_stopped() {
            return self.is_eos(token);
        }
        let t = self.canonical(token);
        matches!(m.validate_tokens(&[t]), Ok(1))
    }

    fn fill_mask(&self, mask: &mut Vec<u32>) {
        let mut m = self.lock();
        if m.is_stopped() {
            drop(m);
            return self.eos_mask(mask);
        }
        match m.compute_mask() {
            Ok(v) => {
                mask.clear();
                mask.extend_from_slice(v.as_slice());
                mask.resize(self.vocab_size.div_ceil(32), 0);
                let e0 = self.eos[0];
                if v.is_allowed(e0) {
                    for &t in self.eos.iter() {
                        if let Some(w) = mask.get_mut(t as usize / 32) {
                            *w |= 1 << (t % 32);
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "grammar mask failed: only EOS allowed");
                drop(m);
                self.eos_mask(mask);
            }
        }
    }

    fn accept(&self, token: TokenId) {
        let mut m = self.lock();
        if m.is_stopped() {
            return;
        }
        let t = self.canonical(token);
        if let Err(e) = m.consume_token(t) {
            tracing::debug!(error = %e, token, "grammar refused an accepted token");
        }
    }

    fn fork(&self) -> Constraint {
        Constraint::new(GrammarConstraint {
            matcher: Mutex::new(self.lock().deep_clone()),
            eos: Arc::clone(&self.eos),
            vocab_size: self.vocab_size,
        })
    }
}

/// Whether bit `t` of a [`TokenConstraint::fill_mask`] bitset is set.
#[inline]
pub fn mask_allows(mask: &[u32], t: TokenId) -> bool {
    mask.get(t as usize / 32)
        .is_some_and(|w| w & (1 << (t % 32)) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachet_text::ByteTokenizer;

    fn compiler() -> GrammarCompiler {
        GrammarCompiler::new(Arc::new(ByteTokenizer)).unwrap()
    }

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes()
            .map(|b| b as u32 + ByteTokenizer::OFFSET)
            .collect()
    }

    /// Feeds `text` byte by byte; returns how many bytes were allowed before the first refusal.
    fn feed(c: &GrammarConstraint, text: &str) -> usize {
        for (i, t) in bytes(text).into_iter().enumerate() {
            if !c.allows(t) {
                return i;
            }
            c.accept(t);
        }
        text.len()
    }

    #[test]
    fn a_schema_admits_exactly_its_compact_json() {
        let g = compiler();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": false});
        let c = g.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
        let good = r#"{"a": 12, "b": "x"}"#;
        assert_eq!(feed(&c, good), good.len());
        assert!(c.is_accepting());
        assert!(c.allows(ByteTokenizer::EOS));
        // Once complete, the mask is EOS only.
        let mut mask = Vec::new();
        c.fill_mask(&mut mask);
        let allowed: Vec<u32> = (0..ByteTokenizer::VOCAB_SIZE as u32)
            .filter(|&t| mask_allows(&mask, t))
            .collect();
        assert_eq!(allowed, vec![ByteTokenizer::EOS]);

        // Wrong key order, a missing space, a string for the integer: refused where they start.
        let c = g.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
        assert_eq!(feed(&c, r#"{"b": "x"}"#), 2, "`a` comes first");
        let c = g.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
        assert_eq!(feed(&c, r#"{"a":1}"#), 5, "a space after the colon");
        let c = g.compile(&Grammar::JsonSchema(schema)).unwrap();
        assert_eq!(feed(&c, r#"{"a": "1"}"#), 6);
        assert!(!c.is_accepting());
    }

    #[test]
    fn declared_objects_are_closed_and_free_ones_stay_open() {
        let g = compiler();
        let ok = |schema: Value, text: &str| {
            let c = g.compile(&Grammar::JsonSchema(schema)).unwrap();
            feed(&c, text) == text.len() && c.is_accepting()
        };
        let city = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        assert!(ok(city.clone(), r#"{"city": "Rome"}"#));
        assert!(
            !ok(city, r#"{"city": "Rome", "metres": 9}"#),
            "an undeclared key"
        );
        // Said open stays open; an object declaring nothing is free.
        let open = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": true});
        assert!(ok(open, r#"{"city": "Rome", "metres": 9}"#));
        let free = json!({"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]});
        assert!(ok(free.clone(), r#"{"meta": {"any": 1}}"#));
        assert!(!ok(free, r#"{"meta": {}, "x": 1}"#));
        // Nested: in properties, in array items, in anyOf.
        let nested = json!({"type": "object", "properties": {"list": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "integer"}]}}}, "required": ["list"]});
        assert!(ok(nested.clone(), r#"{"list": [{"a": 1}, 2]}"#));
        assert!(!ok(nested, r#"{"list": [{"a": 1, "b": 2}]}"#));
        // allOf parts are left as they are (closing each would refuse the other's keys).
        let all = json!({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]});
        let mut closed = all.clone();
        close_objects(&mut closed);
        assert_eq!(closed, all);
    }

    #[test]
    fn a_fork_goes_on_from_the_same_state_on_its_own() {
        let g = compiler();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
        let c = g.compile(&Grammar::JsonSchema(schema)).unwrap();
        assert_eq!(feed(&c, r#"{"a": "#), 6);
        let f = c.fork();
        // The original goes on with a number and ends; the fork is still after `{"a": `.
        assert_eq!(feed(&c, "12}"), 3);
        assert!(c.is_accepting());
        let digit = bytes("7")[0];
        assert!(f.allows(digit) && !f.allows(bytes("}")[0]));
        f.accept(digit);
        assert!(f.allows(bytes("}")[0]));
        f.accept(bytes("}")[0]);
        assert!(f.allows(ByteTokenizer::EOS));
        // Neither moved the other: the original still allows only EOS.
        assert!(!c.allows(digit) && c.allows(ByteTokenizer::EOS));
    }

    #[test]
    fn the_mask_agrees_with_allows_on_every_token() {
        let g = compiler();
        let c = g
            .compile(&Grammar::JsonSchema(json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
            .unwrap();
        let mut mask = Vec::new();
        for prefix_len in 0..7 {
            let text = r#"{"n": 42}"#;
            if prefix_len > 0 {
                c.accept(bytes(&text[prefix_len - 1..prefix_len])[0]);
            }
            c.fill_mask(&mut mask);
            assert_eq!(mask.len(), ByteTokenizer::VOCAB_SIZE.div_ceil(32));
            for t in 0..ByteTokenizer::VOCAB_SIZE as u32 {
                assert_eq!(
                    mask_allows(&mask, t),
                    c.allows(t),
                    "token {t} after {prefix_len}"
                );
            }
        }
        // After `{"n": ` only digits and `-` start a number.
        let c = g
            .compile(&Grammar::JsonSchema(json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
            .unwrap();
        feed(&c, r#"{"n": "#);
        c.fill_mask(&mut mask);
        let allowed: String = (0..ByteTokenizer::VOCAB_SIZE as u32)
            .filter(|&t| mask_allows(&mask, t))
            .map(|t| (t - ByteTokenizer::OFFSET) as u8 as char)
            .collect();
        assert_eq!(allowed, "-0123456789");
    }

    #[test]
    fn lark_with_embedded_json_and_regex() {
        let g = compiler();
        let lark = r#"start: "<tool_call>" %json {"type": "object", "properties": {"name": {"const": "f"}}, "required": ["name"], "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}} "</tool_call>""#;
        let c = g.compile(&Grammar::Lark(lark.into())).unwrap();
        let good = r#"<tool_call>{"name": "f"}</tool_call>"#;
        assert_eq!(feed(&c, good), good.len());
        assert!(c.is_accepting());
        let c = g.compile(&Grammar::Regex("ab+c".into())).unwrap();
        assert_eq!(feed(&c, "abbbc"), 5);
        assert!(c.is_accepting());
        let c = g.compile(&Grammar::Regex("ab+c".into())).unwrap();
        assert_eq!(feed(&c, "ac"), 1);
    }

    #[test]
    fn unsupported_features_are_named_and_bad_grammars_are_invalid() {
        let g = compiler();
        let e = g
            .compile(&Grammar::JsonSchema(
                json!({"type": "object", "if": {"properties": {}}}),
            ))
            .unwrap_err();
        match e {
            GrammarError::Unsupported { feature } => assert!(feature.contains("if"), "{feature}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            g.compile(&Grammar::Lark("start: missing_rule".into())),
            Err(GrammarError::Invalid(_))
        ));
        assert!(g
            .compile(&Grammar::JsonSchema(json!({"type": "frobnicate"})))
            .is_err());
    }

    #[test]
    fn an_accepted_refused_token_leaves_only_eos() {
        let g = compiler();
        let c = g.compile(&Grammar::Regex("a".into())).unwrap();
        c.accept(bytes("z")[0]);
        assert!(c.error().is_some());
        let mut mask = Vec::new();
        c.fill_mask(&mut mask);
        assert!(mask_allows(&mask, ByteTokenizer::EOS));
        assert!(!mask_allows(&mask, bytes("a")[0]));
    }
}
