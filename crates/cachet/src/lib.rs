//! Wiring for the `cachet` binary: engine flags, building an engine over the simulated or the
//! real model, and the `generate` command. `main.rs` only parses and dispatches.

pub mod args;
pub mod generate;
pub mod wiring;
