//! Element-wise activations of the feed-forward block.

use crate::isa;
use crate::micro;

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]` with `silu(x) = x / (1 + e^-x)`, for
/// `i < out.len()`. Relative error against exact arithmetic is below 1e-6 (the vector paths
/// evaluate `e^-|x|` with a degree-6 polynomial).
///
/// Panics if `gate` or `up` is shorter than `out`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() >= out.len() && up.len() >= out.len(),
        "swiglu: inputs shorter than the output"
    );
    micro::swiglu(isa::active(), gate, up, out);
}
