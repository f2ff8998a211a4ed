//! Drivers: the public entry points. They validate arguments, cut the work into tasks over
//! the [`crate::ThreadPool`], pick the micro-kernel for the active ISA level and assemble
//! the results.

pub mod act;
pub mod attention;
pub(crate) mod grid;
pub(crate) mod matmul;
pub mod probe;
