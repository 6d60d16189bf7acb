//! pipewright's generators against torch.distributed.pipelining's own per-rank orders
//! (`tests/fixtures/torch-orders/`, written by torch 2.15 through `scripts/torch-orders` and
//! committed, so this runs without torch). P in {2, 4, 8}, M in {P, 2P, 4P}, 2 chunks a worker.

use pipewright_core::plan::torch_csv::{from_torch_csv, to_torch_csv};
use pipewright_core::plan::validate::validate;
use pipewright_core::profile::StageCost;
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::sim::{simulate, SimSetup};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch-orders")
}

/// `(file text, P, M)` of every fixture of `name`.
fn fixtures(name: &str) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for p in [2, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            let f = dir().join(format!("{name}-p{p}-m{m}.csv"));
            if let Ok(text) = std::fs::read_to_string(&f) {
                out.push((text, p, m));
            }
        }
    }
    out
}

fn makespan(plan: &pipewright_core::plan::ir::Plan) -> f64 {
    let stages = vec![StageCost::uniform(1.0, 1.0, 1.0); plan.num_stages()];
    let cluster = pipewright_core::cluster::Cluster::uniform(plan.num_workers());
    let setup = SimSetup {
        plan,
        stages: &stages,
        cluster: &cluster,
    };
    simulate(&setup).unwrap().makespan
}

#[test]
fn interleaved_looped_bfs_and_interleaved_zb_are_torchs_orders() {
    for kind in [
        ScheduleKind::Interleaved,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZb,
    ] {
        let all = fixtures(kind.name());
        assert_eq!(all.len(), 9, "{kind}: fixtures");
        for (torch, p, m) in all {
            let plan = generate(kind, p, m, 2).unwrap();
            validate(&plan).unwrap_or_else(|e| panic!("{kind} P={p} M={m}: {e}"));
            let ours = to_torch_csv(&plan).unwrap();
            for (r, (a, b)) in ours.lines().zip(torch.lines()).enumerate() {
                assert_eq!(a, b, "{kind} P={p} M={m}: rank {r}");
            }
            assert_eq!(ours.lines().count(), torch.lines().count());
        }
    }
}

/// pipewright's ZB-V is its own greedy order (see `schedule::zb_v`), not torch's hand-written
/// one: both are valid, and on unit costs pipewright's is never longer.
#[test]
fn zbv_differs_from_torchs_order_and_is_never_slower() {
    let all = fixtures("zbv");
    assert_eq!(all.len(), 9);
    for (torch, p, m) in all {
        let theirs = from_torch_csv("torch", &torch).unwrap();
        validate(&theirs).unwrap();
        let ours = generate(ScheduleKind::ZbV, p, m, 2).unwrap();
        let (a, b) = (makespan(&ours), makespan(&theirs));
        assert!(a <= b + 1e-9, "zbv P={p} M={m}: ours {a}, torch's {b}");
    }
}
