//! A token's attention output must not depend on which other tokens share its pass: a token
//! computed alone (one-token decode) gets the same bits as the same token computed as one row
//! of a multi-token tile (chunked prefill, speculative verification, batching), on every ISA
//! level, f32 and f16 KV alike. This is what lets the model's logits be batch-independent
//! (`cachet-model/tests/real_model.rs`); here it is checked on the kernels directly, for the
//! shapes that take each kernel path (grouped decode rows for 1–4 heads per kv group, the
//! per-row path above that, in-place f16 reads and the f16 scratch).

mod common;
use common::for_each_isa;

use cachet_kernels::attention::{paged_attention, paged_attention_parallel, KvElem, PagedAttnArgs};
use cachet_kernels::isa;
use cachet_kernels::ThreadPool;
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A shuffled block table, a random K/V arena and random queries for `n` tokens from `start`.
struct Case<T> {
    table: Vec<u32>,
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<f32>,
    nh: usize,
    nkv: usize,
    hd: usize,
    bs: usize,
}

impl<T: KvElem> Case<T> {
    fn new(nh: usize, nkv: usize, hd: usize, bs: usize, ctx: usize, n: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let nblk = ctx.div_ceil(bs);
        let mut table: Vec<u32> = (0..(nblk + 2) as u32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, rng.gen_range(0..=i));
        }
        table.truncate(nblk);
        let arena = (nblk + 2) * bs * nkv * hd;
        let mut r = |lo: f32, hi: f32, len: usize| -> Vec<f32> {
            (0..len).map(|_| rng.gen_range(lo..hi)).collect()
        };
        let k = r(-2.0, 2.0, arena).into_iter().map(T::from_f32).collect();
        let v = r(-1.0, 1.0, arena).into_iter().map(T::from_f32).collect();
        let q = r(-1.0, 1.0, n * nh * hd);
        Case {
            table,
            k,
            v,
            q,
            nh,
            nkv,
            hd,
            bs,
        }
    }

    fn args(&self, start_pos: usize, n_tokens: usize) -> PagedAttnArgs<'_> {
        PagedAttnArgs {
            block_table: &self.table,
            block_size: self.bs,
            n_heads: self.nh,
            n_kv_heads: self.nkv,
            head_dim: self.hd,
            start_pos,
            n_tokens,
            scale: 1.0 / (self.hd as f32).sqrt(),
            window: 0,
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Tokens `start..start + n` as one call (tiles of several tokens) and each alone.
fn tile_equals_alone<T: KvElem>(
    pool: &ThreadPool,
    shape: (usize, usize, usize, usize),
    start: usize,
    n: usize,
) {
    let (nh, nkv, hd, bs) = shape;
    let c = Case::<T>::new(nh, nkv, hd, bs, start + n, n, (start * 31 + n) as u64);
    let qd = nh * hd;
    let mut tile = vec![0f32; n * qd];
    paged_attention(&c.args(start, n), &c.q, &c.k, &c.v, &mut tile);
    let mut tile_par = vec![0f32; n * qd];
    paged_attention_parallel(pool, &c.args(start, n), &c.q, &c.k, &c.v, &mut tile_par);
    for t in 0..n {
        let mut alone = vec![0f32; qd];
        let q = &c.q[t * qd..(t + 1) * qd];
        paged_attention(&c.args(start + t, 1), q, &c.k, &c.v, &mut alone);
        let what = format!(
            "{:?} {} h={nh}/{nkv} hd={hd} bs={bs} start={start} n={n} token {t}",
            isa::active(),
            std::any::type_name::<T>()
        );
        assert!(alone.iter().all(|x| x.is_finite()), "{what}: not finite");
        assert_eq!(
            bits(&alone),
            bits(&tile[t * qd..(t + 1) * qd]),
            "{what}: tile"
        );
        assert_eq!(
            bits(&alone),
            bits(&tile_par[t * qd..(t + 1) * qd]),
            "{what}: parallel tile"
        );
    }
}

#[test]
fn a_token_alone_equals_its_row_in_a_tile() {
    let pool = ThreadPool::new(2);
    // (heads, kv heads, head dim, block size): a decode token with 3, 2, 4 or 1 heads per kv
    // group reads K/V in place, and with 6, 8 or 5 it takes the tile's path; on AVX2 a tile
    // advances a token's heads of a group 3 (of 3 or 6), 2, 4 (of 4 or 8) or 1 (of 1 or 5)
    // at a time. Odd block sizes cross chunk boundaries anywhere.
    let shapes = [
        (9, 3, 64, 16),
        (16, 8, 64, 16),
        (8, 2, 128, 32),
        (4, 4, 32, 8),
        (6, 1, 48, 5),
        (12, 2, 16, 7),
        (16, 2, 64, 16),
        (10, 2, 32, 11),
    ];
    for_each_isa(|_| {
        for &shape in &shapes {
            for &(start, n) in &[
                (0, 1),
                (0, 9),
                (37, 5),
                (30, 40),
                (100, 21),
                (126, 4),
                (250, 6),
                (1038, 6),
                (300, 2),
                (126, 3),
                (1500, 3),
            ] {
                tile_equals_alone::<f32>(&pool, shape, start, n);
                tile_equals_alone::<f16>(&pool, shape, start, n);
            }
        }
    });
}

/// A decode token over a long context computed by the parallel driver (as batch-1 decode
/// runs it, context segments spread over the threads) and by the sequential one (as each
/// sequence of a batch runs it) gets the same bits.
#[test]
fn a_decode_token_is_the_same_alone_and_batched_at_long_contexts() {
    // Two threads take 4 runs of segments, three take 6 (each run one segment at 700
    // positions, two at 1,500).
    for threads in [2, 3] {
        decode_token_alone_and_batched(&ThreadPool::new(threads));
    }
}

fn decode_token_alone_and_batched(pool: &ThreadPool) {
    for_each_isa(|_| {
        for &(nh, nkv, hd, bs) in &[(9, 3, 64, 16), (8, 1, 64, 16), (16, 8, 64, 16)] {
            for &ctx in &[255usize, 256, 700, 1500] {
                let c = Case::<f16>::new(nh, nkv, hd, bs, ctx, 1, ctx as u64);
                let mut seq = vec![0f32; nh * hd];
                let mut par = vec![0f32; nh * hd];
                paged_attention(&c.args(ctx - 1, 1), &c.q, &c.k, &c.v, &mut seq);
                paged_attention_parallel(pool, &c.args(ctx - 1, 1), &c.q, &c.k, &c.v, &mut par);
                assert_eq!(
                    bits(&seq),
                    bits(&par),
                    "{:?} h={nh}/{nkv} ctx={ctx} threads {}",
                    isa::active(),
                    pool.n_threads()
                );
            }
        }
    });
}
