//! PNG charts with plotters' bitmap backend. Text needs a TrueType font: the first of a few
//! common system paths (or `$CACHET_PLOT_FONT`) is loaded at run time with `ab_glyph`; with
//! none found the chart is drawn without text.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::error::BenchError;
use crate::serve::ServeReport;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a font as "sans-serif" once; false when none could be loaded.
fn font_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let env = std::env::var("CACHET_PLOT_FONT").ok();
        let paths = env
            .iter()
            .map(String::as_str)
            .chain(FONT_PATHS.iter().copied());
        for p in paths {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.retain(|x| x.is_finite());
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// Writes a 1200×500 PNG: CDFs of TTFT (left) and inter-token latency (right), in ms, one
/// line per report.
pub fn write_png(path: &Path, reports: &[&ServeReport]) -> Result<(), BenchError> {
    draw(path, reports, font_available()).map_err(|e| BenchError::Plot(e.to_string()))
}

fn draw(
    path: &Path,
    reports: &[&ServeReport],
    text: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    type Getter = fn(&ServeReport) -> Vec<f64>;
    let series: [(&str, Getter); 2] = [
        ("TTFT (ms), CDF", |r| {
            r.requests
                .iter()
                .filter_map(|q| q.ttft_s)
                .map(|x| x * 1e3)
                .collect()
        }),
        ("inter-token latency (ms), CDF", |r| {
            r.requests
                .iter()
                .flat_map(|q| q.itl_s.iter().map(|x| x * 1e3))
                .collect()
        }),
    ];
    for (panel, (title, get)) in panels.iter().zip(series) {
        let lines: Vec<Vec<(f64, f64)>> = reports.iter().map(|r| cdf(get(r))).collect();
        let xmax = lines
            .iter()
            .flat_map(|l| l.iter().map(|p| p.0))
            .fold(1e-3, f64::max)
            * 1.05;
        let mut b = ChartBuilder::on(panel);
        b.margin(15);
        if text {
            b.caption(title, ("sans-serif", 20))
                .x_label_area_size(35)
                .y_label_area_size(45);
        }
        let mut chart = b.build_cartesian_2d(0f64..xmax, 0f64..1.0)?;
        let mut mesh = chart.configure_mesh();
        if !text {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw()?;
        for (i, (l, r)) in lines.into_iter().zip(reports).enumerate() {
            let color = COLORS[i % COLORS.len()];
            let s = chart.draw_series(LineSeries::new(l, color.stroke_width(2)))?;
            if text {
                s.label(r.label.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            }
        }
        if text {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 15))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_by_hand() {
        assert_eq!(
            cdf(vec![3.0, 1.0, 2.0, 4.0]),
            vec![(1.0, 0.25), (2.0, 0.5), (3.0, 0.75), (4.0, 1.0)]
        );
    }
}
