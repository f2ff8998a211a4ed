//! The one timed loop of the bench: `rounds` interleaved rounds over several cases, the order
//! rotating each round (so that drift on a shared machine falls on every case alike), each
//! case's samples filed under named series and reduced to a [`Spread`] at the end.

use super::Spread;
use crate::error::BenchError;

/// The order of `cases` cases in round `round`: `0..cases` rotated left by `round`.
pub(super) fn rotation(round: usize, cases: usize) -> Vec<usize> {
    (0..cases).map(|i| (i + round) % cases.max(1)).collect()
}

/// Runs `rounds` rounds; in each, `run(round, case)` for every case in [`rotation`] order.
/// A case returns its samples as `(series index, value)`; the spreads come back in `series`
/// order. After each round the `headline` series' latest values are printed, under `label`.
pub(super) async fn interleaved<F>(
    label: &str,
    rounds: usize,
    cases: usize,
    series: &[&str],
    headline: &[usize],
    mut run: F,
) -> Result<Vec<Spread>, BenchError>
where
    F: AsyncFnMut(usize, usize) -> Result<Vec<(usize, f64)>, BenchError>,
{
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); series.len()];
    for round in 0..rounds {
        for case in rotation(round, cases) {
            for (i, v) in run(round, case).await? {
                if let Some(s) = samples.get_mut(i) {
                    s.push(v);
                }
            }
        }
        let last: Vec<String> = headline
            .iter()
            .filter_map(|&i| {
                let v = samples.get(i)?.last()?;
                Some(format!("{} {v:.1}", series[i]))
            })
            .collect();
        eprintln!(
            "[tiers] {label} round {}/{rounds}: {}",
            round + 1,
            last.join(", ")
        );
    }
    Ok(samples.into_iter().map(Spread::of).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_starts_each_round_one_case_later() {
        assert_eq!(rotation(0, 3), vec![0, 1, 2]);
        assert_eq!(rotation(1, 3), vec![1, 2, 0]);
        assert_eq!(rotation(5, 3), vec![2, 0, 1]);
        assert_eq!(rotation(2, 1), vec![0]);
    }

    #[test]
    fn samples_are_filed_per_series_in_round_order() {
        // Case c of round r yields r * 10 + c into series c, and 1.0 into series 2 for case 0.
        let mut calls = Vec::new();
        let spreads = block_on(interleaved(
            "test",
            3,
            2,
            &["a", "b", "count"],
            &[0],
            async |r, c| {
                calls.push((r, c));
                let mut v = vec![(c, (r * 10 + c) as f64)];
                if c == 0 {
                    v.push((2, 1.0));
                }
                Ok(v)
            },
        ))
        .unwrap();
        assert_eq!(calls, vec![(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]);
        assert_eq!(spreads[0].samples, vec![0.0, 10.0, 20.0]);
        assert_eq!(spreads[1].samples, vec![1.0, 11.0, 21.0]);
        assert_eq!(spreads[1].median, 11.0);
        assert_eq!(spreads[2].samples, vec![1.0, 1.0, 1.0]);
    }

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }
}
