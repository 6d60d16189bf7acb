//! The training run as a library: its loop is the trainer's steps and nothing else; resume,
//! plan switches and freezing (with elastic re-planning) behave as the CLI relies on; settings
//! that cannot work are refused before any step.

use pipewright_core::policy::freeze::{FreezeMode, FreezePolicy};
use pipewright_runtime::data::Corpus;
use pipewright_runtime::error::{Error, Result};
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::{
    Checkpointing, FreezeSettings, LrSchedule, Metric, RunConfig, RunSink, RunStart, StepRow,
    TrainConfig, Trainer, TrainingRun,
};

fn cfg(layers: usize, stages: usize, steps: u64) -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab: 256,
            d_model: 16,
            heads: 2,
            layers,
            seq_len: 8,
            ..ModelConfig::default()
        },
        stages,
        microbatches: 2,
        rows: 2,
        steps,
        ..TrainConfig::default()
    }
}

fn run_of(c: TrainConfig, settings: RunConfig) -> Result<TrainingRun> {
    let plan = c.plan()?;
    TrainingRun::new(Trainer::new(c, plan)?, Corpus::builtin(), settings)
}

/// What a sink saw.
#[derive(Default)]
struct Seen {
    start: Option<RunStart>,
    notes: Vec<String>,
    steps: Vec<u64>,
    frozen: Vec<usize>,
    stages: Vec<usize>,
    vals: Vec<(u64, f64)>,
}

impl RunSink for Seen {
    fn start(&mut self, s: &RunStart) -> Result<()> {
        self.start = Some(s.clone());
        Ok(())
    }
    fn note(&mut self, text: &str) {
        self.notes.push(text.to_string());
    }
    fn step(&mut self, row: &StepRow) -> Result<()> {
        assert_eq!(row.to_json()["step"], row.report.step);
        self.steps.push(row.report.step);
        self.frozen.push(row.frozen);
        self.stages.push(row.stages);
        if let Some(v) = row.val_loss {
            self.vals.push((row.report.step, v));
        }
        Ok(())
    }
}

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pw-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_run_is_the_trainers_steps_and_reports_each() {
    let c = cfg(2, 2, 4);
    let mut straight = Trainer::new(c.clone(), c.plan().unwrap()).unwrap();
    let corpus = Corpus::builtin();
    for _ in 0..4 {
        straight.train_step(&corpus).unwrap();
    }
    let settings = RunConfig {
        eval_every: 2,
        eval_batches: 1,
        ..RunConfig::default()
    };
    let mut run = run_of(c, settings).unwrap();
    let mut seen = Seen::default();
    let s = run.run(&mut seen).unwrap();
    assert_eq!(seen.steps, vec![1, 2, 3, 4]);
    assert_eq!(s.step, 4);
    assert_eq!(s.steps_run, 4);
    assert!(s.checkpoint.is_none() && s.timeline.is_none());
    // Evaluation between steps does not touch the parameters.
    assert_eq!(
        run.trainer.flat_params().unwrap(),
        straight.flat_params().unwrap()
    );
}

#[test]
fn resume_continues_to_the_same_parameters() {
    let d = dir("resume");
    let ck = |every| {
        Some(Checkpointing {
            dir: d.clone(),
            every,
            keep: 2,
            overwrite: false,
        })
    };
    let first = RunConfig {
        eval_batches: 1,
        checkpoints: ck(0),
        ..RunConfig::default()
    };
    run_of(cfg(2, 2, 3), first)
        .unwrap()
        .run(&mut Seen::default())
        .unwrap();
    let second = RunConfig {
        eval_batches: 1,
        checkpoints: ck(0),
        resume_from: Some(d.clone()),
        ..RunConfig::default()
    };
    let mut resumed = run_of(cfg(2, 2, 6), second).unwrap();
    let mut seen = Seen::default();
    let s = resumed.run(&mut seen).unwrap();
    assert_eq!(seen.start.as_ref().unwrap().resumed, Some(3));
    assert_eq!(seen.steps, vec![4, 5, 6]);
    assert!(
        seen.notes.iter().any(|n| n.starts_with("resumed from")),
        "{:?}",
        seen.notes
    );
    assert_eq!(s.steps_run, 3);
    let straight = RunConfig {
        eval_batches: 1,
        ..RunConfig::default()
    };
    let mut whole = run_of(cfg(2, 2, 6), straight).unwrap();
    whole.run(&mut Seen::default()).unwrap();
    let (a, b) = (
        resumed.trainer.flat_params().unwrap(),
        whole.trainer.flat_params().unwrap(),
    );
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-6, "resumed run differs by {diff}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_plan_switch_moves_the_run_to_the_new_plan() {
    let deeper = cfg(2, 4, 4).plan().unwrap().into_plan();
    let settings = RunConfig {
        eval_batches: 1,
        switches: vec![(2, deeper.clone())],
        trace: true,
        ..RunConfig::default()
    };
    let mut run = run_of(cfg(2, 2, 4), settings).unwrap();
    let mut seen = Seen::default();
    let s = run.run(&mut seen).unwrap();
    assert_eq!(seen.stages, vec![2, 2, 4, 4]);
    assert!(
        seen.notes
            .iter()
            .any(|n| n.starts_with("step 2: re-planned")),
        "{:?}",
        seen.notes
    );
    assert_eq!(run.trainer.plan, deeper);
    assert_eq!(s.timeline.unwrap().worker_names.len(), 4);
}

fn freeze(elastic: bool) -> FreezeSettings {
    FreezeSettings {
        policy: FreezePolicy {
            mode: FreezeMode::Schedule,
            alpha: 0.5,
            ..FreezePolicy::default()
        },
        every: Some(2),
        elastic,
        scale_batch: false,
    }
}

#[test]
fn the_freeze_schedule_freezes_a_growing_prefix_at_its_cadence() {
    // 6 blocks in 2 stages; without elastic the prefix stays inside stage 0.
    let settings = RunConfig {
        eval_batches: 1,
        freeze: Some(freeze(false)),
        ..RunConfig::default()
    };
    let mut run = run_of(cfg(4, 2, 6), settings).unwrap();
    let mut seen = Seen::default();
    run.run(&mut seen).unwrap();
    let stage0 = run.trainer.plan.layers_per_stage()[0];
    assert_eq!(
        seen.frozen[0], 0,
        "nothing frozen before the first decision"
    );
    assert!(
        seen.frozen.windows(2).all(|w| w[0] <= w[1]),
        "{:?}",
        seen.frozen
    );
    assert!(
        run.trainer.frozen() > 0 && run.trainer.frozen() < stage0,
        "{}",
        run.trainer.frozen()
    );
    // Decisions fall on steps 2, 4, 6 only: the row after a decision shows its effect.
    for (i, w) in seen.frozen.windows(2).enumerate() {
        if w[0] != w[1] {
            assert_eq!((i + 1) % 2, 0, "froze after step {}", i + 1);
        }
    }
    assert!(
        seen.notes
            .iter()
            .any(|n| n.contains("froze layer blocks 0-")),
        "{:?}",
        seen.notes
    );
}

#[test]
fn elastic_freezing_replans_onto_the_layers_still_training() {
    let settings = RunConfig {
        eval_batches: 1,
        freeze: Some(freeze(true)),
        ..RunConfig::default()
    };
    let mut run = run_of(cfg(4, 2, 6), settings).unwrap();
    let mut seen = Seen::default();
    run.run(&mut seen).unwrap();
    assert!(run.trainer.frozen() > 0);
    let stage0 = run.trainer.plan.layers_per_stage()[0];
    assert!(
        run.trainer.frozen() < stage0,
        "the frozen prefix lies inside stage 0"
    );
    assert!(
        seen.notes.iter().any(|n| n.contains("froze layer blocks")),
        "{:?}",
        seen.notes
    );
}

#[test]
fn settings_that_cannot_work_are_refused_before_any_step() {
    let is_config = |r: Result<TrainingRun>, want: &str| match r {
        Err(Error::Config(m)) => assert!(m.contains(want), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted; wanted {want:?}"),
    };
    let later = cfg(2, 2, 4).plan().unwrap().into_plan();
    let base = RunConfig {
        eval_batches: 1,
        ..RunConfig::default()
    };
    let with = |f: &dyn Fn(&mut RunConfig)| {
        let mut r = base.clone();
        f(&mut r);
        run_of(cfg(2, 2, 4), r)
    };
    is_config(
        with(&|r| r.switches = vec![(0, later.clone())]),
        "plan switch at step 0",
    );
    is_config(
        with(&|r| r.switches = vec![(4, later.clone())]),
        "plan switch at step 4",
    );
    is_config(with(&|r| r.eval_every = 0), "evaluation every 0 steps");
    is_config(
        with(&|r| {
            r.switches = vec![(2, later.clone())];
            r.freeze = Some(freeze(true));
        }),
        "plan switches and elastic re-planning",
    );
    is_config(
        run_of(
            cfg(2, 2, 2),
            RunConfig {
                compare_sim: true,
                ..base.clone()
            },
        ),
        "at least 3 steps",
    );
    // A tied embedding cannot head a frozen prefix.
    let mut tied = cfg(2, 2, 4);
    tied.model.family = pipewright_runtime::model::Family::Llama;
    tied.model.tie_embeddings = true;
    is_config(
        run_of(
            tied,
            RunConfig {
                freeze: Some(freeze(false)),
                ..base.clone()
            },
        ),
        "tied embeddings cannot freeze",
    );
    let mut wrong = cfg(3, 2, 4).plan().unwrap().into_plan();
    wrong.kind = pipewright_core::plan::ScheduleKind::Custom;
    is_config(
        with(&|r| r.switches = vec![(2, wrong.clone())]),
        "the model has 4 layer blocks",
    );
}

/// PipeTransformer on the default model (6 layer blocks, 4 stages, 8 micro-batches), as the
/// E-elastic acceptance script runs it: the freeze schedule every 3 steps frees workers, the
/// layout gets shallower with more replicas, and the whole run's trace marks each transition
/// and holds every step's forwards.
#[test]
fn elastic_freezing_frees_workers_and_the_trace_covers_the_run() {
    let c = TrainConfig {
        stages: 4,
        microbatches: 8,
        steps: 9,
        ..TrainConfig::default()
    };
    let mut f = freeze(true);
    f.every = Some(3);
    let settings = RunConfig {
        eval_batches: 1,
        freeze: Some(f),
        trace: true,
        ..RunConfig::default()
    };
    let mut run = run_of(c, settings).unwrap();
    let mut seen = Seen::default();
    let s = run.run(&mut seen).unwrap();
    assert!(
        seen.notes
            .iter()
            .any(|n| n.contains("froze layer blocks 0-1")),
        "{:?}",
        seen.notes
    );
    assert!(run.trainer.frozen() >= 3, "{}", run.trainer.frozen());
    assert!(
        run.trainer.plan.num_stages() < 4,
        "{:?}",
        run.trainer.plan.layers_per_stage()
    );
    assert!(run.trainer.plan.replicas() >= 2);
    assert_eq!(seen.frozen[0], 0);
    let tl = s.timeline.expect("asked for");
    assert!(
        tl.marks
            .iter()
            .any(|(_, m)| m.contains("froze layer blocks 0-1")),
        "{:?}",
        tl.marks
    );
    let forwards = tl
        .actions
        .iter()
        .filter(|a| a.action.op == pipewright_core::plan::ir::Op::F)
        .count();
    let want: usize = seen.stages.iter().map(|s| 8 * s).sum();
    assert_eq!(forwards, want, "every step's forwards");
}

/// AutoCache with elastic freezing: later epochs read the frozen prefix's output back, the
/// cache stays within its budget (the rest spilled), and a resume freezes the prefix again.
#[test]
fn cached_elastic_run_reads_back_and_resumes_frozen() {
    use pipewright_runtime::cache::PrefixCache;
    use pipewright_runtime::data::Sampling;
    let d = dir("cache");
    std::fs::create_dir_all(&d).unwrap();
    // 1150 bytes: 1035 to train on = 64 samples of 16 = 2 steps of 32 an epoch.
    let text: String = "the quick brown fox jumps over the lazy dog. "
        .repeat(30)
        .chars()
        .take(1150)
        .collect();
    let corpus = Corpus::from_text("fox", &text);
    let c = |steps| TrainConfig {
        model: ModelConfig {
            seq_len: 16,
            ..cfg(4, 4, steps).model
        },
        stages: 4,
        microbatches: 8,
        rows: 4,
        sampling: Sampling::Epochs,
        ..cfg(4, 4, steps)
    };
    let settings = |resume: bool| RunConfig {
        eval_batches: 1,
        checkpoints: Some(Checkpointing {
            dir: d.join("ck"),
            every: 0,
            keep: 2,
            overwrite: false,
        }),
        resume_from: resume.then(|| d.join("ck")),
        freeze: Some(FreezeSettings {
            every: Some(4),
            ..freeze(true)
        }),
        cache: Some(std::sync::Arc::new(PrefixCache::new(4096, false, &d))),
        ..RunConfig::default()
    };
    let run = |steps, resume| {
        let c: TrainConfig = c(steps);
        let plan = c.plan().unwrap();
        TrainingRun::new(
            Trainer::new(c, plan).unwrap(),
            corpus.clone(),
            settings(resume),
        )
        .unwrap()
    };
    let mut first = run(8, false);
    assert_eq!(first.epoch_steps(), 2);
    let s = first.run(&mut Seen::default()).unwrap();
    let frozen = first.trainer.frozen();
    assert!(frozen >= 2, "{frozen}");
    let cache = s.cache.expect("cache on");
    assert!(
        cache.hits > 0 && cache.disk_bytes > 0 && cache.memory_bytes <= 4096,
        "{cache:?}"
    );
    drop(first);
    let mut second = run(10, true);
    let mut seen = Seen::default();
    second.run(&mut seen).unwrap();
    assert!(
        seen.notes.iter().any(|n| n.contains("frozen again on")),
        "{:?}",
        seen.notes
    );
    assert_eq!(seen.steps, vec![9, 10]);
    assert!(seen.frozen[0] >= frozen);
    let _ = std::fs::remove_dir_all(&d);
}

/// `scale_batch`: the replicas that freezing frees keep their micro-batches, so the global batch
/// and the learning rate double, where keeping the batch splits the same micro-batches.
#[test]
fn a_scaled_batch_grows_with_the_replicas_and_the_learning_rate_with_it() {
    let run = |scale_batch: bool| {
        let c = TrainConfig {
            microbatches: 8,
            ..cfg(4, 4, 14)
        };
        let f = FreezeSettings {
            every: Some(4),
            scale_batch,
            ..freeze(true)
        };
        let settings = RunConfig {
            eval_batches: 1,
            freeze: Some(f),
            ..RunConfig::default()
        };
        let mut rows = Rows::default();
        run_of(c, settings).unwrap().run(&mut rows).unwrap();
        rows.0
    };
    let (keep, scale) = (run(false), run(true));
    // (replicas, micro-batches a step, lr) of step 14: two replicas in both runs.
    let (k, s) = (keep[13], scale[13]);
    assert_eq!((k.0, s.0), (2, 2), "{k:?} {s:?}");
    assert_eq!((k.1, s.1), (8, 16));
    assert!((s.2 / k.2 - 2.0).abs() < 1e-9, "{k:?} {s:?}");
    assert_eq!(
        keep[5].2, scale[5].2,
        "the same learning rate before any freeze"
    );
}

/// (replicas, micro-batches, lr) of every step.
#[derive(Default)]
struct Rows(Vec<(usize, usize, f64)>);

impl RunSink for Rows {
    fn step(&mut self, row: &StepRow) -> Result<()> {
        let mbs = (row.samples_per_s * row.report.seconds / 2.0).round() as usize;
        self.0.push((row.replicas, mbs, row.report.lr));
        Ok(())
    }
}

/// A resume without a freeze policy says what became of the checkpoint's frozen blocks: kept
/// frozen where the plan has room for them, else trained again, never silently.
#[test]
fn resuming_frozen_blocks_without_a_freeze_policy_says_what_happens() {
    let d = dir("frozen-resume");
    let ck = Checkpointing {
        dir: d.clone(),
        every: 0,
        keep: 2,
        overwrite: false,
    };
    let first = RunConfig {
        eval_batches: 1,
        checkpoints: Some(ck.clone()),
        freeze: Some(FreezeSettings {
            every: Some(1),
            ..freeze(false)
        }),
        ..RunConfig::default()
    };
    let mut run = run_of(cfg(4, 1, 3), first).unwrap();
    run.run(&mut Seen::default()).unwrap();
    let frozen = run.trainer.frozen();
    assert!(frozen > 1, "{frozen}");
    drop(run);
    let again = |stages: usize, steps: u64| {
        let settings = RunConfig {
            eval_batches: 1,
            checkpoints: Some(ck.clone()),
            resume_from: Some(d.clone()),
            ..RunConfig::default()
        };
        let mut run = run_of(cfg(4, stages, steps), settings).unwrap();
        let mut seen = Seen::default();
        run.run(&mut seen).unwrap();
        (run.trainer.frozen(), seen.notes)
    };
    // One stage holds every block: the prefix stays frozen, and the run says so.
    let (kept, notes) = again(1, 4);
    assert_eq!(kept, frozen);
    assert!(
        notes.iter().any(|n| n.contains("they stay frozen")),
        "{notes:?}"
    );
    // Stage 0 of an even 2-stage cut has no room for them: they train again, with a warning.
    let (kept, notes) = again(2, 5);
    assert_eq!(kept, 0);
    assert!(
        notes.iter().any(|n| n.contains("they train again")),
        "{notes:?}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// The runtime's metrics writers plug into a run as any sink does: JSON lines (the start row,
/// then one per step) and a TensorBoard event file, both through one fan-out.
#[test]
fn a_library_run_writes_metrics_and_tensorboard_through_the_runtimes_writers() {
    use pipewright_runtime::train::{Fanout, MetricsFile, TensorBoard};
    let dir = tempfile::tempdir().unwrap();
    let (m, tb) = (dir.path().join("m.jsonl"), dir.path().join("tb"));
    let mut run = run_of(cfg(2, 2, 3), RunConfig::default()).unwrap();
    let mut sinks = Fanout(vec![
        Box::new(MetricsFile::new(&m)),
        Box::new(TensorBoard::new(&tb)),
    ]);
    run.run(&mut sinks).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2, 3]);
    assert!(rows[3]["loss"].as_f64().is_some_and(f64::is_finite));
    let events: Vec<_> = std::fs::read_dir(&tb).unwrap().collect();
    assert_eq!(events.len(), 1, "one event file");
    let bytes = std::fs::metadata(events[0].as_ref().unwrap().path())
        .unwrap()
        .len();
    assert!(bytes > 100, "the event file holds the rows ({bytes} bytes)");
}

/// `epochs` sets the steps from the data; `warmup_ratio` the warmup from the steps; the LR
/// schedules end at `min_lr` (constant: stay at `lr`).
#[test]
fn epochs_and_warmup_ratio_follow_from_the_data() {
    let c = TrainConfig {
        epochs: Some(2),
        warmup_ratio: Some(0.25),
        ..cfg(2, 2, 1000)
    };
    let run = run_of(c, RunConfig::default()).unwrap();
    let per = run.epoch_steps();
    assert!(per > 1);
    assert_eq!(run.trainer.cfg.steps, 2 * per);
    assert_eq!(run.trainer.cfg.warmup, (2 * per).div_ceil(4));
    let mut c = TrainConfig {
        steps: 20,
        warmup: 4,
        lr: 1.0,
        min_lr: 0.1,
        ..cfg(2, 2, 20)
    };
    for (s, end, mid) in [
        (LrSchedule::Cosine, 0.1, 0.55),
        (LrSchedule::Linear, 0.1, 0.55),
        (LrSchedule::Constant, 1.0, 1.0),
    ] {
        c.lr_schedule = s;
        assert_eq!(c.lr_at(3), 1.0, "{s:?}: the warmup ends at lr");
        assert!((c.lr_at(20) - end).abs() < 1e-12, "{s:?}");
        assert!(
            (c.lr_at(12) - mid).abs() < 1e-12,
            "{s:?}: halfway {}",
            c.lr_at(12)
        );
    }
    c.lr_schedule = LrSchedule::Linear;
    assert!((c.lr_at(8) - (0.1 + 0.9 * 0.75)).abs() < 1e-12);
}

/// The best validation's checkpoint is kept in `best/`, and an early stop comes at the first
/// `early_stop`-th validation in a row without a better loss.
#[test]
fn keep_best_and_early_stop_follow_the_validations() {
    let d = dir("best");
    let settings = |early| RunConfig {
        eval_every: 1,
        eval_batches: 1,
        checkpoints: Some(Checkpointing {
            dir: d.clone(),
            every: 0,
            keep: 3,
            overwrite: true,
        }),
        keep_best: Some(Metric::ValLoss),
        early_stop: early,
        ..RunConfig::default()
    };
    // A learning rate high enough that the held-out loss goes up and down.
    let c = TrainConfig {
        lr: 0.05,
        min_lr: 0.05,
        ..cfg(2, 2, 40)
    };
    let mut seen = Seen::default();
    run_of(c.clone(), settings(None))
        .unwrap()
        .run(&mut seen)
        .unwrap();
    let best = seen.vals.iter().fold(
        (0, f64::INFINITY),
        |b, &(s, v)| if v < b.1 { (s, v) } else { b },
    );
    let kept = std::fs::read_dir(d.join("best"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect::<Vec<_>>();
    assert_eq!(kept, vec![format!("step-{:06}", best.0)], "{:?}", seen.vals);
    // Where two validations in a row were no better than the best before them, the run stops.
    let mut low = f64::INFINITY;
    let mut stale = 0;
    let stop = seen.vals.iter().find_map(|&(s, v)| {
        stale = if v < low { 0 } else { stale + 1 };
        low = low.min(v);
        (stale == 2).then_some(s)
    });
    let stop = stop.expect("the loss never stalled twice: raise the learning rate");
    let mut early = Seen::default();
    let s = run_of(c.clone(), settings(Some(2)))
        .unwrap()
        .run(&mut early)
        .unwrap();
    assert_eq!(s.step, stop);
    assert_eq!(early.vals, seen.vals[..stop as usize]);
    assert!(early
        .notes
        .iter()
        .any(|n| n.starts_with("early stop at step")));
    // A file where the best checkpoint would go is refused before any step, and kept.
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("best"), "mine").unwrap();
    let e = run_of(c, settings(None)).err().expect("refused");
    assert!(
        e.to_string()
            .contains("best: exists and is not a directory"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(d.join("best")).unwrap(), "mine");
    let _ = std::fs::remove_dir_all(&d);
}
