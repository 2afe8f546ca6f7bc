//! Plot of GPU memory over one iteration, one line per policy plus the capacity line, as SVG or
//! PNG (`teraio plan --svg/--png`, `teraio sim --svg/--png`): one drawing, either backend.
//!
//! What makes it readable: the title and the trace's description are wrapped to the width; each
//! line after the first is dashed in its own pattern, so a line drawn over an identical one still
//! shows; the y axis spans the planned lines and the budget, not the peak without offload (which
//! can be ten times the budget and flatten everything that matters) unless `full_y` asks for it.

use std::path::Path;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use teraio_planner::lifetime::{base_pressure_bytes, Timeline};
use teraio_planner::trace::Trace;

use crate::error::{CliError, CliResult};

/// Most points drawn per line; longer series are thinned keeping each bucket's maximum.
pub const POINTS_PER_SERIES_MAX: usize = 4000;
/// The picture's size in pixels.
pub const PLOT_SIZE: (u32, u32) = (1000, 560);
const MARGIN: u32 = 12;
const TITLE_FONT: u32 = 20;
const DESCRIPTION_FONT: u32 = 14;
/// Average glyph width of a sans-serif font as a share of its size: wrapping at this width keeps
/// every line inside the picture.
const GLYPH_WIDTH_SHARE: f64 = 0.6;
/// Lines of the trace description at most (a longer one is cut, saying so with "...").
const DESCRIPTION_LINES_MAX: usize = 3;
/// Dash and gap lengths (pixels) of the lines after the first, in turn; the first is solid.
const DASHES: [(u32, u32); 4] = [(10, 5), (3, 3), (14, 4), (6, 2)];

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

/// Words of `text` in lines of at most `width_chars` characters, at most `lines_max` lines (the
/// last ends in "..." where text was left out). A word longer than a line is cut.
pub fn wrap(text: &str, width_chars: usize, lines_max: usize) -> Vec<String> {
    assert!(width_chars >= 4 && lines_max >= 1);
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        let word: String = word.chars().take(width_chars).collect();
        if !current.is_empty() && current.chars().count() + 1 + word.chars().count() > width_chars {
            lines.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(&word);
    }
    if !current.is_empty() {
        lines.push(current);
    }
    if lines.len() > lines_max {
        lines.truncate(lines_max);
        let last = &mut lines[lines_max - 1];
        let kept: String = last.chars().take(width_chars - 3).collect();
        *last = format!("{kept}...");
    }
    lines
}

/// Characters of a `font_px` font that fit `width_px`.
fn chars_fitting(width_px: u32, font_px: u32) -> usize {
    (f64::from(width_px) / (GLYPH_WIDTH_SHARE * f64::from(font_px))).floor() as usize
}

/// The y axis's top (GiB): 10% above the highest of the budget and the lines it spans.
fn y_top_gib(capacity_gib: f64, lines: &[(String, Vec<(f64, f64)>)]) -> f64 {
    lines.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).fold(capacity_gib, f64::max) * 1.1
}

/// The file format of a plot: the same chart either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlotFormat {
    /// Vector; text is drawn by the viewer in its own sans-serif font.
    Svg,
    /// Bitmap of `PLOT_SIZE` pixels; text is drawn in the embedded DejaVu Sans.
    Png,
}

/// DejaVu Sans (cli/assets/fonts/, with its license): the PNG's text, and the text metrics both
/// formats lay out with, so the binary needs no system font.
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Registers the embedded font as "sans-serif", once: plotters' text layout (SVG) and text
/// drawing (PNG) look fonts up by name and fail on one never registered.
fn register_font() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        let registered = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok();
        assert!(registered, "the embedded DejaVu Sans parses");
    });
}

/// What one plot draws, worked out once for either format.
struct MemoryChart {
    title: Vec<String>,
    described: Vec<String>,
    header_px: u32,
    capacity_gib: f64,
    x_max: f64,
    y_max: f64,
    /// The unconstrained line first, then the planned ones.
    lines: Vec<(String, Vec<(f64, f64)>)>,
}

impl MemoryChart {
    fn new(description: &str, capacity_bytes: u64, unconstrained: &Series, planned: &[Series], full_y: bool) -> Self {
        let capacity_gib = capacity_bytes as f64 / (1u64 << 30) as f64;
        let unconstrained_line = thin(&unconstrained.1);
        let planned_lines: Vec<(String, Vec<(f64, f64)>)> =
            planned.iter().map(|(label, points)| (label.clone(), thin(points))).collect();
        let unconstrained_peak = unconstrained_line.iter().map(|(_, y)| *y).fold(0.0, f64::max);
        let y_max = if full_y || planned_lines.is_empty() {
            y_top_gib(capacity_gib, &planned_lines).max(unconstrained_peak * 1.1)
        } else {
            y_top_gib(capacity_gib, &planned_lines)
        };
        let unconstrained_label = if unconstrained_peak > y_max {
            format!("{} (peak {unconstrained_peak:.1} GiB, above the chart; --svg-full-y shows it)", unconstrained.0)
        } else {
            unconstrained.0.clone()
        };
        let lines: Vec<_> = std::iter::once((unconstrained_label, unconstrained_line)).chain(planned_lines).collect();
        let x_max = lines.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)).fold(1e-9, f64::max);
        let text_width = PLOT_SIZE.0 - 2 * MARGIN;
        let title = wrap("GPU memory over one iteration", chars_fitting(text_width, TITLE_FONT), 1);
        let described = wrap(description, chars_fitting(text_width, DESCRIPTION_FONT), DESCRIPTION_LINES_MAX);
        let header_px =
            MARGIN + (TITLE_FONT + 6) * title.len() as u32 + (DESCRIPTION_FONT + 4) * described.len() as u32;
        MemoryChart { title, described, header_px, capacity_gib, x_max, y_max, lines }
    }

    /// Draws the chart on `root`, whatever its backend (SVG or bitmap).
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        root.fill(&WHITE)?;
        let (header, body) = root.split_vertically(self.header_px + MARGIN);
        let mut y = MARGIN as i32;
        for line in &self.title {
            header.draw(&Text::new(line.clone(), (MARGIN as i32, y), ("sans-serif", TITLE_FONT).into_font()))?;
            y += (TITLE_FONT + 6) as i32;
        }
        for line in &self.described {
            header.draw(&Text::new(line.clone(), (MARGIN as i32, y), ("sans-serif", DESCRIPTION_FONT).into_font()))?;
            y += (DESCRIPTION_FONT + 4) as i32;
        }
        assert!(
            y as u32 <= self.header_px + MARGIN && self.header_px < PLOT_SIZE.1 / 2,
            "the header leaves room for the chart"
        );

        let (x_max, capacity_gib) = (self.x_max, self.capacity_gib);
        let mut chart = ChartBuilder::on(&body)
            .margin(MARGIN)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..self.y_max)?;
        chart.configure_mesh().x_desc("time in iteration (s)").y_desc("GPU memory (GiB)").draw()?;
        chart
            .draw_series(LineSeries::new(vec![(0.0, capacity_gib), (x_max, capacity_gib)], BLACK.stroke_width(2)))?
            .label(format!("GPU capacity ({capacity_gib:.2} GiB)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        for (index, (label, points)) in self.lines.iter().enumerate() {
            let color = Palette99::pick(index).to_rgba();
            let style = color.stroke_width(2);
            let points = points.iter().copied();
            // Points above the axis are clipped to the chart area.
            if index == 0 {
                chart
                    .draw_series(LineSeries::new(points, style))?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            } else {
                let (dash, gap) = DASHES[(index - 1) % DASHES.len()];
                chart
                    .draw_series(DashedLineSeries::new(points, dash, gap, style))?
                    .label(label)
                    .legend(move |(x, y)| DashedPathElement::new(vec![(x, y), (x + 24, y)], dash, gap, style));
            }
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        root.present()
    }
}

/// Draws memory over time (seconds, GiB) into `path` as `format`: `unconstrained` (memory with
/// nothing moved) and `planned` (one line per plan or policy) against `capacity_bytes`. The y
/// axis spans the planned lines and the capacity; with `full_y` also the unconstrained peak.
/// The picture is drawn in memory and then written, so a path that cannot be written is an
/// error of its own (exit 1) and leaves no partial file.
pub fn plot_memory(
    path: &Path,
    format: PlotFormat,
    description: &str,
    capacity_bytes: u64,
    unconstrained: &Series,
    planned: &[Series],
    full_y: bool,
) -> CliResult<()> {
    register_font();
    let plot_error = |reason: String| CliError::failed(format!("plot {}: {reason}", path.display()));
    let chart = MemoryChart::new(description, capacity_bytes, unconstrained, planned, full_y);
    let bytes = match format {
        PlotFormat::Svg => {
            let mut svg = String::new();
            chart
                .draw(&SVGBackend::with_string(&mut svg, PLOT_SIZE).into_drawing_area())
                .map_err(|e| plot_error(e.to_string()))?;
            svg.into_bytes()
        }
        PlotFormat::Png => {
            let (width, height) = PLOT_SIZE;
            let mut rgb = vec![0u8; width as usize * height as usize * 3];
            chart
                .draw(&BitMapBackend::with_buffer(&mut rgb, PLOT_SIZE).into_drawing_area())
                .map_err(|e| plot_error(e.to_string()))?;
            encode_png(&rgb, PLOT_SIZE).map_err(|e| plot_error(e.to_string()))?
        }
    };
    std::fs::write(path, bytes).map_err(|e| {
        CliError::failed(format!(
            "cannot write the plot to {}: {e}; name a file in a directory that exists and is writable",
            path.display()
        ))
    })
}

/// `rgb` (8-bit RGB rows of `width` pixels) as a PNG file's bytes.
fn encode_png(rgb: &[u8], (width, height): (u32, u32)) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn svg_path(name: &str) -> std::path::PathBuf {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-files");
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(format!("teraio-plot-{name}-{}.svg", std::process::id()))
    }

    /// A text element of an SVG: font size, left and right edges (px, from its anchor and its width
    /// in the embedded font), whether
    /// it is rotated, and its text.
    struct SvgText {
        font: f64,
        left: f64,
        right: f64,
        rotated: bool,
        text: String,
    }

    fn texts(svg: &str) -> Vec<SvgText> {
        register_font();
        let attribute = |element: &str, name: &str| -> Option<String> {
            let start = element.find(&format!(" {name}=\"")).map(|i| i + name.len() + 3)?;
            element[start..].split('"').next().map(str::to_string)
        };
        svg.split("<text")
            .skip(1)
            .map(|rest| {
                let (element, after) = rest.split_once('>').unwrap();
                let text = after.split("</text>").next().unwrap().trim().to_string();
                let font: f64 = attribute(element, "font-size").unwrap().parse().unwrap();
                let x: f64 = attribute(element, "x").unwrap().parse().unwrap();
                // Measured in the embedded DejaVu Sans, the font the layout was computed with (one
                // of the widest sans-serif fonts a viewer may substitute).
                let width = f64::from(("sans-serif", font).into_font().box_size(&text).unwrap().0);
                let left = match attribute(element, "text-anchor").as_deref() {
                    Some("end") => x - width,
                    Some("middle") => x - width / 2.0,
                    _ => x,
                };
                SvgText { font, left, right: left + width, rotated: element.contains("rotate("), text }
            })
            .collect()
    }

    /// The y axis's tick labels (GiB): numbers right-aligned left of the plot area.
    fn y_ticks(svg: &str) -> Vec<f64> {
        texts(svg).iter().filter(|t| t.right < 100.0 && !t.rotated).filter_map(|t| t.text.parse::<f64>().ok()).collect()
    }

    fn series(label: &str, peak_bytes: u64) -> Series {
        (label.to_string(), vec![(0.0, GIB), (5e5, peak_bytes), (1e6, GIB)])
    }

    #[test]
    fn titles_wrap_inside_the_picture_and_say_all_of_a_long_description() {
        let description = "Llama3 70B Fp32 layers 80 (this stage 40..80) hidden 8192 heads 64/8 ffn 28672 vocab \
                           128256 seq 2048 batch 2 on h100-nvl, 4 SSDs of 6.7/6.5 GB/s and 385 GiB of host memory";
        let path = svg_path("title");
        plot_memory(
            &path,
            PlotFormat::Svg,
            description,
            94 * GIB,
            &series("no offload", 526 * GIB),
            &[series("teraio", 90 * GIB)],
            false,
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let texts = texts(&svg);
        for t in texts.iter().filter(|t| !t.rotated) {
            assert!(
                t.left >= 0.0 && t.right <= f64::from(PLOT_SIZE.0),
                "{:?} runs past the edge ({} px)",
                t.text,
                t.right
            );
        }
        let title_font = texts.iter().find(|t| t.text == "GPU memory over one iteration").expect("the title").font;
        let described: Vec<&str> = texts
            .iter()
            .filter(|t| t.font < title_font && t.left == f64::from(MARGIN))
            .map(|t| t.text.as_str())
            .collect();
        assert!(described.len() >= 2, "the description wraps: {described:?}");
        assert_eq!(described.join(" "), description.split_whitespace().collect::<Vec<_>>().join(" "));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_y_axis_spans_the_plan_and_the_budget_unless_asked_for_the_unconstrained_peak() {
        let path = svg_path("axis");
        let unconstrained = series("no offload", 526 * GIB);
        plot_memory(&path, PlotFormat::Svg, "t", 94 * GIB, &unconstrained, &[series("teraio", 90 * GIB)], false)
            .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let top = y_ticks(&svg).into_iter().fold(0.0, f64::max);
        assert!((94.0..=94.0 * 1.1).contains(&top), "top tick {top} GiB: the budget, not the 526 GiB peak");
        assert!(svg.contains("no offload (peak 526.0 GiB, above the chart; --svg-full-y shows it)"), "{svg}");
        plot_memory(&path, PlotFormat::Svg, "t", 94 * GIB, &unconstrained, &[series("teraio", 90 * GIB)], true)
            .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let top = y_ticks(&svg).into_iter().fold(0.0, f64::max);
        assert!(top >= 500.0, "with full_y the axis reaches the peak: top tick {top}");
        assert!(!svg.contains("above the chart"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn identical_lines_stay_apart_by_their_dashes() {
        let path = svg_path("dashes");
        let same = series("teraio", 90 * GIB);
        let other = ("teraio-ssd".to_string(), same.1.clone());
        plot_memory(&path, PlotFormat::Svg, "t", 94 * GIB, &series("no offload", 100 * GIB), &[same, other], false)
            .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        // A solid line is one polyline; a dashed one is drawn as many short segments.
        let polylines = svg.matches("<polyline").count();
        let segments = svg.matches("<line").count();
        assert!(polylines >= 2 && segments > 20, "{polylines} polylines, {segments} segments");
        let labels: Vec<String> = texts(&svg).into_iter().map(|t| t.text).collect();
        assert!(labels.contains(&"teraio".to_string()) && labels.contains(&"teraio-ssd".to_string()), "{labels:?}");
        std::fs::remove_file(&path).unwrap();
    }

    /// A decoded PNG: width, height and 8-bit RGB pixels.
    fn decode_png(bytes: &[u8]) -> (u32, u32, Vec<[u8; 3]>) {
        let mut reader = png::Decoder::new(bytes).read_info().unwrap();
        let mut buffer = vec![0; reader.output_buffer_size()];
        let frame = reader.next_frame(&mut buffer).unwrap();
        assert_eq!((frame.color_type, frame.bit_depth), (png::ColorType::Rgb, png::BitDepth::Eight));
        let pixels = buffer[..frame.buffer_size()].chunks(3).map(|p| [p[0], p[1], p[2]]).collect();
        (frame.width, frame.height, pixels)
    }

    #[test]
    fn the_png_is_the_svg_chart_in_pixels_with_nothing_past_its_edges() {
        let description = "Llama3 70B Fp32 layers 80 (this stage 40..80) hidden 8192 heads 64/8 ffn 28672 vocab \
                           128256 seq 2048 batch 2 on h100-nvl, 4 SSDs of 6.7/6.5 GB/s and 385 GiB of host memory";
        let (png_path, svg_path) = (svg_path("bitmap").with_extension("png"), svg_path("bitmap"));
        let planned = [series("teraio", 90 * GIB), series("lru", 80 * GIB)];
        for (path, format) in [(&png_path, PlotFormat::Png), (&svg_path, PlotFormat::Svg)] {
            plot_memory(path, format, description, 94 * GIB, &series("no offload", 526 * GIB), &planned, false)
                .unwrap();
        }
        let bytes = std::fs::read(&png_path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG signature");
        let (width, height, pixels) = decode_png(&bytes);
        let svg = std::fs::read_to_string(&svg_path).unwrap();
        let svg_size = format!("<svg width=\"{width}\" height=\"{height}\"");
        assert!(svg.starts_with(&svg_size), "the PNG's size ({width}x{height}) is the SVG's: {}", &svg[..80]);
        assert_eq!((width, height), PLOT_SIZE);
        let at = |x: u32, y: u32| pixels[(y * width + x) as usize];
        const WHITE_PIXEL: [u8; 3] = [255, 255, 255];
        // Nothing is drawn in the outermost pixels: no text or line runs past an edge.
        for x in 0..width {
            for y in [0, 1, height - 2, height - 1] {
                assert_eq!(at(x, y), WHITE_PIXEL, "pixel ({x}, {y}) is drawn on");
            }
        }
        for y in 0..height {
            for x in [0, 1, width - 2, width - 1] {
                assert_eq!(at(x, y), WHITE_PIXEL, "pixel ({x}, {y}) is drawn on");
            }
        }
        // The title is drawn (dark pixels at its place), and every line in its own colour.
        let title_rows = MARGIN..MARGIN + TITLE_FONT;
        let dark = title_rows.flat_map(|y| (0..width).map(move |x| (x, y))).filter(|&(x, y)| at(x, y)[0] < 128).count();
        assert!(dark > 200, "{dark} dark pixels where the title is");
        for index in 0..=planned.len() {
            let (r, g, b) = Palette99::pick(index).to_rgba().rgb();
            let drawn = pixels.iter().filter(|&&p| p == [r, g, b]).count();
            assert!(drawn > 50, "line {index} (#{r:02X}{g:02X}{b:02X}) has {drawn} pixels");
        }
        std::fs::remove_file(&png_path).unwrap();
        std::fs::remove_file(&svg_path).unwrap();
    }

    #[test]
    fn wrapped_header_lines_fit_the_picture_in_the_embedded_font() {
        register_font();
        let description = "Llama3 70B Fp32 layers 80 (this stage 40..80) hidden 8192 heads 64/8 ffn 28672 vocab \
                           128256 seq 2048 batch 2 on h100-nvl, 4 SSDs of 6.7/6.5 GB/s and 385 GiB of host memory, \
                           MMMM WWWW mmmm wwww 0000 MMMM WWWW mmmm wwww 0000";
        let chart = MemoryChart::new(description, GIB, &series("no offload", GIB), &[], false);
        let text_width = f64::from(PLOT_SIZE.0 - 2 * MARGIN);
        let lines =
            chart.title.iter().map(|l| (l, TITLE_FONT)).chain(chart.described.iter().map(|l| (l, DESCRIPTION_FONT)));
        for (line, font) in lines {
            let (width, _) = ("sans-serif", font).into_font().box_size(line).unwrap();
            assert!(
                f64::from(width) <= text_width,
                "{line:?} is {width} px wide in DejaVu Sans, more than {text_width}"
            );
        }
    }

    #[test]
    fn wrapping_keeps_words_and_cuts_what_does_not_fit() {
        assert_eq!(wrap("a bb ccc dddd", 6, 3), vec!["a bb", "ccc", "dddd"]);
        assert_eq!(wrap("a bb ccc dddd", 6, 2), vec!["a bb", "ccc..."]);
        assert_eq!(wrap("abcdefghij", 6, 2), vec!["abcdef"]);
        assert_eq!(chars_fitting(976, 14), 116);
    }
}
