//! The per-rank action CSV of `torch.distributed.pipelining` (what its schedule runtime's
//! `_load_csv` reads): one row per rank, one cell per action, `{stage}{type}{micro-batch}` with
//! type `F` (forward), `I` (input gradient), `W` (weight gradient) or `B` (full backward),
//! e.g. `2F0`, `1I3`, `0W1`, `0B2`. Empty cells are idle slots. An overlapped pair is one cell,
//! `(0F3;3B1)OVERLAP_F_B`: the forward, then the backward it overlaps (DualPipeV's).
//!
//! torch's format has no routes or replica groups: a plan exports only if every micro-batch
//! visits every stage in model order and every stage has one host.

use super::ir::{Action, Op, Plan};
use super::ScheduleKind;
use crate::error::{Error, Result};

/// torch's letter for an op (its `_ComputationType` short names).
fn letter(op: Op) -> char {
    match op {
        Op::F => 'F',
        Op::B => 'I',
        Op::W => 'W',
        Op::BW => 'B',
    }
}

fn op_of(letter: &str) -> Option<Op> {
    Some(match letter {
        "F" => Op::F,
        "I" => Op::B,
        "W" => Op::W,
        "B" => Op::BW,
        _ => return None,
    })
}

/// Why `plan` cannot be written in torch's format, if it cannot.
fn unsupported(plan: &Plan) -> Option<String> {
    if let Some(s) = plan.stages.iter().position(|s| s.hosts.len() > 1) {
        return Some(format!(
            "stage {s} has {} replicas; torch's schedule CSV describes one pipeline",
            plan.stages[s].hosts.len()
        ));
    }
    let stages = plan.num_stages();
    for (m, r) in plan.routes.iter().enumerate() {
        let in_order = r.len() == stages && r.iter().enumerate().all(|(i, h)| h.stage == i);
        if !in_order {
            let visits: Vec<usize> = r.iter().map(|h| h.stage).collect();
            return Some(format!(
                "micro-batch {m} visits stages {visits:?} (skips or swaps); torch's schedule CSV sends every micro-batch through every stage in order"
            ));
        }
    }
    None
}

/// `plan` as torch's per-rank action CSV; plans with skips, swaps or replicas are refused.
pub fn to_torch_csv(plan: &Plan) -> Result<String> {
    if let Some(why) = unsupported(plan) {
        return Err(Error::Invalid(format!("cannot export as torch-csv: {why}")));
    }
    let one = |a: &Action| format!("{}{}{}", a.stage, letter(a.op), a.mb);
    let mut out = String::new();
    for acts in &plan.workers {
        let mut cells: Vec<String> = Vec::with_capacity(acts.len());
        let mut i = 0;
        while i < acts.len() {
            match acts.get(i + 1).filter(|_| acts[i].overlap) {
                Some(b) => {
                    cells.push(format!("({};{}){OVERLAP}", one(&acts[i]), one(b)));
                    i += 2;
                }
                None => {
                    cells.push(one(&acts[i]));
                    i += 1;
                }
            }
        }
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    Ok(out)
}

/// torch's name for an overlapped forward-backward pair (`_ComputationType.OVERLAP_F_B`).
const OVERLAP: &str = "OVERLAP_F_B";

/// One cell: an action, or an overlapped pair (a forward, then a backward).
fn parse_cells(cell: &str) -> Option<Vec<Action>> {
    let Some(inner) = cell
        .strip_prefix('(')
        .and_then(|c| c.strip_suffix(OVERLAP))
        .and_then(|c| c.strip_suffix(')'))
    else {
        return Some(vec![parse_cell(cell)?]);
    };
    let (f, b) = inner.split_once(';')?;
    let (f, b) = (parse_cell(f.trim())?, parse_cell(b.trim())?);
    (f.op == Op::F && b.op.sends_grad()).then(|| vec![f.overlapped(), b])
}

/// Does `text` look like torch's format (rather than pipewright's CSV, whose first line is a
/// header starting `record`)?
pub fn is_torch_csv(text: &str) -> bool {
    let first = text.lines().map(str::trim).find(|l| !l.is_empty());
    first.is_some_and(|l| !l.starts_with("record"))
}

/// One cell: `{stage}{type}{micro-batch}`.
fn parse_cell(cell: &str) -> Option<Action> {
    let digits = |s: &str| s.chars().take_while(char::is_ascii_digit).count();
    let n = digits(cell);
    let rest = &cell[n..];
    let k = rest.chars().take_while(char::is_ascii_alphabetic).count();
    let (kind, mb) = rest.split_at(k);
    if n == 0 || mb.is_empty() || digits(mb) != mb.len() {
        return None;
    }
    Some(Action::new(
        op_of(kind)?,
        cell[..n].parse().ok()?,
        mb.parse().ok()?,
    ))
}

/// Read torch's per-rank CSV into a plan: rank r is worker r, each stage hosted by the rank
/// that runs it, every micro-batch through every stage in order, one layer per stage.
pub fn from_torch_csv(file: &str, text: &str) -> Result<Plan> {
    let mut workers: Vec<Vec<Action>> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut acts = Vec::new();
        for cell in line.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            let a = parse_cells(cell).ok_or_else(|| {
                Error::input(
                    file,
                    format!(
                        "line {}: {cell:?} is not a torch action (e.g. 0F1, 1I0, 0W2, 2B1, (0F3;3B1)OVERLAP_F_B)",
                        i + 1
                    ),
                )
            })?;
            acts.extend(a);
        }
        workers.push(acts);
    }
    while workers.last().is_some_and(Vec::is_empty) {
        workers.pop();
    }
    let all = || workers.iter().flatten();
    let stages = all().map(|a| a.stage.saturating_add(1)).max().unwrap_or(0);
    let microbatches = all().map(|a| a.mb.saturating_add(1)).max().unwrap_or(0);
    let limit = text.len();
    if stages > limit || microbatches > limit {
        return Err(Error::input(
            file,
            "stage or micro-batch numbers larger than the file can describe",
        ));
    }
    let mut hosts: Vec<Option<usize>> = vec![None; stages];
    for (w, acts) in workers.iter().enumerate() {
        for a in acts {
            match hosts[a.stage] {
                Some(h) if h != w => {
                    return Err(Error::input(
                        file,
                        format!(
                        "stage {} runs on ranks {h} and {w}; torch's CSV gives each stage one rank",
                        a.stage
                    ),
                    ))
                }
                _ => hosts[a.stage] = Some(w),
            }
        }
    }
    let hosts: Vec<usize> = hosts
        .iter()
        .enumerate()
        .map(|(s, h)| h.ok_or_else(|| Error::input(file, format!("stage {s} has no actions"))))
        .collect::<Result<_>>()?;
    Ok(Plan::pipeline(
        ScheduleKind::Custom,
        hosts,
        microbatches,
        workers,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::validate::validate;

    /// A 2-stage 1F1B plan written by hand (generators live above this module).
    fn one_f_one_b() -> Plan {
        let csv = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n";
        from_torch_csv("t.csv", csv).unwrap()
    }

    #[test]
    fn round_trip_keeps_every_action_in_order() {
        let p = one_f_one_b();
        validate(&p).unwrap();
        assert_eq!(p.num_workers(), 2);
        assert_eq!(p.num_microbatches, 2);
        assert_eq!(p.workers[1][1], Action::new(Op::BW, 1, 0));
        assert_eq!(
            to_torch_csv(&p).unwrap(),
            "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
        );
    }

    #[test]
    fn split_backward_letters_map_both_ways() {
        let csv = "0F0,0I0,0W0\n";
        let p = from_torch_csv("t.csv", csv).unwrap();
        assert_eq!(
            p.workers[0].iter().map(|a| a.op).collect::<Vec<_>>(),
            vec![Op::F, Op::B, Op::W]
        );
        assert_eq!(to_torch_csv(&p).unwrap(), csv);
    }

    #[test]
    fn replicas_and_skips_are_refused_with_the_reason() {
        let mut p = one_f_one_b();
        p.stages[1].hosts.push(0);
        let e = to_torch_csv(&p).unwrap_err().to_string();
        assert!(e.contains("stage 1 has 2 replicas"), "{e}");
        let mut p = one_f_one_b();
        p.routes[1].remove(1);
        let e = to_torch_csv(&p).unwrap_err().to_string();
        assert!(e.contains("micro-batch 1 visits stages [0]"), "{e}");
    }

    #[test]
    fn bad_cells_and_shared_stages_are_named() {
        let e = from_torch_csv("t.csv", "0F0,0X1\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.csv: line 1: \"0X1\" is not a torch action"),
            "{e}"
        );
        let e = from_torch_csv("t.csv", "0F0\n0B0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 0 runs on ranks 0 and 1"), "{e}");
        assert!(from_torch_csv("t.csv", "F0\n").is_err());
        assert!(from_torch_csv("t.csv", "0F\n").is_err());
        assert!(from_torch_csv("t.csv", "18446744073709551615F0\n").is_err());
    }

    #[test]
    fn overlapped_pairs_read_and_write_as_one_cell() {
        // 2 stages on 2 ranks; rank 0 pairs micro-batch 2's forward with micro-batch 0's
        // backward.
        let csv = "0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n";
        let p = from_torch_csv("t.csv", csv).unwrap();
        assert_eq!(p.workers[0][2], Action::new(Op::F, 0, 2).overlapped());
        assert_eq!(p.workers[0][3], Action::new(Op::BW, 0, 0));
        validate(&p).unwrap();
        assert_eq!(to_torch_csv(&p).unwrap(), csv);
        for bad in [
            "(0B0;0F2)OVERLAP_F_B",
            "(0F2;0W0)OVERLAP_F_B",
            "(0F2)OVERLAP_F_B",
            "(0F2;0B0)",
        ] {
            let e = from_torch_csv("t.csv", &format!("0F0,0F1,{bad}\n")).unwrap_err();
            assert!(
                e.to_string().contains("is not a torch action"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn plan_csv_and_torch_csv_are_told_apart() {
        assert!(is_torch_csv("0F0,1F0\n"));
        assert!(!is_torch_csv("record,worker,step,op,stage,microbatch\n"));
        let p = Plan::from_csv("t.csv", "0F0,0B0\n").unwrap();
        assert_eq!(p.num_stages(), 1);
    }
}
