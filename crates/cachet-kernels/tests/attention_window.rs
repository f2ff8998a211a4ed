//! Sliding-window attention (`PagedAttnArgs::window`, Gemma 3's local layers): query token at
//! position `p` sees positions `max(0, p + 1 - W)..=p`. On every ISA level, f32 and f16 KV:
//! the kernels equal the naive reference; a token alone equals its row in a prefill chunk
//! (sequential and parallel drivers), windows starting mid-segment included; a window of 1 gives
//! the token's own V row exactly; a window covering the whole context gives the unwindowed bits.

mod common;
use common::for_each_isa;

use cachet_kernels::attention::{
    attention_reference, paged_attention, paged_attention_parallel, KvElem, PagedAttnArgs,
};
use cachet_kernels::isa;
use cachet_kernels::ThreadPool;
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A shuffled block table, a random K/V arena and random queries.
struct Case<T> {
    table: Vec<u32>,
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<f32>,
    shape: (usize, usize, usize, usize),
}

impl<T: KvElem> Case<T> {
    fn new(shape: (usize, usize, usize, usize), ctx: usize, n: usize, seed: u64) -> Self {
        let (nh, nkv, hd, bs) = shape;
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
            shape,
        }
    }

    fn args(&self, start_pos: usize, n_tokens: usize, window: usize) -> PagedAttnArgs<'_> {
        let (nh, nkv, hd, bs) = self.shape;
        PagedAttnArgs {
            block_table: &self.table,
            block_size: bs,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            start_pos,
            n_tokens,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
        }
    }

    /// The V row of position `p`, kv group `g`, as f32.
    fn v_row(&self, p: usize, g: usize) -> Vec<f32> {
        let (_, nkv, hd, bs) = self.shape;
        let slot = self.table[p / bs] as usize * bs + p % bs;
        self.v[(slot * nkv + g) * hd..][..hd]
            .iter()
            .map(|x| x.to_f32())
            .collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (heads, kv heads, head dim, block size): Gemma 3 270M's shape (4 heads, 1 kv head of 256),
/// several kv groups (the decode kernel's all-groups pass), and odd block sizes.
const SHAPES: [(usize, usize, usize, usize); 4] = [
    (4, 1, 256, 16),
    (8, 2, 64, 16),
    (9, 3, 32, 7),
    (6, 1, 48, 5),
];

/// (start, tokens, window): windows starting at 0, mid-segment and on a segment boundary, a
/// chunk crossing segments, a window of one, and one as long as a segment.
const CASES: [(usize, usize, usize); 8] = [
    (0, 9, 4),
    (37, 5, 30),
    (100, 40, 50),
    (250, 6, 128),
    (300, 20, 1),
    (500, 12, 200),
    (1038, 6, 512),
    (126, 4, 3),
];

fn windowed_case<T: KvElem>(pool: &ThreadPool, shape: (usize, usize, usize, usize)) {
    let (nh, _, hd, _) = shape;
    let qd = nh * hd;
    for &(start, n, w) in &CASES {
        let c = Case::<T>::new(shape, start + n, n, (start * 7 + n * 3 + w) as u64);
        let a = c.args(start, n, w);
        let what = format!(
            "{:?} {} shape={shape:?} start={start} n={n} window={w}",
            isa::active(),
            std::any::type_name::<T>()
        );
        let mut want = vec![0f32; n * qd];
        attention_reference(&a, &c.q, &c.k, &c.v, &mut want);
        let mut tile = vec![0f32; n * qd];
        paged_attention(&a, &c.q, &c.k, &c.v, &mut tile);
        let mut tile_par = vec![0f32; n * qd];
        paged_attention_parallel(pool, &a, &c.q, &c.k, &c.v, &mut tile_par);
        for (i, (x, y)) in tile.iter().zip(&want).enumerate() {
            assert!((x - y).abs() < 2e-4, "{what}: [{i}] {x} vs reference {y}");
        }
        for t in 0..n {
            let q = &c.q[t * qd..(t + 1) * qd];
            let mut alone = vec![0f32; qd];
            paged_attention(&c.args(start + t, 1, w), q, &c.k, &c.v, &mut alone);
            let mut alone_par = vec![0f32; qd];
            paged_attention_parallel(
                pool,
                &c.args(start + t, 1, w),
                q,
                &c.k,
                &c.v,
                &mut alone_par,
            );
            let row = &tile[t * qd..(t + 1) * qd];
            assert_eq!(bits(&alone), bits(row), "{what}: token {t} alone vs tile");
            assert_eq!(
                bits(&alone_par),
                bits(row),
                "{what}: token {t} parallel alone"
            );
            assert_eq!(
                bits(&tile_par[t * qd..(t + 1) * qd]),
                bits(row),
                "{what}: token {t} parallel tile"
            );
            if w == 1 {
                // softmax over one position is 1: the output is that position's V row.
                let gs = nh / shape.1;
                for h in 0..nh {
                    let want_v = c.v_row(start + t, h / gs);
                    assert_eq!(
                        bits(&row[h * hd..(h + 1) * hd]),
                        bits(&want_v),
                        "{what}: token {t} head {h}, window 1"
                    );
                }
            }
        }
    }
}

#[test]
fn windowed_attention_matches_the_reference_and_is_tile_independent() {
    let pool = ThreadPool::new(2);
    for_each_isa(|_| {
        for &shape in &SHAPES {
            windowed_case::<f32>(&pool, shape);
            windowed_case::<f16>(&pool, shape);
        }
    });
}

/// A window that covers every position a token sees changes nothing, to the bit: a decode
/// token over any context, for windows of exactly the context and longer.
#[test]
fn a_window_covering_the_context_gives_the_unwindowed_bits() {
    let pool = ThreadPool::new(2);
    for_each_isa(|_| {
        for &shape in &SHAPES {
            let qd = shape.0 * shape.2;
            for &ctx in &[1usize, 100, 128, 129, 700] {
                let c = Case::<f16>::new(shape, ctx, 1, ctx as u64);
                let mut plain = vec![0f32; qd];
                paged_attention(&c.args(ctx - 1, 1, 0), &c.q, &c.k, &c.v, &mut plain);
                for w in [ctx, ctx + 1, 4096] {
                    let mut got = vec![0f32; qd];
                    paged_attention(&c.args(ctx - 1, 1, w), &c.q, &c.k, &c.v, &mut got);
                    let mut par = vec![0f32; qd];
                    paged_attention_parallel(
                        &pool,
                        &c.args(ctx - 1, 1, w),
                        &c.q,
                        &c.k,
                        &c.v,
                        &mut par,
                    );
                    let what = format!("{:?} shape={shape:?} ctx={ctx} window={w}", isa::active());
                    assert_eq!(bits(&got), bits(&plain), "{what}");
                    assert_eq!(bits(&par), bits(&plain), "{what}: parallel");
                }
            }
        }
    });
}

/// The window changes the result once it is shorter than the context (the test above cannot
/// pass by ignoring the window): a decode token at position 299 with a window of 200 differs
/// from the unwindowed one and equals the reference over positions 100..=299.
#[test]
fn a_short_window_drops_the_early_positions() {
    let c = Case::<f32>::new((4, 1, 256, 16), 300, 1, 9);
    let qd = 4 * 256;
    let mut plain = vec![0f32; qd];
    paged_attention(&c.args(299, 1, 0), &c.q, &c.k, &c.v, &mut plain);
    let mut win = vec![0f32; qd];
    paged_attention(&c.args(299, 1, 200), &c.q, &c.k, &c.v, &mut win);
    assert_ne!(bits(&plain), bits(&win));
    // The reference restricted by hand: gather positions 100..=299 into a fresh table.
    let (bs, hd) = (16usize, 256usize);
    let mut k2 = Vec::with_capacity(200 * hd);
    let mut v2 = Vec::with_capacity(200 * hd);
    for p in 100..300 {
        let slot = c.table[p / bs] as usize * bs + p % bs;
        k2.extend_from_slice(&c.k[slot * hd..(slot + 1) * hd]);
        v2.extend_from_slice(&c.v[slot * hd..(slot + 1) * hd]);
    }
    let table2: Vec<u32> = (0..(200 / 8) as u32).collect();
    let a2 = PagedAttnArgs {
        block_table: &table2,
        block_size: 8,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: hd,
        start_pos: 199,
        n_tokens: 1,
        scale: 1.0 / 16.0,
        window: 0,
    };
    let mut want = vec![0f32; qd];
    attention_reference(&a2, &c.q, &k2, &v2, &mut want);
    for (i, (x, y)) in win.iter().zip(&want).enumerate() {
        assert!((x - y).abs() < 2e-5, "[{i}] {x} vs {y}");
    }
}
