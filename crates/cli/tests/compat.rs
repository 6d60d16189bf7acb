//! Checkpoints written by earlier binaries still resume and evaluate.

use std::path::Path;
use std::process::{Command, Output};

mod common;

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        match e.file_type().unwrap().is_dir() {
            true => copy_dir(&e.path(), &dest),
            false => drop(std::fs::copy(e.path(), &dest).unwrap()),
        }
    }
}

/// `fixtures/checkpoint-2026-12-07`: 4 steps of the tiny model (2 stages, 1F1B), written by
/// the binary of 2026-12-07 before the data wing, the typed model errors and the validated
/// plans (`train --d-model 16 --heads 2 --layers 2 --seq-len 16 --stages 2 --microbatches 2
/// --rows 2 --steps 4 --checkpoint-every 2 --keep 1 --eval-every 2`). Its settings, plan and
/// `[run]` table are read back as they were written.
#[test]
fn a_checkpoint_of_2026_12_07_resumes_and_evaluates() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-2026-12-07");
    let ck = common::fresh_dir("compat").join("ck");
    copy_dir(&fixture, &ck);
    let ck = ck.to_str().unwrap();
    let o = pw(&[
        "train",
        "--resume",
        "--checkpoint-dir",
        ck,
        "--steps",
        "6",
        "--transport",
        "threads",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("step 4"), "the resume names its step: {err}");
    assert!(Path::new(ck).join("step-000006").is_dir(), "{err}");
    let o = pw(&["eval", "--checkpoint-dir", ck]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("val loss"), "{out}");
}
