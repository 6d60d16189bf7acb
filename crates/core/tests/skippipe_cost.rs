//! SkipPipe's cost model (`sim::slotted`) against SkipPipe's own simulator: plans written by
//! `skip-plan` on the geo example, priced by `scripts/skippipe-sim` (gensyn-ai/skippipe's
//! com_sym.py) when they were saved.

use pipewright_core::cluster::Cluster;
use pipewright_core::plan::ir::Plan;
use pipewright_core::profile::Profile;
use pipewright_core::sim::slotted::slotted_plan_time;
use pipewright_core::sim::{devices_for_plan, SimSetup};

fn priced(name: &str, text: &str) -> (f64, usize) {
    let profile = Profile::parse(
        "llama500m.toml",
        include_str!("../../../examples/llama500m_skippipe.toml"),
    )
    .unwrap();
    let cluster = Cluster::parse(
        "geo20.toml",
        include_str!("../../../examples/geo20_skippipe.toml"),
    )
    .unwrap();
    let plan = Plan::from_json(name, text).unwrap();
    let stages = profile.stage_costs(&plan.layers_per_stage());
    let devices = devices_for_plan(&plan, &cluster).unwrap();
    let run = slotted_plan_time(&SimSetup {
        plan: &plan,
        stages: &stages,
        cluster: &devices,
    })
    .unwrap();
    (run.pipeline_time, run.finished)
}

#[test]
fn plans_price_as_in_skippipes_own_simulator() {
    // (plan, com_sym.py's pipeline time, micro-batches back)
    let cases = [
        (
            "seed 2",
            include_str!("fixtures/skip_plan_geo_seed2.json"),
            79.9277331730141,
        ),
        (
            "10 moves, skip 1",
            include_str!("fixtures/skip_plan_geo_skip1_10moves.json"),
            129.94326962350155,
        ),
    ];
    for (name, text, want) in cases {
        let (t, done) = priced(name, text);
        assert_eq!(done, 30, "{name}");
        assert!(
            (t - want).abs() < 1e-6,
            "{name}: {t} against com_sym.py's {want}"
        );
    }
}
