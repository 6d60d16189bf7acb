//! `--data` and its companions: what a run learns from, and how it is held out.

use crate::BadInput;
use anyhow::Result;
use pipewright_runtime::data::Corpus;
use pipewright_runtime::labelled::{cifar_files, read_texts, Classes, Examples, Fields};
use pipewright_runtime::model::{Family, TaskHead};
use pipewright_runtime::train::{DataSource, TrainConfig};
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

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Task::Lm => "lm",
            Task::Classify => "classify",
            Task::Qa => "qa",
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
            task: self.task.name().into(),
            text_field: self.text_field.clone(),
            label_field: self.label_field.clone(),
        })
    }

    /// The data settings in force: these flags when `--data` is given, else what a
    /// configuration or checkpoint recorded (`recorded`), else the built-in corpus.
    pub fn resolve(&self, recorded: Option<&DataSource>) -> Result<DataArgs> {
        let (None, Some(r)) = (&self.data, recorded) else {
            return Ok(self.clone());
        };
        let task = <Task as clap::ValueEnum>::from_str(&r.task, true).map_err(|_| {
            BadInput(format!(
                "data task {:?}: expected lm, classify or qa",
                r.task
            ))
        })?;
        Ok(DataArgs {
            data: Some(r.path.clone()),
            val_data: r.val_path.clone(),
            val_fraction: r.val_fraction,
            task,
            text_field: r.text_field.clone(),
            label_field: r.label_field.clone(),
        })
    }

    fn check(&self) -> Result<()> {
        let f = self.val_fraction;
        if !(f.is_finite() && f > 0.0 && f < 1.0) {
            return Err(BadInput(format!(
                "--val-fraction {f}: expected a number between 0 and 1"
            ))
            .into());
        }
        if self.task != Task::Lm && self.data.is_none() {
            return Err(BadInput(
                "--task classify and qa need labelled examples: --data FILE.jsonl, FILE.csv, an image folder (vit) or SQuAD JSON (qa)".into(),
            )
            .into());
        }
        if self.val_data.is_some() && self.data.is_none() {
            return Err(BadInput("--val-data goes with --data".into()).into());
        }
        Ok(())
    }
}

/// The training data as the run's tokenizer reads it, checked against the model. A task's
/// classes decide the model's head: one it lacks is added (and `cfg.model` changed).
pub fn corpus(a: &DataArgs, cfg: &mut TrainConfig) -> Result<Corpus> {
    a.check()?;
    if a.task == Task::Lm {
        let what = a
            .data
            .as_ref()
            .map_or("the built-in corpus".into(), |d| d.display().to_string());
        cfg.model.check_text(&what, 0).map_err(BadInput)?;
    }
    let tok = crate::model::tokenizer(cfg)?;
    if cfg.model.family != Family::Vit {
        tok.check_fits(cfg.model.vocab).map_err(BadInput)?; // images need no tokenizer
    }
    let Some(data) = &a.data else {
        return Ok(Corpus::builtin_with(&tok).map_err(BadInput)?);
    };
    let corpus = match a.task {
        Task::Lm => text_corpus(a, data, &tok)?,
        Task::Classify => examples(a, data, cfg, &tok)?,
        Task::Qa => questions(a, data, cfg, &tok)?,
    };
    Ok(corpus)
}

/// Text to model: records' `--text-field` (JSONL, Parquet), or text and token shards.
fn text_corpus(
    a: &DataArgs,
    data: &std::path::Path,
    tok: &pipewright_runtime::tokenizer::Tokenizer,
) -> Result<Corpus> {
    let records = |p: &std::path::Path| {
        p.is_file()
            && p.extension()
                .is_some_and(|x| x == "jsonl" || x == "parquet")
    };
    let open = |p: &std::path::Path, fraction: f64| match records(p) {
        true => read_texts(p, &a.text_field).and_then(|docs| {
            Corpus::from_documents(&p.display().to_string(), &docs, tok, fraction)
        }),
        false => Corpus::open_split(p, tok, fraction),
    };
    let corpus = match &a.val_data {
        Some(v) if records(data) || records(v) => {
            let (train, val) = (open(data, 0.0), open(v, 1.0));
            train.and_then(|t| {
                val.map(|v| Corpus {
                    name: format!("{} (validation: {})", t.name, v.name),
                    ids: t.ids.max(v.ids),
                    train: t.train,
                    val: v.val,
                })
            })
        }
        Some(v) => Corpus::open_with_val(data, v, tok),
        None => open(data, a.val_fraction),
    };
    Ok(corpus.map_err(BadInput)?)
}

/// Labelled examples from `data` (and --val-data), the model given a head for their classes.
fn examples(
    a: &DataArgs,
    data: &std::path::Path,
    cfg: &mut TrainConfig,
    tok: &pipewright_runtime::tokenizer::Tokenizer,
) -> Result<Corpus> {
    let fields = Fields {
        text: a.text_field.clone(),
        label: a.label_field.clone(),
    };
    let m = &cfg.model;
    let seq_len = m.seq_len;
    let (vit, size, channels) = (m.family == Family::Vit, m.image(), m.channels());
    // Texts from JSONL or CSV; images (vit) from CIFAR's binary files or a folder per class.
    let load = |path: &std::path::Path, classes: Option<&Classes>| match vit {
        true => match cifar_files(path, classes.is_some()) {
            Some(files) => Examples::load_cifar(&files, size, channels, seq_len),
            None => Examples::load_images(path, size, channels, seq_len, classes),
        },
        false => Examples::load(path, tok, &fields, seq_len, classes),
    };
    if vit && !data.is_dir() && cifar_files(data, false).is_none() {
        return Err(BadInput(format!(
            "{}: a vit model learns from images: --data a folder per class, or CIFAR's .bin files",
            data.display()
        ))
        .into());
    }
    // The training labels make the classes (the run checks a classifier's head has room).
    let (train, classes) = load(data, None).map_err(BadInput)?;
    let name = data.display().to_string();
    let ids = if vit { 0 } else { tok.vocab_size() };
    // A CIFAR directory brings its own test set.
    let cifar_test = (vit && data.is_dir())
        .then(|| cifar_files(data, true).map(|_| data.to_path_buf()))
        .flatten();
    let corpus = match a.val_data.as_ref().or(cifar_test.as_ref()) {
        Some(v) => {
            let (val, _) = load(v, Some(&classes)).map_err(BadInput)?;
            Corpus::examples(
                &format!("{name} (validation: {})", v.display()),
                train,
                val,
                ids,
            )
        }
        None => Corpus::examples_split(&name, &train, ids, a.val_fraction, cfg.seed),
    };
    // A classifier keeps its head unless an image model's classes differ (a new head then, as
    // transformers' `ignore_mismatched_sizes`).
    let differs = vit && cfg.model.classes() != classes.count();
    if differs || !matches!(cfg.model.head, Some(TaskHead::Classify { .. })) {
        cfg.model = cfg.model.with_head(Some(TaskHead::Classify {
            classes: classes.count(),
        }));
    }
    // The class names go with the model (export writes them as id2label).
    cfg.model.labels = match &classes {
        Classes::Named(names) => names.clone(),
        Classes::Numbered(_) => Vec::new(),
    };
    // Every example is drawn once an epoch (what the frozen-prefix cache keys on).
    cfg.sampling = pipewright_runtime::data::Sampling::Epochs;
    cfg.model.check().map_err(BadInput)?;
    Ok(corpus)
}

/// SQuAD questions from `data` (and --val-data); the model given an answer-span head.
fn questions(
    a: &DataArgs,
    data: &std::path::Path,
    cfg: &mut TrainConfig,
    tok: &pipewright_runtime::tokenizer::Tokenizer,
) -> Result<Corpus> {
    use pipewright_runtime::squad;
    let seq_len = cfg.model.seq_len;
    let name = data.display().to_string();
    let ids = tok.vocab_size();
    let corpus = match &a.val_data {
        Some(v) => {
            let (train, _) = squad::load(data, tok, seq_len, true).map_err(BadInput)?;
            let (val, _) = squad::load(v, tok, seq_len, false).map_err(BadInput)?;
            let name = format!("{name} (validation: {})", v.display());
            Corpus::examples(&name, train, val, ids)
        }
        None => {
            let (all, _) = squad::load(data, tok, seq_len, true).map_err(BadInput)?;
            Corpus::examples_split(&name, &all, ids, a.val_fraction, cfg.seed)
        }
    };
    cfg.model = cfg.model.with_head(Some(TaskHead::Span));
    cfg.sampling = pipewright_runtime::data::Sampling::Epochs;
    cfg.model.check().map_err(BadInput)?;
    Ok(corpus)
}
