//! `--data` and its companions: what a run learns from, and how it is held out.

use crate::BadInput;
use anyhow::Result;
use pipewright_runtime::data::source::{self, DataSource};
use pipewright_runtime::data::Corpus;
use pipewright_runtime::train::TrainConfig;
use std::path::PathBuf;

/// What the model learns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    /// Language modelling: the next token of a text.
    #[default]
    Lm,
    /// A class per text (JSONL or CSV with text and label fields), or per image (vit: a folder
    /// per class of PNG or JPEG files, or CIFAR-10/100's binary files, whose test file is the
    /// held-out part); the model gets a classification head (fresh, from
    /// --seed, unless it has one).
    Classify,
    /// Extractive question answering (bert) on SQuAD-format JSON: each question with its
    /// context, the answer's first and last token; validation reports exact match and F1.
    Qa,
}

impl From<Task> for source::Task {
    fn from(t: Task) -> Self {
        match t {
            Task::Lm => source::Task::Lm,
            Task::Classify => source::Task::Classify,
            Task::Qa => source::Task::Qa,
        }
    }
}

impl From<source::Task> for Task {
    fn from(t: source::Task) -> Self {
        match t {
            source::Task::Lm => Task::Lm,
            source::Task::Classify => Task::Classify,
            source::Task::Qa => Task::Qa,
        }
    }
}

#[derive(clap::Args, Clone, Debug, Default)]
pub struct DataArgs {
    /// Training data. For --task lm: a UTF-8 text file, a directory of .txt files, records
    /// (.jsonl or .parquet: each --text-field a document), or token shards (.bin, from
    /// `pipewright tokenize`; those named *val* are held out); default: the built-in synthetic
    /// corpus. For --task classify: a JSONL, CSV or Parquet file of texts and labels,
    /// or (vit) a directory with a folder of images per class.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Held-out data in the same form as --data (default: part of --data, see
    /// --val-fraction).
    #[arg(long, value_name = "PATH")]
    pub val_data: Option<PathBuf>,
    /// The share of --data held out for validation when there is no --val-data: the end of a
    /// text, or examples drawn by --seed.
    #[arg(long, default_value_t = 0.1, value_name = "F")]
    pub val_fraction: f64,
    #[arg(long, value_enum, default_value_t)]
    pub task: Task,
    /// The field (JSONL) or column (CSV) that holds each example's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// The field or column of its label: a whole number (a class index) or a name (classes
    /// are the names, sorted).
    #[arg(long, default_value = "label")]
    pub label_field: String,
    /// For --task classify: the classes the head has. The data must have exactly these
    /// (default: the data's own).
    #[arg(long, value_name = "N")]
    pub num_labels: Option<usize>,
}

impl DataArgs {
    /// These flags as a run records them (none: the built-in corpus). Paths are made absolute,
    /// so that a checkpoint or printed configuration reads the same data from anywhere.
    pub fn source(&self) -> Option<DataSource> {
        let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        Some(DataSource {
            path: abs(self.data.as_ref()?),
            val_path: self.val_data.as_ref().map(abs),
            val_fraction: self.val_fraction,
            task: self.task.into(),
            text_field: self.text_field.clone(),
            label_field: self.label_field.clone(),
            num_labels: self.num_labels,
        })
    }

    /// The data settings in force: these flags when `--data` is given, else what a
    /// configuration or checkpoint recorded (`recorded`), else the built-in corpus.
    pub fn resolve(&self, recorded: Option<&DataSource>) -> DataArgs {
        let (None, Some(r)) = (&self.data, recorded) else {
            return self.clone();
        };
        DataArgs {
            data: Some(r.path.clone()),
            val_data: r.val_path.clone(),
            val_fraction: r.val_fraction,
            task: r.task.into(),
            text_field: r.text_field.clone(),
            label_field: r.label_field.clone(),
            num_labels: r.num_labels,
        }
    }

    /// What only the flags can get wrong (the data wing checks the rest).
    fn check(&self) -> Result<()> {
        if self.task != Task::Lm && self.data.is_none() {
            return Err(BadInput(
                "--task classify and qa need labelled examples: --data FILE.jsonl, FILE.csv, an image folder (vit) or SQuAD JSON (qa)".into(),
            )
            .into());
        }
        if self.num_labels.is_some() && self.task != Task::Classify {
            return Err(BadInput("--num-labels goes with --task classify".into()).into());
        }
        if self.num_labels == Some(0) {
            return Err(BadInput("--num-labels must be at least 1".into()).into());
        }
        if self.val_data.is_some() && self.data.is_none() {
            return Err(BadInput("--val-data goes with --data".into()).into());
        }
        Ok(())
    }
}

/// The training data as the run's tokenizer reads it, checked against the model; the model
/// and sampling become what the data needs (a task's head, its examples in epochs).
pub fn corpus(a: &DataArgs, cfg: &mut TrainConfig) -> Result<Corpus> {
    a.check()?;
    let tok = crate::model::tokenizer(cfg)?;
    let opened = source::open(a.source().as_ref(), &tok, &cfg.model, cfg.seed)?;
    cfg.model = opened.model;
    if let Some(s) = opened.sampling {
        cfg.sampling = s;
    }
    Ok(opened.corpus)
}
