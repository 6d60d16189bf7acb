//! Property: whatever is done to a checkpoint directory's files (truncated, overwritten,
//! extended, deleted, turned into a directory, a FIFO or a link, `latest` rewritten), a resume
//! never panics, never hangs, and never loads anything that does not verify: it loads one of
//! the checkpoints as written, or says why it cannot.

use pipewright_runtime::data::Corpus;
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::{TrainConfig, Trainer};
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

fn cfg() -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab: 256,
            d_model: 8,
            heads: 2,
            layers: 1,
            seq_len: 8,
            ..ModelConfig::default()
        },
        stages: 1,
        microbatches: 1,
        rows: 2,
        steps: 4,
        ..TrainConfig::default()
    }
}

/// A checkpoint directory, and the parameters of each step written into it.
type Pristine = (PathBuf, Vec<(u64, Vec<f32>)>);

/// A directory with the checkpoints of steps 1 and 2, and each step's parameters.
fn pristine() -> &'static Pristine {
    static P: OnceLock<Pristine> = OnceLock::new();
    P.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("pw-crafted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let corpus = Corpus::builtin();
        let mut t = Trainer::from_config(cfg()).unwrap();
        let mut params = Vec::new();
        for _ in 0..2 {
            t.train_step(&corpus).unwrap();
            t.save_checkpoint(&d).unwrap();
            params.push((t.step, t.flat_params().unwrap()));
        }
        (d, params)
    })
}

fn files(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[derive(Debug, Clone)]
enum Harm {
    Truncate(usize, f64),
    Overwrite(usize, f64, Vec<u8>),
    Append(usize, Vec<u8>),
    Delete(usize),
    Directory(usize),
    Fifo(usize),
    LinkToZero(usize),
    Latest(String),
}

fn harm() -> impl Strategy<Value = Harm> {
    let bytes = proptest::collection::vec(any::<u8>(), 1..16);
    prop_oneof![
        (any::<usize>(), 0.0..1.0f64).prop_map(|(f, x)| Harm::Truncate(f, x)),
        (any::<usize>(), 0.0..1.0f64, bytes.clone()).prop_map(|(f, x, b)| Harm::Overwrite(f, x, b)),
        (any::<usize>(), bytes).prop_map(|(f, b)| Harm::Append(f, b)),
        any::<usize>().prop_map(Harm::Delete),
        any::<usize>().prop_map(Harm::Directory),
        any::<usize>().prop_map(Harm::Fifo),
        any::<usize>().prop_map(Harm::LinkToZero),
        prop_oneof![
            Just("step-000001".to_string()),
            Just("step-000009".to_string()),
            Just("../../etc".to_string()),
            Just("/tmp".to_string()),
            "[ -~]{0,24}",
        ]
        .prop_map(Harm::Latest),
    ]
}

fn apply(d: &Path, h: &Harm) {
    let fs = files(d);
    let pick = |i: &usize| fs.get(i % fs.len().max(1)).cloned();
    // Contents are harmed in regular files only (a FIFO made by an earlier harm would block
    // the test's own read, and a link leads out of the directory).
    let regular = |f: &PathBuf| std::fs::symlink_metadata(f).is_ok_and(|m| m.is_file());
    let content = |i: &usize| pick(i).filter(regular);
    let _ = match h {
        Harm::Truncate(i, x) => content(i).map(|f| {
            let len = std::fs::metadata(&f).map_or(0, |m| m.len());
            let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
            file.set_len((len as f64 * x) as u64).unwrap();
        }),
        Harm::Overwrite(i, x, b) => content(i).map(|f| {
            let mut data = std::fs::read(&f).unwrap();
            let at = (data.len() as f64 * x) as usize;
            for (k, v) in b.iter().enumerate() {
                if let Some(slot) = data.get_mut(at + k) {
                    *slot = *v;
                }
            }
            std::fs::write(&f, data).unwrap();
        }),
        Harm::Append(i, b) => content(i).map(|f| {
            let mut data = std::fs::read(&f).unwrap();
            data.extend_from_slice(b);
            std::fs::write(&f, data).unwrap();
        }),
        Harm::Delete(i) => pick(i).map(|f| std::fs::remove_file(f).unwrap()),
        Harm::Directory(i) => pick(i).map(|f| {
            std::fs::remove_file(&f).unwrap();
            std::fs::create_dir(&f).unwrap();
        }),
        Harm::Fifo(i) => pick(i).map(|f| {
            std::fs::remove_file(&f).unwrap();
            let ok = std::process::Command::new("mkfifo").arg(&f).status();
            assert!(ok.is_ok_and(|s| s.success()), "mkfifo");
        }),
        Harm::LinkToZero(i) => pick(i).map(|f| {
            std::fs::remove_file(&f).unwrap();
            std::os::unix::fs::symlink("/dev/zero", &f).unwrap();
        }),
        // `latest` may be a directory, FIFO or link by now: then it stays one (writing into
        // a FIFO would block the test itself).
        Harm::Latest(text) => {
            let l = d.join("latest");
            let odd = std::fs::symlink_metadata(&l).is_ok_and(|m| !m.is_file());
            (!odd).then(|| std::fs::write(&l, text).unwrap())
        }
    };
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_harmed_checkpoint_directory_never_loads_what_was_not_written(
        harms in proptest::collection::vec(harm(), 1..4),
        case in any::<u64>(),
    ) {
        let (src, params) = pristine();
        let d = std::env::temp_dir().join(format!("pw-crafted-{}-{case}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        copy(src, &d);
        for h in &harms {
            apply(&d, h);
        }
        // A resume on its own thread: a hang (a read of a FIFO or of /dev/zero) fails the
        // case instead of the whole test run.
        let (tx, rx) = std::sync::mpsc::channel();
        let dir = d.clone();
        std::thread::spawn(move || {
            let mut t = Trainer::from_config(cfg()).unwrap();
            let r = t.load_checkpoint(&dir).map(|r| (r.step, t.flat_params().unwrap()));
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        let got = rx.recv_timeout(Duration::from_secs(30));
        let _ = std::fs::remove_dir_all(&d);
        match got {
            Err(_) => prop_assert!(false, "the resume hung after {harms:?}"),
            Ok(Err(msg)) => prop_assert!(!msg.is_empty()),
            Ok(Ok((step, loaded))) => {
                let want = params.iter().find(|(s, _)| *s == step);
                prop_assert!(want.is_some_and(|(_, p)| *p == loaded),
                    "loaded step {step}, which is not as written, after {harms:?}");
            }
        }
    }
}
