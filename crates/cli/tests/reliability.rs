//! Operations on a checkpoint directory that must lose nothing: runs started together on one
//! directory (one trains, the others are refused at start), and a resume that has nothing
//! left to train (it says so and writes nothing).

mod common;
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

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .unwrap()
}

fn refused(args: &[&str], want: &str) {
    let o = pw(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Links that never deliver, and plans that cannot fit, are refused before any work with a
/// message naming them (no panic, no `inf s`).
#[test]
fn impossible_links_are_refused_up_front() {
    let d = scratch("links");
    let cluster = |name: &str, defaults: &str| {
        let p = d.join(name);
        std::fs::write(
            &p,
            format!(
                "[defaults]\n{defaults}\n[[devices]]\nname = \"a\"\n[[devices]]\nname = \"b\"\n"
            ),
        )
        .unwrap();
        p.to_str().unwrap().to_string()
    };
    let slow = cluster("slow.toml", "latency = 1e20");
    let never = cluster("never.toml", "latency = 1e308\noverhead = 1e308");
    let tiny = &TINY[..8];
    refused(
        &[
            &[
                "train",
                "--steps",
                "1",
                "--no-checkpoint",
                "--cluster",
                &slow,
            ][..],
            tiny,
        ]
        .concat(),
        "beyond the peer timeout",
    );
    refused(
        &[
            "simulate",
            "--stages",
            "2",
            "--cost-f",
            "1",
            "--cluster",
            &never,
        ],
        "messages on it never arrive",
    );
    let geo = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/geo20_skippipe.toml"
    ))
    .unwrap();
    let zero = d.join("geo-zero.toml");
    let mut crafted = String::new();
    let mut done = false;
    for line in geo.lines() {
        if !done && line.trim_start().starts_with("bandwidth") {
            crafted.push_str("bandwidth = 1e-300\n");
            done = true;
        } else {
            crafted.push_str(line);
            crafted.push('\n');
        }
    }
    std::fs::write(&zero, crafted).unwrap();
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/llama500m_skippipe.toml"
    );
    refused(
        &[
            "skip-plan",
            "--profile",
            profile,
            "--cluster",
            zero.to_str().unwrap(),
            "--stages",
            "6",
            "--skip",
            "1",
            "--moves",
            "50",
            "--polish-moves",
            "50",
        ],
        "too slow for any time to be finite",
    );
    // Device memory in bytes binds skip-plan as it binds simulate and plan.
    let small = d.join("geo-mem0.toml");
    std::fs::write(
        &small,
        geo.replacen("[defaults]\n", "[defaults]\nmemory = 0\n", 1),
    )
    .unwrap();
    refused(
        &[
            "skip-plan",
            "--profile",
            profile,
            "--cluster",
            small.to_str().unwrap(),
            "--stages",
            "6",
            "--skip",
            "1",
            "--moves",
            "50",
            "--polish-moves",
            "50",
        ],
        "does not fit device memory",
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// An output into a missing directory is refused at start, not after the whole run.
#[test]
fn outputs_into_missing_directories_are_refused_at_start() {
    let d = scratch("outputs");
    let missing = d.join("no-such-dir/t.json");
    let args = [
        "train",
        "--steps",
        "1",
        "--no-checkpoint",
        "--trace",
        missing.to_str().unwrap(),
    ];
    refused(
        &[&args[..], &TINY[..8]].concat(),
        "does not exist (create it first)",
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `eval` with its defaults works on the default 2-stage checkpoint, where no stage may be left
/// out (each holds the embedding or the head): it reports all stages and no impossible subset.
#[test]
fn eval_defaults_fit_the_checkpoints_plan() {
    let d = scratch("eval");
    let ck = d.join("ck");
    let o = train(&["--steps", "1", "--checkpoint-dir", ck.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = pw(&[
        "eval",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--batches",
        "1",
    ]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("all stages:") && !out.contains("keep "),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// SIGTERM to a run of worker threads (a time limit, `kill`): it stops at the next step
/// boundary, writes that step's checkpoint and exits 0; `--resume` continues from it.
#[test]
fn sigterm_stops_a_threads_run_at_a_step_with_its_checkpoint() {
    sigterm_stops_at_a_step("threads", 2, libc::SIGTERM, false);
}

/// The same for the worker processes pipewright starts under mpirun by default: the signal
/// to the command the user ran reaches every rank as a stop request.
#[cfg(feature = "mpi")]
#[test]
fn sigterm_stops_a_run_of_worker_processes_at_a_step_with_its_checkpoint() {
    sigterm_stops_at_a_step("auto", 5, libc::SIGTERM, false);
}

/// The same when the signal reaches the whole process group, as `timeout`'s SIGTERM, a batch
/// script's stop or a terminal's Ctrl-C (SIGINT) do: the mpirun that pipewright starts is not
/// hit, the ranks stop at a step with its checkpoint, and the run exits 0.
#[cfg(feature = "mpi")]
#[test]
fn a_stop_sent_to_the_whole_process_group_exits_0_with_a_checkpoint() {
    sigterm_stops_at_a_step("auto", 5, libc::SIGTERM, true);
    sigterm_stops_at_a_step("auto", 5, libc::SIGINT, true);
}

fn sigterm_stops_at_a_step(transport: &str, after_s: u64, sig: i32, group: bool) {
    let d = scratch(&format!("sigterm-{transport}-{sig}-{group}"));
    let ck = d.join("ck");
    let mut cmd = train(&[
        "--steps",
        "100000",
        "--transport",
        transport,
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]);
    if group {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
    let job = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(after_s));
    let pid = job.id() as i32;
    // SAFETY: signals the child this test started (or its process group, which it leads).
    unsafe { libc::kill(if group { -pid } else { pid }, sig) };
    let o = job.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let at = common::stopped_at(&err);
    assert!(
        listing(&ck).contains(&format!("step-{at:06}")),
        "{:?}",
        listing(&ck)
    );
    let target = (at + 1).to_string();
    let o = train(&[
        "--steps",
        &target,
        "--resume",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains(&format!("at step {at}")),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Without a terminal (stderr to a pipe, as under nohup or Slurm), a timestamped line every
/// `--log-every` steps and at the last.
#[test]
fn batch_jobs_get_a_timestamped_line_every_few_steps() {
    let o = train(&["--steps", "7", "--log-every", "3", "--no-checkpoint"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let steps: Vec<&str> = err
        .lines()
        .filter(|l| l.len() > 20 && l.as_bytes()[4] == b'-' && l[19..].starts_with(" step "))
        .filter_map(|l| l[20..].split_whitespace().nth(1))
        .collect();
    assert_eq!(steps, vec!["3/7", "6/7", "7/7"], "{err}");
    // Each line has the model FLOPs utilisation, a percentage. This model is tiny, and to
    // one decimal a slow step (the first, on a busy machine) can read 0.0%.
    let mfu: Vec<f64> = err
        .lines()
        .filter_map(|l| l.split(" MFU ").nth(1))
        .filter_map(|rest| rest.split('%').next()?.parse().ok())
        .collect();
    assert_eq!(mfu.len(), 3, "{err}");
    assert!(mfu.iter().all(|m| (0.0..150.0).contains(m)), "{mfu:?}");
    assert!(mfu.iter().any(|m| *m > 0.0), "{mfu:?}");
}

/// `--print-config` writes the resolved settings as TOML; `--config` on it trains the same run,
/// loss for loss.
#[test]
fn a_printed_config_reproduces_the_run() {
    let d = scratch("print-config");
    let o = train(&["--steps", "4", "--print-config"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let toml = d.join("run.toml");
    std::fs::write(&toml, &o.stdout).unwrap();
    let losses = |m: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(m)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].to_string())
            .collect()
    };
    let (m1, m2) = (d.join("m1.jsonl"), d.join("m2.jsonl"));
    let by_flags = train(&[
        "--steps",
        "4",
        "--no-checkpoint",
        "--metrics",
        m1.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(by_flags.status.success());
    let by_file = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args([
            "train",
            "--config",
            toml.to_str().unwrap(),
            "--no-checkpoint",
            "--metrics",
        ])
        .arg(&m2)
        .output()
        .unwrap();
    assert!(
        by_file.status.success(),
        "{}",
        String::from_utf8_lossy(&by_file.stderr)
    );
    assert_eq!(losses(&m1), losses(&m2));
    assert_eq!(losses(&m1).len(), 5, "the starting row and 4 steps");
    let _ = std::fs::remove_dir_all(&d);
}

/// Every `train` setting has a key in the `[run]` table: a config printed with run flags
/// trains the same run with no flags, and a flag given on the command line wins over its key.
#[test]
fn run_settings_round_trip_through_the_run_table() {
    let d = scratch("run-table");
    let m = d.join("m.jsonl");
    let flags = [
        &TINY[..12],
        &[
            "--steps",
            "4",
            "--stages",
            "1",
            "--global-batch",
            "6",
            "--eval-every",
            "2",
            "--no-checkpoint",
            "--metrics",
            m.to_str().unwrap(),
        ],
    ]
    .concat();
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .arg("train")
        .args(&flags)
        .arg("--print-config")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    for key in [
        "[run]",
        "global_batch = 6",
        "eval_every = 2",
        "no_checkpoint = true",
        "microbatches = 6",
    ] {
        assert!(text.contains(key), "{key} missing from\n{text}");
    }
    let toml = d.join("run.toml");
    std::fs::write(&toml, &text).unwrap();
    let rows = |args: &[&str]| -> Vec<String> {
        let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .arg("train")
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(&m).unwrap();
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!("{} {} {}", v["step"], v["loss"], v["val_loss"])
            })
            .collect()
    };
    let by_flags = rows(&flags);
    let by_file = rows(&["--config", toml.to_str().unwrap()]);
    assert_eq!(by_flags, by_file);
    let vals = |r: &[String]| r.iter().filter(|l| !l.ends_with(" null")).count();
    assert_eq!(
        vals(&by_file),
        3,
        "validation at steps 0, 2 and 4: {by_file:?}"
    );
    // The flag wins over the file's eval_every = 2: validation at steps 0, 3 and 4.
    let over = rows(&["--config", toml.to_str().unwrap(), "--eval-every", "3"]);
    assert_eq!(vals(&over), 3);
    assert!(
        over.iter()
            .any(|l| l.starts_with("3 ") && !l.ends_with(" null")),
        "{over:?}"
    );
    // An unknown key is named with its line.
    std::fs::write(&toml, "[run]\nevl_every = 2\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--config", toml.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("line 2") && err.contains("evl_every"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A checkpoint keeps the run's `[run]` settings: `--resume` without `--config` continues
/// with them (here the metrics file and the validation cadence), with no flag repeated.
#[test]
fn a_resume_continues_with_the_checkpoints_run_settings() {
    let d = scratch("resume-run-table");
    let (ck, m) = (d.join("ck"), d.join("m.jsonl"));
    let o = train(&[
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--metrics",
        m.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args([
            "train",
            "--resume",
            "--steps",
            "6",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        [0, 1, 2, 3, 4, 5, 6],
        "the same metrics file, continued"
    );
    let validated: Vec<u64> = rows
        .iter()
        .filter(|r| r["val_loss"].is_number())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        validated,
        [0, 2, 4, 6],
        "every 2 steps, as the first run did"
    );
    // A run from a plan file resumes under another plan named by flags: the checkpoint's
    // plan file gives way instead of conflicting with them.
    let plan = d.join("plan.json");
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args([
            "schedule",
            "--schedule",
            "1f1b",
            "--stages",
            "2",
            "--microbatches",
            "2",
        ])
        .args(["--layer-blocks", "4", "--format", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(&plan, &o.stdout).unwrap();
    let ck2 = d.join("ck2");
    let base = [&TINY[..12], &["--checkpoint-dir", ck2.to_str().unwrap()]].concat();
    let first = [
        &base[..],
        &["--plan", plan.to_str().unwrap(), "--steps", "2"],
    ]
    .concat();
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .arg("train")
        .args(&first)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(["train", "--resume", "--stages", "1", "--steps", "3"])
        .args(["--checkpoint-dir", ck2.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("1 stage"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `--tensorboard DIR` writes an event file there (its records are checked in the unit tests
/// and read by TensorBoard's own reader by hand: docs/training.md); a file in the way is bad
/// input, named, before any step.
#[test]
fn tensorboard_event_files_are_written_and_a_bad_directory_is_named() {
    let d = scratch("tensorboard");
    let tb = d.join("tb");
    let o = train(&[
        "--steps",
        "2",
        "--no-checkpoint",
        "--tensorboard",
        tb.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files: Vec<_> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    // The version record, then the starting row and 2 steps: at least 4 records.
    assert!(std::fs::metadata(&files[0]).unwrap().len() > 200);
    let blocker = d.join("a-file");
    std::fs::write(&blocker, "x").unwrap();
    let o = train(&[
        "--steps",
        "2",
        "--no-checkpoint",
        "--tensorboard",
        blocker.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--tensorboard") && err.contains("a-file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A run that fails (here it diverges) leaves its last error beside its checkpoints, with a
/// timestamp; bad input writes nothing there.
#[test]
fn a_failed_run_leaves_its_last_error_beside_the_checkpoints() {
    let d = scratch("last-error");
    let ck = d.join("ck");
    let o = train(&[
        "--steps",
        "3",
        "--lr",
        "1e30",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let last = std::fs::read_to_string(ck.join("last-error.txt")).unwrap();
    assert!(last.contains("loss is not finite"), "{last}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A FIFO or a directory given as a plan, profile or cluster file is refused without reading
/// it (a read would block for ever).
#[test]
fn fifos_and_directories_as_input_files_are_refused() {
    let d = scratch("fifo-input");
    let fifo = d.join("plan.csv");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let f = fifo.to_str().unwrap();
    let dir = d.to_str().unwrap();
    for args in [
        vec!["schedule", "--plan", f],
        vec!["validate", f],
        vec!["simulate", "--profile", f],
        vec!["simulate", "--cost-f", "1", "--cluster", dir],
        vec!["train", "--config", f],
        vec!["train", "--data", f, "--steps", "1"],
        vec!["profile", "--model", f],
    ] {
        refused(&args, "not a regular file");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A fresh run into a directory holding an earlier run's checkpoints is refused (exit 2,
/// nothing touched); `--overwrite` replaces them, and `--resume` continues them.
#[test]
fn a_fresh_run_does_not_mix_with_an_earlier_runs_checkpoints() {
    let dir = scratch("fresh");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let run = |extra: &[&str]| {
        train(&[&["--checkpoint-dir", ck_s][..], extra].concat())
            .output()
            .unwrap()
    };
    assert!(run(&["--steps", "4"]).status.success());
    let before = listing(&ck);
    let o = run(&["--steps", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("earlier run's checkpoints (the newest at step 4)"),
        "{err}"
    );
    assert_eq!(listing(&ck), before, "a refused run touched the directory");
    let o = run(&["--steps", "2", "--overwrite"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(listing(&ck).iter().any(|n| n == "step-000002"));
    assert!(
        !listing(&ck).iter().any(|n| n == "step-000004"),
        "{:?}",
        listing(&ck)
    );
    assert!(run(&["--steps", "3", "--resume"]).status.success());
}

/// The default checkpoint directory is a scratch place: a fresh run there replaces what an
/// earlier run left, and says so (so the README's first command can be run again).
#[test]
fn the_default_checkpoint_directory_is_replaced_with_a_note() {
    let dir = scratch("default-dir");
    let run = |steps: &str| {
        train(&["--steps", steps])
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    assert!(run("3").status.success());
    let o = run("2");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("note: replacing the checkpoints an earlier run left in checkpoints (the newest at step 3)"), "{err}");
    assert_eq!(
        listing(&dir.join("checkpoints")),
        [".lock", "latest", "step-000002"]
    );
}

/// A full disk while writing a checkpoint: the run fails (exit 1, not the bad-input 2), says
/// which file, and removes its partial checkpoint instead of leaving it to fill the disk.
/// Needs a small tmpfs (root); skipped, saying so, where it cannot be mounted.
#[test]
fn a_full_disk_fails_the_run_and_leaves_no_partial_checkpoint() {
    let dir = scratch("enospc");
    let fs = dir.join("fs");
    std::fs::create_dir_all(&fs).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&fs)
        .output()
        .is_ok_and(|o| o.status.success());
    if !mounted {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return;
    }
    let ck = fs.join("ck");
    let o = train(&["--steps", "2", "--checkpoint-dir", ck.to_str().unwrap()])
        .output()
        .unwrap();
    let names = listing(&ck);
    let _ = Command::new("umount").arg(&fs).status();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!names.iter().any(|n| n.ends_with(".partial")), "{names:?}");
}

/// A tokenizer whose ids are sparse (3 tokens, the largest id 5000) is bounded by its largest
/// id, not its count: train and generate refuse it against a 256-token model (they panicked in
/// the embedding's gather), naming the id; a model that holds it trains, and so does the
/// built-in model that nobody sized (its embedding takes the tokenizer's 5001 rows).
#[test]
fn a_sparse_tokenizer_is_bounded_by_its_largest_id() {
    let d = scratch("sparse-tok");
    let tok = d.join("tokenizer.json");
    std::fs::write(
        &tok,
        r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 5000},
            "unk_token": "[UNK]"}}"#,
    )
    .unwrap();
    let text = d.join("t.txt");
    std::fs::write(&text, "a b zz ".repeat(400)).unwrap();
    let (tok, text) = (tok.to_str().unwrap(), text.to_str().unwrap());
    let run = [
        "--tokenizer",
        tok,
        "--data",
        text,
        "--steps",
        "1",
        "--no-checkpoint",
    ];
    let model = d.join("m.toml");
    std::fs::write(
        &model,
        "family = \"llama\"\nvocab = 256\nd_model = 16\nheads = 2\nlayers = 1\nseq_len = 16\n",
    )
    .unwrap();
    let m = model.to_str().unwrap();
    refused(
        &[&["train", "--model", m][..], &run].concat(),
        "ids reach 5000, past the model's vocabulary of 256",
    );
    let o = pw(&[&["train"][..], &TINY[..8], &run].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    refused(
        &[
            "generate",
            "--model",
            m,
            "--tokenizer",
            tok,
            "--prompt",
            "a b",
        ],
        "ids reach 5000",
    );
    // A vocabulary of 5001 holds every id.
    std::fs::write(
        &model,
        "family = \"llama\"\nvocab = 5001\nd_model = 16\nheads = 2\nlayers = 1\nseq_len = 16\n",
    )
    .unwrap();
    let o = pw(&[&["train", "--model", m][..], &run].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_dir_all(&d);
}

/// A tokenize killed (SIGKILL) inside its first batch, as soon as its first shard is on disk,
/// leaves a manifest that says so: training refuses the partial shards, and the same command
/// run again resumes to shards byte-identical to an uninterrupted run's.
#[test]
fn a_tokenize_killed_in_its_first_batch_resumes_to_the_same_shards() {
    let d = scratch("tokenize-kill");
    let text = d.join("corpus.txt");
    let body: String = (0..60_000)
        .map(|i| format!("line {i} of the corpus\n"))
        .collect();
    std::fs::write(&text, body).unwrap();
    let args = |out: &std::path::Path| -> Vec<String> {
        [
            "tokenize",
            "--tokenizer",
            "bytes",
            "--shard-tokens",
            "20000",
            "--data",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            text.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ])
        .collect()
    };
    let whole = d.join("whole");
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args(&whole))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let part = d.join("part");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args(&part))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first = part.join("train_000000.bin");
    let t0 = std::time::Instant::now();
    while !first.exists() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let manifest = std::fs::read_to_string(part.join("tokenize.json"))
        .expect("a manifest beside the first shard");
    assert!(manifest.contains("\"complete\": false"), "{manifest}");
    refused(
        &[
            "train",
            "--data",
            part.to_str().unwrap(),
            "--steps",
            "1",
            "--no-checkpoint",
        ],
        "its tokenize has not finished",
    );
    let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args(&part))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files = |dir: &std::path::Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (want, got) = (files(&whole), files(&part));
    assert!(want.len() > 20, "{} shards", want.len());
    assert!(got == want, "{} shards against {}", got.len(), want.len());
    let _ = std::fs::remove_dir_all(&d);
}

/// `skip-plan` depends on its inputs, seed and move budgets alone: the same command beside two
/// busy loops (every core taken) writes the same plan, byte for byte, and says its time limit
/// did not cut it.
#[test]
fn skip_plan_gives_the_same_plan_beside_a_busy_cpu() {
    let d = scratch("skip-busy");
    let ex = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/");
    let run = |out: &std::path::Path| -> serde_json::Value {
        let o = pw(&[
            "skip-plan",
            "--profile",
            &format!("{ex}llama500m_skippipe.toml"),
            "--cluster",
            &format!("{ex}geo20_skippipe.toml"),
            "--stages",
            "6",
            "--skip",
            "0.33",
            "--moves",
            "3000",
            "--polish-moves",
            "300",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let quiet = run(&d.join("quiet.json"));
    let loaded = {
        let _busy = common::Busy::cores(2);
        run(&d.join("busy.json"))
    };
    assert_eq!(quiet["time_limit_hit"], false);
    assert_eq!(loaded["time_limit_hit"], false);
    assert_eq!(quiet["skip_time"], loaded["skip_time"]);
    assert_eq!(quiet["moves"], loaded["moves"]);
    assert!(
        std::fs::read(d.join("quiet.json")).unwrap() == std::fs::read(d.join("busy.json")).unwrap(),
        "the plan files differ"
    );
    let _ = std::fs::remove_dir_all(&d);
}
