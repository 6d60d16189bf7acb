//! Timeline views: Chrome trace JSON (Perfetto, chrome://tracing), a standalone SVG Gantt chart
//! and a text chart. Simulated and measured timelines use the same [`Timeline`] and format.

use crate::error::{Error, Result};
use crate::plan::ir::{Action, Op};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::fmt::Write;

/// One action on the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimedAction {
    pub worker: usize,
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

/// One message on the timeline (activation forward, gradient backward, or all-reduce share).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimedTransfer {
    pub from: usize,
    pub to: usize,
    /// The action whose result is carried.
    pub action: Action,
    pub bytes: u64,
    pub start: f64,
    pub end: f64,
}

/// Work on a worker beside the pipeline's actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpanKind {
    /// A stage's gradient all-reduce over its replica group.
    AllReduce,
    /// The optimizer step over the worker's stages.
    OptimizerStep,
    /// Measured: handing a stage's output or input gradient to the transport.
    Send,
    /// Measured: waiting for a peer's activation or gradient.
    Receive,
}

impl SpanKind {
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::AllReduce => "all-reduce",
            SpanKind::OptimizerStep => "optimizer step",
            SpanKind::Send => "send",
            SpanKind::Receive => "receive wait",
        }
    }
}

/// A span of [`SpanKind`] on a worker (of a stage, for an all-reduce).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimedSpan {
    pub worker: usize,
    pub kind: SpanKind,
    pub stage: Option<usize>,
    pub start: f64,
    pub end: f64,
    /// For a measured send or receive: the message it moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Message>,
}

/// The message of a measured send or receive: the worker at the other end, the micro-batch,
/// whether it carried a gradient (else an activation), and its bytes. The stage is the span's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub peer: usize,
    pub mb: usize,
    pub gradient: bool,
    pub bytes: u64,
}

/// Measured messages as link transfers: each send joined to its receive, from the moment the
/// sender handed it over to the moment the receiver had it (in flight, or waiting to be
/// taken). A send whose receive is not among `spans` (another step's) is left out.
pub fn transfers_of(spans: &[TimedSpan]) -> Vec<TimedTransfer> {
    type Key = (usize, usize, usize, usize, bool);
    let key = |from: usize, to: usize, st: usize, m: &Message| (from, to, st, m.mb, m.gradient);
    let received: std::collections::HashMap<Key, f64> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Receive)
        .filter_map(|s| Some((key(s.message?.peer, s.worker, s.stage?, &s.message?), s.end)))
        .collect();
    let mut out: Vec<TimedTransfer> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Send)
        .filter_map(|s| {
            let (m, stage) = (s.message?, s.stage?);
            let end = *received.get(&key(s.worker, m.peer, stage, &m))?;
            let op = if m.gradient { Op::B } else { Op::F };
            Some(TimedTransfer {
                from: s.worker,
                to: m.peer,
                action: Action::new(op, stage, m.mb),
                bytes: m.bytes,
                start: s.start,
                end: end.max(s.end),
            })
        })
        .collect();
    out.sort_by(|a, b| a.start.total_cmp(&b.start));
    out
}

/// What happened, in order of start time per worker: the format both the simulator and the
/// runtime's measurements produce.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timeline {
    pub worker_names: Vec<String>,
    pub actions: Vec<TimedAction>,
    pub transfers: Vec<TimedTransfer>,
    /// Moments worth a line across the whole trace (re-plans, freezes), in seconds.
    pub marks: Vec<(f64, String)>,
    /// All-reduces and optimizer steps: the iteration past the pipeline's makespan.
    pub spans: Vec<TimedSpan>,
    /// Devices of the cluster that the plan leaves without work (listed under the chart).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub idle_devices: Vec<String>,
}

const US: f64 = 1e6;

impl Timeline {
    pub fn makespan(&self) -> f64 {
        self.actions
            .iter()
            .map(|a| a.end)
            .chain(self.transfers.iter().map(|t| t.end))
            .chain(self.spans.iter().map(|t| t.end))
            .fold(0.0, f64::max)
    }

    /// The pipeline's critical path: from the action that ends last, back through whatever
    /// each one waited for (the same worker's previous action, or a message and the action
    /// that sent it), to time 0. Its actions, in time order; compute on it is what freezing
    /// must shorten to shorten the iteration.
    pub fn critical_path(&self) -> Vec<TimedAction> {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        let ends_at = |t: f64, worker: Option<usize>| {
            self.actions
                .iter()
                .filter(|a| close(a.end, t) && worker.is_none_or(|w| a.worker == w))
                .max_by(|a, b| a.start.total_cmp(&b.start))
        };
        let mut path = Vec::new();
        let mut cur = self.actions.iter().max_by(|a, b| a.end.total_cmp(&b.end));
        while let Some(a) = cur {
            path.push(*a);
            if a.start <= 0.0 {
                break;
            }
            // A message that arrived as the action started, from the action that sent it.
            let sent = self
                .transfers
                .iter()
                .filter(|t| t.to == a.worker && close(t.end, a.start) && t.start < t.end)
                .find_map(|t| ends_at(t.start, Some(t.from)));
            cur = ends_at(a.start, Some(a.worker))
                .or(sent)
                .or_else(|| ends_at(a.start, None))
                .filter(|p| p.start < a.start);
        }
        path.reverse();
        path
    }

    /// Chrome trace: compute on process 0 (a thread per worker), transfers on process 1 (a
    /// thread per directed link). Times in microseconds of the timeline's seconds.
    pub fn to_chrome_trace(&self) -> String {
        let mut out = Vec::new();
        self.write_chrome_trace(&mut out)
            .expect("writing to memory cannot fail");
        String::from_utf8(out).expect("JSON is UTF-8")
    }

    /// Stream the Chrome trace to `w` event by event, so a large timeline needs no second copy
    /// of itself as JSON in memory.
    pub fn write_chrome_trace(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        let mut first = true;
        let mut event = |w: &mut dyn std::io::Write, v: Value| -> std::io::Result<()> {
            if !first {
                w.write_all(b",")?;
            }
            first = false;
            serde_json::to_writer(&mut *w, &v).map_err(std::io::Error::other)
        };
        w.write_all(b"{\"traceEvents\":[")?;
        event(
            w,
            json!({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "workers"}}),
        )?;
        event(
            w,
            json!({"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "links"}}),
        )?;
        for (i, n) in self.worker_names.iter().enumerate() {
            event(
                w,
                json!({"ph": "M", "pid": 0, "tid": i, "name": "thread_name", "args": {"name": format!("worker {i} ({n})")}}),
            )?;
        }
        let p = self.worker_names.len().max(1);
        let mut links: Vec<usize> = self.transfers.iter().map(|t| t.from * p + t.to).collect();
        links.sort_unstable();
        links.dedup();
        for &l in &links {
            event(
                w,
                json!({"ph": "M", "pid": 1, "tid": l, "name": "thread_name", "args": {"name": format!("w{} -> w{}", l / p, l % p)}}),
            )?;
        }
        for a in &self.actions {
            let mut args =
                json!({"op": a.action.op.as_str(), "stage": a.action.stage, "mb": a.action.mb});
            if a.action.overlap {
                args["overlap"] = true.into();
            }
            event(
                w,
                json!({
                    "ph": "X", "pid": 0, "tid": a.worker, "cat": a.action.op.as_str(),
                    "name": a.action.cell(false),
                    "ts": a.start * US, "dur": (a.end - a.start) * US,
                    "args": args,
                }),
            )?;
        }
        for t in &self.transfers {
            event(
                w,
                json!({
                    "ph": "X", "pid": 1, "tid": t.from * p + t.to, "cat": "transfer",
                    "name": format!("{}{} s{}", t.action.op.as_str(), t.action.mb, t.action.stage),
                    "ts": t.start * US, "dur": (t.end - t.start) * US,
                    "args": {"from": t.from, "to": t.to, "bytes": t.bytes, "op": t.action.op.as_str(), "stage": t.action.stage, "mb": t.action.mb},
                }),
            )?;
        }
        for sp in &self.spans {
            let name = match sp.stage {
                Some(st) => format!("{} s{st}", sp.kind.name()),
                None => sp.kind.name().to_string(),
            };
            event(
                w,
                json!({
                    "ph": "X", "pid": 0, "tid": sp.worker, "cat": sp.kind.name(), "name": name,
                    "ts": sp.start * US, "dur": (sp.end - sp.start) * US,
                    "args": {"span": sp.kind, "stage": sp.stage},
                }),
            )?;
        }
        for (t, label) in &self.marks {
            event(
                w,
                json!({"ph": "i", "s": "g", "pid": 0, "tid": 0, "name": label, "ts": t * US}),
            )?;
        }
        w.write_all(b"],\"displayTimeUnit\":\"ms\"}")
    }

    /// Read back a trace written by [`Timeline::to_chrome_trace`] (simulated or measured).
    pub fn from_chrome_trace(file: &str, text: &str) -> Result<Self> {
        let bad = |m: String| Error::input(file, m);
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("line {}: {e}", e.line())))?;
        let events = v
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no traceEvents array".into()))?;
        let mut tl = Timeline::default();
        for (i, e) in events.iter().enumerate() {
            let ph = e.get("ph").and_then(Value::as_str).unwrap_or("");
            let pid = e.get("pid").and_then(Value::as_u64).unwrap_or(0);
            let tid = e.get("tid").and_then(Value::as_u64).unwrap_or(0) as usize;
            if ph == "M" && pid == 0 && e.get("name").and_then(Value::as_str) == Some("thread_name")
            {
                let name = e["args"]["name"].as_str().unwrap_or("").to_string();
                let short = name
                    .split_once('(')
                    .map_or(name.clone(), |(_, r)| r.trim_end_matches(')').to_string());
                if tl.worker_names.len() <= tid {
                    tl.worker_names.resize(tid + 1, String::new());
                }
                tl.worker_names[tid] = short;
            }
            if ph != "X" {
                continue;
            }
            let args = &e["args"];
            if let Some(kind) = args.get("span").and_then(Value::as_str) {
                let kind = match kind {
                    "all-reduce" => SpanKind::AllReduce,
                    "send" => SpanKind::Send,
                    "receive" => SpanKind::Receive,
                    _ => SpanKind::OptimizerStep,
                };
                let start = e.get("ts").and_then(Value::as_f64).unwrap_or(0.0) / US;
                tl.spans.push(TimedSpan {
                    worker: tid,
                    kind,
                    stage: args
                        .get("stage")
                        .and_then(Value::as_u64)
                        .map(|x| x as usize),
                    start,
                    end: start + e.get("dur").and_then(Value::as_f64).unwrap_or(0.0) / US,
                    message: None,
                });
                continue;
            }
            let num = |k: &str| {
                args.get(k)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| bad(format!("traceEvents[{i}]: args.{k} missing")))
            };
            let op = args
                .get("op")
                .and_then(Value::as_str)
                .and_then(Op::parse)
                .ok_or_else(|| bad(format!("traceEvents[{i}]: args.op missing or unknown")))?;
            let mut action = Action::new(op, num("stage")? as usize, num("mb")? as usize);
            action.overlap = args.get("overlap").and_then(Value::as_bool) == Some(true);
            let start = e.get("ts").and_then(Value::as_f64).unwrap_or(0.0) / US;
            let end = start + e.get("dur").and_then(Value::as_f64).unwrap_or(0.0) / US;
            if pid == 0 {
                tl.actions.push(TimedAction {
                    worker: tid,
                    action,
                    start,
                    end,
                });
            } else {
                tl.transfers.push(TimedTransfer {
                    from: num("from")? as usize,
                    to: num("to")? as usize,
                    action,
                    bytes: num("bytes")?,
                    start,
                    end,
                });
            }
        }
        let workers = tl.actions.iter().map(|a| a.worker + 1).max().unwrap_or(0);
        if tl.worker_names.len() < workers {
            tl.worker_names.resize(workers, String::new());
        }
        Ok(tl)
    }

    /// A standalone SVG Gantt chart: a row per worker, F/B/W/BW in distinct colours labelled
    /// with micro-batch ids, transfers as thin bars under the sending worker, legend and axis.
    /// The SVG's legend from `left` (measured timelines also show their sends and waits).
    fn svg_legend(&self, s: &mut String, left: f64) {
        let measured = self
            .spans
            .iter()
            .any(|sp| matches!(sp.kind, SpanKind::Send | SpanKind::Receive));
        let mut lx = left;
        for (label, colour, h) in [
            ("F forward", colour(Op::F), 12.0),
            ("B input grad", colour(Op::B), 12.0),
            ("W weight grad", colour(Op::W), 12.0),
            ("BW full backward", colour(Op::BW), 12.0),
            ("activation transfer", TRANSFER_F, 4.0),
            ("gradient transfer", TRANSFER_B, 4.0),
            ("all-reduce", ALLREDUCE, 12.0),
            ("optimizer step", OPTIMIZER, 12.0),
        ]
        .into_iter()
        .chain(measured.then_some(("send, receive wait", COMM, 12.0)))
        {
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="{:.1}" width="14" height="{h}" fill="{colour}"/><text x="{}" y="46" font-size="12">{label}</text>"#,
                42.0 - h / 2.0,
                lx + 18.0
            );
            lx += 30.0 + 7.0 * label.len() as f64;
        }
    }

    pub fn to_svg(&self, title: &str) -> String {
        self.svg_scaled(title, self.svg_scale()).0
    }

    /// The time drawn and the plot's width for it: wide enough that the shortest action can
    /// carry a two-digit label, within reason.
    fn svg_scale(&self) -> (f64, f64) {
        let span = self.makespan().max(1e-12);
        let min_dur = self
            .actions
            .iter()
            .map(|a| a.end - a.start)
            .filter(|d| *d > 0.0)
            .fold(f64::INFINITY, f64::min);
        let plot_w = if min_dur.is_finite() {
            (18.0 * span / min_dur).clamp(1000.0, 6000.0)
        } else {
            1000.0
        };
        (span, plot_w)
    }

    /// Two timelines of one step, one above the other on one time scale: the simulated one,
    /// then the measured one (`train --compare-svg`), so that where they differ shows.
    pub fn compare_svg(simulated: &Timeline, measured: &Timeline, titles: [&str; 2]) -> String {
        let (s0, w0) = simulated.svg_scale();
        let (s1, w1) = measured.svg_scale();
        let scale = (s0.max(s1), w0.max(w1));
        let (a, aw, ah) = simulated.svg_scaled(titles[0], scale);
        let (b, bw, bh) = measured.svg_scaled(titles[1], scale);
        let (w, h) = (aw.max(bw), ah + bh);
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}">
<svg x="0" y="0">{a}</svg>
<svg x="0" y="{ah:.0}">{b}</svg>
</svg>
"#
        )
    }

    /// The SVG at a given (time drawn, plot width), with its width and height.
    fn svg_scaled(&self, title: &str, (span, plot_w): (f64, f64)) -> (String, f64, f64) {
        let p = self.worker_names.len();
        let (left, top, row_h, bar_h, lane_h) = (120.0, 70.0, 34.0, 24.0, 5.0);
        let width = left + plot_w + 30.0;
        let footer = if self.idle_devices.is_empty() {
            0.0
        } else {
            20.0
        };
        let height = top + p as f64 * row_h + 50.0 + footer;
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="Helvetica, Arial, sans-serif">
<rect width="100%" height="100%" fill="white"/>
<text x="{left}" y="22" font-size="15" font-weight="bold">{}</text>
"#,
            xml_escape(title)
        );
        self.svg_legend(&mut s, left);
        let f = Frame {
            left,
            top,
            row_h,
            bar_h,
            lane_h,
            span,
            plot_w,
        };
        self.svg_rows(&mut s, &f);
        self.svg_actions(&mut s, &f);
        self.svg_transfers(&mut s, &f);
        self.svg_spans(&mut s, &f);
        let ay = self.svg_axis(&mut s, &f);
        self.svg_idle(&mut s, left, ay + 56.0);
        s.push_str("</svg>\n");
        (s, width, height)
    }

    /// Each worker's row: a band, its number and its device's name.
    fn svg_rows(&self, s: &mut String, f: &Frame) {
        let Frame {
            left,
            top,
            row_h,
            plot_w,
            ..
        } = *f;
        for (w, name) in self.worker_names.iter().enumerate() {
            let y = top + w as f64 * row_h;
            let fill = if w % 2 == 0 { "#f6f6f6" } else { "#ffffff" };
            let _ = writeln!(
                s,
                r#"<rect x="{left}" y="{y}" width="{plot_w:.1}" height="{row_h}" fill="{fill}"/>"#
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{:.1}" font-size="12" text-anchor="end">worker {w}</text>"#,
                left - 8.0,
                y + 14.0
            );
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" font-size="10" fill="#666" text-anchor="end">{}</text>"##,
                left - 8.0,
                y + 27.0,
                xml_escape(name)
            );
        }
    }

    /// Each action as a box in its worker's row, labelled where it fits (with op and stage
    /// where a worker runs several stages).
    fn svg_actions(&self, s: &mut String, f: &Frame) {
        let Frame {
            top, row_h, bar_h, ..
        } = *f;
        let p = self.worker_names.len();
        let x = |t: f64| f.x(t);
        // Where a worker runs several stages (interleaved, ZB-V), boxes name the stage too.
        let mut stages_of = vec![std::collections::BTreeSet::new(); p];
        for a in &self.actions {
            if let Some(set) = stages_of.get_mut(a.worker) {
                set.insert(a.action.stage);
            }
        }
        for a in &self.actions {
            let y = top + a.worker as f64 * row_h + 2.0;
            let (x0, x1) = (x(a.start), x(a.end));
            let w = (x1 - x0).max(0.5);
            // An overlapped forward is outlined in black and labelled `+`: it and the backward
            // after it are one pair.
            let (edge, pair, note) = match a.action.overlap {
                true => ("black", "+", " (overlapped with the next backward)"),
                false => ("white", "", ""),
            };
            let _ = write!(
                s,
                r#"<rect x="{x0:.2}" y="{y:.1}" width="{w:.2}" height="{bar_h}" fill="{}" stroke="{edge}" stroke-width="0.6"><title>{} stage {} mb {}{note}: {:.6} - {:.6}</title></rect>"#,
                colour(a.action.op),
                a.action.op.as_str(),
                a.action.stage,
                a.action.mb,
                a.start,
                a.end
            );
            let label = match stages_of.get(a.worker).is_some_and(|set| set.len() > 1) {
                true => a.action.cell(true),
                false => format!("{}{pair}", a.action.mb),
            };
            let fs = 10.0f64.min(bar_h * 0.6);
            if w >= fs * 0.62 * label.len() as f64 + 2.0 {
                let _ = write!(
                    s,
                    r#"<text x="{:.2}" y="{:.1}" font-size="{fs}" fill="white" text-anchor="middle">{label}</text>"#,
                    x0 + w / 2.0,
                    y + bar_h / 2.0 + fs * 0.35
                );
            }
            s.push('\n');
        }
    }

    /// Each message as a thin lane under its sender's row, while it travels.
    fn svg_transfers(&self, s: &mut String, f: &Frame) {
        let Frame {
            top,
            row_h,
            bar_h,
            lane_h,
            ..
        } = *f;
        let x = |t: f64| f.x(t);
        for t in &self.transfers {
            let y = top + t.from as f64 * row_h + 2.0 + bar_h + 1.5;
            let (x0, x1) = (x(t.start), x(t.end));
            let fill = if t.action.op == Op::F {
                TRANSFER_F
            } else {
                TRANSFER_B
            };
            let _ = writeln!(
                s,
                r#"<rect x="{x0:.2}" y="{y:.1}" width="{:.2}" height="{lane_h}" fill="{fill}"><title>{} mb {} stage {}: w{} -> w{}, {} bytes, {:.6} - {:.6}</title></rect>"#,
                (x1 - x0).max(0.5),
                if t.action.op == Op::F {
                    "activation"
                } else {
                    "gradient"
                },
                t.action.mb,
                t.action.stage,
                t.from,
                t.to,
                t.bytes,
                t.start,
                t.end
            );
        }
    }

    /// All-reduces, optimizer steps and measured sends and receives, in their workers' rows.
    fn svg_spans(&self, s: &mut String, f: &Frame) {
        let Frame {
            top, row_h, bar_h, ..
        } = *f;
        let x = |t: f64| f.x(t);
        for sp in &self.spans {
            let y = top + sp.worker as f64 * row_h + 2.0;
            let (x0, x1) = (x(sp.start), x(sp.end));
            let fill = match sp.kind {
                SpanKind::AllReduce => ALLREDUCE,
                SpanKind::OptimizerStep => OPTIMIZER,
                SpanKind::Send | SpanKind::Receive => COMM,
            };
            let _ = writeln!(
                s,
                r#"<rect x="{x0:.2}" y="{y:.1}" width="{:.2}" height="{bar_h}" fill="{fill}"><title>{}{}: {:.6} - {:.6}</title></rect>"#,
                (x1 - x0).max(0.5),
                sp.kind.name(),
                sp.stage
                    .map_or(String::new(), |st| format!(" of stage {st}")),
                sp.start,
                sp.end
            );
        }
    }

    /// The time axis under the rows, with round ticks; returns its height on the page.
    fn svg_axis(&self, s: &mut String, f: &Frame) -> f64 {
        let Frame {
            left,
            top,
            row_h,
            span,
            plot_w,
            ..
        } = *f;
        let x = |t: f64| f.x(t);
        let p = self.worker_names.len();
        // Axis with round ticks.
        let ay = top + p as f64 * row_h + 6.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{ay}" x2="{:.1}" y2="{ay}" stroke="#333"/>"##,
            left + plot_w
        );
        let step = nice_step(span / (plot_w / 90.0));
        let mut t = 0.0;
        while t <= span * (1.0 + 1e-9) {
            let tx = x(t);
            let _ = writeln!(
                s,
                r##"<line x1="{tx:.1}" y1="{ay}" x2="{tx:.1}" y2="{:.1}" stroke="#333"/><line x1="{tx:.1}" y1="{top}" x2="{tx:.1}" y2="{ay}" stroke="#ddd" stroke-width="0.5"/><text x="{tx:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
                ay + 5.0,
                ay + 18.0,
                fmt_tick(t, step)
            );
            t += step;
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">time (s)</text>"#,
            left + plot_w / 2.0,
            ay + 36.0
        );
        ay
    }

    /// `idle devices (N): a, b, ...`: the first 8 by name (what fits under the narrowest
    /// chart), then how many more; `None`
    /// when every device works.
    pub fn idle_line(&self) -> Option<String> {
        let idle = &self.idle_devices;
        if idle.is_empty() {
            return None;
        }
        let shown: Vec<&str> = idle.iter().take(8).map(String::as_str).collect();
        let more = match idle.len() - shown.len() {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        Some(format!(
            "idle devices ({}): {}{more}",
            idle.len(),
            shown.join(", ")
        ))
    }

    /// The idle devices under the chart.
    fn svg_idle(&self, s: &mut String, left: f64, y: f64) {
        if let Some(line) = self.idle_line() {
            let _ = writeln!(
                s,
                r##"<text x="{left}" y="{y:.1}" font-size="12" fill="#666">{}</text>"##,
                xml_escape(&line)
            );
        }
    }

    /// Text chart, one row per worker and one column per `unit` of time.
    pub fn to_text(&self, unit: f64) -> String {
        let cols = (self.makespan() / unit).ceil() as usize;
        let mut out = String::new();
        for w in 0..self.worker_names.len() {
            let mut row = vec!['.'; cols];
            for a in self.actions.iter().filter(|a| a.worker == w) {
                let (c0, c1) = (
                    (a.start / unit).round() as usize,
                    ((a.end / unit).round() as usize).min(cols),
                );
                let ch = match a.action.op {
                    Op::F => 'F',
                    Op::B => 'B',
                    Op::W => 'W',
                    Op::BW => 'X',
                };
                row[c0.min(cols.saturating_sub(1))..c1.max(c0 + 1).min(cols)]
                    .iter_mut()
                    .for_each(|c| *c = ch);
            }
            let _ = writeln!(out, "w{w:<3} {}", row.into_iter().collect::<String>());
        }
        out
    }
}

const TRANSFER_F: &str = "#555555";
const TRANSFER_B: &str = "#b07aa1";
/// Measured sends and receive waits.
const COMM: &str = "#bdbdbd";
const ALLREDUCE: &str = "#9c755f";
const OPTIMIZER: &str = "#bab0ac";

fn colour(op: Op) -> &'static str {
    match op {
        Op::F => "#4e79a7",
        Op::B => "#59a14f",
        Op::W => "#f28e2b",
        Op::BW => "#2f6f4f",
    }
}

fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let n = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    n * mag
}

fn fmt_tick(t: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{t:.decimals$}")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Where a timeline is drawn: the plot's left edge and top, row, bar and message-lane heights,
/// and the time span drawn over `plot_w` pixels.
#[derive(Clone, Copy)]
struct Frame {
    left: f64,
    top: f64,
    row_h: f64,
    bar_h: f64,
    lane_h: f64,
    span: f64,
    plot_w: f64,
}

impl Frame {
    /// The page x of time `t`.
    fn x(&self, t: f64) -> f64 {
        self.left + t / self.span * self.plot_w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Cluster, Link};
    use crate::profile::StageCost;
    use crate::schedule::{generate, ScheduleKind};
    use crate::sim::{simulate, SimSetup};

    /// A replicated plan's timeline draws each stage's all-reduce on its hosts and each
    /// worker's optimizer step, up to the iteration time, and the trace reads them back.
    #[test]
    fn the_all_reduce_and_optimizer_step_are_drawn() {
        let plan = generate(ScheduleKind::OneFOneB, 2, 2, 1)
            .unwrap()
            .replicate(2)
            .unwrap();
        let cost = StageCost {
            params: 1_000_000,
            update: 0.5,
            ..StageCost::uniform(1.0, 1.0, 1.0)
        };
        let cluster = Cluster::homogeneous(
            4,
            Link {
                latency: 0.1,
                bandwidth: 1e7,
                overhead: 0.0,
            },
        );
        let r = simulate(&SimSetup {
            plan: &plan,
            stages: &[cost, cost],
            cluster: &cluster,
        })
        .unwrap();
        let tl = &r.timeline;
        let ar: Vec<_> = tl
            .spans
            .iter()
            .filter(|s| s.kind == SpanKind::AllReduce)
            .collect();
        assert_eq!(ar.len(), 4, "two stages, two hosts each");
        assert!(ar
            .iter()
            .all(|s| s.end > s.start && s.start >= r.makespan - 4.0));
        let steps = tl
            .spans
            .iter()
            .filter(|s| s.kind == SpanKind::OptimizerStep)
            .count();
        assert_eq!(steps, 4, "one per worker");
        assert!(
            (tl.makespan() - r.iteration_time).abs() < 1e-9,
            "drawn to the iteration's end"
        );
        let mut trace = Vec::new();
        tl.write_chrome_trace(&mut trace).unwrap();
        let back =
            Timeline::from_chrome_trace("t.json", std::str::from_utf8(&trace).unwrap()).unwrap();
        assert_eq!(back.spans.len(), tl.spans.len());
        assert!(tl.to_svg("t").contains("all-reduce of stage 1"));
    }

    #[test]
    fn trace_round_trips_and_svg_has_every_action() {
        let plan = generate(ScheduleKind::ZbH1, 3, 4, 1).unwrap();
        let stages = vec![
            StageCost {
                activation_out: 1000,
                ..StageCost::uniform(1.0, 1.0, 1.0)
            };
            3
        ];
        let cluster = Cluster::homogeneous(
            3,
            Link {
                latency: 0.1,
                bandwidth: 1e4,
                overhead: 0.0,
            },
        );
        let r = simulate(&SimSetup {
            plan: &plan,
            stages: &stages,
            cluster: &cluster,
        })
        .unwrap();
        let back = Timeline::from_chrome_trace("t.json", &r.timeline.to_chrome_trace()).unwrap();
        assert_eq!(back.actions.len(), r.timeline.actions.len());
        assert_eq!(back.transfers.len(), r.timeline.transfers.len());
        for (a, b) in back.actions.iter().zip(&r.timeline.actions) {
            assert_eq!((a.worker, a.action), (b.worker, b.action));
            assert!((a.start - b.start).abs() < 1e-9 && (a.end - b.end).abs() < 1e-9);
        }
        let svg = r.timeline.to_svg("zbh1");
        assert_eq!(
            svg.matches("<title>").count(),
            r.timeline.actions.len() + r.timeline.transfers.len()
        );
        assert!(svg.contains("W weight grad"));
    }

    /// Idle devices are listed under the chart: the first 8, then how many more; none, no line.
    #[test]
    fn idle_devices_are_listed_under_the_chart() {
        let mut tl = Timeline::default();
        assert_eq!(tl.idle_line(), None);
        assert!(!tl.to_svg("t").contains("idle devices"));
        tl.idle_devices = (0..11).map(|i| format!("gpu{i}")).collect();
        let line = tl.idle_line().unwrap();
        assert_eq!(
            line,
            "idle devices (11): gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 and 3 more"
        );
        assert!(tl.to_svg("t").contains(&line));
    }

    /// Measured sends and receives join into link transfers: from the send's start to the
    /// receive's end, matched by ends, stage, micro-batch and kind; a send without its receive
    /// is left out.
    #[test]
    fn measured_messages_join_into_link_transfers() {
        let span = |worker, kind, stage, (start, end), peer, mb, gradient| TimedSpan {
            worker,
            kind,
            stage: Some(stage),
            start,
            end,
            message: Some(Message {
                peer,
                mb,
                gradient,
                bytes: 64,
            }),
        };
        let spans = [
            span(0, SpanKind::Send, 1, (1.0, 1.1), 1, 0, false),
            span(1, SpanKind::Receive, 1, (0.5, 1.5), 0, 0, false),
            span(1, SpanKind::Send, 0, (2.0, 2.1), 0, 0, true),
            span(0, SpanKind::Receive, 0, (2.5, 2.6), 1, 0, true),
            span(0, SpanKind::Send, 1, (3.0, 3.1), 1, 1, false),
        ];
        let t = transfers_of(&spans);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!((t[0].from, t[0].to, t[0].action.op), (0, 1, Op::F));
        assert_eq!((t[0].start, t[0].end, t[0].bytes), (1.0, 1.5, 64));
        assert_eq!((t[1].from, t[1].to, t[1].action.op), (1, 0, Op::B));
        assert_eq!((t[1].start, t[1].end), (2.0, 2.6));
    }
}
