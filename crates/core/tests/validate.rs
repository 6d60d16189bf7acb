//! The validator's rules, each on a plan broken on purpose (generators live above the plan
//! module, so these tests live outside it).

use pipewright_core::plan::ir::{Action, Op, Plan};
use pipewright_core::plan::ir::{Hop, Topology};
use pipewright_core::plan::validate::validate;
use pipewright_core::schedule::{generate, ScheduleKind};

fn plan() -> Plan {
    generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap()
}

#[test]
fn generated_plans_validate() {
    for k in ScheduleKind::ALL {
        let p = generate(k, 4, 8, k.default_chunks()).unwrap();
        validate(&p).unwrap_or_else(|e| panic!("{k}: {e}"));
    }
}

#[test]
fn missing_action() {
    let mut p = plan();
    p.workers[1].retain(|a| !(a.op == Op::BW && a.mb == 1));
    assert_eq!(
        validate(&p).unwrap_err().to_string(),
        "worker 1: missing BW(stage 1, mb 1) (the schedule never runs it) (rule actions)"
    );
}

#[test]
fn wrong_order_on_one_worker() {
    let mut p = plan();
    // worker 1 runs F0 BW0 F1 BW1; put BW1 before F1.
    p.workers[1].swap(2, 3);
    assert_eq!(
        validate(&p).unwrap_err().to_string(),
        "worker 1, step 2: BW(stage 1, mb 1) comes before F(stage 1, mb 1) (step 3) that it needs (rule deadlock)"
    );
}

#[test]
fn deadlock_across_workers() {
    let mut p = plan();
    // worker 0 runs F0 F1 BW0 BW1; make it wait for BW1's gradient before running F1.
    // worker 0 finishes mb 0 before starting mb 1; worker 1 insists on mb 1 first.
    p.workers[0] = vec![
        Action::new(Op::F, 0, 0),
        Action::new(Op::BW, 0, 0),
        Action::new(Op::F, 0, 1),
        Action::new(Op::BW, 0, 1),
    ];
    p.workers[1] = vec![
        Action::new(Op::F, 1, 1),
        Action::new(Op::F, 1, 0),
        Action::new(Op::BW, 1, 0),
        Action::new(Op::BW, 1, 1),
    ];
    assert_eq!(
        validate(&p).unwrap_err().to_string(),
        "deadlock: worker 0, step 1: BW(stage 0, mb 0) waits for BW(stage 1, mb 0) (worker 1, step 2); \
         stuck: worker 0 step 1 BW(stage 0, mb 0), worker 1 step 0 F(stage 1, mb 1) (rule deadlock)"
    );
}

#[test]
fn duplicate_and_misplaced() {
    let mut p = plan();
    p.workers[0].push(Action::new(Op::F, 0, 0));
    assert!(validate(&p)
        .unwrap_err()
        .to_string()
        .contains("worker 0, step 4: F(stage 0, mb 0) is a duplicate (first at step 0)"));
    let mut p = plan();
    p.workers[0][0].stage = 1;
    assert_eq!(
        validate(&p).unwrap_err().to_string(),
        "worker 0, step 0: F(stage 1, mb 0) belongs to worker 1 (the route of mb 0 runs stage 1 there) (rule actions)"
    );
}

#[test]
fn generated_whole_job_plans_validate() {
    for k in ScheduleKind::ALL {
        for d in 1..=3 {
            for (p, m) in [(1, 1), (2, 4), (3, 6), (4, 8)] {
                let Ok(one) = generate(k, p, m, k.default_chunks()) else {
                    continue;
                };
                let job = one.replicate(d).unwrap();
                assert_eq!(job.num_workers(), p * d);
                assert_eq!(job.num_microbatches, m * d);
                validate(&job).unwrap_or_else(|e| panic!("{k} P={p} M={m} D={d}: {e}"));
                // Each stage's replica group has one host per replica.
                let topo = Topology::new(&job);
                assert!(topo.groups.iter().all(|g| g.len() == d));
            }
        }
    }
}

/// A 4-stage plan whose routes are given by hand, one worker per stage, each worker running
/// all its forwards then its backwards (GPipe order, so any routes run).
fn routed(routes: &[&[usize]]) -> Plan {
    let s = 4;
    let m = routes.len();
    let mut plan = Plan::pipeline(ScheduleKind::Custom, (0..s).collect(), m, vec![]);
    plan.routes = routes
        .iter()
        .map(|r| {
            r.iter()
                .map(|&st| Hop {
                    stage: st,
                    worker: st,
                })
                .collect()
        })
        .collect();
    plan.workers = (0..s)
        .map(|w| {
            let mbs: Vec<usize> = (0..m).filter(|&mb| routes[mb].contains(&w)).collect();
            mbs.iter()
                .map(|&mb| Action::new(Op::F, w, mb))
                .chain(mbs.iter().map(|&mb| Action::new(Op::BW, w, mb)))
                .collect()
        })
        .collect();
    plan
}

#[test]
fn skipped_and_swapped_stages_are_valid() {
    validate(&routed(&[
        &[0, 1, 2, 3],
        &[0, 2, 3],
        &[0, 2, 1, 3],
        &[0, 3],
    ]))
    .unwrap();
}

#[test]
fn head_on_the_data_node_is_valid() {
    // SkipPipe's form: stage 3 is the head alone, on worker 0 with the embedding.
    let mut plan = routed(&[&[0, 1, 2, 3], &[0, 2, 1, 3]]);
    plan.stages[3].hosts = vec![0];
    for r in &mut plan.routes {
        r.last_mut().unwrap().worker = 0;
    }
    let head = std::mem::take(&mut plan.workers[3]);
    plan.workers.pop();
    // Worker 0: F(0) of both, then the head's F and BW, then BW(0).
    plan.workers[0] = vec![Action::new(Op::F, 0, 0), Action::new(Op::F, 0, 1)];
    plan.workers[0].extend(head);
    plan.workers[0].extend([Action::new(Op::BW, 0, 0), Action::new(Op::BW, 0, 1)]);
    validate(&plan).unwrap();
    assert_eq!(
        plan.routes[1].first().unwrap().worker,
        plan.routes[1].last().unwrap().worker
    );
}

#[test]
fn each_route_rule_is_named() {
    let e = |p: &Plan| validate(p).unwrap_err().to_string();
    assert_eq!(
        e(&routed(&[&[1, 2, 3]])),
        "route of mb 0 starts at stage 1, but stage 0 holds the embedding (rule route-start)"
    );
    assert_eq!(
        e(&routed(&[&[0, 1, 2]])),
        "route of mb 0 ends at stage 2, but stage 3 holds the head and loss (rule route-end)"
    );
    assert_eq!(
        e(&routed(&[&[0, 1, 1, 3]])),
        "route of mb 0 visits stage 1 twice (rule route-once)"
    );
    let mut p = routed(&[&[0, 1, 2, 3]]);
    p.routes[0][1].worker = 2;
    assert_eq!(
        e(&p),
        "route of mb 0 runs stage 1 on worker 2, which does not host it (hosts [1]) (rule hop-host)"
    );
    // An action for a stage the route skips.
    let mut p = routed(&[&[0, 2, 3]]);
    p.workers[1] = vec![Action::new(Op::F, 1, 0), Action::new(Op::BW, 1, 0)];
    assert_eq!(
        e(&p),
        "worker 1, step 0: F(stage 1, mb 0) but mb 0 does not visit stage 1 on its route (rule actions)"
    );
    // A hop without its actions.
    let mut p = routed(&[&[0, 1, 3]]);
    p.workers[1].clear();
    assert_eq!(
        e(&p),
        "worker 1: missing F(stage 1, mb 0) (the schedule never runs it) (rule actions)"
    );
    let mut p = routed(&[&[0, 1, 2, 3]]);
    p.stages[2].layers = 0;
    assert_eq!(e(&p), "stage 2 holds no layers (rule stages)");
    // Swapped stages whose worker orders cannot both be met deadlock, and say so.
    let mut p = routed(&[&[0, 1, 2, 3], &[0, 2, 1, 3]]);
    p.stages[2].hosts = vec![1];
    for r in &mut p.routes {
        for h in r.iter_mut().filter(|h| h.stage == 2) {
            h.worker = 1;
        }
    }
    let two = std::mem::take(&mut p.workers[2]);
    p.workers[1].splice(0..0, two);
    assert!(e(&p).contains("(rule deadlock)"), "{}", e(&p));
}

#[test]
fn overlapped_pairs_keep_their_form() {
    // 1F1B on 2 workers, 2 micro-batches: worker 0 runs F0 F1 BW0 BW1, worker 1 F0 BW0 F1 BW1.
    let cases: [(usize, usize, &str); 4] = [
        (0, 1, "worker 0, step 1: F(stage 0, mb 1) is overlapped with BW(stage 0, mb 0)"),
        (0, 2, "worker 0, step 2: BW(stage 0, mb 0) is marked overlapped, but only a forward opens a pair"),
        (0, 3, "worker 0, step 3: BW(stage 0, mb 1) is marked overlapped"),
        (1, 0, "worker 1, step 0: F(stage 1, mb 0) is overlapped with BW(stage 1, mb 0): a pair joins two micro-batches"),
    ];
    for (w, i, want) in cases {
        let mut p = plan();
        p.workers[w][i] = p.workers[w][i].overlapped();
        match validate(&p) {
            // Worker 0's F1 with BW0 is a proper pair.
            Ok(()) if (w, i) == (0, 1) => {}
            Ok(()) => panic!("{w} {i}: accepted"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with(want) && e.ends_with("(rule overlap)"), "{e}");
            }
        }
    }
    let mut p = plan();
    p.workers[1].swap(2, 3);
    p.workers[1][3] = p.workers[1][3].overlapped();
    let e = validate(&p).unwrap_err().to_string();
    assert_eq!(e, "worker 1, step 3: F(stage 1, mb 1) opens an overlapped pair, but is the worker's last action (rule overlap)");
}
