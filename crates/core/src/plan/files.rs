//! The plan's files: pipewright's JSON (and the single-pipeline JSON of pipewright 0.1, converted
//! on load) and its per-action CSV; a CSV in torch's per-rank action format is read by
//! `torch_csv`. The IR itself is `ir`, which knows no format.

use super::ir::{Action, Hop, Op, Plan, StagePlan};
use super::ScheduleKind;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

impl Plan {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plan serialises")
    }

    /// Load a plan; files in the single-pipeline format of pipewright 0.1 (with `placement`)
    /// are converted: one layer per stage, stage `s` hosted by `placement[s]`.
    pub fn from_json(file: &str, text: &str) -> Result<Self> {
        let at = |e: serde_json::Error| {
            Error::input(
                file,
                format!("line {}, column {}: {e}", e.line(), e.column()),
            )
        };
        let v: serde_json::Value = serde_json::from_str(text).map_err(at)?;
        if v.get("placement").is_some() {
            let old: OldPlan = serde_json::from_value(v).map_err(|e| {
                Error::input(
                    file,
                    format!("looks like a 0.1 single-pipeline plan (has `placement`) but does not parse: {e}; regenerate it as JSON with pipewright's schedule command"),
                )
            })?;
            return old.convert(file);
        }
        serde_json::from_str(text).map_err(at)
    }

    /// CSV, one record per row: `record,worker,step,op,stage,microbatch` (op `F+`: a forward
    /// overlapped with the worker's next action). A `plan` row carries
    /// the kind and counts (worker = workers, step = stages); `stage` rows a host of a stage
    /// (step = its layers); `route` rows the hops (step = position); `action` rows the actions.
    pub fn to_csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        let mut row = |r: CsvRow| w.serialize(r).expect("csv in memory");
        row(CsvRow {
            record: "plan".into(),
            worker: self.num_workers(),
            step: self.num_stages(),
            op: self.kind.name().into(),
            stage: 0,
            microbatch: self.num_microbatches,
        });
        for (s, st) in self.stages.iter().enumerate() {
            for &h in &st.hosts {
                row(CsvRow {
                    record: "stage".into(),
                    worker: h,
                    step: st.layers,
                    op: String::new(),
                    stage: s,
                    microbatch: 0,
                });
            }
        }
        for (m, r) in self.routes.iter().enumerate() {
            for (i, h) in r.iter().enumerate() {
                row(CsvRow {
                    record: "route".into(),
                    worker: h.worker,
                    step: i,
                    op: String::new(),
                    stage: h.stage,
                    microbatch: m,
                });
            }
        }
        for (wk, acts) in self.workers.iter().enumerate() {
            for (i, a) in acts.iter().enumerate() {
                row(CsvRow {
                    record: "action".into(),
                    worker: wk,
                    step: i,
                    // `F+`: a forward overlapped with the next action (the grid's mark).
                    op: format!("{}{}", a.op.as_str(), if a.overlap { "+" } else { "" }),
                    stage: a.stage,
                    microbatch: a.mb,
                });
            }
        }
        String::from_utf8(w.into_inner().expect("csv flush")).expect("csv is utf-8")
    }

    /// Read the CSV view. Files without `stage` rows (pipewright 0.1) get one layer per stage
    /// and hosts taken from the routes and actions.
    /// The empty plan a CSV's `plan` record declares; every count must be backed by rows, so
    /// a tiny file (of `limit` bytes) cannot ask for huge tables.
    fn from_header(r: &CsvRow, limit: usize) -> std::result::Result<Plan, String> {
        let kind = r.op.parse::<ScheduleKind>().map_err(|e| e.to_string())?;
        if r.step > limit || r.worker > limit || r.microbatch > limit {
            return Err(format!(
                "plan record asks for {} stages, {} workers, {} micro-batches: more than a file of {limit} bytes can describe",
                r.step, r.worker, r.microbatch
            ));
        }
        let stage = StagePlan {
            layers: 1,
            hosts: Vec::new(),
            cost: None,
        };
        Ok(Plan {
            kind,
            num_microbatches: r.microbatch,
            stages: vec![stage; r.step],
            routes: vec![Vec::new(); r.microbatch],
            workers: vec![Vec::new(); r.worker],
            devices: Vec::new(),
        })
    }

    pub fn from_csv(file: &str, text: &str) -> Result<Self> {
        if super::torch_csv::is_torch_csv(text) {
            return super::torch_csv::from_torch_csv(file, text);
        }
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let mut plan: Option<Plan> = None;
        let mut stage_rows = false;
        for (i, rec) in rd.deserialize::<CsvRow>().enumerate() {
            let line = i + 2;
            let r = rec.map_err(|e| Error::input(file, format!("line {line}: {e}")))?;
            let bad = |msg: String| Error::input(file, format!("line {line}: {msg}"));
            match (r.record.as_str(), plan.as_mut()) {
                ("plan", None) => plan = Some(Plan::from_header(&r, text.len()).map_err(bad)?),
                ("plan", Some(_)) => return Err(bad("a second `plan` record".into())),
                (_, None) => return Err(bad("the first record must be `plan`".into())),
                ("stage", Some(p)) => {
                    if r.stage >= p.stages.len() || r.worker >= p.workers.len() {
                        return Err(bad(format!(
                            "stage record out of range (stage {}, worker {})",
                            r.stage, r.worker
                        )));
                    }
                    stage_rows = true;
                    let st = &mut p.stages[r.stage];
                    st.layers = r.step;
                    if !st.hosts.contains(&r.worker) {
                        st.hosts.push(r.worker);
                    }
                }
                ("route", Some(p)) => {
                    if r.stage >= p.stages.len()
                        || r.microbatch >= p.routes.len()
                        || r.worker >= p.workers.len()
                    {
                        return Err(bad(format!(
                            "route record out of range (stage {}, mb {}, worker {})",
                            r.stage, r.microbatch, r.worker
                        )));
                    }
                    if r.step != p.routes[r.microbatch].len() {
                        return Err(bad(format!(
                            "route of mb {} skips position {}",
                            r.microbatch,
                            p.routes[r.microbatch].len()
                        )));
                    }
                    p.routes[r.microbatch].push(Hop {
                        stage: r.stage,
                        worker: r.worker,
                    });
                }
                ("action", Some(p)) => {
                    let (name, overlap) = match r.op.strip_suffix('+') {
                        Some(f) => (f, true),
                        None => (r.op.as_str(), false),
                    };
                    let op = Op::parse(name).ok_or_else(|| {
                        bad(format!(
                            "unknown op {:?} (expected F, B, W or BW, or F+ for an overlapped forward)",
                            r.op
                        ))
                    })?;
                    let acts = p
                        .workers
                        .get_mut(r.worker)
                        .ok_or_else(|| bad(format!("worker {} out of range", r.worker)))?;
                    if r.step != acts.len() {
                        return Err(bad(format!(
                            "worker {} skips step {}",
                            r.worker,
                            acts.len()
                        )));
                    }
                    let a = Action::new(op, r.stage, r.microbatch);
                    acts.push(if overlap { a.overlapped() } else { a });
                }
                (other, _) => {
                    return Err(bad(format!(
                        "unknown record {other:?} (expected plan, stage, route or action)"
                    )))
                }
            }
        }
        let mut p = plan.ok_or_else(|| Error::input(file, "empty: no `plan` record"))?;
        if !stage_rows {
            // 0.1 files: hosts are where routes and actions put each stage.
            let mut add = |s: usize, w: usize| {
                if let Some(st) = p.stages.get_mut(s) {
                    if !st.hosts.contains(&w) {
                        st.hosts.push(w);
                    }
                }
            };
            for h in p.routes.iter().flatten() {
                add(h.stage, h.worker);
            }
            for (w, acts) in p.workers.iter().enumerate() {
                for a in acts {
                    add(a.stage, w);
                }
            }
        }
        if let Some(s) = p.stages.iter().position(|st| st.hosts.is_empty()) {
            return Err(Error::input(file, format!("stage {s} has no worker")));
        }
        Ok(p)
    }
}

/// The single-pipeline plan of pipewright 0.1, converted on load.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OldPlan {
    kind: String,
    num_microbatches: usize,
    placement: Vec<usize>,
    routes: Vec<Vec<usize>>,
    workers: Vec<Vec<Action>>,
}

impl OldPlan {
    fn convert(self, file: &str) -> Result<Plan> {
        let kind = self
            .kind
            .parse::<ScheduleKind>()
            .unwrap_or(ScheduleKind::Custom);
        let mut routes = Vec::with_capacity(self.routes.len());
        for (m, r) in self.routes.iter().enumerate() {
            let mut hops = Vec::with_capacity(r.len());
            for &s in r {
                let w = *self.placement.get(s).ok_or_else(|| {
                    Error::input(
                        file,
                        format!(
                            "route of mb {m} visits stage {s}, but `placement` has {} stages",
                            self.placement.len()
                        ),
                    )
                })?;
                hops.push(Hop {
                    stage: s,
                    worker: w,
                });
            }
            routes.push(hops);
        }
        let mut plan = Plan::pipeline(kind, self.placement, 0, self.workers);
        plan.num_microbatches = self.num_microbatches;
        plan.routes = routes;
        Ok(plan)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct CsvRow {
    record: String,
    worker: usize,
    step: usize,
    op: String,
    stage: usize,
    microbatch: usize,
}
