//! The paged KV arena: per layer, K and V as `[num_blocks][block_size][n_kv_heads][head_dim]`,
//! and one block's KV as bytes (for external tiers): every layer's K rows then V rows of the
//! block, each element little-endian in the arena's dtype.

use std::sync::Mutex;

use cachet_core::{BlockId, BlockLoad, ExecError};
use cachet_kernels::attention::KvElem;
use cachet_kernels::ThreadPool;

/// A KV element the executor can write.
pub trait KvStore: KvElem + Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// Bytes per element.
    const BYTES: usize;
    /// `dst[i] = src[i]` converted (same lengths).
    fn store_slice(src: &[f32], dst: &mut [Self]);
    /// Append `src` as little-endian bytes.
    fn write_le(src: &[Self], out: &mut Vec<u8>);
    /// `dst` from little-endian bytes (`src.len() == dst.len() * BYTES`).
    fn read_le(src: &[u8], dst: &mut [Self]);
}

/// Per-layer K and V, each `[num_blocks][block_size][n_kv_heads][head_dim]`.
pub(crate) struct LayerKv<T> {
    pub(crate) k: Vec<T>,
    pub(crate) v: Vec<T>,
}

pub(crate) enum Arena {
    F32(Vec<LayerKv<f32>>),
    F16(Vec<LayerKv<half::f16>>),
}

pub(crate) fn new_layers<T: KvStore>(n_layers: usize, elems: usize) -> Vec<LayerKv<T>> {
    (0..n_layers)
        .map(|_| LayerKv {
            k: vec![T::ZERO; elems],
            v: vec![T::ZERO; elems],
        })
        .collect()
}

impl KvStore for f32 {
    const ZERO: Self = 0.0;
    const BYTES: usize = 4;
    fn store_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn write_le(src: &[Self], out: &mut Vec<u8>) {
        write_le_bytes(src, out, f32::to_le_bytes);
    }
    fn read_le(src: &[u8], dst: &mut [Self]) {
        read_le_bytes(src, dst, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
}

impl KvStore for half::f16 {
    const ZERO: Self = half::f16::ZERO;
    const BYTES: usize = 2;
    fn store_slice(src: &[f32], dst: &mut [Self]) {
        // Vectorised (F16C when the CPU has it, detected once per call).
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
    fn write_le(src: &[Self], out: &mut Vec<u8>) {
        write_le_bytes(src, out, half::f16::to_le_bytes);
    }
    fn read_le(src: &[u8], dst: &mut [Self]) {
        read_le_bytes(src, dst, |c| half::f16::from_le_bytes([c[0], c[1]]));
    }
}

/// Append `src` as little-endian bytes: one streaming copy on a little-endian CPU (a block's
/// save is ~370 KB for the default model, an element-wise loop measured several times slower,
/// and the saved bytes go to a tier, not back into this step's caches).
fn write_le_bytes<T: bytemuck::Pod, const N: usize>(
    src: &[T],
    out: &mut Vec<u8>,
    _to_le: fn(T) -> [u8; N],
) {
    #[cfg(target_endian = "little")]
    cachet_kernels::formats::kv::append_streaming(out, bytemuck::cast_slice(src));
    #[cfg(not(target_endian = "little"))]
    out.extend(src.iter().flat_map(|&v| _to_le(v)));
}

/// `dst` from little-endian bytes (`src.len() == dst.len() * size_of::<T>()`): one `memcpy` on a
/// little-endian CPU.
fn read_le_bytes<T: bytemuck::Pod>(src: &[u8], dst: &mut [T], _from_le: fn(&[u8]) -> T) {
    #[cfg(target_endian = "little")]
    bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(src);
    #[cfg(not(target_endian = "little"))]
    for (d, c) in dst
        .iter_mut()
        .zip(src.chunks_exact(std::mem::size_of::<T>()))
    {
        *d = _from_le(c);
    }
}

/// One pool task's share of a parallel save: its blocks and their buffers (locked by that
/// task alone).
type SavePart<'a> = Mutex<(&'a [BlockId], &'a mut [Vec<u8>])>;
/// One pool task's share of a parallel load: its first layer's index and its layers.
type LoadPart<'a, T> = Mutex<(usize, &'a mut [LayerKv<T>])>;

/// Elements of one block in one layer's K (or V).
fn block_range(block: BlockId, block_elems: usize) -> std::ops::Range<usize> {
    let start = block as usize * block_elems;
    start..start + block_elems
}

impl Arena {
    pub(crate) fn elem_bytes(&self) -> usize {
        match self {
            Arena::F32(_) => f32::BYTES,
            Arena::F16(_) => half::f16::BYTES,
        }
    }

    fn num_layers(&self) -> usize {
        match self {
            Arena::F32(l) => l.len(),
            Arena::F16(l) => l.len(),
        }
    }

    /// Bytes of one block: every layer's K and V.
    pub(crate) fn block_bytes(&self, block_elems: usize) -> usize {
        self.num_layers() * 2 * block_elems * self.elem_bytes()
    }

    /// Append block `block`'s KV to `out` (layer by layer: K rows, then V rows).
    pub(crate) fn save_block(&self, block: BlockId, block_elems: usize, out: &mut Vec<u8>) {
        fn save<T: KvStore>(layers: &[LayerKv<T>], r: std::ops::Range<usize>, out: &mut Vec<u8>) {
            for l in layers {
                T::write_le(&l.k[r.clone()], out);
                T::write_le(&l.v[r.clone()], out);
            }
        }
        let r = block_range(block, block_elems);
        out.reserve(self.block_bytes(block_elems));
        match self {
            Arena::F32(l) => save(l, r, out),
            Arena::F16(l) => save(l, r, out),
        }
    }

    /// [`Arena::save_block`] of `blocks[i]` into `outs[i]` (appended), the blocks split over
    /// `pool`'s threads. A tier offload copies ~46 MB for a 2,000-token prompt of the default
    /// model; one thread's copy is bound by its own memory bandwidth, not the machine's.
    pub(crate) fn save_blocks(
        &self,
        pool: &ThreadPool,
        block_elems: usize,
        blocks: &[BlockId],
        outs: &mut [Vec<u8>],
    ) {
        let n = blocks.len().min(outs.len());
        let per = n.div_ceil(pool.n_threads().max(1)).max(1);
        if n <= 1 || pool.n_threads() <= 1 {
            for (&b, out) in blocks.iter().zip(outs.iter_mut()) {
                self.save_block(b, block_elems, out);
            }
            return;
        }
        // One part per task; each lock is taken by its task alone.
        let parts: Vec<SavePart> = blocks[..n]
            .chunks(per)
            .zip(outs[..n].chunks_mut(per))
            .map(Mutex::new)
            .collect();
        pool.parallel_for(parts.len(), &|i| {
            let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
            let (bs, os) = &mut *part;
            for (&b, out) in bs.iter().zip(os.iter_mut()) {
                self.save_block(b, block_elems, out);
            }
        });
    }

    /// [`Arena::load_block`] of every load, the layers split over `pool`'s threads (a layer's
    /// K and V belong to one task, so the writes are disjoint by construction). Every load's
    /// size is checked before anything is written.
    pub(crate) fn load_blocks(
        &mut self,
        pool: &ThreadPool,
        block_elems: usize,
        loads: &[BlockLoad<'_>],
    ) -> Result<(), ExecError> {
        let want = self.block_bytes(block_elems);
        if let Some(bad) = loads.iter().find(|l| l.data.len() != want) {
            return Err(ExecError::BadLoad {
                block: bad.block,
                got: bad.data.len(),
                want,
            });
        }
        fn load<T: KvStore>(
            pool: &ThreadPool,
            layers: &mut [LayerKv<T>],
            block_elems: usize,
            loads: &[BlockLoad<'_>],
        ) {
            let half = block_elems * T::BYTES;
            let per = layers.len().div_ceil(pool.n_threads().max(1)).max(1);
            let parts: Vec<LoadPart<T>> = layers
                .chunks_mut(per)
                .enumerate()
                .map(|(i, c)| Mutex::new((i * per, c)))
                .collect();
            pool.parallel_for(parts.len(), &|i| {
                let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
                let (first, layers) = &mut *part;
                for ld in loads {
                    let r = block_range(ld.block, block_elems);
                    for (j, l) in layers.iter_mut().enumerate() {
                        let at = (*first + j) * 2 * half;
                        T::read_le(&ld.data[at..at + half], &mut l.k[r.clone()]);
                        T::read_le(&ld.data[at + half..at + 2 * half], &mut l.v[r.clone()]);
                    }
                }
            });
        }
        match self {
            Arena::F32(l) => load(pool, l, block_elems, loads),
            Arena::F16(l) => load(pool, l, block_elems, loads),
        }
        Ok(())
    }

    /// Copy block `src`'s KV (every layer, K and V) into block `dst`.
    pub(crate) fn copy_block(&mut self, src: BlockId, dst: BlockId, block_elems: usize) {
        fn copy<T: KvStore>(layers: &mut [LayerKv<T>], s: usize, d: usize, n: usize) {
            for l in layers {
                l.k.copy_within(s..s + n, d);
                l.v.copy_within(s..s + n, d);
            }
        }
        let (s, d) = (src as usize * block_elems, dst as usize * block_elems);
        match self {
            Arena::F32(l) => copy(l, s, d, block_elems),
            Arena::F16(l) => copy(l, s, d, block_elems),
        }
    }

    /// Overwrite block `block` with bytes written by [`Arena::save_block`] (the executor
    /// writes a step's loads with [`Arena::load_blocks`]).
    #[cfg(test)]
    pub(crate) fn load_block(
        &mut self,
        block: BlockId,
        block_elems: usize,
        data: &[u8],
    ) -> Result<(), ExecError> {
        let want = self.block_bytes(block_elems);
        if data.len() != want {
            return Err(ExecError::BadLoad {
                block,
                got: data.len(),
                want,
            });
        }
        fn load<T: KvStore>(layers: &mut [LayerKv<T>], r: std::ops::Range<usize>, data: &[u8]) {
            let half = r.len() * T::BYTES;
            for (l, chunk) in layers.iter_mut().zip(data.chunks_exact(2 * half)) {
                T::read_le(&chunk[..half], &mut l.k[r.clone()]);
                T::read_le(&chunk[half..], &mut l.v[r.clone()]);
            }
        }
        let r = block_range(block, block_elems);
        match self {
            Arena::F32(l) => load(l, r, data),
            Arena::F16(l) => load(l, r, data),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two layers, blocks of 3 elements: element `i` of layer `l`'s K holds `l*100 + i`, V the
    /// negation.
    fn arena_f16() -> Arena {
        arena_f16_layers(2)
    }

    /// `n` layers, 4 blocks of 3 elements, element `i` of layer `l`'s K holding `l*100 + i`
    /// and V the negation (five layers: an odd count, split 3 + 2 over two threads).
    fn arena_f16_layers(n: usize) -> Arena {
        let mut layers = new_layers::<half::f16>(n, 3 * 4);
        for (l, layer) in layers.iter_mut().enumerate() {
            for i in 0..12 {
                layer.k[i] = half::f16::from_f32((l * 100 + i) as f32);
                layer.v[i] = half::f16::from_f32(-((l * 100 + i) as f32));
            }
        }
        Arena::F16(layers)
    }

    #[test]
    fn a_saved_block_is_each_layers_k_then_v_little_endian() {
        let a = arena_f16();
        let mut out = vec![0xAB];
        a.save_block(2, 3, &mut out);
        // Block 2 is elements 6..9. f16 of 6, 7, 8 is 0x4600, 0x4700, 0x4800; of -6.. the sign
        // bit set; 106, 107, 108 are 0x56A0, 0x56B0, 0x56C0.
        let want: Vec<u8> = [
            0x4600u16, 0x4700, 0x4800, 0xC600, 0xC700, 0xC800, // layer 0: K, V
            0x56A0, 0x56B0, 0x56C0, 0xD6A0, 0xD6B0, 0xD6C0, // layer 1: K, V
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
        assert_eq!(out[0], 0xAB, "appends");
        assert_eq!(&out[1..], &want[..]);
        assert_eq!(out.len() - 1, a.block_bytes(3));
    }

    #[test]
    fn a_loaded_block_restores_exactly_what_was_saved() {
        let mut a = arena_f16();
        let mut saved = Vec::new();
        a.save_block(1, 3, &mut saved);
        a.load_block(3, 3, &saved).expect("right size");
        let Arena::F16(layers) = &a else {
            unreachable!()
        };
        for (l, layer) in layers.iter().enumerate() {
            for j in 0..3 {
                assert_eq!(layer.k[9 + j].to_f32(), (l * 100 + 3 + j) as f32);
                assert_eq!(layer.v[9 + j].to_f32(), -((l * 100 + 3 + j) as f32));
            }
        }
        assert!(
            a.load_block(0, 3, &saved[1..]).is_err(),
            "a short value is refused"
        );

        let mut f = Arena::F32(new_layers::<f32>(1, 4));
        let bytes: Vec<u8> = [1.5f32, -2.0, 0.25, 8.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        f.load_block(1, 2, &bytes).expect("right size");
        let mut back = Vec::new();
        f.save_block(1, 2, &mut back);
        assert_eq!(back, bytes);
        let Arena::F32(layers) = &f else {
            unreachable!()
        };
        assert_eq!(layers[0].k, [0.0, 0.0, 1.5, -2.0]);
        assert_eq!(layers[0].v, [0.0, 0.0, 0.25, 8.0]);
    }

    #[test]
    fn saves_and_loads_spread_over_threads_are_the_one_block_ones() {
        let pool = ThreadPool::new(2);
        let a = arena_f16_layers(5);
        // Three blocks (split 2 + 1 over the threads), each appended after a marker byte.
        let blocks = [2, 0, 3];
        let mut outs = vec![vec![7u8]; 3];
        a.save_blocks(&pool, 3, &blocks, &mut outs);
        for (&b, out) in blocks.iter().zip(&outs) {
            let mut one = vec![7u8];
            a.save_block(b, 3, &mut one);
            assert_eq!(out, &one, "block {b}");
        }
        // Blocks 2 and 0 loaded into 1 and 3 of a zeroed arena: every layer of exactly those.
        let mut z = Arena::F16(new_layers::<half::f16>(5, 3 * 4));
        let loads = [
            BlockLoad {
                block: 1,
                data: &outs[0][1..],
            },
            BlockLoad {
                block: 3,
                data: &outs[1][1..],
            },
        ];
        z.load_blocks(&pool, 3, &loads).expect("right sizes");
        let Arena::F16(layers) = &z else {
            unreachable!()
        };
        for (l, layer) in layers.iter().enumerate() {
            let k: Vec<f32> = layer.k.iter().map(|x| x.to_f32()).collect();
            let b = (l * 100) as f32;
            let want = [
                0.0,
                0.0,
                0.0,
                b + 6.0,
                b + 7.0,
                b + 8.0,
                0.0,
                0.0,
                0.0,
                b,
                b + 1.0,
                b + 2.0,
            ];
            assert_eq!(k, want, "layer {l} K");
            assert_eq!(layer.v[4].to_f32(), -(b + 7.0), "layer {l} V");
        }
        // A short value anywhere: refused before anything is written.
        let short = [
            BlockLoad {
                block: 0,
                data: &outs[2][1..],
            },
            BlockLoad {
                block: 2,
                data: &outs[2][2..],
            },
        ];
        assert!(z.load_blocks(&pool, 3, &short).is_err());
        let Arena::F16(layers) = &z else {
            unreachable!()
        };
        assert!(
            layers.iter().all(|l| l.k[0].to_f32() == 0.0),
            "block 0 untouched"
        );
    }
}
