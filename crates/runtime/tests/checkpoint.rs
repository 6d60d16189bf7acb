//! Resume equals straight training; bad checkpoints and divergence are clear errors; a crash
//! at any point of a checkpoint write leaves one that resumes; a flipped byte is named.

use pipewright_runtime::data::Corpus;
use pipewright_runtime::exec::ExecError;
use pipewright_runtime::model::ModelConfig;
use pipewright_runtime::train::{TrainConfig, Trainer};

fn cfg() -> TrainConfig {
    TrainConfig {
        model: ModelConfig {
            vocab: 256,
            d_model: 16,
            heads: 2,
            layers: 2,
            seq_len: 8,
            ..ModelConfig::default()
        },
        stages: 2,
        microbatches: 2,
        rows: 2,
        steps: 20,
        ..TrainConfig::default()
    }
}

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pw-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn resume_equals_straight_training() {
    let corpus = Corpus::builtin();
    let mut straight = Trainer::from_config(cfg()).unwrap();
    for _ in 0..20 {
        straight.train_step(&corpus).unwrap();
    }
    let d = dir("resume");
    let mut first = Trainer::from_config(cfg()).unwrap();
    for _ in 0..10 {
        first.train_step(&corpus).unwrap();
    }
    first.save_checkpoint(&d).unwrap();
    drop(first);
    let mut second = Trainer::from_config(cfg()).unwrap();
    second.load_checkpoint(&d).unwrap();
    assert_eq!(second.step, 10);
    for _ in 0..10 {
        second.train_step(&corpus).unwrap();
    }
    let (a, b) = (
        second.flat_params().unwrap(),
        straight.flat_params().unwrap(),
    );
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(a == b, "resumed run differs: max |diff| {diff}");
}

/// 10 steps at P = 2, D = 1, then `--resume` at P = 4, D = 2 (zbh1, other boundaries) for
/// 10 more: the same parameters as 20 straight single-worker steps, within 1e-5.
#[test]
fn resume_under_another_plan() {
    use pipewright_core::schedule::ScheduleKind;
    use pipewright_runtime::train::PlainTrainer;
    let corpus = Corpus::builtin();
    let base = TrainConfig {
        microbatches: 4,
        ..cfg()
    };
    let mut plain = PlainTrainer::new(base.clone(), &base.plan().unwrap());
    for _ in 0..20 {
        plain.train_step(&corpus);
    }
    let d = dir("replan");
    let mut first = Trainer::from_config(base.clone()).unwrap();
    for _ in 0..10 {
        first.train_step(&corpus).unwrap();
    }
    first.save_checkpoint(&d).unwrap();
    drop(first);
    let other = TrainConfig {
        schedule: ScheduleKind::ZbH1,
        stages: 4,
        replicas: 2,
        microbatches: 2,
        ..base
    };
    let mut second = Trainer::from_config(other).unwrap();
    assert_eq!(second.plan.num_workers(), 8);
    second.load_checkpoint(&d).unwrap();
    assert_eq!(second.step, 10);
    for _ in 0..10 {
        second.train_step(&corpus).unwrap();
    }
    let (a, b) = (second.flat_params().unwrap(), plain.flat_params());
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff <= 1e-5,
        "resumed under another plan: max |diff| {diff}"
    );
}

#[test]
fn bad_checkpoints_are_named() {
    let corpus = Corpus::builtin();
    let d = dir("bad");
    let mut t = Trainer::from_config(cfg()).unwrap();
    t.train_step(&corpus).unwrap();
    let ck = t.save_checkpoint(&d).unwrap();
    // A different model cannot load it.
    let other = TrainConfig {
        model: ModelConfig {
            d_model: 32,
            ..cfg().model
        },
        ..cfg()
    };
    let e = Trainer::from_config(other)
        .unwrap()
        .load_checkpoint(&d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("different model"), "{e}");
    // Corrupt weights.
    std::fs::write(ck.join("weights.safetensors"), b"not a safetensors file").unwrap();
    let e = Trainer::from_config(cfg())
        .unwrap()
        .load_checkpoint(&d)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("weights.safetensors: does not match the manifest"),
        "{e}"
    );
    // No checkpoint at all.
    let e = Trainer::from_config(cfg())
        .unwrap()
        .load_checkpoint(&dir("none"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no checkpoint to resume"), "{e}");
}

#[test]
fn divergence_is_an_error_not_a_nan_model() {
    let corpus = Corpus::builtin();
    let mut t = Trainer::from_config(TrainConfig {
        lr: 1e8,
        min_lr: 1e8,
        warmup: 0,
        clip: 1e30,
        ..cfg()
    })
    .unwrap();
    let err = (0..10)
        .find_map(|_| t.train_step(&corpus).err())
        .expect("diverges");
    assert!(matches!(err, ExecError::NonFinite(_)), "{err}");
}

/// Every file under `d`, relative.
fn files(d: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        if e.path().is_dir() {
            out.extend(files(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

#[test]
fn a_crash_between_any_two_file_operations_leaves_a_checkpoint_that_resumes() {
    let corpus = Corpus::builtin();
    let mut old = Trainer::from_config(cfg()).unwrap();
    old.train_step(&corpus).unwrap();
    let mut new = Trainer::from_config(cfg()).unwrap();
    new.train_step(&corpus).unwrap();
    new.train_step(&corpus).unwrap();
    let (p_old, p_new) = (old.flat_params().unwrap(), new.flat_params().unwrap());
    let mut crashed = 0;
    for n in 0.. {
        let d = dir(&format!("crash{n}"));
        old.save_checkpoint(&d).unwrap();
        match new.save_checkpoint_crashing(&d, Some(n)) {
            Err(e) => {
                assert!(e.to_string().contains("simulated crash"), "{e}");
                crashed += 1;
            }
            Ok(_) => {
                assert!(crashed > 10, "only {crashed} operations");
                let mut t = Trainer::from_config(cfg()).unwrap();
                assert_eq!(t.load_checkpoint(&d).unwrap().step, 2);
                let _ = std::fs::remove_dir_all(&d);
                break;
            }
        }
        let mut t = Trainer::from_config(cfg()).unwrap();
        let r = t
            .load_checkpoint(&d)
            .unwrap_or_else(|e| panic!("crash after {n} operations: {e}"));
        let want = if r.step == 1 { &p_old } else { &p_new };
        assert!(r.step == 1 || r.step == 2, "step {}", r.step);
        assert_eq!(&t.flat_params().unwrap(), want, "crash after {n}");
        // The next save after a crash succeeds and becomes the latest.
        new.save_checkpoint(&d).unwrap();
        assert_eq!(t.load_checkpoint(&d).unwrap().step, 2);
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[test]
fn a_flipped_byte_in_any_checkpoint_file_is_named_and_an_older_one_is_used() {
    let corpus = Corpus::builtin();
    let mut t = Trainer::from_config(cfg()).unwrap();
    t.train_step(&corpus).unwrap();
    let d = dir("flip");
    let older = t.save_checkpoint(&d).unwrap();
    t.train_step(&corpus).unwrap();
    let newest = t.save_checkpoint(&d).unwrap();
    let all = files(&newest);
    assert!(all.len() >= 5, "{all:?}");
    // Near the start, the middle and the end of every file (inside the manifest's hashes too).
    let flips: Vec<(std::path::PathBuf, usize)> = all
        .iter()
        .flat_map(|f| {
            let n = std::fs::metadata(f).unwrap().len() as usize;
            [n / 7, n / 2, n.saturating_sub(3)].map(|i| (f.clone(), i))
        })
        .collect();
    for (f, i) in flips {
        let good = std::fs::read(&f).unwrap();
        let mut bad = good.clone();
        bad[i] ^= 0x10;
        std::fs::write(&f, &bad).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        // The manifest and its checksum name each other.
        let name = if name == "manifest.sha256" {
            "manifest.json".to_string()
        } else {
            name
        };
        // Alone, the corrupt checkpoint is refused, naming the file.
        let only = dir("flip-only");
        std::fs::create_dir_all(&only).unwrap();
        let copy = only.join(newest.file_name().unwrap());
        copy_dir(&newest, &copy);
        std::fs::write(
            only.join("latest"),
            newest.file_name().unwrap().to_string_lossy().as_bytes(),
        )
        .unwrap();
        let e = Trainer::from_config(cfg())
            .unwrap()
            .load_checkpoint(&only)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&name), "{name}: {e}");
        // Beside an older good one, resume falls back to it and says why.
        let mut u = Trainer::from_config(cfg()).unwrap();
        let r = u.load_checkpoint(&d).unwrap();
        assert_eq!(r.path, older);
        assert!(r.fallback.as_deref().unwrap_or("").contains(&name), "{r:?}");
        std::fs::write(&f, &good).unwrap();
        let _ = std::fs::remove_dir_all(&only);
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Crafted files that verify their own checksums but lie inside: a non-ASCII checksum in the
/// manifest, and a sampler offset past every sample in the state. Neither panics; the
/// checksum is refused naming the file, and the offset starts the next epoch.
#[test]
fn crafted_manifest_and_sampler_state_do_not_panic() {
    use sha2::{Digest, Sha256};
    let hex = |b: &[u8]| -> String {
        Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    };
    let d = dir("crafted");
    let mut t = Trainer::from_config(TrainConfig { steps: 4, ..cfg() }).unwrap();
    t.train_step(&Corpus::builtin()).unwrap();
    let ck = t.save_checkpoint(&d).unwrap();
    let manifest = ck.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first = m["files"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    m["files"][&first][0] = serde_json::json!("é".repeat(32));
    let text = serde_json::to_vec_pretty(&m).unwrap();
    std::fs::write(&manifest, &text).unwrap();
    std::fs::write(ck.join("manifest.sha256"), hex(&text)).unwrap();
    let mut again = Trainer::from_config(TrainConfig { steps: 4, ..cfg() }).unwrap();
    let e = again.load_checkpoint(&d).unwrap_err().to_string();
    assert!(e.contains("does not match the manifest"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
    // The sampler at an offset no epoch has.
    use pipewright_runtime::data::{Sampler, SamplerPos, Sampling};
    let corpus = Corpus::builtin();
    let mut s = Sampler::new(Sampling::Epochs, 8, 2, 1);
    s.set_position(Some(SamplerPos {
        step: 3,
        epoch: 0,
        offset: usize::MAX,
    }));
    let b = s.batches(&corpus.train, 3, 2).unwrap();
    assert_eq!(b.len(), 2);
    assert_eq!(s.position().unwrap().epoch, 1, "the next epoch");
}

/// `latest` is a name in the directory, not a path: one naming another directory's checkpoint
/// is passed over with a warning. FIFOs in place of `latest` or a weights file, and a manifest
/// naming a file outside its checkpoint, are refused without reading them (no hang).
#[test]
fn latest_is_a_name_and_odd_files_are_refused_without_reading() {
    let d = dir("latest-a");
    let other = dir("latest-b");
    let mut t = Trainer::from_config(cfg()).unwrap();
    let corpus = Corpus::builtin();
    t.train_step(&corpus).unwrap();
    t.save_checkpoint(&d).unwrap();
    t.train_step(&corpus).unwrap();
    let foreign = t.save_checkpoint(&other).unwrap();
    // `latest` pointing outside: the directory's own checkpoint (step 1) is resumed.
    std::fs::write(d.join("latest"), foreign.to_str().unwrap()).unwrap();
    let mut r = Trainer::from_config(cfg()).unwrap();
    let got = r.load_checkpoint(&d).unwrap();
    assert_eq!(got.step, 1);
    assert!(got
        .fallback
        .unwrap()
        .contains("not a checkpoint of this directory"));
    let fifo = |p: &std::path::Path| {
        let _ = std::fs::remove_file(p);
        assert!(std::process::Command::new("mkfifo")
            .arg(p)
            .status()
            .unwrap()
            .success());
    };
    // A FIFO as `latest`: passed over.
    fifo(&d.join("latest"));
    let got = Trainer::from_config(cfg())
        .unwrap()
        .load_checkpoint(&d)
        .unwrap();
    assert_eq!(got.step, 1);
    // A FIFO as the weights of the only checkpoint: refused, naming it.
    let ck = got.path.clone();
    fifo(&ck.join("weights.safetensors"));
    let e = Trainer::from_config(cfg())
        .unwrap()
        .load_checkpoint(&d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no checkpoint to resume"), "{e}");
    let v = match pipewright_runtime::train::store::verify(&ck) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a FIFO verified"),
    };
    assert!(v.contains("is not a regular file"), "{v}");
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(&other);
}
