//! `report`: a training run's metrics file drawn as one chart (SVG, or PNG rendered from it):
//! the loss (training, its running mean, held-out, and the run's baseline), a task's accuracy,
//! throughput (samples/s for a task, tokens/s for a text), and the layout (stages, replicas,
//! frozen layer blocks) of an elastic run, each against the step, with ticks and a grid, and a
//! dashed line wherever the layout changed.

use crate::files::write_with;
use crate::BadInput;
use anyhow::Result;
use clap::Args;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Args)]
pub struct ReportArgs {
    /// The metrics file of a run (`train --metrics FILE`, JSON lines).
    metrics: PathBuf,
    /// The chart to write: FILE.svg, or FILE.png (the same chart rendered, with the system's
    /// fonts).
    #[arg(long, default_value = "report.svg")]
    out: PathBuf,
}

/// A line on a panel: its name, colour and (step, value) points.
struct Series {
    name: &'static str,
    color: &'static str,
    points: Vec<(f64, f64)>,
}

struct Panel {
    title: &'static str,
    series: Vec<Series>,
    /// A level to compare with (the run's baseline loss), drawn dashed.
    baseline: Option<(f64, String)>,
    /// Points not drawn (series name, step, value): outside the robust range.
    left_out: Vec<(&'static str, f64, f64)>,
}

/// The range a robust scale draws: the quartiles widened by 20 interquartile ranges (at least
/// a millionth of the median's size), so one absurd value (1e308, a diverged step) cannot
/// flatten the rest of the curve, while ordinary falls and spikes of a loss stay in.
fn robust_range(values: &[f64]) -> (f64, f64) {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (f64::NEG_INFINITY, f64::INFINITY);
    }
    v.sort_by(f64::total_cmp);
    let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    let (q1, med, q3) = (q(0.25), q(0.5), q(0.75));
    let spread = (q3 - q1).max(1e-6 * med.abs()).max(1e-12);
    (q1 - 20.0 * spread, q3 + 20.0 * spread)
}

impl Panel {
    /// A panel of `series`, whose points outside the robust range of all its values (or of
    /// all steps) are moved to `left_out`.
    fn new(title: &'static str, mut series: Vec<Series>, steps: (f64, f64)) -> Self {
        let all: Vec<f64> = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .collect();
        let (lo, hi) = robust_range(&all);
        let mut left_out = Vec::new();
        for s in &mut series {
            s.points.retain(|&(step, v)| {
                let keep = (lo..=hi).contains(&v) && (steps.0..=steps.1).contains(&step);
                if !keep {
                    left_out.push((s.name, step, v));
                }
                keep
            });
        }
        Panel {
            title,
            series,
            baseline: None,
            left_out,
        }
    }
}

/// The (step, value) points of `key` in `rows`.
fn points(rows: &[Value], key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(key)?.as_f64()?)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

fn series(rows: &[Value], name: &'static str, key: &str, color: &'static str) -> Series {
    Series {
        name,
        color,
        points: points(rows, key),
    }
}

/// The running mean of `points` over the last `k` of them: a noisy training loss read as its
/// trend.
fn running_mean(points: &[(f64, f64)], k: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    (0..points.len())
        .map(|i| {
            sum += points[i].1;
            if i >= k {
                sum -= points[i - k].1;
            }
            (points[i].0, sum / (i + 1).min(k) as f64)
        })
        .collect()
}

/// The run's baseline loss and its name, from the first row (`train` writes them there).
fn baseline(rows: &[Value]) -> Option<(f64, String)> {
    let r = rows.first()?;
    let v = r.get("baseline")?.as_f64().filter(|v| v.is_finite())?;
    let name = r
        .get("baseline_name")
        .and_then(Value::as_str)
        .unwrap_or("baseline");
    Some((v, name.to_string()))
}

/// Steps after which the layout (stages, replicas, frozen blocks) differed from the step before.
fn layout_changes(rows: &[Value]) -> Vec<f64> {
    let key = |r: &Value| {
        ["stages", "replicas", "frozen_layers", "weight_only_frozen"].map(|k| r.get(k).cloned())
    };
    let steps: Vec<&Value> = rows.iter().filter(|r| r.get("stages").is_some()).collect();
    steps
        .windows(2)
        .filter(|w| key(w[0]) != key(w[1]))
        .filter_map(|w| w[1].get("step")?.as_f64())
        .collect()
}

/// The panels worth drawing for these rows: empty series and a layout that never changed are
/// left out.
fn panels(rows: &[Value], steps: (f64, f64)) -> Vec<Panel> {
    // The running mean of the points the scale keeps: one absurd value would carry into the
    // next k means.
    let train = points(rows, "loss");
    let (lo, hi) = robust_range(&train.iter().map(|p| p.1).collect::<Vec<_>>());
    let kept: Vec<(f64, f64)> = train
        .into_iter()
        .filter(|p| (lo..=hi).contains(&p.1))
        .collect();
    let k = (kept.len() / 40).max(5);
    let mut loss = Panel::new(
        "loss",
        vec![
            series(rows, "training", "loss", "#a6c4e0"),
            Series {
                name: "training, running mean",
                color: "#1f4e79",
                points: running_mean(&kept, k),
            },
            series(rows, "held-out", "val_loss", "#e15759"),
        ],
        steps,
    );
    loss.baseline = baseline(rows);
    let mut out = vec![loss];
    out.push(Panel::new(
        "held-out accuracy",
        vec![series(rows, "accuracy", "accuracy", "#59a14f")],
        steps,
    ));
    let task = rows
        .iter()
        .any(|r| r.get("accuracy").is_some_and(|a| !a.is_null()));
    out.push(match task {
        true => Panel::new(
            "throughput (samples/s)",
            vec![series(rows, "samples/s", "samples_per_s", "#f28e2b")],
            steps,
        ),
        false => Panel::new(
            "throughput (tokens/s)",
            vec![series(rows, "tokens/s", "tokens_per_s", "#f28e2b")],
            steps,
        ),
    });
    let layout = vec![
        series(rows, "stages", "stages", "#76b7b2"),
        series(rows, "replicas", "replicas", "#edc948"),
        series(rows, "frozen blocks", "frozen_layers", "#b07aa1"),
    ];
    let varies = |s: &Series| s.points.windows(2).any(|w| w[0].1 != w[1].1);
    if layout.iter().any(varies) {
        out.push(Panel::new("layout", layout, steps));
    }
    out.retain(|p| p.series.iter().any(|s| !s.points.is_empty()));
    out
}

/// What a panel left out, in a line: the first few points.
fn left_out_line(p: &Panel) -> Option<String> {
    if p.left_out.is_empty() {
        return None;
    }
    let first: Vec<String> = p
        .left_out
        .iter()
        .take(4)
        .map(|(name, step, v)| format!("{name} {v:e} at step {step}"))
        .collect();
    let more = p.left_out.len().saturating_sub(4);
    Some(format!(
        "not drawn (outside the scale): {}{}",
        first.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    ))
}

const W: f64 = 760.0;
const H: f64 = 200.0;
const LEFT: f64 = 70.0;

/// About `n` round values (1, 2 or 5 times a power of ten) from `lo` to `hi`; none where the
/// range is empty or too wide to count.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let raw = (hi / 2.0 - lo / 2.0) / n as f64 * 2.0;
    if !(raw.is_finite() && raw > 0.0) {
        return Vec::new();
    }
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let (first, last) = ((lo / step).ceil(), (hi / step).floor());
    if !(last - first).is_finite() || last - first > 50.0 {
        return Vec::new();
    }
    (first as i64..=last as i64)
        .map(|k| k as f64 * step)
        .collect()
}

/// Where a panel's values go: the plot's box and its scales.
struct Frame {
    top: f64,
    lo: f64,
    hi: f64,
    last: f64,
}

impl Frame {
    const PLOT_W: f64 = W - LEFT - 20.0;
    const PLOT_H: f64 = H - 60.0;

    fn x(&self, s: f64) -> f64 {
        LEFT + s / self.last.max(1.0) * Self::PLOT_W
    }

    /// In halves: hi - lo of values near f64's ends would overflow.
    fn y(&self, v: f64) -> f64 {
        self.top + 30.0 + (self.hi / 2.0 - v / 2.0) / (self.hi / 2.0 - self.lo / 2.0) * Self::PLOT_H
    }

    /// The box, a grid line and a label at each tick of both axes, and the layout changes.
    fn axes(&self, svg: &mut String, marks: &[f64]) {
        let (top, bottom) = (self.top + 30.0, self.top + 30.0 + Self::PLOT_H);
        for v in ticks(self.lo, self.hi, 4) {
            let y = self.y(v);
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"##,
                LEFT + Self::PLOT_W,
                LEFT - 4.0,
                y + 4.0,
                short(v)
            );
        }
        for s in ticks(0.0, self.last, 8) {
            let x = self.x(s);
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{top:.1}" y2="{bottom:.1}" stroke="#e4e4e4"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"##,
                bottom + 14.0,
                if s.fract() == 0.0 {
                    format!("{s:.0}")
                } else {
                    short(s)
                }
            );
        }
        for &s in marks {
            let x = self.x(s);
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{top:.1}" y2="{bottom:.1}" stroke="#777" stroke-dasharray="4 3"/>"##
            );
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT}" y="{top:.1}" width="{}" height="{}" fill="none" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">step</text>"##,
            Self::PLOT_W,
            Self::PLOT_H,
            W - 20.0,
            bottom + 28.0
        );
    }
}

/// One panel at height `top`, steps 0..=`last` across, a dashed line at each step in `marks`.
fn draw(svg: &mut String, p: &Panel, top: f64, last: f64, marks: &[f64]) {
    let values = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(_, v)| v));
    let base = p.baseline.as_ref().map(|b| b.0);
    let (lo, hi) = values
        .chain(base)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let f = Frame { top, lo, hi, last };
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="{:.1}" font-weight="bold">{}</text>"##,
        top + 20.0,
        p.title
    );
    f.axes(svg, marks);
    if let Some(line) = left_out_line(p) {
        let _ = writeln!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="11" fill="#c00">{}</text>"##,
            top + H - 4.0,
            line
        );
    }
    if let Some((v, name)) = &p.baseline {
        let y = f.y(*v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#555" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11" fill="#555">{name} {}</text>"##,
            LEFT + Frame::PLOT_W,
            LEFT + Frame::PLOT_W - 4.0,
            y - 4.0,
            short(*v)
        );
    }
    // Legends start past the bold title (about 8 px a character at 13 px).
    let mut legend = LEFT + 8.5 * p.title.len() as f64 + 30.0;
    for s in &p.series {
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(a, v)| format!("{:.1},{:.1}", f.x(a), f.y(v)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/><text x="{legend:.1}" y="{:.1}" fill="{}" font-size="12">{}</text>"#,
            s.color,
            pts.join(" "),
            top + 20.0,
            s.color,
            s.name
        );
        legend += 8.0 * s.name.len() as f64 + 24.0;
        if let [(a, v)] = s.points[..] {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                f.x(a),
                f.y(v),
                s.color
            );
        }
    }
}

/// A value in a few characters.
fn short(v: f64) -> String {
    match v.abs() {
        a if a >= 1e4 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.3}"),
    }
}

/// The rows of a metrics file, each line one JSON object; a bad line is named.
fn read_rows(path: &std::path::Path) -> Result<Vec<Value>> {
    let text = pipewright_core::inputs::read_file(path).map_err(|e| BadInput(e.to_string()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => Ok(v),
            _ => Err(BadInput(format!(
                "{}:{}: not a metrics row (a JSON object per line)",
                path.display(),
                i + 1
            ))
            .into()),
        })
        .collect()
}

/// The chart rendered as a PNG, its text in the system's fonts.
fn png(svg: &str) -> std::io::Result<Vec<u8>> {
    use resvg::{tiny_skia, usvg};
    let fail = |e: String| std::io::Error::other(format!("rendering the chart: {e}"));
    let mut opt = usvg::Options::default();
    opt.fontdb_mut().load_system_fonts();
    let tree = usvg::Tree::from_str(svg, &opt).map_err(|e| fail(e.to_string()))?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| fail(format!("no {} x {} image", size.width(), size.height())))?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.encode_png().map_err(|e| fail(e.to_string()))
}

pub fn cmd_report(a: ReportArgs) -> Result<()> {
    crate::files::check_output(&a.out)?;
    let rows = read_rows(&a.metrics)?;
    let steps: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.get("step")?.as_f64())
        .collect();
    // Steps count from 0; a crafted one past the robust range is not drawn either.
    let steps_range = (0.0, robust_range(&steps).1);
    let last = steps
        .iter()
        .copied()
        .filter(|s| (steps_range.0..=steps_range.1).contains(s))
        .fold(0.0, f64::max);
    let panels = panels(&rows, steps_range);
    if last < 1.0 || panels.is_empty() {
        return Err(BadInput(format!(
            "{}: no training steps to draw",
            a.metrics.display()
        ))
        .into());
    }
    let height = H * panels.len() as f64 + 10.0;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="DejaVu Sans, Liberation Sans, Arial, sans-serif" font-size="13">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    let marks = layout_changes(&rows);
    for (i, p) in panels.iter().enumerate() {
        draw(&mut svg, p, i as f64 * H, last, &marks);
    }
    svg.push_str("</svg>\n");
    match a
        .out
        .extension()
        .map(|e| e.to_string_lossy().to_lowercase())
        .as_deref()
    {
        Some("png") => write_with(&a.out, |w| w.write_all(&png(&svg)?))?,
        Some("svg") => crate::files::write_file(&a.out, &svg)?,
        // After reading: `--out` naming the metrics file itself is refused as that, first.
        _ => {
            crate::files::check_output(&a.out)?;
            return Err(
                BadInput(format!("--out {}: write a .svg or a .png", a.out.display())).into(),
            );
        }
    }
    for line in panels
        .iter()
        .filter_map(|p| Some((p.title, left_out_line(p)?)))
    {
        println!("{}: {}", line.0, line.1);
    }
    let names: Vec<&str> = panels.iter().map(|p| p.title).collect();
    println!(
        "wrote {}: {} steps; {}",
        a.out.display(),
        last,
        names.join(", ")
    );
    Ok(())
}
