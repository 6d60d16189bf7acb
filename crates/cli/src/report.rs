//! `report`: a training run's metrics file drawn as one SVG: the loss (training and held-out),
//! a task's accuracy, throughput, and the layout (stages, replicas, frozen layer blocks) of an
//! elastic run, each against the step.

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use serde_json::Value;
use std::fmt::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct ReportArgs {
    /// The metrics file of a run (`train --metrics FILE`, JSON lines).
    metrics: PathBuf,
    /// The SVG to write.
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

/// The panels worth drawing for these rows: empty series and a layout that never changed are
/// left out.
fn panels(rows: &[Value], steps: (f64, f64)) -> Vec<Panel> {
    let mut out = vec![Panel::new(
        "loss",
        vec![
            series(rows, "training", "loss", "#4e79a7"),
            series(rows, "held-out", "val_loss", "#e15759"),
        ],
        steps,
    )];
    out.push(Panel::new(
        "held-out accuracy",
        vec![series(rows, "accuracy", "accuracy", "#59a14f")],
        steps,
    ));
    out.push(Panel::new(
        "throughput (tokens/s)",
        vec![series(rows, "tokens/s", "tokens_per_s", "#f28e2b")],
        steps,
    ));
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

/// One panel at height `top`, steps 0..=`last` across.
fn draw(svg: &mut String, p: &Panel, top: f64, last: f64) {
    let (lo, hi) = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(_, v)| v))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        (lo - 1.0, hi + 1.0)
    };
    let (plot_w, plot_h) = (W - LEFT - 20.0, H - 50.0);
    let x = |s: f64| LEFT + s / last.max(1.0) * plot_w;
    // In halves: hi - lo of values near f64's ends would overflow.
    let y = |v: f64| top + 30.0 + (hi / 2.0 - v / 2.0) / (hi / 2.0 - lo / 2.0) * plot_h;
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="{:.1}" font-weight="bold">{}</text><rect x="{LEFT}" y="{:.1}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>"##,
        top + 20.0,
        p.title,
        top + 30.0
    );
    for (v, anchor) in [(hi, top + 34.0), (lo, top + 30.0 + plot_h)] {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{anchor:.1}" text-anchor="end" font-size="11">{}</text>"#,
            LEFT - 4.0,
            short(v)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">step {last}</text>"#,
        W - 20.0,
        top + H - 6.0
    );
    if let Some(line) = left_out_line(p) {
        let _ = writeln!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="11" fill="#c00">{}</text>"##,
            top + H - 6.0,
            line
        );
    }
    for (k, s) in p.series.iter().enumerate() {
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(a, v)| format!("{:.1},{:.1}", x(a), y(v)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/><text x="{:.1}" y="{:.1}" fill="{}" font-size="12">{}</text>"#,
            s.color,
            pts.join(" "),
            LEFT + 200.0 + 120.0 * k as f64,
            top + 20.0,
            s.color,
            s.name
        );
        if let [(a, v)] = s.points[..] {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                x(a),
                y(v),
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
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="13">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    for (i, p) in panels.iter().enumerate() {
        draw(&mut svg, p, i as f64 * H, last);
    }
    svg.push_str("</svg>\n");
    crate::files::write_file(&a.out, &svg)?;
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
