//! Property tests over random schedules and costs.

use pipewright_core::cluster::{Cluster, Link};
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::validate;
use pipewright_core::profile::StageCost;
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::sim::{simulate, SimResult, SimSetup};
use proptest::prelude::*;

fn arb_plan() -> impl Strategy<Value = Plan> {
    (
        0..ScheduleKind::ALL.len(),
        1usize..7,
        1usize..13,
        1usize..4,
        1usize..4,
    )
        .prop_filter_map("valid combination", |(k, p, m, v, d)| {
            let kind = ScheduleKind::ALL[k];
            let v = match kind {
                ScheduleKind::Interleaved
                | ScheduleKind::LoopedBfs
                | ScheduleKind::InterleavedZb => v,
                ScheduleKind::ZbV | ScheduleKind::DualPipeV => 2,
                _ => 1,
            };
            let m = if kind == ScheduleKind::Interleaved {
                m.div_ceil(p) * p
            } else {
                m
            };
            generate(kind, p, m, v).ok()?.replicate(d).ok()
        })
}

fn run(plan: &Plan, f: f64, b: f64, w: f64, link: Option<Link>) -> SimResult {
    let stages = vec![
        StageCost {
            activation_out: 1 << 20,
            ..StageCost::uniform(f, b, w)
        };
        plan.num_stages()
    ];
    let p = plan.num_workers();
    let cluster = link.map_or_else(|| Cluster::uniform(p), |l| Cluster::homogeneous(p, l));
    simulate(&SimSetup {
        plan,
        stages: &stages,
        cluster: &cluster,
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn generated_plans_validate_and_makespan_is_bounded(
        plan in arb_plan(), f in 0.1f64..5.0, b in 0.1f64..5.0, w in 0.1f64..5.0,
        lat in 0.0f64..2.0, with_links in any::<bool>(),
    ) {
        prop_assert!(validate(&plan).is_ok(), "{}", validate(&plan).unwrap_err());
        let link = with_links.then_some(Link { latency: lat, bandwidth: 1e6, overhead: 0.01 });
        let r = run(&plan, f, b, w, link);
        let busiest = r.busy.iter().copied().fold(0.0, f64::max);
        let comm: f64 = r.timeline.transfers.iter().map(|t| t.end - t.start).sum();
        let serial: f64 = r.busy.iter().sum::<f64>() + comm;
        prop_assert!(r.makespan >= busiest - 1e-9, "makespan {} < busiest {}", r.makespan, busiest);
        prop_assert!(r.makespan <= serial + 1e-9, "makespan {} > serial {}", r.makespan, serial);
        prop_assert!(r.bubble_fraction >= -1e-12 && r.bubble_fraction < 1.0);
        // Every action ran exactly once.
        prop_assert_eq!(r.timeline.actions.len(), plan.workers.iter().map(Vec::len).sum::<usize>());
    }

    #[test]
    fn gpipe_and_1f1b_closed_form(p in 1usize..8, m in 1usize..16, f in 0.1f64..5.0, bw in 0.1f64..5.0) {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let plan = generate(kind, p, m, 1).unwrap();
            let r = run(&plan, f, bw / 2.0, bw / 2.0, None);
            let want = (m + p - 1) as f64 * (f + bw);
            prop_assert!((r.makespan - want).abs() < 1e-9 * want, "{kind}: {} vs {want}", r.makespan);
        }
        // 1F1B holds at most P - w micro-batches on worker w; GPipe holds all of them.
        let r = run(&generate(ScheduleKind::OneFOneB, p, m, 1).unwrap(), f, bw / 2.0, bw / 2.0, None);
        let want: Vec<usize> = (0..p).map(|w| (p - w).min(m)).collect();
        prop_assert_eq!(r.peak_activations, want);
    }

    #[test]
    fn zero_bubble_memory_stays_at_1f1b_peak(p in 1usize..8, m in 1usize..16) {
        let h1 = run(&generate(ScheduleKind::ZbH1, p, m, 1).unwrap(), 1.0, 1.0, 1.0, None);
        prop_assert!(h1.peak_activations.iter().all(|&x| x <= p.min(m)), "{:?}", h1.peak_activations);
        let v = run(&generate(ScheduleKind::ZbV, p, m, 2).unwrap(), 1.0, 1.0, 1.0, None);
        prop_assert!(v.peak_activations.iter().all(|&x| x <= 2 * p), "{:?}", v.peak_activations);
    }

    #[test]
    fn json_and_csv_round_trip(plan in arb_plan()) {
        prop_assert_eq!(&Plan::from_json("p.json", &plan.to_json()).unwrap(), &plan);
        prop_assert_eq!(&Plan::from_csv("p.csv", &plan.to_csv()).unwrap(), &plan);
    }
}

#[test]
fn zb_h1_closed_form_when_w_fits() {
    // Bubble (P - 1)(F + B - W) for F = B = W (Qi et al. 2024, table 1).
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 32)] {
        let r = run(
            &generate(ScheduleKind::ZbH1, p, m, 1).unwrap(),
            1.0,
            1.0,
            1.0,
            None,
        );
        assert_eq!(r.makespan, (3 * m + p - 1) as f64, "P={p} M={m}");
    }
}

#[test]
fn interleaved_and_looped_bfs_bubbles_shrink_by_v() {
    // Megatron-LM: bubble time (P - 1)(f + b) per chunk, with chunks costing 1/V of a stage.
    // Looped BFS reaches the same when M >= P (no loop waits for the previous one), but every
    // worker holds all V M micro-batches' activations at the turn, where interleaved holds
    // fewer.
    for kind in [ScheduleKind::Interleaved, ScheduleKind::LoopedBfs] {
        for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 12, 3), (8, 16, 2)] {
            let r = run(&generate(kind, p, m, v).unwrap(), 1.0, 1.0, 1.0, None);
            let what = format!("{kind} P={p} M={m} V={v}");
            assert_eq!(r.makespan, (3 * m * v + 3 * (p - 1)) as f64, "{what}");
            if kind == ScheduleKind::LoopedBfs {
                assert_eq!(r.peak_activations, vec![m * v; p], "{what}");
            }
        }
    }
}

#[test]
fn interleaved_zero_bubble_of_one_chunk_is_zb_h1() {
    for p in 1..7 {
        for m in 1..13 {
            let Ok(one) = generate(ScheduleKind::InterleavedZb, p, m, 1) else {
                continue;
            };
            let h1 = generate(ScheduleKind::ZbH1, p, m, 1).unwrap();
            assert_eq!(one.workers, h1.workers, "P={p} M={m}");
        }
    }
}

/// A plan file written by pipewright 0.1 (`schedule --format json`, with `placement`) loads as
/// the same one-pipeline plan.
#[test]
fn single_pipeline_files_of_0_1_load() {
    let old = r#"{"kind": "1f1b", "num_microbatches": 2, "placement": [0, 1],
        "routes": [[0, 1], [0, 1]],
        "workers": [[{"op":"F","stage":0,"mb":0},{"op":"F","stage":0,"mb":1},{"op":"BW","stage":0,"mb":0},{"op":"BW","stage":0,"mb":1}],
                    [{"op":"F","stage":1,"mb":0},{"op":"BW","stage":1,"mb":0},{"op":"F","stage":1,"mb":1},{"op":"BW","stage":1,"mb":1}]]}"#;
    let plan = Plan::from_json("old.json", old).unwrap();
    assert_eq!(plan, generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap());
    let csv = "record,worker,step,op,stage,microbatch\nplan,2,2,1f1b,0,2\nroute,0,0,,0,0\nroute,1,1,,1,0\nroute,0,0,,0,1\nroute,1,1,,1,1\naction,0,0,F,0,0\naction,0,1,F,0,1\naction,0,2,BW,0,0\naction,0,3,BW,0,1\naction,1,0,F,1,0\naction,1,1,BW,1,0\naction,1,2,F,1,1\naction,1,3,BW,1,1\n";
    assert_eq!(Plan::from_csv("old.csv", csv).unwrap(), plan);
}

/// A cluster of `n` devices in `regions` regions with random links between regions and the
/// same in-flight cap on every device.
fn random_cluster(n: usize, regions: usize, cap: usize, links: &[(f64, f64)]) -> Cluster {
    let mut toml = format!("[defaults]\nmemory_microbatches = {cap}\nbandwidth = 1e9\n");
    for i in 0..n {
        toml += &format!(
            "[[devices]]\nname = \"d{i}\"\nregion = \"r{}\"\n",
            i % regions
        );
    }
    let mut k = 0;
    for a in 0..regions {
        for b in a + 1..regions {
            let (lat, bw) = links[k % links.len()];
            k += 1;
            toml += &format!(
                "[[links]]\na = \"r{a}\"\nb = \"r{b}\"\nlatency = {lat}\nbandwidth = {bw}\n"
            );
        }
    }
    Cluster::parse("random.toml", &toml).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// Whatever the setting, the skip scheduler's plans (and its two baselines) are valid
    /// and keep every SkipPipe rule, the in-flight cap and the per-node load cap included; it
    /// fails only by saying the caps admit no order or leave no room for the visits.
    #[test]
    fn skip_scheduler_plans_keep_every_rule(
        stages in 3usize..6,
        skip_pick in 0usize..4,
        data in 1usize..4,
        mbs in 1usize..7,
        max_swaps in 0usize..3,
        extra in 0usize..4,
        regions in 1usize..4,
        cap in 1usize..4,
        links in proptest::collection::vec((0.0f64..0.5, 1e6f64..1e10), 1..4),
        costs in proptest::collection::vec((0.1f64..3.0, 0.1f64..3.0), 9..10),
        seed in 0u64..1000,
        mechanics in (0usize..2, 0.0f64..0.5, proptest::bool::ANY),
        node_load in proptest::option::of(1usize..8),
    ) {
        use pipewright_core::profile::Profile;
        use pipewright_core::sim::{Dispatch, SimOptions};
        use pipewright_core::search::skip::{check_skip_rules, SkipRules};
        use pipewright_core::search::skipplan::{skip_plan, SkipSetup};
        let middle = stages - 1;
        let skip = skip_pick % middle;
        let n = data + middle * (1 + extra % 2) + extra / 2;
        let cluster = random_cluster(n, regions, cap, &links);
        let mut toml = String::from("[model]\nname = \"r\"\n");
        for (i, (f, b)) in costs.iter().enumerate() {
            toml += &format!("[[layers]]\nname = \"l{i}\"\nforward = {f}\nbackward = {b}\nparams = 4096\nactivation = 65536\n");
        }
        let profile = Profile::parse("r.toml", &toml).unwrap();
        let setup = SkipSetup {
            stages,
            skip,
            data_nodes: data,
            microbatches: mbs,
            max_swaps,
            moves: 60,
            time_limit: std::time::Duration::from_secs(60),
            seed,
            // pipewright's simulator as it is, or with some of SkipPipe's mechanics.
            mechanics: SimOptions {
                dispatch: [Dispatch::Plan, Dispatch::Arrival][mechanics.0],
                idle_gap: mechanics.1,
                no_link_queue: mechanics.2,
                ..SimOptions::default()
            },
            max_node_load: node_load,
            // The last phase keeps every rule too.
            polish_moves: 30,
        };
        match skip_plan(&profile, &cluster, &setup) {
            Ok(r) => {
                let rules = SkipRules {
                    skip,
                    max_swaps,
                    max_in_flight: Some(cap),
                    max_node_load: node_load,
                };
                for p in [&r.plan, &r.random_plan] {
                    validate(p).unwrap();
                    check_skip_rules(p, &rules).unwrap();
                }
                validate(&r.full_plan).unwrap();
                let full = SkipRules { skip: 0, max_node_load: None, ..rules };
                check_skip_rules(&r.full_plan, &full).unwrap();
                prop_assert_eq!(r.plan.num_microbatches, data * mbs);
                prop_assert!(r.skip_time.is_finite() && r.skip_time > 0.0);
            }
            Err(e) => {
                let e = e.to_string();
                prop_assert!(e.contains("in-flight caps") || e.contains("load cap"), "{}", e)
            }
        }
    }
}

/// A profile of `costs.len()` layers with the given (forward, backward) seconds.
fn layer_profile(costs: &[(f64, f64)]) -> pipewright_core::profile::Profile {
    let mut toml = String::from("[model]\nname = \"m\"\n");
    for (i, (f, b)) in costs.iter().enumerate() {
        toml += &format!(
            "[[layers]]\nname = \"l{i}\"\nforward = {f}\nbackward = {b}\nparams = 1000000\nactivation = 100000\n"
        );
    }
    pipewright_core::profile::Profile::parse("m.toml", &toml).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// AutoPipe never moves to a layout its simulator rates slower than keeping the current
    /// one: in the first frozen epoch every re-planning ablation is at least as fast as
    /// freezing alone (which keeps the layout), and while no new layer freezes an epoch is
    /// never slower than the one before it.
    #[test]
    fn autopipe_never_adopts_a_slower_layout(
        costs in proptest::collection::vec((0.1f64..3.0, 0.1f64..6.0), 6..12),
        pipelines in 1usize..3, depth in 2usize..5, first in 1usize..4, more in 0usize..3,
    ) {
        use pipewright_core::policy::elastic::{ablation, Ablation, AblationSetup};
        let prof = layer_profile(&costs);
        let n = costs.len();
        let k1 = first.min(n - 2);
        let k2 = (k1 + more).min(n - 2);
        let trajectory = [0, k1, k1, k2, k2];
        let cluster = Cluster::uniform(pipelines * depth);
        let setup = AblationSetup {
            profile: &prof,
            cluster: &cluster,
            pipelines,
            depth: depth.min(n),
            microbatches: 4,
            kind: ScheduleKind::GPipe,
            trajectory: &trajectory,
            memory_budget: u64::MAX,
        };
        let freeze = ablation(&setup, Ablation::FreezeOnly).unwrap();
        for which in [Ablation::PipeCache, Ablation::PipeDp, Ablation::All] {
            let run = ablation(&setup, which).unwrap();
            prop_assert!(run[1].iteration_time <= freeze[1].iteration_time * (1.0 + 1e-9),
                "{}: {:?} against freeze only {:?}", which.name(), run[1], freeze[1]);
            for e in 1..trajectory.len() {
                if trajectory[e] == trajectory[e - 1] {
                    prop_assert!(run[e].iteration_time <= run[e - 1].iteration_time * (1.0 + 1e-9),
                        "{} epoch {e}: {:?} after {:?}", which.name(), run[e], run[e - 1]);
                }
            }
        }
    }
}
