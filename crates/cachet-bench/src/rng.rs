//! A tiny deterministic PRNG (SplitMix64): the same seed gives the same workload on every
//! platform and every version of this crate, with no dependency whose stream could change.

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent stream derived from `seed` and a label (user id, turn, ...).
    pub fn derive(seed: u64, parts: &[u64]) -> Self {
        let mut r = Rng(seed ^ 0x5eed_cac4_e7b3_9c11);
        for &p in parts {
            r.0 ^= p.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            r.next_u64();
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `(0, 1]`.
    pub fn unit_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Exponential with the given rate (mean `1 / rate`): Poisson inter-arrival gaps.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -self.unit_open0().ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_distinct_streams() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.iter().all(|&x| x == a[0]));
        let mut x = Rng::derive(7, &[1, 2]);
        let mut y = Rng::derive(7, &[2, 1]);
        assert_ne!(x.next_u64(), y.next_u64());
    }

    #[test]
    fn exponential_mean_is_close() {
        let mut r = Rng::new(3);
        let n = 20_000;
        let mean = (0..n).map(|_| r.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
    }
}
