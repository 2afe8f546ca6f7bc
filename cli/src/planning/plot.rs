//! SVG plot of GPU memory over one iteration, one line per policy plus the capacity line
//! (`teraio plan --svg`, `teraio sim --svg`).

use std::path::Path;

use plotters::prelude::*;
use teraio_planner::lifetime::{base_pressure_bytes, Timeline};
use teraio_planner::trace::Trace;

use crate::error::{CliError, CliResult};

/// Most points drawn per line; longer series are thinned keeping each bucket's maximum.
pub const POINTS_PER_SERIES_MAX: usize = 4000;

/// One line: a label and (microseconds, bytes) samples.
pub type Series = (String, Vec<(f64, u64)>);

fn thin(points: &[(f64, u64)]) -> Vec<(f64, f64)> {
    const GIB: f64 = (1u64 << 30) as f64;
    let to_point = |&(t, b): &(f64, u64)| (t / 1e6, b as f64 / GIB);
    if points.len() <= POINTS_PER_SERIES_MAX {
        return points.iter().map(to_point).collect();
    }
    let bucket = points.len().div_ceil(POINTS_PER_SERIES_MAX / 2);
    let mut out = Vec::with_capacity(POINTS_PER_SERIES_MAX);
    for chunk in points.chunks(bucket) {
        let first = to_point(&chunk[0]);
        let peak = chunk.iter().map(to_point).fold(first, |a, b| if b.1 > a.1 { b } else { a });
        out.push(first);
        out.push(peak);
    }
    out
}

/// Draws memory over time (seconds, GiB) into an SVG file.
pub fn plot_memory(path: &Path, title: &str, capacity_bytes: u64, series: &[Series]) -> CliResult<()> {
    let plot_error = |reason: String| CliError::failed(format!("plot {}: {reason}", path.display()));
    let lines: Vec<(String, Vec<(f64, f64)>)> =
        series.iter().map(|(label, points)| (label.clone(), thin(points))).collect();
    let capacity_gib = capacity_bytes as f64 / (1u64 << 30) as f64;
    let x_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)).fold(1e-9, f64::max);
    let y_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).fold(capacity_gib, f64::max) * 1.1;
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| plot_error(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("time in iteration (s)")
        .y_desc("GPU memory (GiB)")
        .draw()
        .map_err(|e| plot_error(e.to_string()))?;
    chart
        .draw_series(LineSeries::new(vec![(0.0, capacity_gib), (x_max, capacity_gib)], BLACK.stroke_width(2)))
        .map_err(|e| plot_error(e.to_string()))?
        .label("GPU capacity")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    for (index, (label, points)) in lines.into_iter().enumerate() {
        let color = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| plot_error(e.to_string()))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_error(e.to_string()))?;
    root.present().map_err(|e| plot_error(e.to_string()))?;
    Ok(())
}

/// Memory with nothing moved, on the stall-free time axis (the "before" line of the plot).
pub fn unplanned_series(trace: &Trace) -> Series {
    let timeline = Timeline::new(trace);
    let pressure = base_pressure_bytes(trace);
    let mut points = Vec::with_capacity(pressure.len() * 2);
    for (slot, &bytes) in pressure.iter().enumerate() {
        points.push((timeline.start_us[slot], bytes));
        points.push((timeline.start_us[slot] + timeline.duration_us[slot], bytes));
    }
    ("no offload".to_string(), points)
}
