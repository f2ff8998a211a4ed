//! Element-wise kernels of a transformer block: SwiGLU and RMS norms.

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

/// RMS norm: `out[i] = x[i] / sqrt(mean(x²) + eps) * w[i]` for `i < x.len()`, computed as
/// `r = 1 / sqrt(Σx² / n + eps)`, `out[i] = x[i] * r * w[i]`. `Σx²` is summed in one fixed
/// order (four 8-lane FMA chains), so the result is bit-identical on every ISA level.
///
/// Panics if `w` or `out` is shorter than `x`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        w.len() >= x.len() && out.len() >= x.len(),
        "rms_norm: weight or output shorter than the input"
    );
    let level = isa::active();
    let r = 1.0 / (micro::sum_squares(level, x) / x.len() as f32 + eps).sqrt();
    micro::scale_mul(level, x, r, w, &mut out[..x.len()]);
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    assert!(
        w.len() >= x.len(),
        "rms_norm: weight shorter than the input"
    );
    let level = isa::active();
    let r = 1.0 / (micro::sum_squares(level, x) / x.len() as f32 + eps).sqrt();
    // Element-wise products are the same on every level; the compiler vectorises this.
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * r * g;
    }
}

/// The residual add fused with the next norm: `x += d`, then `out = rms_norm(x) * w`.
///
/// Panics if `d`, `w` or `out` is shorter than `x`.
pub fn add_rms_norm(x: &mut [f32], d: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        d.len() >= x.len(),
        "add_rms_norm: residual shorter than the input"
    );
    micro::add_assign(isa::active(), x, &d[..x.len()]);
    rms_norm(x, w, eps, out);
}
