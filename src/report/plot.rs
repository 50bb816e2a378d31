//! `nanodist plot`: loss curves of one or several runs, as a PNG and an SVG of four panels: train and val
//! loss vs step, val loss vs tokens, val loss vs wall time, and val loss vs bytes each worker sent.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::Run;
use crate::bad_input;

/// Size of the whole figure in pixels.
pub const SIZE: (u32, u32) = (1600, 1100);

/// Where to look for a TrueType font (plotters renders text with one): NANODIST_PLOT_FONT first.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a system font as plotters' "sans-serif", once per process.
fn register_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("NANODIST_PLOT_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONTS.iter().map(PathBuf::from))
            .collect();
        let Some((path, bytes)) = candidates
            .iter()
            .find_map(|p| std::fs::read(p).ok().map(|b| (p, b)))
        else {
            return Err(format!(
                "no TrueType font found for the plot's text (looked at {}); install one (Debian: \
                 apt-get install fonts-dejavu-core) or set NANODIST_PLOT_FONT=/path/to/font.ttf",
                FONTS.join(", ")
            ));
        };
        // plotters keeps fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{}: not a usable TrueType font", path.display()))
    })
    .clone()
    .map_err(|e| bad_input!("{e}"))
}

/// Tableau's ten colors: distinct, readable on white.
const COLORS: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

/// Axis numbers without noise: 40k, 1.2M, 0.5, 300.
fn tick(v: &f64) -> String {
    let a = v.abs();
    let (x, suffix) = match a {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e4 => (v / 1e3, "k"),
        _ => (*v, ""),
    };
    let text = format!("{x:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{suffix}")
}

/// One curve: points and the run it belongs to.
struct Series {
    run: usize,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// Val loss against each run's predicted clock on each cluster (the first solid, the others dashed).
fn predicted(runs: &[Run]) -> Vec<Series> {
    let mut out = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        for (k, p) in run.predicted.iter().enumerate() {
            let points = run
                .rows
                .iter()
                .zip(&p.clock)
                .filter_map(|(r, &t)| Some((t, r.val_loss?)))
                .collect();
            out.push(Series {
                run: i,
                dashed: k > 0,
                points,
            });
        }
    }
    out
}

/// How the figure is drawn (`nanodist plot --title --log-y --smooth`).
#[derive(Debug, Clone, Default)]
pub struct Style {
    /// The figure's title (default: the run's label, or "N runs").
    pub title: Option<String>,
    /// Loss on a logarithmic axis.
    pub log_y: bool,
    /// Each curve as the trailing mean of its last `smooth` points (0 or 1: as logged).
    pub smooth: usize,
}

impl Style {
    /// A curve as drawn: smoothed, then on the loss axis's scale (log10 with `log_y`).
    pub fn apply(&self, points: &[(f64, f64)]) -> Vec<(f64, f64)> {
        let window = self.smooth.max(1);
        let mut sum = 0.0;
        let mut out = Vec::with_capacity(points.len());
        for (i, &(x, y)) in points.iter().enumerate() {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            let mean = sum / (i + 1).min(window) as f64;
            out.push((x, if self.log_y { mean.log10() } else { mean }));
        }
        out
    }
}

/// Draws `runs` to `output` (.png) and to the same path with .svg; returns both paths.
pub fn plot(runs: &[Run], output: &Path, style: &Style) -> Result<(PathBuf, PathBuf)> {
    if runs.is_empty() {
        return Err(bad_input!("plot: give at least one run directory"));
    }
    match output.extension().and_then(|e| e.to_str()) {
        Some("png") => {}
        _ => {
            return Err(bad_input!(
                "--output {}: give a .png path (the .svg is written beside it)",
                output.display()
            ))
        }
    }
    let parent = output.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent.filter(|p| !p.is_dir()) {
        return Err(bad_input!(
            "--output {}: there is no directory {}; create it (mkdir -p {}) or give a path in one that exists",
            output.display(),
            dir.display(),
            dir.display()
        ));
    }
    register_font()?;
    let svg = output.with_extension("svg");
    let title = style.title.clone().unwrap_or_else(|| match runs {
        [one] => one.label(),
        _ => format!("{} runs", runs.len()),
    });
    {
        let root = BitMapBackend::new(output, SIZE).into_drawing_area();
        draw(&root, runs, &title, style)?;
        root.present()
            .map_err(|e| anyhow!("writing {}: {e}", output.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        draw(&root, runs, &title, style)?;
        root.present()
            .map_err(|e| anyhow!("writing {}: {e}", svg.display()))?;
    }
    Ok((output.to_path_buf(), svg))
}

/// Height of a line of the legend, and runs per line.
const LEGEND_LINE: i32 = 24;
const LEGEND_COLUMNS: usize = 2;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[Run],
    title: &str,
    style: &Style,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    // The title, then one legend for all panels: a run keeps its color everywhere.
    let legend_lines = runs.len().div_ceil(LEGEND_COLUMNS) as i32;
    let (top, body) = root.split_vertically(50 + LEGEND_LINE * legend_lines + 6);
    legend(&top, runs, title)?;
    let specs: [(String, &str, Vec<Series>); 4] = [
        (
            "loss vs step (dashed: train, solid: val)".into(),
            "step",
            series_by(runs, &|r, _| r.step as f64, true),
        ),
        (
            "val loss vs tokens".into(),
            "tokens",
            series_by(runs, &|r, _| r.tokens as f64, false),
        ),
        time_panel(runs),
        (
            "val loss vs bytes sent per worker".into(),
            "MB",
            series_by(runs, &|_, b| b as f64 / 1e6, false),
        ),
    ];
    for (panel, (caption, xlabel, mut series)) in body.split_evenly((2, 2)).iter().zip(specs) {
        for s in &mut series {
            s.points = style.apply(&s.points);
        }
        draw_panel(panel, &caption, xlabel, &series, style.log_y)?;
    }
    Ok(())
}

/// The title and one legend line per run (its color and label).
fn legend<DB: DrawingBackend>(top: &DrawingArea<DB, Shift>, runs: &[Run], title: &str) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    top.draw(&Text::new(
        title.to_string(),
        (20, 12),
        ("sans-serif", 26).into_font(),
    ))
    .map_err(err)?;
    let column_width = SIZE.0 as i32 / LEGEND_COLUMNS as i32;
    for (i, run) in runs.iter().enumerate() {
        let (x, y) = (
            20 + column_width * (i % LEGEND_COLUMNS) as i32,
            50 + LEGEND_LINE * (i / LEGEND_COLUMNS) as i32 + LEGEND_LINE / 2,
        );
        let (r, g, b) = COLORS[i % COLORS.len()];
        top.draw(&PathElement::new(
            [(x, y), (x + 30, y)],
            RGBColor(r, g, b).stroke_width(3),
        ))
        .map_err(err)?;
        top.draw(&Text::new(
            run.label(),
            (x + 40, y - 8),
            ("sans-serif", 16).into_font(),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// Each run's val loss (and, with `with_train`, dashed train loss) against `x` of a row and the bytes
/// sent up to it.
fn series_by(
    runs: &[Run],
    x: &dyn Fn(&crate::metrics::Row, u64) -> f64,
    with_train: bool,
) -> Vec<Series> {
    let mut out = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let bytes = run.cumulative_bytes();
        if with_train {
            out.push(Series {
                run: i,
                dashed: true,
                points: run
                    .rows
                    .iter()
                    .zip(&bytes)
                    .map(|(r, &b)| (x(r, b), r.train_loss))
                    .collect(),
            });
        }
        out.push(Series {
            run: i,
            dashed: false,
            points: run
                .rows
                .iter()
                .zip(&bytes)
                .filter_map(|(r, &b)| Some((x(r, b), r.val_loss?)))
                .collect(),
        });
    }
    out
}

/// The time panel: val loss against wall time, or with --cluster the predicted time on each cluster.
fn time_panel(runs: &[Run]) -> (String, &'static str, Vec<Series>) {
    let clusters: Vec<&str> = runs
        .first()
        .map(|r| r.predicted.iter().map(|p| p.cluster.as_str()).collect())
        .unwrap_or_default();
    match clusters.as_slice() {
        [] => (
            "val loss vs wall time".to_string(),
            "seconds",
            series_by(runs, &|r, _| r.elapsed_s, false),
        ),
        [one] => (
            format!("val loss vs predicted time on {one}"),
            "predicted seconds",
            predicted(runs),
        ),
        [first, rest @ ..] => (
            format!(
                "val loss vs predicted time: {first} (solid), {} (dashed)",
                rest.join(", ")
            ),
            "predicted seconds",
            predicted(runs),
        ),
    }
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    xlabel: &str,
    series: &[Series],
    log_y: bool,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        // Nothing to draw (no evaluation yet): leave the panel with its caption.
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1.max(x0 + 1e-9), (y0 - pad)..(y1 + pad))
        .map_err(err)?;
    // On a log axis the points are log10(loss): the labels show the loss itself.
    let y_label = |v: &f64| tick(&if log_y { 10f64.powf(*v) } else { *v });
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(if log_y {
            "loss (nats, log scale)"
        } else {
            "loss (nats)"
        })
        .x_label_formatter(&tick)
        .y_label_formatter(&y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for s in series {
        let (r, g, b) = COLORS[s.run % COLORS.len()];
        let color = RGBColor(r, g, b).to_rgba();
        let style = ShapeStyle::from(&color).stroke_width(if s.dashed { 1 } else { 2 });
        let points = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite());
        if s.dashed {
            chart
                .draw_series(DashedLineSeries::new(points, 6, 4, style))
                .map_err(err)?;
        } else {
            chart
                .draw_series(LineSeries::new(points, style))
                .map_err(err)?;
        }
    }
    Ok(())
}
