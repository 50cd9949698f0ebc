//! Latency statistics: percentiles by linear interpolation between closest ranks (the method
//! numpy calls `linear`, Hyndman and Fan's type 7), so figures match a spreadsheet or numpy.

use std::time::Duration;

use serde::Serialize;

/// Summary of a set of latencies, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

/// The `p`-th percentile (0..=100) of `sorted` (ascending), or `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p.clamp(0.0, 100.0) / 100.0) * last as f64;
    let low = rank.floor() as usize;
    let high = rank.ceil() as usize;
    let (a, b) = (sorted[low.min(last)], sorted[high.min(last)]);
    Some(a + (b - a) * (rank - low as f64))
}

/// Median of unsorted values, or `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile(&sorted, 50.0)
}

/// Summarize latencies in any order, or `None` when there are none.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    Some(Summary {
        count: ms.len(),
        min_ms: *ms.first()?,
        p50_ms: percentile(&ms, 50.0)?,
        p90_ms: percentile(&ms, 90.0)?,
        p99_ms: percentile(&ms, 99.0)?,
        max_ms: *ms.last()?,
        mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_interpolate_between_ranks_like_numpy() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        // numpy.percentile(range(1, 101), [0, 50, 90, 99, 100]) == [1, 50.5, 90.1, 99.01, 100]
        assert!(close(percentile(&values, 0.0).unwrap(), 1.0));
        assert!(close(percentile(&values, 50.0).unwrap(), 50.5));
        assert!(close(percentile(&values, 90.0).unwrap(), 90.1));
        assert!(close(percentile(&values, 99.0).unwrap(), 99.01));
        assert!(close(percentile(&values, 100.0).unwrap(), 100.0));
    }

    #[test]
    fn percentile_of_one_value_is_that_value_and_of_none_is_none() {
        assert_eq!(percentile(&[7.5], 99.0), Some(7.5));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn out_of_range_percentiles_are_clamped() {
        assert_eq!(percentile(&[1.0, 2.0], -5.0), Some(1.0));
        assert_eq!(percentile(&[1.0, 2.0], 150.0), Some(2.0));
    }

    #[test]
    fn median_sorts_its_input() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn summary_reads_unsorted_durations_in_milliseconds() {
        let samples: Vec<Duration> = [5u64, 1, 4, 2, 3]
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect();
        let s = summarize(&samples).unwrap();
        assert_eq!(s.count, 5);
        assert!(close(s.min_ms, 1.0));
        assert!(close(s.p50_ms, 3.0));
        assert!(close(s.p90_ms, 4.6));
        assert!(close(s.max_ms, 5.0));
        assert!(close(s.mean_ms, 3.0));
        assert_eq!(summarize(&[]), None);
    }
}
