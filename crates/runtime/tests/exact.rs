//! Exact gradients: pipelined, data-parallel training ends with the same parameters as plain
//! single-worker training on the same data and seeds.

use pipewright_core::plan::ir::{Hop, Op, Plan, StagePlan};
use pipewright_core::schedule::{generate, gpipe_routes, ScheduleKind};
use pipewright_runtime::data::Corpus;
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::PlanIn;
use pipewright_runtime::train::{PlainTrainer, TrainConfig, Trainer};

fn tiny(schedule: &str, p: usize, d: usize, m: usize) -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab: 256,
            d_model: 16,
            heads: 2,
            layers: 6,
            seq_len: 8,
            ..ModelConfig::default()
        },
        schedule: schedule.parse().unwrap(),
        stages: p,
        chunks: schedule
            .parse::<ScheduleKind>()
            .map_or(1, ScheduleKind::default_chunks),
        replicas: d,
        microbatches: m,
        rows: 2,
        steps: 3,
        // A tight clip so clipping is exercised.
        clip: 0.5,
        lr: 3e-3,
        warmup: 1,
        ..TrainConfig::default()
    }
}

#[test]
fn pipelined_equals_plain_training() {
    let mut checked = 0;
    for schedule in ScheduleKind::ALL.map(ScheduleKind::name) {
        for p in [1, 2, 4] {
            for d in [1, 2] {
                for m in [1, 4, 8] {
                    let cfg = tiny(schedule, p, d, m);
                    let Ok(plan) = cfg.plan() else {
                        assert!(
                            (schedule == "interleaved" && m % p != 0)
                                || (schedule == "dualpipev" && m < 2 * p),
                            "{schedule} P={p} D={d} M={m} should be possible"
                        );
                        continue;
                    };
                    same_as_plain(&cfg, plan, &format!("{schedule} P={p} D={d} M={m}"));
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 120, "only {checked} combinations ran");
}

/// Train `plan` and the plain reference 3 steps; losses and parameters agree within 1e-5.
fn same_as_plain(cfg: &TrainConfig, plan: impl Into<PlanIn>, what: &str) -> Trainer {
    let corpus = Corpus::builtin();
    let plan: PlanIn = plan.into();
    let mut plain = PlainTrainer::new(cfg.clone(), plan.plan());
    let mut pipe = Trainer::new(cfg.clone(), plan).unwrap();
    for _ in 0..3 {
        let a = pipe.train_step(&corpus).unwrap().loss;
        let b = plain.train_step(&corpus);
        assert!((a - b).abs() < 1e-5, "{what}: loss {a} vs {b}");
    }
    assert_close(&pipe.flat_params().unwrap(), &plain.flat_params(), what);
    pipe
}

/// One step of each; their losses agree.
fn step_both(pipe: &mut Trainer, plain: &mut PlainTrainer, corpus: &Corpus, what: &str) {
    let a = pipe.train_step(corpus).unwrap().loss;
    let b = plain.train_step(corpus);
    assert!((a - b).abs() < 1e-5, "{what}: loss {a} vs {b}");
}

fn assert_close(x: &[f32], y: &[f32], what: &str) {
    assert_eq!(x.len(), y.len(), "{what}: parameter counts");
    let diff = x
        .iter()
        .zip(y)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff <= 1e-5, "{what}: max |diff| {diff}");
}

/// Four stages over the tiny model's 8 layer blocks, `d` hosts per stage (replica r of stage
/// s on worker r * 4 + s), micro-batch m through replica m % d, its stages given by `route(m)`.
fn routed(d: usize, m: usize, route: impl Fn(usize) -> Vec<usize>) -> Plan {
    let stages = (0..4)
        .map(|s| StagePlan {
            layers: 2,
            hosts: (0..d).map(|r| r * 4 + s).collect(),
            cost: None,
        })
        .collect();
    let routes = (0..m)
        .map(|mb| {
            route(mb)
                .into_iter()
                .map(|s| Hop {
                    stage: s,
                    worker: (mb % d) * 4 + s,
                })
                .collect()
        })
        .collect();
    gpipe_routes(stages, routes, 4 * d)
}

#[test]
fn skipped_stages_give_exact_gradients() {
    for d in [1, 2] {
        // Some micro-batches skip stage 1, some stage 2, some both; one goes through all.
        let plan = routed(d, 4, |mb| match mb {
            0 => vec![0, 2, 3],
            1 => vec![0, 1, 3],
            2 => vec![0, 3],
            _ => vec![0, 1, 2, 3],
        });
        pipewright_core::plan::validate::validate(&plan).unwrap();
        same_as_plain(&tiny("1f1b", 4, d, 4), plan, &format!("skips D={d}"));
    }
}

#[test]
fn swapped_adjacent_stages_give_exact_gradients() {
    for d in [1, 2] {
        let plan = routed(d, 4, |mb| {
            if mb % 2 == 0 {
                vec![0, 2, 1, 3]
            } else {
                vec![0, 1, 2, 3]
            }
        });
        same_as_plain(&tiny("1f1b", 4, d, 4), plan, &format!("swap D={d}"));
    }
}

/// The head as a stage of its own on the embedding's worker (SkipPipe's data node): the
/// route ends where it started.
#[test]
fn head_on_the_data_node_gives_exact_gradients() {
    let mut plan = routed(1, 4, |mb| {
        if mb == 1 {
            vec![0, 2, 1, 3]
        } else {
            vec![0, 1, 2, 3]
        }
    });
    plan.stages[3].hosts = vec![0];
    for r in &mut plan.routes {
        r.last_mut().unwrap().worker = 0;
    }
    let plan = gpipe_routes(plan.stages, plan.routes, 3);
    same_as_plain(&tiny("1f1b", 3, 1, 4), plan, "head on worker 0");
}

/// Split and fused backward mixed in one plan: ZB-H1 with the B and W of some (stage, mb)
/// fused back into one BW. Every Linear weight gradient still arrives.
#[test]
fn mixed_split_and_fused_backward_give_exact_gradients() {
    let cfg = tiny("zbh1", 4, 1, 4);
    let mut plan = cfg.plan().unwrap().into_plan();
    for acts in &mut plan.workers {
        let fuse = |stage: usize, mb: usize| (stage + mb).is_multiple_of(2);
        acts.retain(|a| !(a.op == Op::W && fuse(a.stage, a.mb)));
        for a in acts.iter_mut() {
            if a.op == Op::B && fuse(a.stage, a.mb) {
                a.op = Op::BW;
            }
        }
    }
    assert!(plan.workers.iter().flatten().any(|a| a.op == Op::BW));
    assert!(plan.workers.iter().flatten().any(|a| a.op == Op::W));
    pipewright_core::plan::validate::validate(&plan).unwrap();
    same_as_plain(&cfg, plan, "mixed B/W and BW");
}

/// Re-planning in memory: parameters and AdamW moments are identical across the switch, and
/// training goes on with exact gradients under the new plan.
#[test]
fn replanning_moves_state_in_memory() {
    let corpus = Corpus::builtin();
    let cfg = tiny("1f1b", 2, 1, 4);
    let first = cfg.plan().unwrap();
    let mut plain = PlainTrainer::new(cfg.clone(), &first);
    let mut pipe = Trainer::new(cfg.clone(), first).unwrap();
    for _ in 0..3 {
        pipe.train_step(&corpus).unwrap();
        plain.train_step(&corpus);
    }
    let (params, moments) = (pipe.flat_params().unwrap(), pipe.optimizer_bytes().unwrap());
    // Deeper, replicated, another schedule and other boundaries; same 4 micro-batches a step.
    let mut next = generate(ScheduleKind::ZbH1, 4, 2, 1)
        .unwrap()
        .replicate(2)
        .unwrap();
    next.set_layers(&[1, 3, 2, 2]);
    let report = pipe.replan(next).unwrap();
    assert!(report.before.contains("2 workers") && report.after.contains("8 workers"));
    assert_eq!(
        pipe.flat_params().unwrap(),
        params,
        "parameters changed in the switch"
    );
    assert_eq!(
        pipe.optimizer_bytes().unwrap(),
        moments,
        "AdamW moments changed in the switch"
    );
    for _ in 0..3 {
        let a = pipe.train_step(&corpus).unwrap().loss;
        let b = plain.train_step(&corpus);
        assert!((a - b).abs() < 1e-5, "after replan: loss {a} vs {b}");
    }
    assert_close(
        &pipe.flat_params().unwrap(),
        &plain.flat_params(),
        "after replan",
    );
}

#[test]
fn plain_training_is_deterministic() {
    let corpus = Corpus::builtin();
    let run = || {
        let cfg = tiny("1f1b", 1, 1, 4);
        let mut t = PlainTrainer::new(cfg.clone(), &cfg.plan().unwrap());
        for _ in 0..3 {
            t.train_step(&corpus);
        }
        t.flat_params()
    };
    assert_eq!(run(), run());
}

#[test]
fn plan_larger_than_model_is_refused() {
    let e = Trainer::from_config(TrainConfig {
        stages: 9,
        ..tiny("1f1b", 9, 1, 9)
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("only 8 layer blocks"), "{e}");
    // A plan file for another layer count names both.
    let mut plan = tiny("1f1b", 2, 1, 2).plan().unwrap().into_plan();
    plan.set_layers(&[3, 3]);
    let e = Trainer::new(tiny("1f1b", 2, 1, 2), plan)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("holds 6 layers") && e.contains("8 layer blocks"),
        "{e}"
    );
}

/// The B/W split is real: B's backward yields no Linear weight gradients at all; W computes
/// them from the kept layer inputs and output gradients; together they equal the fused backward.
#[test]
fn split_backward_defers_linear_weight_gradients() {
    use pipewright_runtime::backend::train_device;
    use pipewright_runtime::burn::tensor::{Distribution, Tensor};
    use pipewright_runtime::grads::{add_grads, GradSource};
    use pipewright_runtime::model::{Deferred, Layers, StageInput};
    let cfg = tiny("zbh1", 1, 1, 1).model;
    let dev = train_device();
    let stage = Layers::new(&cfg, 3, &dev).stage(1, 3); // two transformer blocks
    let x = Tensor::<3>::random(
        [2, cfg.seq_len, cfg.d_model],
        Distribution::Normal(0.0, 1.0),
        &dev,
    );
    let dy = Tensor::<3>::random(
        [2, cfg.seq_len, cfg.d_model],
        Distribution::Normal(0.0, 1.0),
        &dev,
    );
    let xf = x.clone().require_grad();
    let g = (stage.forward(StageInput::Hidden(xf.clone())) * dy.clone())
        .sum()
        .backward();
    let mut fused = Vec::new();
    add_grads(&stage, &GradSource::Autodiff(&g), &mut fused);
    let dx_fused = xf
        .grad(&g)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();

    let xs = x.require_grad();
    let mut d = Deferred::default();
    let g = (stage
        .forward_split(StageInput::Hidden(xs.clone()), &Default::default(), &mut d)
        .unwrap()
        * dy)
        .sum()
        .backward();
    let mut b_part = Vec::new();
    add_grads(&stage, &GradSource::Autodiff(&g), &mut b_part);
    let dx_split = xs
        .grad(&g)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let mut w_part = vec![0.0; b_part.len()];
    add_grads(
        &stage,
        &GradSource::Deferred(&d.weight_grads()),
        &mut w_part,
    );

    let max = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    assert!(max(&dx_fused, &dx_split) < 1e-5, "input gradients differ");
    // B and W touch disjoint parameters, and the Linear weights (most of them) only in W.
    assert!(b_part
        .iter()
        .zip(&w_part)
        .all(|(b, w)| *b == 0.0 || *w == 0.0));
    let in_w = w_part.iter().filter(|w| **w != 0.0).count();
    assert!(
        in_w > fused.len() * 9 / 10,
        "W holds {in_w} of {} gradients",
        fused.len()
    );
    let sum: Vec<f32> = b_part.iter().zip(&w_part).map(|(b, w)| b + w).collect();
    assert!(max(&sum, &fused) < 1e-5, "B + W != fused backward");
}

/// A weight-only frozen block (its parameters outside autodiff) passes the same input gradient
/// back, and neither the fused backward nor B or W computes any gradient of its weights.
#[test]
fn a_weight_only_frozen_block_computes_no_weight_gradient() {
    use pipewright_runtime::backend::train_device;
    use pipewright_runtime::burn::module::Module;
    use pipewright_runtime::burn::tensor::{Distribution, Tensor};
    use pipewright_runtime::grads::{add_grads, GradSource};
    use pipewright_runtime::model::{Deferred, Layers, Stage, StageInput};
    let cfg = tiny("zbh1", 1, 1, 1).model;
    let dev = train_device();
    let stage = Layers::new(&cfg, 3, &dev).stage(1, 3);
    let mut frozen = Stage {
        layers: stage.layers.clone(),
    };
    frozen.layers[0] = frozen.layers[0].clone().no_grad();
    let shape = [2, cfg.seq_len, cfg.d_model];
    let x = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &dev);
    let dy = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &dev);
    let n0 = stage.layers[0].num_params();
    let run = |s: &Stage, split: bool| {
        let x = x.clone().require_grad();
        let mut d = Deferred::default();
        let y = match split {
            true => s
                .forward_split(StageInput::Hidden(x.clone()), &Default::default(), &mut d)
                .unwrap(),
            false => s.forward(StageInput::Hidden(x.clone())),
        };
        let g = (y * dy.clone()).sum().backward();
        let mut grads = Vec::new();
        add_grads(&stage, &GradSource::Autodiff(&g), &mut grads);
        let mut w = vec![0.0; grads.len()];
        add_grads(&stage, &GradSource::Deferred(&d.weight_grads()), &mut w);
        let dx = x.grad(&g).unwrap().into_data().try_to_vec::<f32>().unwrap();
        (grads, w, dx)
    };
    for split in [false, true] {
        let (g_all, w_all, dx_all) = run(&stage, split);
        let (g, w, dx) = run(&frozen, split);
        assert_eq!(dx, dx_all, "split {split}: input gradient");
        assert!(
            g[..n0].iter().chain(&w[..n0]).all(|&v| v == 0.0),
            "split {split}"
        );
        assert!(g_all[..n0].iter().chain(&w_all[..n0]).any(|&v| v != 0.0));
        // The block after it trains as before.
        assert_eq!(g[n0..], g_all[n0..], "split {split}");
        assert_eq!(w[n0..], w_all[n0..], "split {split}");
    }
    // The stage it was cloned from still trains (no_grad changed the clone only).
    let (g_again, _, _) = run(&stage, false);
    assert!(g_again[..n0].iter().any(|&v| v != 0.0));
}

/// SkipPipe: the routes the skip-plan scheduler emits (skipped stages, swaps where it chose
/// them, the head on each data node, pools shared by both data nodes) train exactly as each
/// micro-batch's layer sequence would on one worker.
#[test]
fn skip_scheduler_routes_give_exact_gradients() {
    use pipewright_core::cluster::Cluster;
    use pipewright_core::search::skipplan::{skip_plan, SkipSetup};
    // Eight devices in two regions joined by a slow link.
    let mut toml = String::from("[defaults]\nlatency = 0.001\nbandwidth = 1e9\n");
    for i in 0..8 {
        toml += &format!("[[devices]]\nname = \"d{i}\"\nregion = \"r{}\"\n", i % 2);
    }
    toml += "[[links]]\na = \"r0\"\nb = \"r1\"\nlatency = 0.05\nbandwidth = 1e6\n";
    let cluster = Cluster::parse("two.toml", &toml).unwrap();
    let cfg = tiny("1f1b", 4, 2, 3);
    let mut swapped = false;
    for (skip, seed) in [(1, 3), (2, 5), (1, 11)] {
        let setup = SkipSetup {
            stages: 4,
            skip,
            data_nodes: 2,
            microbatches: 3,
            max_swaps: 1,
            moves: 300,
            time_limit: std::time::Duration::from_secs(120),
            seed,
            mechanics: Default::default(),
            // SkipPipe's per-node load cap, as tight as it can be: each stage's visits shared
            // evenly by its 2 devices.
            max_node_load: Some(3 - skip),
            polish_moves: 100,
        };
        let plan = skip_plan(&cfg.model.cost_profile(cfg.rows), &cluster, &setup)
            .unwrap()
            .plan;
        // Every route skips `skip` of the 3 middle stages.
        assert!(plan.routes.iter().all(|r| r.len() == 5 - skip));
        swapped |= plan.routes.iter().any(|r| {
            r.windows(2)
                .any(|w| w[1].stage < w[0].stage && w[1].stage != 0)
        });
        same_as_plain(&cfg, plan, &format!("skip-plan routes, skip {skip}"));
    }
    // With these seeds the scheduler chose at least one swap of neighbouring stages.
    assert!(swapped, "no route swapped stages; pick seeds that do");
}

/// zb-auto's orders (searched for the tiny model's own stage costs) train exactly too.
#[test]
fn zb_auto_gives_exact_gradients() {
    for (p, d, m) in [(2, 1, 4), (4, 1, 8), (2, 2, 3)] {
        let cfg = tiny("zb-auto", p, d, m);
        let plan = cfg.plan().unwrap();
        assert_eq!(plan.kind, pipewright_core::schedule::ScheduleKind::ZbAuto);
        same_as_plain(&cfg, plan, &format!("zb-auto P={p} D={d} M={m}"));
    }
}

/// Freezing (AutoFreeze): with the first layer blocks frozen mid-run, a pipelined run equals
/// plain training that stops updating those blocks; frozen weights and their AdamW state stay
/// as they were; re-planning to fewer stages and more replicas (AutoPipe + AutoDP) keeps
/// parameters and optimizer state, and training then continues exactly.
#[test]
fn frozen_prefix_and_elastic_replan_stay_exact() {
    let corpus = Corpus::builtin();
    let cfg = tiny("1f1b", 4, 1, 4);
    let plan = cfg.plan().unwrap();
    // Stage 0 must hold the frozen prefix and one training block: 3 of the 8 blocks there.
    let mut plan = plan.into_plan();
    plan.set_layers(&[3, 2, 2, 1]);
    let mut plain = PlainTrainer::new(cfg.clone(), &plan);
    let mut pipe = Trainer::new(cfg.clone(), plan).unwrap();
    let step = |pipe: &mut Trainer, plain: &mut PlainTrainer, what: &str| {
        step_both(pipe, plain, &corpus, what)
    };
    step(&mut pipe, &mut plain, "before freezing");
    pipe.set_frozen(2).unwrap();
    plain.frozen = 2;
    let before = pipe.flat_params().unwrap();
    let opt_before = pipe.optimizer_bytes().unwrap();
    for _ in 0..2 {
        step(&mut pipe, &mut plain, "frozen 2");
    }
    let after = pipe.flat_params().unwrap();
    let opt_after = pipe.optimizer_bytes().unwrap();
    // Embedding and block 0 did not move; the rest did.
    let n0 = {
        let cfg_layers = fresh_counts(&cfg);
        cfg_layers[0] + cfg_layers[1]
    };
    assert_eq!(before[..n0], after[..n0]);
    assert_ne!(before[n0..], after[n0..]);
    assert_eq!(opt_before[..2], opt_after[..2]);
    assert_close(&after, &plain.flat_params(), "frozen 2");
    // Too deep a freeze for stage 0 is refused.
    assert!(pipe.set_frozen(3).is_err());
    // Elastic: 2 stages x 2 replicas, the frozen prefix in stage 0.
    let params = pipe.flat_params().unwrap();
    let opt = pipe.optimizer_bytes().unwrap();
    let mut two = tiny("1f1b", 2, 2, 2).plan().unwrap().into_plan();
    two.set_layers(&[4, 4]);
    pipe.replan(two).unwrap();
    assert_eq!(pipe.flat_params().unwrap(), params);
    assert_eq!(pipe.optimizer_bytes().unwrap(), opt);
    for _ in 0..2 {
        step(&mut pipe, &mut plain, "after the elastic re-plan");
    }
    assert_close(
        &pipe.flat_params().unwrap(),
        &plain.flat_params(),
        "elastic",
    );
}

/// Weight-only freezing (`--freeze critical`): with a prefix frozen whole and two blocks past it
/// frozen for their weights only (their backward passes the input gradient on and skips the
/// weight products), every schedule trains the other blocks exactly as plain training that
/// merely leaves those blocks out of the optimizer, and the frozen blocks do not move.
#[test]
fn weight_only_frozen_blocks_stay_exact_on_every_schedule() {
    let corpus = Corpus::builtin();
    let skips = routed(1, 4, |mb| match mb {
        0 => vec![0, 2, 3],
        1 => vec![0, 1, 3],
        _ => vec![0, 1, 2, 3],
    });
    let mut cases: Vec<(String, TrainConfig, PlanIn)> = Vec::new();
    let kinds = ScheduleKind::ALL.into_iter().chain([ScheduleKind::ZbAuto]);
    for schedule in kinds.map(ScheduleKind::name) {
        for (p, d) in [(2, 1), (4, 1), (2, 2)] {
            // DualPipeV needs 2P micro-batches.
            let m = if schedule == "dualpipev" { 2 * p } else { 4 };
            let cfg = tiny(schedule, p, d, m);
            let plan = cfg.plan().unwrap();
            cases.push((format!("{schedule} P={p} D={d}"), cfg, plan.into()));
        }
    }
    cases.push(("skip routes".into(), tiny("1f1b", 4, 1, 4), skips.into()));
    let counts = fresh_counts(&tiny("1f1b", 1, 1, 1));
    let offset = |b: usize| counts[..b].iter().sum::<usize>();
    let block = |flat: &[f32], b: usize| flat[offset(b)..offset(b + 1)].to_vec();
    for (what, cfg, plan) in cases {
        let mut plain = PlainTrainer::new(cfg.clone(), plan.plan());
        let mut pipe = Trainer::new(cfg.clone(), plan).unwrap();
        step_both(&mut pipe, &mut plain, &corpus, &what);
        // A prefix where stage 0 has room for one, and blocks 3 and 5 (any stage) by weight.
        let prefix = pipewright_core::policy::freeze::max_frozen(&pipe.plan).min(1);
        pipe.set_frozen(prefix).unwrap();
        pipe.set_weight_only(&[5, 3]).unwrap();
        assert_eq!(pipe.weight_only(), [3, 5]);
        (plain.frozen, plain.weight_only) = (prefix, vec![3, 5]);
        let before = pipe.flat_params().unwrap();
        for _ in 0..2 {
            step_both(&mut pipe, &mut plain, &corpus, &what);
        }
        let after = pipe.flat_params().unwrap();
        assert_close(&after, &plain.flat_params(), &what);
        for b in 0..counts.len() {
            let still = block(&before, b) == block(&after, b);
            let frozen = b < prefix || b == 3 || b == 5;
            assert_eq!(still, frozen, "{what}: block {b} moved: {}", !still);
        }
    }
    // The head always trains.
    let mut pipe =
        Trainer::new(tiny("1f1b", 2, 1, 4), tiny("1f1b", 2, 1, 4).plan().unwrap()).unwrap();
    assert!(pipe.set_weight_only(&[7]).is_err());
}

/// A tiny BERT classifier (2 classes) over `p` stages, reading examples in epochs.
fn tiny_bert(schedule: &str, p: usize) -> TrainConfig {
    let mut cfg = tiny(schedule, p, 1, 4);
    cfg.model = ModelConfig {
        family: pipewright_runtime::model::Family::Bert,
        vocab: 64,
        d_model: 16,
        heads: 2,
        layers: 4,
        seq_len: 8,
        ffn: Some(32),
        max_positions: Some(8),
        type_vocab: Some(2),
        head: Some(pipewright_runtime::model::TaskHead::Classify { classes: 2 }),
        ..ModelConfig::default()
    };
    cfg.sampling = pipewright_runtime::data::Sampling::Epochs;
    cfg
}

/// 24 examples of 1 to 8 tokens, right-padded to 8 and masked, with a class each.
fn mixed_length_corpus() -> Corpus {
    use pipewright_runtime::data::{examples::Examples, Part};
    let mut ex = Examples {
        seq_len: 8,
        target_len: 1,
        ..Examples::default()
    };
    for i in 0..24i64 {
        let n = 1 + (i * 5 % 8);
        for p in 0..8 {
            ex.tokens
                .push(if p < n { 1 + (i * 7 + p * 3) % 63 } else { 0 });
            ex.mask.push((p < n) as i64);
        }
        ex.labels.push(i % 2);
    }
    Corpus {
        train: Part::Examples(ex.clone()),
        val: Part::Examples(ex),
        name: "mixed lengths".into(),
        ids: 64,
    }
}

/// Variable-length micro-batches: each is padded only to its longest row, so micro-batches of
/// one step differ in length as they flow through the pipeline. On 1, 2 and 3 stages, with a
/// frozen prefix (cached or not) and weight-only frozen blocks, training equals plain training
/// on the same batches; the padding is masked, so it equals training on rows padded to 8 too.
#[test]
fn micro_batches_of_mixed_lengths_train_exactly() {
    let corpus = mixed_length_corpus();
    let lens: Vec<usize> = [vec![0, 8], vec![1, 9], vec![2, 3]]
        .into_iter()
        .map(|s| corpus.train.batch(8, s).seq_len)
        .collect();
    assert_eq!(lens, [1, 6, 8], "rows of 1 and 1, 6 and 6, 3 and 8 tokens");
    let cases = [
        ("1f1b", 1, false),
        ("1f1b", 2, false),
        ("1f1b", 2, true),
        ("zbh1", 3, false),
        ("gpipe", 3, false),
    ];
    for (schedule, p, cached) in cases {
        let what = format!("bert {schedule} P={p} cached {cached}");
        let cfg = tiny_bert(schedule, p);
        let plan = cfg.plan().unwrap();
        let mut plain = PlainTrainer::new(cfg.clone(), &plan);
        let mut pipe = Trainer::new(cfg.clone(), plan).unwrap();
        let step0: Vec<usize> = cfg
            .sampler()
            .batches(&corpus.train, 0, 4)
            .unwrap()
            .iter()
            .map(|b| b.seq_len)
            .collect();
        assert!(step0.iter().any(|&t| t != step0[0]), "{what}: {step0:?}");
        if cached {
            // The frozen prefix's outputs from the cache: entries serve shorter micro-batches.
            let dir = std::env::temp_dir().join(format!("pw-mixed-{}", std::process::id()));
            let cache = pipewright_runtime::cache::PrefixCache::new(1 << 20, false, &dir);
            pipe.set_cache(Some(std::sync::Arc::new(cache))).unwrap();
        }
        step_both(&mut pipe, &mut plain, &corpus, &what);
        if p > 1 {
            // A prefix holding a transformer block (it must mask the padding too).
            let k = pipewright_core::policy::freeze::max_frozen(&pipe.plan).min(2);
            pipe.set_frozen(k).unwrap();
            pipe.set_weight_only(&[4]).unwrap();
            (plain.frozen, plain.weight_only) = (k, vec![4]);
        }
        for _ in 0..5 {
            step_both(&mut pipe, &mut plain, &corpus, &what);
        }
        assert_close(&pipe.flat_params().unwrap(), &plain.flat_params(), &what);
    }
    // Padding is masked: the trimmed micro-batch's logits are those of the rows padded to 8.
    let plain = PlainTrainer::new(tiny_bert("1f1b", 1), &tiny_bert("1f1b", 1).plan().unwrap());
    let model = plain.model();
    let trimmed = corpus.train.batch(8, vec![1, 2]);
    let full = pipewright_runtime::batch::MicroBatch {
        seq_len: 8,
        ..trimmed.clone()
    };
    let full = {
        let pipewright_runtime::data::Part::Examples(e) = &corpus.train else {
            unreachable!()
        };
        let x = e.select(&[1, 2]);
        pipewright_runtime::batch::MicroBatch {
            tokens: x.tokens,
            mask: x.mask,
            ..full
        }
    };
    let logits = |mb: &pipewright_runtime::batch::MicroBatch| {
        let dev = pipewright_runtime::backend::train_device();
        let ctx = pipewright_runtime::model::Ctx::of(mb, &dev);
        let x = pipewright_runtime::model::batch_input(mb, &dev);
        model
            .forward_in(x, &ctx)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    let (a, b) = (logits(&trimmed), logits(&full));
    assert_eq!(trimmed.seq_len, 6);
    assert!(
        a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6),
        "{a:?} {b:?}"
    );
}

/// Parameters per layer block of `cfg`'s model, in model order.
fn fresh_counts(cfg: &TrainConfig) -> Vec<usize> {
    let plan = tiny("1f1b", 1, 1, 1).plan().unwrap();
    let t = Trainer::new(TrainConfig { ..cfg.clone() }, {
        let mut p = plan.into_plan();
        p.set_layers(&[cfg.model.num_blocks()]);
        p
    })
    .unwrap();
    t.workers[0].stages[0]
        .module
        .layers
        .iter()
        .map(burn::module::Module::num_params)
        .collect()
}

/// AutoCache: with the frozen prefix's outputs cached per sample (most of them spilled to
/// disk by a small memory budget), training over several epochs equals plain training that
/// runs every layer; a deeper freeze runs only the newly frozen layers on cached tensors.
#[test]
fn cached_frozen_prefix_stays_exact() {
    use pipewright_runtime::cache::PrefixCache;
    use pipewright_runtime::data::{synthetic_text, Part, Sampling};
    use std::sync::Arc;
    // 40 samples of 8 bytes; 4 micro-batches of 2 a step: 5 steps an epoch.
    let text =
        pipewright_runtime::data::tokens::Tokens::bytes(synthetic_text(8 * 40 + 1, 5).into_bytes());
    let corpus = Corpus {
        train: Part::Text(text.clone()),
        val: Part::Text(text),
        name: "40 samples".into(),
        ids: 256,
    };
    let cfg = TrainConfig {
        sampling: Sampling::Epochs,
        steps: 16,
        ..tiny("1f1b", 4, 1, 4)
    };
    let mut plan = cfg.plan().unwrap().into_plan();
    plan.set_layers(&[3, 2, 2, 1]);
    let mut plain = PlainTrainer::new(cfg.clone(), &plan);
    let mut pipe = Trainer::new(cfg.clone(), plan).unwrap();
    let dir = std::env::temp_dir().join(format!("pw-cache-test-{}", std::process::id()));
    // One entry (8 x 16 f32 = 512 bytes) fits in memory; the others spill.
    let cache = Arc::new(PrefixCache::new(600, false, &dir));
    pipe.set_cache(Some(cache.clone())).unwrap();
    let step = |pipe: &mut Trainer, plain: &mut PlainTrainer, what: &str| {
        step_both(pipe, plain, &corpus, what)
    };
    step(&mut pipe, &mut plain, "before freezing");
    pipe.set_frozen(1).unwrap();
    plain.frozen = 1;
    // To the end of the second epoch: every sample computed once, then read back.
    for _ in 0..9 {
        step(&mut pipe, &mut plain, "frozen 1");
    }
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.extended), (40, 32, 0), "{s:?}");
    pipe.set_frozen(2).unwrap();
    plain.frozen = 2;
    // A third epoch extends every entry by one layer; the fourth reads them back.
    for _ in 0..6 {
        step(&mut pipe, &mut plain, "frozen 2");
    }
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.extended), (40, 40, 40), "{s:?}");
    assert_eq!((s.memory_entries, s.disk_entries), (1, 39), "{s:?}");
    assert!(s.memory_bytes <= 600, "{s:?}");
    assert_close(
        &pipe.flat_params().unwrap(),
        &plain.flat_params(),
        "cached prefix",
    );
    // Without epoch sampling there is nothing to key on.
    let mut windows = Trainer::new(tiny("1f1b", 4, 1, 4), {
        let mut p = tiny("1f1b", 4, 1, 4).plan().unwrap().into_plan();
        p.set_layers(&[3, 2, 2, 1]);
        p
    })
    .unwrap();
    assert!(windows.set_cache(Some(cache)).is_err());
    let _ = std::fs::remove_dir_all(dir);
}

/// A tiny LLaMA (grouped-query attention, SwiGLU, RMSNorm, rotary positions).
fn tiny_llama(schedule: &str, p: usize, d: usize, tied: bool) -> TrainConfig {
    let mut cfg = tiny(schedule, p, d, 4);
    cfg.model = ModelConfig {
        family: pipewright_runtime::model::Family::Llama,
        d_model: 16,
        heads: 4,
        kv_heads: Some(2),
        ffn: Some(24),
        layers: 4,
        tie_embeddings: tied,
        ..cfg.model
    };
    cfg
}

#[test]
fn pipelined_llama_equals_plain_training() {
    for (schedule, p, d) in [
        ("1f1b", 2, 1),
        ("1f1b", 4, 2),
        ("zbh1", 2, 2),
        ("gpipe", 3, 1),
    ] {
        let cfg = tiny_llama(schedule, p, d, false);
        let plan = cfg.plan().unwrap();
        same_as_plain(&cfg, plan, &format!("llama {schedule} P={p} D={d}"));
    }
}

/// Tied embeddings: whatever the plan, the run is the same one, and the embedding and the
/// LM head's copy of the matrix stay equal (the head's is stored transposed).
#[test]
fn tied_embeddings_train_the_same_on_every_plan() {
    let corpus = Corpus::builtin();
    // Runs with the same replicas see the same micro-batches; each is compared with the first.
    let mut reference: [Option<Vec<f32>>; 3] = [None, None, None];
    let cases = [
        ("1f1b", 1, 1),
        ("1f1b", 2, 1),
        ("1f1b", 4, 1),
        ("1f1b", 1, 2),
        ("zbh1", 2, 2),
        ("interleaved", 2, 2),
        // The first and last layer blocks on worker 0, in a V.
        ("dualpipev", 2, 1),
        ("dualpipev", 2, 2),
    ];
    for (schedule, p, d) in cases {
        let cfg = tiny_llama(schedule, p, d, true);
        let what = format!("tied llama {schedule} P={p} D={d}");
        let mut t = Trainer::new(cfg.clone(), cfg.plan().unwrap()).unwrap();
        for _ in 0..3 {
            t.train_step(&corpus).unwrap();
        }
        let params = t.flat_params().unwrap();
        let (v, dm) = (cfg.model.vocab, cfg.model.d_model);
        let embed = &params[..v * dm];
        let head = &params[params.len() - v * dm..];
        for r in 0..v {
            for c in 0..dm {
                assert_eq!(
                    embed[r * dm + c],
                    head[c * v + r],
                    "{what}: copies differ at {r},{c}"
                );
            }
        }
        match &reference[d] {
            None => reference[d] = Some(params),
            Some(x) => assert_close(&params, x, &what),
        }
    }
}
