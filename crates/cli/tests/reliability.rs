//! Operations on a checkpoint directory that must lose nothing: runs started together on one
//! directory (one trains, the others are refused at start), and a resume that has nothing
//! left to train (it says so and writes nothing).

use std::process::{Command, Output, Stdio};

const TINY: [&str; 16] = [
    "--d-model",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--rows",
    "2",
    "--eval-batches",
    "1",
    "--microbatches",
    "2",
    "--stages",
    "2",
];

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pw-rel-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn train(extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.arg("train").args(TINY).args(extra);
    c
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn runs_sharing_a_checkpoint_directory_one_trains_the_others_are_refused() {
    let d = scratch("shared");
    let ck = d.join("ck");
    let runs: Vec<_> = (0..3)
        .map(|i| {
            let m = d.join(format!("m{i}.jsonl"));
            let seed = i.to_string();
            train(&["--steps", "12", "--checkpoint-every", "1", "--seed", &seed])
                .args([
                    "--checkpoint-dir",
                    ck.to_str().unwrap(),
                    "--metrics",
                    m.to_str().unwrap(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = runs
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let codes: Vec<i32> = outs.iter().map(|o| o.status.code().unwrap()).collect();
    let mut sorted = codes.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 2, 2], "{codes:?}");
    for (i, o) in outs
        .iter()
        .enumerate()
        .filter(|(_, o)| o.status.code() == Some(2))
    {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("in use by the run of process"), "{err}");
        let m = d.join(format!("m{i}.jsonl"));
        assert!(!m.exists(), "a refused run wrote metrics");
    }
    assert!(
        listing(&ck).contains(&"step-000012".to_string()),
        "{:?}",
        listing(&ck)
    );
    // Nothing left to train: said, and nothing written.
    let before = listing(&ck);
    let o = train(&[
        "--steps",
        "10",
        "--resume",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("at step 12, at or past this run's last step 10"),
        "{err}"
    );
    assert_eq!(listing(&ck), before);
    let _ = std::fs::remove_dir_all(&d);
}
