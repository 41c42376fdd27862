//! The benchmark's plots (SVG, plotters): replay time against backlog size, and the live
//! latency CDF.

use std::path::Path;

use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::prelude::*;

/// One line of a plot.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 4] = [BLUE, RED, GREEN, MAGENTA];
const SIZE_PX: (u32, u32) = (860, 520);

/// Replay time (ready → live, seconds) against backlog size (events), log-log, one line per
/// value size.
pub fn replay_vs_backlog(path: &Path, series: &[Series]) -> Result<(), String> {
    log_log(
        path,
        "Tether replay: ready -> live against backlog size",
        "backlog (events)",
        "ready -> live (s)",
        series,
        true,
    )
}

/// Live end-to-end latency CDF: fraction of events (y) delivered within x microseconds (log).
pub fn latency_cdf(path: &Path, series: &[Series]) -> Result<(), String> {
    log_log(
        path,
        "Tether live latency CDF (publish -> application)",
        "latency (us)",
        "fraction of events",
        series,
        false,
    )
}

fn log_log(
    path: &Path,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    log_y: bool,
) -> Result<(), String> {
    let pts = || series.iter().flat_map(|s| s.points.iter().copied());
    let (x_min, x_max) = bounds(pts().map(|p| p.0)).ok_or("no points")?;
    let (y_min, y_max) = bounds(pts().map(|p| p.1)).ok_or("no points")?;
    let root = SVGBackend::new(path, SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64);
    let x = ((x_min / 1.5)..(x_max * 1.5)).log_scale();
    let labels = Labels {
        x_desc,
        y_desc,
        series,
    };
    if log_y {
        let y = ((y_min / 1.5)..(y_max * 1.5)).log_scale();
        let mut chart = builder
            .build_cartesian_2d(x, y)
            .map_err(|e| e.to_string())?;
        labels.draw(&mut chart, true, SeriesLabelPosition::UpperLeft)?;
    } else {
        let mut chart = builder
            .build_cartesian_2d(x, 0.0..1.0)
            .map_err(|e| e.to_string())?;
        labels.draw(&mut chart, false, SeriesLabelPosition::LowerRight)?;
    }
    root.present().map_err(|e| e.to_string())
}

/// The mesh, the lines (with their points, or not) and the legend of a chart.
struct Labels<'a> {
    x_desc: &'a str,
    y_desc: &'a str,
    series: &'a [Series],
}

impl Labels<'_> {
    fn draw<'b, X, Y>(
        &self,
        chart: &mut ChartContext<'b, SVGBackend<'b>, Cartesian2d<X, Y>>,
        points: bool,
        legend: SeriesLabelPosition,
    ) -> Result<(), String>
    where
        X: Ranged<ValueType = f64> + ValueFormatter<f64>,
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        chart
            .configure_mesh()
            .x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .x_label_formatter(&|v| human(*v))
            .y_label_formatter(&|v| human(*v))
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, s) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(&s.label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            if points {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())
    }
}

/// A tick label with at most three significant digits: 1000 → "1k", 2500000 → "2.5M",
/// 0.25 → "0.25", 0.30000000000000004 → "0.3", 0.0125 → "0.0125".
fn human(v: f64) -> String {
    let (x, unit) = match v.abs() {
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    // Decimals for three significant digits (none for 100 and over).
    let magnitude = if x == 0.0 {
        0
    } else {
        x.abs().log10().floor() as i32
    };
    let decimals = (2 - magnitude).clamp(0, 9) as usize;
    let s = format!("{x:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    format!("{s}{unit}")
}

fn bounds(v: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    v.filter(|x| *x > 0.0).fold(None, |acc, x| match acc {
        None => Some((x, x)),
        Some((lo, hi)) => Some((lo.min(x), hi.max(x))),
    })
}

/// The CDF of a latency histogram as (microseconds, fraction) points, finer in the tail.
pub fn cdf_points(h: &hdrhistogram::Histogram<u64>) -> Vec<(f64, f64)> {
    let mut qs: Vec<f64> = (0..99).map(|i| i as f64 / 100.0).collect();
    qs.extend((990..999).map(|i| i as f64 / 1000.0));
    qs.extend([0.999, 0.9995, 0.9999, 1.0]);
    qs.into_iter()
        .map(|q| (h.value_at_quantile(q).max(1) as f64, q))
        .collect()
}
