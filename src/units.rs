//! Numbers for people: byte counts and durations, one format each for every message and table.

/// `b` bytes to three significant digits in decimal units: "3.25 GB", "497 MB", "1.30 MB", "26.0 kB",
/// "12 B".
pub fn bytes(b: f64) -> String {
    let (v, unit) = match b.abs() {
        x if x >= 999.5e6 => (b / 1e9, "GB"),
        x if x >= 999.5e3 => (b / 1e6, "MB"),
        x if x >= 999.5 => (b / 1e3, "kB"),
        _ => return format!("{b:.0} B"),
    };
    let digits = match v.abs() {
        x if x >= 99.95 => 0,
        x if x >= 9.995 => 1,
        _ => 2,
    };
    format!("{v:.digits$} {unit}")
}

/// `x` to three significant digits (at least): "0.0123", "1.23", "12.3", "123", "1234".
pub fn sig3(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    format!("{x:.digits$}")
}

/// Seconds to three significant digits in the largest unit they fill: "0.512 s", "52.4 s", "1.17 min",
/// "19.5 h", "3.02 d" (one format for every duration in a table).
pub fn secs(s: f64) -> String {
    let (v, unit) = match s.abs() {
        x if x >= 86400.0 => (s / 86400.0, "d"),
        x if x >= 3600.0 => (s / 3600.0, "h"),
        x if x >= 60.0 => (s / 60.0, "min"),
        _ => (s, "s"),
    };
    format!("{} {unit}", sig3(v))
}

/// A duration: "1d 02:03:04", "02:03:04"; "unknown" for a non-finite number of seconds.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "unknown".into();
    }
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_seconds_keep_three_significant_digits() {
        for (x, s) in [
            (0.0, "0"),
            (0.012345, "0.0123"),
            (0.1, "0.100"),
            (1.2345, "1.23"),
            (12.345, "12.3"),
            (123.45, "123"),
            (1234.4, "1234"),
        ] {
            assert_eq!(sig3(x), s, "{x}");
        }
        for (x, s) in [
            (0.5123, "0.512 s"),
            (52.4, "52.4 s"),
            (70.0, "1.17 min"),
            (70200.0, "19.5 h"),
            (260928.0, "3.02 d"),
        ] {
            assert_eq!(secs(x), s, "{x}");
        }
    }

    #[test]
    fn bytes_have_three_significant_digits_and_a_decimal_unit() {
        for (b, s) in [
            (0.0, "0 B"),
            (12.0, "12 B"),
            (999.0, "999 B"),
            (999.6, "1.00 kB"),
            (26_040.0, "26.0 kB"),
            (1_300_000.0, "1.30 MB"),
            (497_200_000.0, "497 MB"),
            (999_700_000.0, "1.00 GB"),
            (3_254_000_000.0, "3.25 GB"),
            (1_450_000_000_000.0, "1450 GB"),
        ] {
            assert_eq!(bytes(b), s, "{b}");
        }
    }

    #[test]
    fn durations_read_as_clock_time() {
        assert_eq!(duration(3723.4), "01:02:03");
        assert_eq!(duration(90061.0), "1d 01:01:01");
        assert_eq!(duration(f64::INFINITY), "unknown");
    }
}
