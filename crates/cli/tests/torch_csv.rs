//! `--format torch-csv` against PyTorch itself: each exported schedule's cells parse with
//! torch's `_Action.from_str` (what its `_load_csv` calls per cell) and pass
//! `_validate_schedule` (every stage's F and B, or I and W, once per micro-batch, in order).
//! Runs where `python3 -c "import torch"` works; says it is skipped elsewhere.

use std::process::{Command, Output};

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .expect("runs")
}

const CHECK: &str = r#"
import csv, sys
from torch.distributed.pipelining.schedules import _Action, _validate_schedule
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
actions = {rank: [_Action.from_str(c) for c in row] for rank, row in enumerate(rows)}
print(dict(sorted(_validate_schedule(actions, len(rows), int(sys.argv[2]), int(sys.argv[3])).items())))
"#;

fn torch() -> Option<String> {
    let python = std::env::var("PIPEWRIGHT_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch.distributed.pipelining"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

/// `kind` on 4 ranks and 8 micro-batches exported as torch-csv, then read and validated by
/// torch with `stages` stages: torch's stage -> rank map, or a failure naming `kind`.
fn torch_reads(python: &str, dir: &std::path::Path, kind: &str, stages: usize) -> String {
    let args = ["schedule", "--schedule", kind, "--stages", "4"];
    let o = pw(&[&args[..], &["--microbatches", "8", "--format", "torch-csv"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = dir.join(format!("{kind}.csv"));
    std::fs::write(&f, &o.stdout).unwrap();
    let r = Command::new(python)
        .args(["-c", CHECK, f.to_str().unwrap(), &stages.to_string(), "8"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{kind}: {err}");
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

/// A fresh directory for the exports, or None (said) where torch is not importable.
fn setup(tag: &str) -> Option<(String, std::path::PathBuf)> {
    let Some(python) = torch() else {
        eprintln!("skipped: torch is not importable (set PIPEWRIGHT_TORCH_PYTHON to a Python that has it)");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("pw-torch-csv-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Some((python, dir))
}

#[test]
fn torch_accepts_1f1b_and_zbh1_exports() {
    let Some((python, dir)) = setup("single") else {
        return;
    };
    for kind in ["1f1b", "zbh1", "gpipe"] {
        // Stage s on rank s.
        let map = torch_reads(&python, &dir, kind, 4);
        assert_eq!(map, "{0: 0, 1: 1, 2: 2, 3: 3}", "{kind}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The multi-stage exports, two stages a rank (DualPipeV's overlapped pairs included), parse
/// and validate in torch with each stage on the rank pipewright put it on.
#[test]
fn torch_accepts_the_multi_stage_exports() {
    let Some((python, dir)) = setup("multi") else {
        return;
    };
    let looped = "{0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}";
    let v = "{0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}";
    for (kind, want) in [
        ("interleaved", looped),
        ("looped-bfs", looped),
        ("interleaved-zb", looped),
        ("zbv", v),
        ("dualpipev", v),
    ] {
        assert_eq!(torch_reads(&python, &dir, kind, 8), want, "{kind}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
