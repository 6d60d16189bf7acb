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
fn interleaved_looped_bfs_interleaved_zb_and_dualpipev_are_torchs_orders() {
    for kind in [
        ScheduleKind::Interleaved,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZb,
        ScheduleKind::DualPipeV,
    ] {
        let all = fixtures(kind.name());
        // torch refuses DualPipeV at M = P (it needs M >= 2P), and so does pipewright.
        let want = if kind == ScheduleKind::DualPipeV {
            6
        } else {
            9
        };
        assert_eq!(all.len(), want, "{kind}: fixtures");
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

/// torch's own DualPipeV orders, read back (overlapped pairs included), are pipewright's plans
/// action for action, and write out as the same CSV.
#[test]
fn torchs_dualpipev_csv_reads_as_pipewrights_plan_and_writes_back_unchanged() {
    for (torch, p, m) in fixtures("dualpipev") {
        let read = from_torch_csv("torch", &torch).unwrap();
        let ours = generate(ScheduleKind::DualPipeV, p, m, 2).unwrap();
        assert_eq!(read.workers, ours.workers, "P={p} M={m}");
        assert_eq!(read.stages, ours.stages, "P={p} M={m}");
        assert_eq!(to_torch_csv(&read).unwrap(), torch, "P={p} M={m}");
        let pairs = read.workers.iter().flatten().filter(|a| a.overlap).count();
        assert!(pairs >= p * (m - 2 * p), "P={p} M={m}: {pairs} pairs");
    }
}
