//! External KV tiers (skeleton).
