//! SVG charts of benchmark results (plotters, SVG backend only): latency CDFs with one line per
//! target, and bar charts (per-pod load, per-target figures).

use std::path::Path;

use plotters::prelude::*;

/// Errors are only ever reported (a chart is a by-product of a run), so one string suffices.
pub type ChartResult = Result<(), String>;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The points of an empirical CDF of `values` (sorted copies; at most ~400 points so the SVG
/// stays small).
pub fn cdf_points(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(400).max(1);
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    if out.last().map(|p| p.1) != Some(1.0) {
        out.push((v[n - 1], 1.0));
    }
    out
}

/// Latency CDF, one line per `(label, values in ms)`, x on a log scale (latencies of
/// different targets span decades).
pub fn latency_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> ChartResult {
    let curves: Vec<(String, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(l, v)| (l.clone(), cdf_points(v)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if curves.is_empty() {
        return Err(format!("{title}: no samples"));
    }
    let lo = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(f64::INFINITY, f64::min)
        .max(0.01);
    let hi = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(0.0, f64::max)
        .max(lo * 1.5);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency, ms (log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (i, (label, points)) in curves.into_iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Horizontal bars, one per `(label, value)`, e.g. requests or prompt tokens per pod.
pub fn bars(path: &Path, title: &str, x_desc: &str, rows: &[(String, f64)]) -> ChartResult {
    if rows.is_empty() {
        return Err(format!("{title}: no rows"));
    }
    let max = rows.iter().map(|r| r.1).fold(0.0, f64::max).max(1e-9);
    let height = (rows.len() as u32 * 26 + 90).max(200);
    let root = SVGBackend::new(path, (800, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let label_width = rows.iter().map(|r| r.0.len()).max().unwrap_or(8) as u32 * 7 + 10;
    let n = rows.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(label_width.min(330))
        .build_cartesian_2d(0.0..max * 1.1, (0..n).into_segmented())
        .map_err(err)?;
    let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(x_desc)
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()
        .map_err(err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, (_, v))| {
            let mut bar = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (*v, SegmentValue::Exact(i + 1)),
                ],
                colour(i).filled(),
            );
            bar.set_margin(3, 3, 0, 0);
            bar
        }))
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let v: Vec<f64> = (0..1000).rev().map(f64::from).collect();
        let p = cdf_points(&v);
        assert!(p.len() <= 401);
        assert!(p.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(p.last(), Some(&(999.0, 1.0)));
        assert_eq!(p[0], (0.0, 1.0 / 1000.0));
        assert!(cdf_points(&[f64::NAN]).is_empty());
    }

    #[test]
    fn charts_are_svg_files() {
        let dir = std::env::temp_dir().join(format!("pd-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cdf = dir.join("cdf.svg");
        latency_cdf(
            &cdf,
            "t",
            &[
                ("a".into(), vec![1.0, 2.0, 3.0]),
                ("b".into(), vec![2.0, 4.0]),
            ],
        )
        .unwrap();
        let text = std::fs::read_to_string(&cdf).unwrap();
        // plotters writes each label on its own line inside <text>.
        let label = |l: &str| text.contains(&format!("\n{l}\n</text>"));
        assert!(text.starts_with("<svg") && label("a") && label("b") && label("t"));
        let bar = dir.join("bars.svg");
        bars(
            &bar,
            "pods",
            "requests",
            &[("pod-0".into(), 3.0), ("pod-1".into(), 5.0)],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&bar).unwrap().contains("pod-1"));
        assert!(latency_cdf(&dir.join("x.svg"), "empty", &[]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
