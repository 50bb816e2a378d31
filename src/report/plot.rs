//! `nanodist plot`: loss curves of one or several runs, as a PNG and an SVG of panels: train and val loss
//! vs step, val loss vs tokens, val loss vs cumulative bytes each worker sent (log axis), and val loss vs
//! wall time, or one panel per `--cluster` of the time predicted there. The loss axis frames where the
//! runs differ: it leaves out the first tenth of each panel's x range (the initial loss), unless `--ylim`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::axis::{clip, Axis};
use super::Run;
use crate::bad_input;

/// Width of the figure, and height of a row of two panels, in pixels.
pub const WIDTH: u32 = 1600;
const ROW: u32 = 500;

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

/// Axis numbers without noise: 40k, 1.2M, 0.5, 2.425, 300.
fn tick(v: &f64) -> String {
    let a = v.abs();
    let (x, suffix) = match a {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e4 => (v / 1e3, "k"),
        _ => (*v, ""),
    };
    let text = format!("{x:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{suffix}")
}

/// One curve: points and the run it belongs to.
#[derive(Debug, Clone)]
pub struct Series {
    pub run: usize,
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

/// How the figure is drawn (`nanodist plot --title --log-x --log-y --ylim --smooth`).
#[derive(Debug, Clone, Default)]
pub struct Style {
    /// The figure's title (default: the run's label, or "N runs").
    pub title: Option<String>,
    /// Steps, tokens and time on logarithmic axes (bytes always are).
    pub log_x: bool,
    /// Loss on a logarithmic axis.
    pub log_y: bool,
    /// The loss axis's range, instead of the one that frames where the runs differ.
    pub ylim: Option<(f64, f64)>,
    /// Each curve as the trailing mean of its last `smooth` points (0 or 1: as logged).
    pub smooth: usize,
}

impl Style {
    /// A curve as drawn: the trailing mean of its last `smooth` points.
    pub fn apply(&self, points: &[(f64, f64)]) -> Vec<(f64, f64)> {
        let window = self.smooth.max(1);
        let mut sum = 0.0;
        let mut out = Vec::with_capacity(points.len());
        for (i, &(x, y)) in points.iter().enumerate() {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            out.push((x, sum / (i + 1).min(window) as f64));
        }
        out
    }
}

/// One panel: its caption, axes and curves.
#[derive(Debug, Clone)]
pub struct Panel {
    pub caption: String,
    pub x_label: String,
    pub x: Axis,
    pub y: Axis,
    pub series: Vec<Series>,
}

impl Panel {
    /// The panel of `series` (smoothed by `style`), its axes framed around them.
    fn new(
        caption: String,
        x_label: &str,
        log_x: bool,
        series: Vec<Series>,
        style: &Style,
    ) -> Self {
        let series: Vec<Series> = series
            .into_iter()
            .map(|s| Series {
                points: style.apply(&s.points),
                ..s
            })
            .collect();
        let xs = Axis::new(0.0, 1.0, log_x);
        let ok = |&&(x, y): &&(f64, f64)| xs.takes(x) && y.is_finite() && (!style.log_y || y > 0.0);
        let pts: Vec<(f64, f64)> = series
            .iter()
            .flat_map(|s| s.points.iter().filter(ok).copied())
            .collect();
        let (x0, x1) = bounds(pts.iter().map(|p| p.0)).unwrap_or((1.0, 2.0));
        let x = Axis::new(x0, x1, log_x);
        // Past the first tenth of the x range (on its drawn scale): where the runs differ.
        let cut = x.scaled(x0) + 0.1 * (x.scaled(x1) - x.scaled(x0));
        let late = pts.iter().filter(|p| x.scaled(p.0) >= cut).map(|p| p.1);
        let (y0, y1) = style
            .ylim
            .or_else(|| bounds(late))
            .or_else(|| bounds(pts.iter().map(|p| p.1)))
            .unwrap_or((1.0, 2.0));
        let pad = if style.ylim.is_some() {
            0.0
        } else {
            ((y1 - y0) * 0.05).max(1e-3)
        };
        let y = Axis::new(y0 - pad, y1 + pad, style.log_y);
        Self {
            caption,
            x_label: x_label.into(),
            x,
            y,
            series,
        }
    }
}

/// The smallest and largest of `values`, if any.
fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |b, v| match b {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// The figure's panels: loss vs step, vs tokens, vs cumulative bytes (log), and vs wall time or one panel
/// per cluster the runs were priced on.
pub fn panels(runs: &[Run], style: &Style) -> Vec<Panel> {
    let log_x = style.log_x;
    let mut out = vec![
        Panel::new(
            "loss vs step (dashed: train, solid: val)".into(),
            "step",
            log_x,
            series_by(runs, &|r, _| r.step as f64, true),
            style,
        ),
        Panel::new(
            "val loss vs tokens".into(),
            "tokens",
            log_x,
            series_by(runs, &|r, _| r.tokens as f64, false),
            style,
        ),
        Panel::new(
            "val loss vs cumulative bytes sent per worker".into(),
            "bytes (log scale)",
            true,
            series_by(runs, &|_, b| b as f64, false),
            style,
        ),
    ];
    let clusters: Vec<String> = runs
        .first()
        .map(|r| r.predicted.iter().map(|p| p.cluster.clone()).collect())
        .unwrap_or_default();
    if clusters.is_empty() {
        out.push(Panel::new(
            "val loss vs wall time".into(),
            "seconds",
            log_x,
            series_by(runs, &|r, _| r.elapsed_s, false),
            style,
        ));
    }
    for (k, cluster) in clusters.iter().enumerate() {
        out.push(Panel::new(
            format!("val loss vs predicted time on {cluster}"),
            "predicted seconds",
            log_x,
            predicted(runs, k),
            style,
        ));
    }
    out
}

/// Val loss against each run's predicted clock on its `k`th cluster.
fn predicted(runs: &[Run], k: usize) -> Vec<Series> {
    let on = |(i, run): (usize, &Run)| {
        let p = run.predicted.get(k)?;
        let points = run
            .rows
            .iter()
            .zip(&p.clock)
            .filter_map(|(r, &t)| Some((t, r.val_loss?)))
            .collect();
        Some(Series {
            run: i,
            dashed: false,
            points,
        })
    };
    runs.iter().enumerate().filter_map(on).collect()
}

/// The figure's size for `panels` panels, two to a row.
pub fn size(panels: usize) -> (u32, u32) {
    (WIDTH, 120 + ROW * panels.div_ceil(2) as u32)
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
    let panels = panels(runs, style);
    let size = size(panels.len());
    {
        let root = BitMapBackend::new(output, size).into_drawing_area();
        draw(&root, runs, &panels, &title)?;
        root.present()
            .map_err(|e| anyhow!("writing {}: {e}", output.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw(&root, runs, &panels, &title)?;
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
    panels: &[Panel],
    title: &str,
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
    let areas = body.split_evenly((panels.len().div_ceil(2), 2));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel)?;
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
    let column_width = WIDTH as i32 / LEGEND_COLUMNS as i32;
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

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(panel.x.clone(), panel.y.clone())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(&panel.x_label)
        .y_desc(if panel.y.log {
            "loss (nats, log scale)"
        } else {
            "loss (nats)"
        })
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for s in &panel.series {
        let (r, g, b) = COLORS[s.run % COLORS.len()];
        let color = RGBColor(r, g, b).to_rgba();
        let style = ShapeStyle::from(&color).stroke_width(if s.dashed { 1 } else { 2 });
        for part in clip(&s.points, &panel.x, &panel.y) {
            if s.dashed {
                chart
                    .draw_series(DashedLineSeries::new(part, 6, 4, style))
                    .map_err(err)?;
            } else {
                chart
                    .draw_series(LineSeries::new(part, style))
                    .map_err(err)?;
            }
        }
    }
    Ok(())
}
