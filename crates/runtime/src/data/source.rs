//! Where a run's data comes from ([`DataSource`], what a run records and a checkpoint keeps)
//! and [`open`], the one place data is opened: read as the run's tokenizer reads it, checked
//! against the model, and the model given the head its task needs.

use super::corpus::{Corpus, Sampling};
use super::error::{Error, Field, Result};
use super::examples::{cifar_files, Classes, Examples};
use super::records::{read_texts, Fields};
use super::squad;
use super::tokenizer::Tokenizer;
use crate::model::{Family, ModelConfig, TaskHead};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What the model learns from its data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// Language modelling: the next token of a text.
    #[default]
    Lm,
    /// A class per text (records with a text and a label), or per image (vit).
    Classify,
    /// Extractive question answering (bert) on SQuAD-format JSON.
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

/// Where a run's data comes from and how it is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSource {
    /// Training data: a text file or directory, records, token shards, or a task's examples.
    pub path: PathBuf,
    /// Held-out data; none: `val_fraction` of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
    #[serde(default = "default_val_fraction")]
    pub val_fraction: f64,
    #[serde(default)]
    pub task: Task,
    #[serde(default = "default_text_field")]
    pub text_field: String,
    #[serde(default = "default_label_field")]
    pub label_field: String,
    /// The classes a classification head must have (`--num-labels`); none: the data's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_labels: Option<usize>,
}

fn default_val_fraction() -> f64 {
    0.1
}
fn default_text_field() -> String {
    "text".into()
}
fn default_label_field() -> String {
    "label".into()
}

impl DataSource {
    /// `path` read for `task`, with the default fields and a tenth held out.
    pub fn new(path: impl Into<PathBuf>, task: Task) -> Self {
        DataSource {
            path: path.into(),
            val_path: None,
            val_fraction: default_val_fraction(),
            task,
            text_field: default_text_field(),
            label_field: default_label_field(),
            num_labels: None,
        }
    }

    /// Settings that cannot work whatever the files hold.
    pub fn check(&self) -> Result<()> {
        let f = self.val_fraction;
        if !(f.is_finite() && f > 0.0 && f < 1.0) {
            return Err(Error::setting(
                Field::ValFraction,
                f,
                "expected a number between 0 and 1",
            ));
        }
        Ok(())
    }

    fn fields(&self) -> Fields {
        Fields {
            text: self.text_field.clone(),
            label: self.label_field.clone(),
        }
    }
}

/// Opened data: the corpus, and the model and sampling it needs (a task's head added, its
/// class names recorded, its examples drawn in epochs).
pub struct Opened {
    pub corpus: Corpus,
    pub model: ModelConfig,
    /// Set when the data decides it: a task's examples are each drawn once an epoch (what the
    /// frozen-prefix cache keys on).
    pub sampling: Option<Sampling>,
}

/// Open `source` (none: the built-in corpus) as `tok` reads it, for `model`; `seed` draws the
/// held-out examples when there is no held-out file.
pub fn open(
    source: Option<&DataSource>,
    tok: &Tokenizer,
    model: &ModelConfig,
    seed: u64,
) -> Result<Opened> {
    let mut model = model.clone();
    if let Some(s) = source {
        s.check()?;
    }
    if source.is_none_or(|s| s.task == Task::Lm) {
        let what = source.map_or("the built-in corpus".into(), |s| {
            s.path.display().to_string()
        });
        model.check_text(&what, 0)?;
    }
    if model.family != Family::Vit {
        tok.check_fits(model.vocab)?; // images need no tokenizer
    }
    let Some(s) = source else {
        let corpus = Corpus::builtin_with(tok)?;
        return Ok(Opened {
            corpus,
            model,
            sampling: None,
        });
    };
    let corpus = match s.task {
        Task::Lm => text_corpus(s, tok)?,
        Task::Classify => examples(s, &mut model, tok, seed)?,
        Task::Qa => questions(s, &mut model, tok, seed)?,
    };
    if s.task != Task::Lm {
        model.check()?;
    }
    Ok(Opened {
        corpus,
        model,
        sampling: (s.task != Task::Lm).then_some(Sampling::Epochs),
    })
}

/// There are `--num-labels` classes when given, and (`every_class`) each has training
/// examples.
fn check_classes(
    data: &Path,
    train: &Examples,
    classes: &Classes,
    num_labels: Option<usize>,
    every_class: bool,
) -> Result<()> {
    let n = classes.count();
    if let Some(want) = num_labels.filter(|&w| w != n) {
        let which = match classes {
            Classes::Named(names) => format!(" ({})", names.join(", ")),
            Classes::Numbered(c) => format!(" (labels 0-{})", c - 1),
        };
        return Err(Error::Input(format!(
            "--num-labels {want} disagrees with {}: its labels make {n} classes{which}",
            data.display()
        )));
    }
    if !every_class {
        return Ok(());
    }
    let mut seen = vec![false; n];
    for &l in train.labels.iter().step_by(train.target_len.max(1)) {
        if let Some(s) = seen.get_mut(l as usize) {
            *s = true;
        }
    }
    match seen.iter().position(|&s| !s) {
        Some(c) => Err(Error::Input(format!(
            "{}: class {c} of 0-{} has no training examples (an empty class: renumber the labels from 0 without gaps)",
            data.display(),
            n - 1
        ))),
        None => Ok(()),
    }
}

/// Records' text field (JSONL, Parquet), or text and token shards.
fn text_corpus(s: &DataSource, tok: &Tokenizer) -> Result<Corpus> {
    let records = |p: &Path| {
        p.is_file()
            && p.extension()
                .is_some_and(|x| x == "jsonl" || x == "parquet")
    };
    let open = |p: &Path, fraction: f64| match records(p) {
        true => read_texts(p, &s.text_field).and_then(|docs| {
            Corpus::from_documents(&p.display().to_string(), &docs, tok, fraction)
        }),
        false => Corpus::open_split(p, tok, fraction),
    };
    match &s.val_path {
        Some(v) if records(&s.path) || records(v) => {
            let (t, v) = (open(&s.path, 0.0)?, open(v, 1.0)?);
            Ok(Corpus {
                name: format!("{} (validation: {})", t.name, v.name),
                ids: t.ids.max(v.ids),
                train: t.train,
                val: v.val,
            })
        }
        Some(v) => Corpus::open_with_val(&s.path, v, tok),
        None => open(&s.path, s.val_fraction),
    }
}

/// Labelled examples (texts, or a vit's images), the model given a head for their classes.
fn examples(s: &DataSource, model: &mut ModelConfig, tok: &Tokenizer, seed: u64) -> Result<Corpus> {
    let (data, fields, seq_len) = (&s.path, s.fields(), model.seq_len);
    let (vit, size, channels) = (model.family == Family::Vit, model.image(), model.channels());
    // Texts from records; images (vit) from CIFAR's binary files or a folder per class.
    let load = |path: &Path, classes: Option<&Classes>| match vit {
        true => match cifar_files(path, classes.is_some()) {
            Some(files) => Examples::load_cifar(&files, size, channels, seq_len),
            None => Examples::load_images(path, size, channels, seq_len, classes),
        },
        false => Examples::load(path, tok, &fields, seq_len, classes),
    };
    if vit && !data.is_dir() && cifar_files(data, false).is_none() {
        return Err(Error::Input(format!(
            "{}: a vit model learns from images: a folder per class, or CIFAR's .bin files",
            data.display()
        )));
    }
    // The training labels make the classes (the run checks a classifier's head has room).
    let (train, classes) = load(data, None)?;
    // CIFAR's ten classes are the format's: a part of it may lack some.
    let every_class = !(vit && cifar_files(data, false).is_some());
    check_classes(data, &train, &classes, s.num_labels, every_class)?;
    let mut notes = Vec::new();
    if train.truncated > 0 {
        notes.push(format!(
            "{} of {} texts cut to {seq_len} tokens",
            train.truncated,
            train.len()
        ));
    }
    if train.lossy > 0 {
        notes.push(format!("{} lines not UTF-8, read lossily", train.lossy));
    }
    let name = match notes.is_empty() {
        true => data.display().to_string(),
        false => format!("{} ({})", data.display(), notes.join("; ")),
    };
    let ids = if vit { 0 } else { tok.vocab_size() };
    // A CIFAR directory brings its own test set.
    let cifar_test = (vit && data.is_dir())
        .then(|| cifar_files(data, true).map(|_| data.to_path_buf()))
        .flatten();
    let corpus = match s.val_path.as_ref().or(cifar_test.as_ref()) {
        Some(v) => {
            let (val, _) = load(v, Some(&classes))?;
            let name = format!("{name} (validation: {})", v.display());
            Corpus::examples(&name, train, val, ids)
        }
        None => Corpus::examples_split(&name, &train, ids, s.val_fraction, seed),
    };
    // A classifier keeps its head unless an image model's classes differ (a new head then, as
    // transformers' `ignore_mismatched_sizes`).
    let differs = vit && model.classes() != classes.count();
    if differs || !matches!(model.head, Some(TaskHead::Classify { .. })) {
        *model = model.with_head(Some(TaskHead::Classify {
            classes: classes.count(),
        }));
    }
    // The class names go with the model (export writes them as id2label).
    model.labels = match &classes {
        Classes::Named(names) => names.clone(),
        Classes::Numbered(_) => Vec::new(),
    };
    Ok(corpus)
}

/// SQuAD questions, the model given an answer-span head.
fn questions(
    s: &DataSource,
    model: &mut ModelConfig,
    tok: &Tokenizer,
    seed: u64,
) -> Result<Corpus> {
    let (data, seq_len) = (&s.path, model.seq_len);
    let name = data.display().to_string();
    let ids = tok.vocab_size();
    let corpus = match &s.val_path {
        Some(v) => {
            let (train, _) = squad::load(data, tok, seq_len, true)?;
            let (val, _) = squad::load(v, tok, seq_len, false)?;
            let name = format!("{name} (validation: {})", v.display());
            Corpus::examples(&name, train, val, ids)
        }
        None => {
            let (all, _) = squad::load(data, tok, seq_len, true)?;
            Corpus::examples_split(&name, &all, ids, s.val_fraction, seed)
        }
    };
    *model = model.with_head(Some(TaskHead::Span));
    Ok(corpus)
}
