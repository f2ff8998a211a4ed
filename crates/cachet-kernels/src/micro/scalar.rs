//! Portable micro-kernels: the reference every SIMD level is tested against, and the path of
//! CPUs without AVX2. The same integer math as the SIMD kernels.

use super::{TileJob, CHUNK};
use crate::formats::kv::{KvElem, PagedAttnArgs};

/// Portable micro-kernel (same integer math as the SIMD kernels).
pub(crate) fn tile(job: &TileJob) {
    let p = job.p;
    let f = p.fmt;
    let bk = f.bk();
    let a = job.a;
    for lr in 0..job.nvalid {
        let r = job.r0 + lr;
        for i in job.i0..job.i0 + job.mr {
            let mut acc = 0f32;
            for b in 0..p.nb {
                let (d, c) = p.scales(r, b);
                let xq = &a.q[i * a.cols + b * bk..i * a.cols + (b + 1) * bk];
                let mut isum = 0i32;
                for (kk, &xv) in xq.iter().enumerate() {
                    isum += p.code(r, b * bk + kk) as i32 * xv as i32;
                }
                acc += isum as f32 * (d * a.d[i * a.nb + b]) + c * a.s[i * a.nb + b];
            }
            // SAFETY: (i, r) lies inside y (checked by try_matmul) and is owned by this tile.
            unsafe { *job.y.get().add(i * job.ystride + r) = acc };
        }
    }
}

/// `Σ a_i b_i` over the shorter slice, in 8 independent lanes.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out[i] = silu(gate[i]) * up[i]`.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `Σ x²` in the order of the SIMD version ([`super::sum_squares`]), so the two are
/// bit-identical: four 8-lane accumulators of fused multiply-adds over blocks of 32 values,
/// then blocks of 8 into the first, the accumulators added as `(a0 + a1) + (a2 + a3)`, the
/// 8 lanes as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, then the tail in order.
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= x.len() {
        for (k, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                let v = x[i + 8 * k + l];
                *a = v.mul_add(v, *a);
            }
        }
        i += 32;
    }
    while i + 8 <= x.len() {
        for (l, a) in acc[0].iter_mut().enumerate() {
            let v = x[i + l];
            *a = v.mul_add(v, *a);
        }
        i += 8;
    }
    let t: Vec<f32> = (0..8)
        .map(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]))
        .collect();
    let mut s = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    for &v in &x[i..] {
        s = v.mul_add(v, s);
    }
    s
}

/// `out[i] = x[i] * r * w[i]`.
pub(crate) fn scale_mul(x: &[f32], r: f32, w: &[f32], out: &mut [f32]) {
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `x[i] += d[i]`.
pub(crate) fn add_assign(x: &mut [f32], d: &[f32]) {
    for (a, &b) in x.iter_mut().zip(d) {
        *a += b;
    }
}

/// Partial attention of all query heads in kv group `g` for query token `t` over positions
/// `p0..p1`: writes `[m, l, acc[head_dim]]` per head into `part`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_part<T: KvElem>(
    a: &PagedAttnArgs,
    q: &[f32],
    k: &[T],
    v: &[T],
    t: usize,
    g: usize,
    (p0, p1): (usize, usize),
    part: &mut [f32],
) {
    let hd = a.head_dim;
    let gs = a.n_heads / a.n_kv_heads;
    let row = a.n_kv_heads * hd;
    let mut m = vec![f32::NEG_INFINITY; gs];
    let mut l = vec![0f32; gs];
    let mut acc = vec![0f32; gs * hd];
    let mut s = vec![0f32; gs * CHUNK];
    let mut c0 = p0;
    while c0 < p1 {
        let n = (p1 - c0).min(CHUNK);
        for j in 0..n {
            let p = c0 + j;
            let off = (a.block_table[p / a.block_size] as usize * a.block_size + p % a.block_size)
                * row
                + g * hd;
            let kr = &k[off..off + hd];
            for h in 0..gs {
                let qh = &q[(t * a.n_heads + g * gs + h) * hd..][..hd];
                let mut d = 0f32;
                for (x, y) in qh.iter().zip(kr) {
                    d += x * y.to_f32();
                }
                s[h * CHUNK + j] = d * a.scale;
            }
        }
        for h in 0..gs {
            let sh = &mut s[h * CHUNK..h * CHUNK + n];
            let cmax = sh.iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
            let new_m = m[h].max(cmax);
            let alpha = if m[h] == f32::NEG_INFINITY {
                0.0
            } else {
                (m[h] - new_m).exp()
            };
            let mut sum = 0f32;
            for x in sh.iter_mut() {
                *x = (*x - new_m).exp();
                sum += *x;
            }
            l[h] = l[h] * alpha + sum;
            m[h] = new_m;
            for x in &mut acc[h * hd..(h + 1) * hd] {
                *x *= alpha;
            }
        }
        for j in 0..n {
            let p = c0 + j;
            let off = (a.block_table[p / a.block_size] as usize * a.block_size + p % a.block_size)
                * row
                + g * hd;
            let vr = &v[off..off + hd];
            for h in 0..gs {
                let w = s[h * CHUNK + j];
                for (o, y) in acc[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                    *o += w * y.to_f32();
                }
            }
        }
        c0 += n;
    }
    for h in 0..gs {
        let p = &mut part[h * (hd + 2)..][..hd + 2];
        p[0] = m[h];
        p[1] = l[h];
        p[2..].copy_from_slice(&acc[h * hd..(h + 1) * hd]);
    }
}
