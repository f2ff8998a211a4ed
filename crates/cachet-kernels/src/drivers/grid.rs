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

impl TaskGrid {
    pub(crate) fn new(units: usize, m_tiles: usize, threads: usize) -> TaskGrid {
        // Weight chunks: enough tasks for load balance, few enough to keep overhead low.
        let units_per_task = (units / (threads * 4)).max(1);
        let unit_tasks = units.div_ceil(units_per_task);
        // Split over m too when there are few weight tasks (small matrices in prefill).
        let m_split = if unit_tasks >= threads * 2 || m_tiles == 1 {
            1
        } else {
            (threads * 2).div_ceil(unit_tasks).min(m_tiles)
        };
        TaskGrid {
            units,
            m_tiles,
            units_per_task,
            m_split,
            tiles_per_split: m_tiles.div_ceil(m_split),
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
