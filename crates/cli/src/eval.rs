//! `eval`: validation loss and perplexity of a checkpoint, with stages left out (SkipPipe's
//! skip-robust inference: a model trained with skipping should lose less when stages go).

use crate::BadInput;
use anyhow::Result;
use clap::Args;
use pipewright_core::rng::Lcg;
use pipewright_runtime::train::{checkpoint_config, TrainConfig, Trainer, Validation};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct EvalArgs {
    /// Checkpoint directory of a `train` run (its newest checkpoint that verifies is read).
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Evaluate a Hugging Face model instead of a checkpoint (each transformer block is then a
    /// stage that --omit and --keep-stages may leave out).
    #[command(flatten)]
    model: crate::model::ModelArgs,
    /// The data the run trained on, as `train` takes it (its held-out part is scored): a text
    /// by default, or a classification or QA task's examples with --task.
    #[command(flatten)]
    data: crate::data::DataArgs,
    /// Held-out micro-batches of a text per evaluation, as `train --eval-batches` (a task
    /// scores all its held-out examples).
    /// (`--batches`, the old spelling, is still taken.)
    #[arg(long = "eval-batches", alias = "batches", default_value_t = 8)]
    batches: usize,
    /// Stages (of the plan that wrote the checkpoint) to leave out, e.g. 1,3. Stages holding
    /// the embedding or the head stay.
    #[arg(long, value_delimiter = ',', conflicts_with = "keep_stages")]
    omit: Vec<usize>,
    /// Fractions of the model's stages to keep (repeatable, default 0.75 and 0.5): the others
    /// are left out, chosen at random among those that may go (every choice when there are at
    /// most --draws of them). (`--keep` is train's count of checkpoints; the old spelling
    /// here is still taken.)
    #[arg(long, alias = "keep")]
    keep_stages: Vec<f64>,
    /// Random choices of left-out stages per --keep-stages fraction.
    #[arg(long, default_value_t = 8)]
    draws: usize,
    /// Seed of the random choices of left-out stages.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// All `k`-subsets of `items` in lexicographic order, or `None` past `limit` of them.
fn subsets(items: &[usize], k: usize, limit: usize) -> Option<Vec<Vec<usize>>> {
    let mut out = Vec::new();
    let mut pick: Vec<usize> = (0..k).collect();
    if k > items.len() {
        return Some(out);
    }
    loop {
        if out.len() == limit {
            return None;
        }
        out.push(pick.iter().map(|&i| items[i]).collect());
        // Next combination: bump the rightmost index that can still move.
        let Some(i) = (0..k).rev().find(|&i| pick[i] < items.len() - k + i) else {
            return Some(out);
        };
        pick[i] += 1;
        for j in i + 1..k {
            pick[j] = pick[j - 1] + 1;
        }
    }
}

pub fn cmd_eval(a: EvalArgs) -> Result<()> {
    check_args(&a)?;
    let brought = a.model.resolve()?;
    let from_checkpoint = brought.is_none();
    let (mut cfg, per, step) = match brought {
        Some(m) => {
            let cfg = TrainConfig {
                pretrained: m.weights,
                model: m.config,
                ..TrainConfig::default()
            };
            (cfg.clone(), vec![1; cfg.model.num_blocks()], 0)
        }
        None => {
            let (cfg, plan, step) = checkpoint_config(&a.checkpoint_dir)?;
            (cfg, plan.layers_per_stage(), step)
        }
    };
    let st = Stages::of(&per, cfg.model.num_blocks());
    st.check_omit(&a.omit)?;
    let corpus = eval_corpus(&a, &mut cfg)?;
    if from_checkpoint {
        // The checkpoint holds every weight: a run fine-tuned from `--model DIR` records DIR
        // (for its tokenizer, read above), and starting from it would score DIR's weights.
        cfg.pretrained = None;
    }
    // Evaluation needs the weights only: one worker, one stage.
    (cfg.stages, cfg.replicas, cfg.chunks) = (1, 1, 1);
    cfg.schedule = pipewright_core::schedule::ScheduleKind::OneFOneB;
    let one = cfg.plan()?;
    let mut trainer = Trainer::in_process(cfg.clone(), one, None, Duration::from_secs(60))?;
    let source = match &cfg.pretrained {
        _ if from_checkpoint => trainer.load_checkpoint(&a.checkpoint_dir)?.path,
        Some(dir) => dir.clone(),
        None => "fresh weights".into(),
    };
    let eval = |stages: &[usize]| trainer.validate(&corpus, a.batches, &st.blocks_of(stages));
    let scores = eval(&[])?;
    let full = scores.loss;
    let (per, may_go) = (&st.per, &st.may_go);
    if !a.json {
        println!(
            "{} (step {step}): {} layer blocks in stages {per:?}; stages that may be left out: {may_go:?}",
            source.display(),
            cfg.model.num_blocks()
        );
        println!("  all stages:  val loss {full:.4}{}", task_scores(&scores));
    }
    let mut rows = Vec::new();
    for (label, choices) in st.omission_sets(&a)? {
        let scores = choices
            .iter()
            .map(|c| eval(c))
            .collect::<std::result::Result<Vec<Validation>, _>>()?;
        rows.push(omission_row(&a, label, &choices, &scores, full));
    }
    if a.json {
        println!(
            "{}",
            json!({
                "checkpoint": source,
                "step": step,
                "layers_per_stage": per,
                "may_omit": may_go,
                "val_loss": full,
                "perplexity": scores.accuracy.is_none().then(|| full.exp()),
                "accuracy": scores.accuracy,
                "f1": scores.f1,
                "omitted": rows,
            })
        );
    }
    Ok(())
}

fn check_args(a: &EvalArgs) -> Result<()> {
    if !(1..=100_000).contains(&a.batches) || !(1..=1000).contains(&a.draws) {
        return Err(BadInput(
            "--eval-batches must be between 1 and 100000 and --draws between 1 and 1000".into(),
        )
        .into());
    }
    if let Some(f) = a
        .keep_stages
        .iter()
        .find(|f| !(f.is_finite() && **f > 0.0 && **f <= 1.0))
    {
        return Err(BadInput(format!("--keep-stages {f}: a fraction in (0, 1]")).into());
    }
    Ok(())
}

/// The held-out data of the checkpoint's run, checked against its model: a task's classes
/// must be those its head was trained for.
fn eval_corpus(a: &EvalArgs, cfg: &mut TrainConfig) -> Result<pipewright_runtime::data::Corpus> {
    let head = cfg.model.head;
    // Without --data, the data the checkpoint's run trained on.
    let data = a.data.resolve(cfg.data.as_ref());
    if a.data.data.is_none() && !a.json {
        match &data.data {
            Some(d) => println!("data: {} (recorded in the checkpoint)", d.display()),
            None => println!("data: the built-in corpus"),
        }
    }
    let corpus = crate::data::corpus(&data, cfg)?;
    if cfg.model.head != head {
        return Err(BadInput(format!(
            "{}: the model's head ({head:?}) does not fit this data's task ({:?}); pass the data and --task it was trained on",
            corpus.name, cfg.model.head
        ))
        .into());
    }
    if !corpus.is_task() {
        corpus.check(cfg.model.seq_len)?;
        cfg.model.check_text(&corpus.name, corpus.ids)?;
    }
    Ok(corpus)
}

/// A task's held-out scores, as printed after the loss.
/// A text's perplexity, or a task's scores (its loss has no perplexity worth the name).
fn task_scores(v: &Validation) -> String {
    match (v.accuracy, v.f1) {
        (Some(em), Some(f1)) => format!("  exact match {em:.3}  F1 {f1:.3}"),
        (Some(acc), None) => format!("  accuracy {acc:.3}"),
        _ => format!("  perplexity {:.3}", v.loss.exp()),
    }
}

/// One set of omissions' scores: printed, and as its JSON row.
fn omission_row(
    a: &EvalArgs,
    label: String,
    choices: &[Vec<usize>],
    scores: &[Validation],
    full: f64,
) -> serde_json::Value {
    let n = scores.len().max(1) as f64;
    let losses: Vec<f64> = scores.iter().map(|v| v.loss).collect();
    let mean = losses.iter().sum::<f64>() / n;
    let worst = losses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let accuracy = scores
        .iter()
        .map(|v| v.accuracy)
        .sum::<Option<f64>>()
        .map(|s| s / n);
    if !a.json {
        let scores = match accuracy {
            None => format!(
                "  perplexity {:.3} ({:+.1}% over all stages), worst {:.3}",
                mean.exp(),
                100.0 * (mean.exp() / full.exp() - 1.0),
                worst.exp()
            ),
            Some(x) => format!(" (all stages {full:.4}), worst {worst:.4}, mean accuracy {x:.3}"),
        };
        println!(
            "  {label}: mean val loss {mean:.4}{scores}, over {} choice(s) {:?}",
            choices.len(),
            choices
        );
    }
    json!({
        "label": label,
        "omitted": choices,
        "val_losses": losses,
        "mean_val_loss": mean,
        "perplexity": accuracy.is_none().then(|| mean.exp()),
        "worst_perplexity": accuracy.is_none().then(|| worst.exp()),
        "mean_accuracy": accuracy,
    })
}

/// The stages of the plan that trained the model, and which of them may be left out.
struct Stages {
    per: Vec<usize>,
    /// Stage s holds layer blocks bounds[s]..bounds[s + 1].
    bounds: Vec<usize>,
    may_go: Vec<usize>,
    /// Stages of the model (a stage of the head alone, SkipPipe's layout, is not one).
    model_stages: usize,
}

impl Stages {
    fn of(per: &[usize], blocks: usize) -> Self {
        let mut bounds = vec![0];
        for l in per {
            bounds.push(bounds.last().unwrap() + l);
        }
        let last = blocks - 1;
        let holds = |s: usize| bounds[s]..bounds[s + 1];
        let may_go = (0..per.len())
            .filter(|&s| !holds(s).contains(&0) && !holds(s).contains(&last))
            .collect();
        Stages {
            per: per.to_vec(),
            may_go,
            model_stages: per.len() - usize::from(per.last() == Some(&1) && per.len() > 1),
            bounds,
        }
    }

    fn blocks_of(&self, stages: &[usize]) -> Vec<usize> {
        stages
            .iter()
            .flat_map(|&s| self.bounds[s]..self.bounds[s + 1])
            .collect()
    }

    fn check_omit(&self, omit: &[usize]) -> Result<()> {
        let (per, may_go) = (&self.per, &self.may_go);
        for &s in omit {
            if s >= per.len() {
                return Err(BadInput(format!(
                    "--omit {s}: the checkpoint's plan has stages 0-{} (layers per stage {per:?})",
                    per.len() - 1
                ))
                .into());
            }
            if !may_go.contains(&s) {
                return Err(BadInput(format!(
                    "--omit {s}: stage {s} holds the embedding or the head, which every route visits; stages that may go: {may_go:?}"
                ))
                .into());
            }
        }
        Ok(())
    }

    /// The sets of stages to leave out: `--omit`'s, or per `--keep-stages` fraction every choice (or
    /// `--draws` random ones).
    fn omission_sets(&self, a: &EvalArgs) -> Result<Vec<(String, Vec<Vec<usize>>)>> {
        if !a.omit.is_empty() {
            let mut o = a.omit.clone();
            o.sort_unstable();
            o.dedup();
            return Ok(vec![(format!("omit {o:?}"), vec![o])]);
        }
        let keeps = if a.keep_stages.is_empty() {
            vec![0.75, 0.5]
        } else {
            a.keep_stages.clone()
        };
        let (model_stages, may_go) = (self.model_stages, &self.may_go);
        let mut rng = Lcg(a.seed);
        let mut sets = Vec::new();
        let mut done = Vec::new();
        for f in keeps {
            let keep = ((f * model_stages as f64).round() as usize).max(1);
            let k = model_stages - keep.min(model_stages);
            // The default fractions show what this plan allows: none leaving out nothing,
            // more than may go, or the same count twice.
            if a.keep_stages.is_empty() && (k == 0 || k > may_go.len() || done.contains(&k)) {
                continue;
            }
            done.push(k);
            if k > may_go.len() {
                return Err(BadInput(format!(
                    "--keep-stages {f}: keeping {keep} of {model_stages} stages leaves out {k}, but only {} may go ({may_go:?})",
                    may_go.len()
                ))
                .into());
            }
            // More choices than --draws: that many different ones, at random (subsets()
            // stops past the limit, so there are more than enough to draw from).
            let choices = subsets(may_go, k, a.draws).unwrap_or_else(|| {
                let mut drawn: Vec<Vec<usize>> = Vec::with_capacity(a.draws);
                while drawn.len() < a.draws {
                    let mut pool = may_go.clone();
                    for i in (1..pool.len()).rev() {
                        pool.swap(i, rng.below(i + 1));
                    }
                    let mut c = pool[..k].to_vec();
                    c.sort_unstable();
                    if !drawn.contains(&c) {
                        drawn.push(c);
                    }
                }
                drawn
            });
            sets.push((format!("keep {keep} of {model_stages}"), choices));
        }
        Ok(sets)
    }
}

#[cfg(test)]
mod tests {
    use super::{subsets, EvalArgs, Stages};
    use clap::Parser;

    #[test]
    fn random_draws_of_left_out_stages_are_all_different() {
        #[derive(Parser)]
        struct Cmd {
            #[command(flatten)]
            a: EvalArgs,
        }
        // 6 of 8 single-block stages may go; leaving out 3 has 20 choices, 19 drawn.
        let a = Cmd::parse_from(["eval", "--keep-stages", "0.5", "--draws", "19"]).a;
        let st = Stages::of(&[1; 8], 8);
        assert_eq!(st.may_go.len(), 6);
        let sets = st.omission_sets(&a).unwrap();
        let choices = &sets[0].1;
        assert_eq!(choices.len(), 19);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c.len(), 3);
            assert!(!choices[..i].contains(c), "{c:?} drawn twice: {choices:?}");
        }
    }

    #[test]
    fn subsets_enumerate_combinations_up_to_a_limit() {
        let all = subsets(&[1, 2, 3, 4], 2, 100).unwrap();
        assert_eq!(
            all,
            vec![
                vec![1, 2],
                vec![1, 3],
                vec![1, 4],
                vec![2, 3],
                vec![2, 4],
                vec![3, 4]
            ]
        );
        assert_eq!(
            subsets(&[1, 2, 3], 0, 5).unwrap(),
            vec![Vec::<usize>::new()]
        );
        assert!(subsets(&[1, 2, 3, 4], 2, 5).is_none());
        assert!(subsets(&[1], 2, 5).unwrap().is_empty());
    }
}
