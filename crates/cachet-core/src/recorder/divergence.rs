//! Divergence points: where a request's prompt first differs from a cached block under the same
//! parent, with the token ids around it held inline.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::TokenId;

/// Tokens shown on each side of a divergence point.
pub const DIVERGENCE_CONTEXT: usize = 8;

/// Where a request's prompt first differs from the most recently used cached block under the
/// same parent (same `cache_salt`: other tenants' blocks are invisible), with a few token ids
/// around it. Its tokens are held inline (no allocation on the admission that finds it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Divergence {
    /// Prompt position of the first differing token.
    pub at: u64,
    /// Up to [`DIVERGENCE_CONTEXT`] prompt tokens before `at` (the same in both).
    pub before: ContextTokens,
    /// The prompt's tokens from `at` (within the block).
    pub ours: ContextTokens,
    /// The cached block's tokens from the same position.
    pub theirs: ContextTokens,
    /// The request that created the cached block.
    pub cached_by: Option<Arc<str>>,
}

/// Up to [`DIVERGENCE_CONTEXT`] token ids held inline; reads as a slice (`Deref`), prints,
/// serializes and compares as a list of ids.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextTokens {
    len: u8,
    ids: [TokenId; DIVERGENCE_CONTEXT],
}

impl ContextTokens {
    /// The first [`DIVERGENCE_CONTEXT`] of `ids` (the rest are not kept).
    pub fn new(ids: &[TokenId]) -> Self {
        let n = ids.len().min(DIVERGENCE_CONTEXT);
        let mut t = ContextTokens {
            len: n as u8,
            ids: [0; DIVERGENCE_CONTEXT],
        };
        t.ids[..n].copy_from_slice(&ids[..n]);
        t
    }
}

impl std::ops::Deref for ContextTokens {
    type Target = [TokenId];
    fn deref(&self) -> &[TokenId] {
        &self.ids[..self.len as usize]
    }
}

impl std::fmt::Debug for ContextTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq<Vec<TokenId>> for ContextTokens {
    fn eq(&self, other: &Vec<TokenId>) -> bool {
        **self == **other
    }
}

impl PartialEq<[TokenId]> for ContextTokens {
    fn eq(&self, other: &[TokenId]) -> bool {
        **self == *other
    }
}

impl Serialize for ContextTokens {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for ContextTokens {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Vec::<TokenId>::deserialize(d)?;
        if v.len() > DIVERGENCE_CONTEXT {
            return Err(serde::de::Error::invalid_length(
                v.len(),
                &"at most DIVERGENCE_CONTEXT token ids",
            ));
        }
        Ok(ContextTokens::new(&v))
    }
}
