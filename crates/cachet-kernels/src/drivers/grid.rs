//! How a matmul is cut into pool tasks.

/// How a matmul is cut into pool tasks: chunks of weight units (16-row groups or pairs of
/// them) × splits of the activation-row tiles.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TaskGrid {
    units: usize,
    m_tiles: usize,
    units_per_task: usize,
    m_split: usize,
    tiles_per_split: usize,
}

/// Activation rows up to which a quantized matmul runs as [`TaskGrid::contiguous`]: each
/// thread streams one contiguous half (third, ...) of the weights, prefetching the next pair of
/// groups all the way through, instead of four tasks per thread taken from a shared counter,
/// each of which starts on weights not prefetched. Measured on an Intel Xeon (2 threads,
/// `examples/perf` `MODEL=`, the default model's whole matmul set, 3–6 interleaved pairs per
/// size; docs/bench-runs/2026-12-05-xeon-amx-small-batches.md): 6–11 % less time at m = 1, 2, 4, 8 and 16
/// on AVX-512 (4–9 % on AVX2), 2 % at m = 6, 6–8 % at m = 24, 32 and 48 (3–8 % on AVX2); at
/// m = 64 the same on AVX-512 (−6 % on AVX2) and at 128 the same on both, so larger batches
/// keep the finer split, which balances better and slices long prefills.
pub(crate) const CONTIGUOUS_ROWS: usize = 48;

impl TaskGrid {
    /// `max_tiles_per_split`: the most activation-row tiles one task runs over each of its
    /// weight units (`usize::MAX`: no bound). A task reads its rows' activations once per
    /// weight unit, so a bound keeps them in the core's near caches while the unit's weights
    /// are reused across them; it also gives a long prefill many equal tasks to balance.
    pub(crate) fn new(
        units: usize,
        m_tiles: usize,
        threads: usize,
        max_tiles_per_split: usize,
    ) -> TaskGrid {
        // Weight chunks: enough tasks for load balance, few enough to keep overhead low.
        let units_per_task = (units / (threads * 4)).max(1);
        let unit_tasks = units.div_ceil(units_per_task);
        // Split over m too when there are few weight tasks (small matrices in prefill).
        let for_balance = if unit_tasks >= threads * 2 || m_tiles == 1 {
            1
        } else {
            (threads * 2).div_ceil(unit_tasks).min(m_tiles)
        };
        let m_split = for_balance.max(m_tiles.div_ceil(max_tiles_per_split.max(1)));
        TaskGrid {
            units,
            m_tiles,
            units_per_task,
            m_split,
            tiles_per_split: m_tiles.div_ceil(m_split),
        }
    }

    /// One task per thread, each a contiguous run of the weight units over all `m_tiles`
    /// tiles: for small batches, whose matmuls stream the weights ([`CONTIGUOUS_ROWS`]).
    pub(crate) fn contiguous(units: usize, m_tiles: usize, threads: usize) -> TaskGrid {
        TaskGrid {
            units,
            m_tiles,
            units_per_task: units.div_ceil(threads.max(1)).max(1),
            m_split: 1,
            tiles_per_split: m_tiles,
        }
    }

    pub(crate) fn tasks(&self) -> usize {
        self.units.div_ceil(self.units_per_task) * self.m_split
    }

    /// Task `task`'s weight units and activation-row tiles (either may be empty).
    pub(crate) fn ranges(&self, task: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (ut, ms) = (task / self.m_split, task % self.m_split);
        let u0 = ut * self.units_per_task;
        let t0 = (ms * self.tiles_per_split).min(self.m_tiles);
        (
            u0..(u0 + self.units_per_task).min(self.units),
            t0..(t0 + self.tiles_per_split).min(self.m_tiles),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (unit, tile) pair belongs to exactly one task, whatever the shape.
    #[test]
    fn tasks_cover_every_unit_and_tile_once() {
        for units in [1, 2, 6, 9, 18, 48, 1536] {
            for m_tiles in [1, 2, 3, 4, 8, 17, 128] {
                for threads in [1, 2, 3, 8] {
                    // `None`: the contiguous grid (no bound on a task's tiles).
                    for cap in [None, Some(1), Some(3), Some(16), Some(usize::MAX)] {
                        let g = match cap {
                            None => TaskGrid::contiguous(units, m_tiles, threads),
                            Some(c) => TaskGrid::new(units, m_tiles, threads, c),
                        };
                        let mut seen = vec![0u8; units * m_tiles];
                        for t in 0..g.tasks() {
                            let (us, ts) = g.ranges(t);
                            assert!(
                                ts.len() <= cap.unwrap_or(usize::MAX),
                                "{units} {m_tiles} {threads} {cap:?}"
                            );
                            for u in us {
                                for tile in ts.clone() {
                                    seen[u * m_tiles + tile] += 1;
                                }
                            }
                        }
                        assert!(
                            seen.iter().all(|&n| n == 1),
                            "{units} {m_tiles} {threads} {cap:?}"
                        );
                    }
                }
            }
        }
    }

    /// The shapes of the default model at 2 threads: a 512-row prefill of the 1536 × 576 up
    /// projection (48 pairs of groups, 128 tiles of 4 rows at the AVX2 level) runs in 8 chunks
    /// of 6 pairs × 8 splits of 16 tiles (64 rows; at the AVX-512 level of an Intel CPU 64 tiles
    /// of 8 rows in splits of 8); batch 16 (4 tiles) and decode are not split over rows
    /// (the packed driver runs batches of up to [`CONTIGUOUS_ROWS`] on
    /// [`TaskGrid::contiguous`]; the AMX driver's small shapes use this grid).
    #[test]
    fn prefill_is_split_into_row_slices() {
        let g = TaskGrid::new(48, 128, 2, 16);
        assert_eq!(g.tasks(), 64);
        assert_eq!(g.ranges(0), (0..6, 0..16));
        assert_eq!(g.ranges(9), (6..12, 16..32));
        assert_eq!(g.ranges(63), (42..48, 112..128));
        let g = TaskGrid::new(48, 4, 2, 16);
        assert_eq!((g.tasks(), g.ranges(1)), (8, (6..12, 0..4)));
        let g = TaskGrid::new(48, 1, 2, 16);
        assert_eq!((g.tasks(), g.ranges(7)), (8, (42..48, 0..1)));
        // Few weight units: split over rows for balance as before (6 pairs, 4 tiles).
        let g = TaskGrid::new(6, 4, 2, 16);
        assert_eq!((g.tasks(), g.ranges(0)), (6, (0..1, 0..4)));
    }

    /// Batches up to 48 rows: one contiguous run of pairs per thread, over every tile.
    #[test]
    fn small_batches_stream_one_contiguous_run_per_thread() {
        let g = TaskGrid::contiguous(48, 4, 2);
        assert_eq!(g.tasks(), 2);
        assert_eq!((g.ranges(0), g.ranges(1)), ((0..24, 0..4), (24..48, 0..4)));
        // 9 pairs: 5 and 4 over 2 threads; 3 tasks of 3 over 4 threads (one thread idle).
        let g = TaskGrid::contiguous(9, 1, 2);
        assert_eq!(
            (g.tasks(), g.ranges(0), g.ranges(1)),
            (2, (0..5, 0..1), (5..9, 0..1))
        );
        let g = TaskGrid::contiguous(9, 1, 4);
        assert_eq!((g.tasks(), g.ranges(2)), (3, (6..9, 0..1)));
    }
}
