//! Fuzzing through every parser and what runs after it: arbitrary bytes, and structured
//! mutations (numbers replaced by edge values: 0, huge, negative, non-finite, fractional) of
//! real plan JSON and CSV, profile and cluster TOML. Whatever the input, parsing, validation,
//! partitioning and simulation return Ok or an error; nothing panics. CI runs a bounded number
//! of cases; `PROPTEST_CASES=20000 cargo test --release -p pipewright-core --test fuzz` runs
//! the longer campaign reported in the README.

use pipewright_core::cluster::Cluster;
use pipewright_core::fuzz::mutate;
use pipewright_core::plan::ir::Plan;
use pipewright_core::plan::validate::validate;
use pipewright_core::profile::{Profile, StageCost};
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::search::partition::{partition, PartitionProblem};
use pipewright_core::sim::{devices_for_plan, simulate, SimSetup};
use proptest::prelude::*;

fn shared(rel: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Everything a plan goes through after loading.
fn exercise_plan(plan: &Plan, cluster: Option<&Cluster>) {
    if validate(plan).is_err() {
        return;
    }
    let stages = plan
        .stage_costs()
        .unwrap_or_else(|| vec![StageCost::uniform(1.0, 1.0, 1.0); plan.num_stages()]);
    let cl = match cluster {
        Some(c) => match devices_for_plan(plan, c) {
            Ok(c) => c,
            Err(_) => return,
        },
        None => Cluster::uniform(plan.num_workers()),
    };
    let _ = simulate(&SimSetup {
        plan,
        stages: &stages,
        cluster: &cl,
    });
    let _ = plan.to_json();
    let _ = plan.to_csv();
}

fn exercise_profile(profile: &Profile, cluster: &Cluster) {
    for k in 1..=4 {
        let _ = partition(&PartitionProblem {
            profile,
            cluster,
            stages: k,
            objective: pipewright_core::search::partition::Objective::Time,
            in_flight: vec![1; k],
        });
    }
}

fn sample_plan() -> Plan {
    generate(ScheduleKind::ZbH1, 3, 4, 1)
        .unwrap()
        .replicate(2)
        .unwrap()
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(p) = Plan::from_json("fuzz.json", &text) {
            exercise_plan(&p, None);
        }
        if let Ok(p) = Plan::from_csv("fuzz.csv", &text) {
            exercise_plan(&p, None);
        }
        let _ = Profile::parse("fuzz.toml", &text);
        let _ = Cluster::parse("fuzz.toml", &text);
    }

    #[test]
    fn mutated_plan_json_never_panics(picks in proptest::collection::vec((any::<usize>(), any::<usize>()), 1..6)) {
        let text = mutate(&sample_plan().to_json(), &picks);
        if let Ok(p) = Plan::from_json("fuzz.json", &text) {
            exercise_plan(&p, None);
        }
    }

    #[test]
    fn mutated_plan_csv_never_panics(picks in proptest::collection::vec((any::<usize>(), any::<usize>()), 1..6)) {
        let text = mutate(&sample_plan().to_csv(), &picks);
        if let Ok(p) = Plan::from_csv("fuzz.csv", &text) {
            exercise_plan(&p, None);
        }
    }

    #[test]
    fn mutated_profiles_and_clusters_never_panic(
        picks in proptest::collection::vec((any::<usize>(), any::<usize>()), 1..6),
        which in any::<bool>(),
    ) {
        let prof_text = shared("examples/vit_b16_params.toml");
        let cl_text = shared("examples/pipetransformer_2x8.toml");
        let (prof_text, cl_text) = if which {
            (mutate(&prof_text, &picks), cl_text)
        } else {
            (prof_text, mutate(&cl_text, &picks))
        };
        let (Ok(profile), Ok(cluster)) = (
            Profile::parse("fuzz-profile.toml", &prof_text),
            Cluster::parse("fuzz-cluster.toml", &cl_text),
        ) else {
            return Ok(());
        };
        exercise_profile(&profile, &cluster);
        let mut plan = generate(ScheduleKind::OneFOneB, 4, 4, 1).unwrap();
        if pipewright_core::search::partition::assign_layers(&profile, &mut plan, &cluster).is_ok() {
            exercise_plan(&plan, Some(&cluster));
        }
    }
}
