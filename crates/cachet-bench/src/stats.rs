//! Summary statistics: mean and linearly interpolated percentiles (numpy's default method).

use serde::Serialize;

/// Percentile `p` (0..=100) of `sorted` (ascending), interpolating linearly between the two
/// nearest ranks: rank = p/100 × (n − 1). `None` when empty.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Mean and percentiles of a sample, in the sample's unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Summary::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let pct = |p| percentile_sorted(&v, p).unwrap_or(0.0);
        Summary {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            max: *v.last().unwrap(),
        }
    }

    /// The same summary with every value multiplied by `k` (e.g. seconds to milliseconds).
    pub fn scaled(self, k: f64) -> Summary {
        Summary {
            count: self.count,
            mean: self.mean * k,
            p50: self.p50 * k,
            p90: self.p90 * k,
            p99: self.p99 * k,
            max: self.max * k,
        }
    }
}

/// Mean and sample standard deviation.
pub fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (m, 0.0);
    }
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    (m, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[test]
    fn percentiles_by_hand() {
        // n = 5: rank = p/100 × 4.
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        close(percentile_sorted(&v, 50.0).unwrap(), 3.0);
        close(percentile_sorted(&v, 0.0).unwrap(), 1.0);
        close(percentile_sorted(&v, 100.0).unwrap(), 5.0);
        // rank 3.6 → 4 + 0.6 × (5 − 4)
        close(percentile_sorted(&v, 90.0).unwrap(), 4.6);
        // rank 3.96 → 4.96
        close(percentile_sorted(&v, 99.0).unwrap(), 4.96);
        // n = 4: p50 at rank 1.5 → (20 + 30) / 2
        close(
            percentile_sorted(&[10.0, 20.0, 30.0, 40.0], 50.0).unwrap(),
            25.0,
        );
        // n = 1
        close(percentile_sorted(&[7.0], 99.0).unwrap(), 7.0);
        assert_eq!(percentile_sorted(&[], 50.0), None);
    }

    #[test]
    fn summary_sorts_and_ignores_nan() {
        // 10 values 10..=100 unsorted: rank(p90) = 8.1 → 90 + 0.1 × 10 = 91.
        let v = [
            100.0,
            10.0,
            50.0,
            20.0,
            90.0,
            30.0,
            70.0,
            40.0,
            80.0,
            60.0,
            f64::NAN,
        ];
        let s = Summary::of(&v);
        assert_eq!(s.count, 10);
        close(s.mean, 55.0);
        close(s.p50, 55.0);
        close(s.p90, 91.0);
        close(s.p99, 99.1);
        close(s.max, 100.0);
        close(s.scaled(1000.0).p90, 91_000.0);
        assert_eq!(Summary::of(&[]), Summary::default());
    }

    #[test]
    fn mean_and_std_by_hand() {
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        close(m, 5.0);
        close(s, (32.0f64 / 7.0).sqrt());
    }
}
