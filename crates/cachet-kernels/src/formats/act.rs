//! Activations quantized to int8 blocks, and the portable reference of that quantization.

/// Activations quantized to int8 blocks of `bk`: `x ≈ d * q`, with `s = d * Σ q` per block.
#[derive(Default)]
pub(crate) struct QAct {
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
    pub(crate) cols: usize,
    pub(crate) nb: usize,
}

impl QAct {
    pub(crate) fn prepare(&mut self, m: usize, cols: usize, bk: usize) {
        self.cols = cols;
        self.nb = cols / bk;
        // +64 so SIMD loads past the end of the last row stay in bounds.
        self.q.resize(m * cols + 64, 0);
        self.d.resize(m * self.nb + 16, 0.0);
        self.s.resize(m * self.nb + 16, 0.0);
    }
}

/// Quantize one row of activations (portable). Ties round to even, as the SIMD conversions
/// (`vcvtps2dq`) do, so every level quantizes to the same bytes.
pub(crate) fn quantize_act_row_scalar(
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    for (b, xb) in x.chunks(bk).enumerate() {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let qv = (v * id).round_ties_even() as i32;
            q[b * bk + j] = qv as i8;
            sum += qv;
        }
        d[b] = db;
        s[b] = db * sum as f32;
    }
}
