//! The text side of cachet (skeleton; filled in by the text-crate work).
