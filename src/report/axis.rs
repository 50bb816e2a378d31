//! The axes of `nanodist plot`: a linear or logarithmic range with round tick values (1, 2, 2.5 and 5
//! times a power of ten; on a log axis spanning decades, 1, 2 and 5 in each), as a plotters coordinate,
//! and the clipping of curves to a range.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

/// An axis from `lo` to `hi` in data units, drawn linearly or as log10, with its tick values.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub log: bool,
    pub ticks: Vec<f64>,
}

impl Axis {
    /// The axis over `lo..hi` (widened where empty; on a log axis, positive values only).
    pub fn new(lo: f64, hi: f64, log: bool) -> Self {
        let (mut lo, mut hi) = (lo, hi);
        if log {
            lo = lo.max(f64::MIN_POSITIVE);
            hi = hi.max(lo * 1.0001);
        } else if hi <= lo {
            (lo, hi) = (lo - 0.5, hi + 0.5);
        }
        let ticks = match log && hi / lo >= 10.0 {
            true => decade_ticks(lo, hi),
            false => linear_ticks(lo, hi),
        };
        Self { lo, hi, log, ticks }
    }

    /// Where `v` lies on the drawn scale.
    pub fn scaled(&self, v: f64) -> f64 {
        if self.log {
            v.log10()
        } else {
            v
        }
    }

    /// Whether `v` can be drawn on this axis at all.
    pub fn takes(&self, v: f64) -> bool {
        v.is_finite() && (!self.log || v > 0.0)
    }
}

/// A round step near `span / 5`: 1, 2, 2.5 or 5 times a power of ten.
fn nice_step(span: f64) -> f64 {
    let raw = span / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let m = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .find(|m| m * power >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0);
    m * power
}

/// Multiples of a round step inside `lo..=hi`.
pub fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let step = nice_step(hi - lo);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// 1, 2 and 5 times each power of ten inside `lo..=hi` (every integer multiple where that leaves
/// fewer than three).
pub fn decade_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let within = |ms: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|k| ms.iter().map(move |m| m * 10f64.powi(k)))
            .filter(|v| *v >= lo * (1.0 - 1e-12) && *v <= hi * (1.0 + 1e-12))
            .collect()
    };
    let ticks = within(&[1.0, 2.0, 5.0]);
    match ticks.len() >= 3 {
        true => ticks,
        false => within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]),
    }
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let (a, b) = (self.scaled(self.lo), self.scaled(self.hi));
        let f = (self.scaled(*v) - a) / (b - a);
        limit.0 + (f * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}

/// The parts of a curve inside the `x` and `y` ranges, each a run of points with the crossings of the
/// range's edges interpolated on the drawn scale (a curve that starts above the frame enters it at its
/// top edge); points an axis cannot take (zero on a log axis) are dropped.
pub fn clip(points: &[(f64, f64)], x: &Axis, y: &Axis) -> Vec<Vec<(f64, f64)>> {
    let mut parts: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut current: Vec<(f64, f64)> = Vec::new();
    let inside = |v: f64| v >= y.lo && v <= y.hi;
    let drawn: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|&(a, b)| x.takes(a) && y.takes(b) && a >= x.lo && a <= x.hi)
        .collect();
    for (i, &(a, b)) in drawn.iter().enumerate() {
        if let Some(&(pa, pb)) = i.checked_sub(1).map(|j| &drawn[j]) {
            // The segment's crossings of the edges, in order along it: each one enters or leaves.
            let at = |edge: f64| (y.scaled(edge) - y.scaled(pb)) / (y.scaled(b) - y.scaled(pb));
            let mut crossings: Vec<(f64, f64)> = [y.lo, y.hi]
                .into_iter()
                .filter(|e| (pb - e) * (b - e) < 0.0)
                .map(|e| (at(e), e))
                .collect();
            crossings.sort_by(|p, q| p.0.total_cmp(&q.0));
            let mut within = inside(pb);
            for (f, edge) in crossings {
                let xs = x.scaled(pa) + f * (x.scaled(a) - x.scaled(pa));
                current.push((if x.log { 10f64.powf(xs) } else { xs }, edge));
                if within {
                    parts.push(std::mem::take(&mut current));
                }
                within = !within;
            }
        }
        if inside(b) {
            current.push((a, b));
        }
    }
    parts.push(current);
    parts.retain(|p| !p.is_empty());
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers_on_linear_and_log_axes() {
        assert_eq!(linear_ticks(0.0, 20.0), [0.0, 5.0, 10.0, 15.0, 20.0]);
        let band = linear_ticks(2.41, 2.49);
        assert!(
            band.len() >= 3
                && band
                    .iter()
                    .all(|v| ((v * 100.0).round() - v * 100.0).abs() < 1e-9)
        );
        assert_eq!(
            decade_ticks(3.0, 600.0),
            [5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        assert_eq!(
            decade_ticks(2.0, 9.5),
            [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
        );
        // Less than a decade on a log axis: round linear steps, not 10^(k/n).
        let a = Axis::new(2.4, 4.9, true);
        assert_eq!(a.ticks, [2.5, 3.0, 3.5, 4.0, 4.5]);
    }

    #[test]
    fn a_log_axis_maps_decades_to_equal_lengths() {
        let a = Axis::new(1.0, 100.0, true);
        assert_eq!(a.map(&10.0, (0, 100)), 50);
        assert_eq!(a.map(&100.0, (0, 100)), 100);
        assert!(!a.takes(0.0) && a.takes(1e-3));
    }

    #[test]
    fn curves_enter_the_frame_at_its_edge() {
        let (x, y) = (Axis::new(0.0, 10.0, false), Axis::new(2.0, 3.0, false));
        let parts = clip(&[(0.0, 5.0), (2.0, 3.5), (4.0, 2.5), (6.0, 2.2)], &x, &y);
        assert_eq!(parts, vec![vec![(3.0, 3.0), (4.0, 2.5), (6.0, 2.2)]]);
        // Leaving and coming back makes two parts.
        let parts = clip(&[(0.0, 2.5), (1.0, 3.5), (2.0, 2.5)], &x, &y);
        assert_eq!(
            parts,
            vec![vec![(0.0, 2.5), (0.5, 3.0)], vec![(1.5, 3.0), (2.0, 2.5)]]
        );
    }
}
