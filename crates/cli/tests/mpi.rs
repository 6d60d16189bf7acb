//! Worker processes over MPI, through the real binary under `mpirun`: exact gradients against
//! single-worker training, a refused rank count, and a rank killed mid-run (the others exit in
//! bounded time naming it; the last checkpoint resumes). Needs Open MPI (`scripts/install-deps` installs
//! it); without `mpirun` these tests fail rather than pass silently.
#![cfg(feature = "mpi")]

mod common;
use common::{FREEZE_EVERY_3, TINY, TINY_L4};
use pipewright_core::plan::ir::Plan;
use pipewright_runtime::data::Corpus;
use pipewright_runtime::train::{PlainTrainer, TrainConfig, Trainer};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The MPI jobs run one at a time: each already oversubscribes the machine's cores.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_JOB.lock().unwrap_or_else(|e| e.into_inner())
}

fn mpirun(np: usize) -> Command {
    let ok = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "mpirun not found: run scripts/install-deps, which installs Open MPI"
    );
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ])
    .arg(env!("CARGO_BIN_EXE_pipewright"));
    c
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 3 short steps (with the tiny model).
const SHORT: [&str; 8] = [
    "--steps",
    "3",
    "--microbatches",
    "4",
    "--eval-every",
    "3",
    "--eval-batches",
    "1",
];

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The config and plan a checkpoint was written with, and its parameters.
fn checkpoint_params(ck: &Path) -> (TrainConfig, Plan, Vec<f32>) {
    let name = std::fs::read_to_string(ck.join("latest")).unwrap();
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join(name.trim()).join("state.json")).unwrap(),
    )
    .unwrap();
    let cfg: TrainConfig = serde_json::from_value(state["config"].clone()).unwrap();
    let plan: Plan = serde_json::from_value(state["plan"].clone()).unwrap();
    let mut t = Trainer::new(cfg.clone(), plan.clone()).unwrap();
    t.load_checkpoint(ck).unwrap();
    (cfg, plan, t.flat_params().unwrap())
}

/// The largest difference between two parameter vectors.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

fn exact_under_mpi(np: usize, flags: &[&str]) {
    exact_within(np, flags, 1e-5);
}

/// `np` ranks training 3 steps with `flags` end with single-worker CPU training's parameters
/// within `tol`.
fn exact_within(np: usize, flags: &[&str], tol: f32) {
    let d = dir(&format!("exact{np}"));
    let ck = d.join("ck");
    let o = mpirun(np)
        .args(["train", "--transport", "mpi"])
        .args(TINY)
        .args(SHORT)
        .args(flags)
        .arg("--checkpoint-dir")
        .arg(&ck)
        .output()
        .unwrap();
    let no_device = text(&o).contains("device did not start");
    if no_device && std::env::var_os("PIPEWRIGHT_REQUIRE_WGPU").is_none() {
        eprintln!("no wgpu device here, comparison skipped: {}", text(&o));
        return;
    }
    assert!(o.status.success(), "{np} ranks: {}", text(&o));
    let (cfg, plan, got) = checkpoint_params(&ck);
    assert_eq!(plan.num_workers(), np);
    assert_eq!(cfg.steps, 3);
    let corpus = Corpus::builtin();
    let mut plain = PlainTrainer::new(cfg, &plan);
    for _ in 0..3 {
        plain.train_step(&corpus);
    }
    let want = plain.flat_params();
    assert_eq!(got.len(), want.len());
    let worst = max_diff(&got, &want);
    assert!(worst <= tol, "{np} ranks {flags:?}: max |diff| {worst}");
}

#[test]
fn two_ranks_two_stages_equal_single_worker_training() {
    let _one = one_at_a_time();
    exact_under_mpi(2, &["--schedule", "1f1b", "--stages", "2"]);
}

#[test]
fn four_ranks_two_stages_two_replicas_equal_single_worker_training() {
    let _one = one_at_a_time();
    exact_under_mpi(
        4,
        &["--schedule", "zbh1", "--stages", "2", "--replicas", "2"],
    );
}

/// torch's looped BFS, interleaved zero bubble and DualPipeV (2 chunks a rank; DualPipeV with
/// its overlapped pairs) over 2 processes.
#[test]
fn two_ranks_looped_bfs_interleaved_zb_and_dualpipev_equal_single_worker_training() {
    let _one = one_at_a_time();
    for schedule in ["looped-bfs", "interleaved-zb", "dualpipev"] {
        exact_under_mpi(
            2,
            &["--schedule", schedule, "--stages", "2", "--chunks", "2"],
        );
    }
}

/// Two ranks on the wgpu device (in CI Mesa's lavapipe), activations and gradients staged
/// through host memory: the CPU's single-worker training within 1e-4.
#[test]
fn two_ranks_on_wgpu_equal_single_worker_cpu_training() {
    let _one = one_at_a_time();
    let flags = ["--schedule", "1f1b", "--stages", "2", "--device", "wgpu"];
    exact_within(2, &flags, 1e-4);
}

/// SkipPipe routes over two data nodes: stages share pools of ranks, so several stages have the
/// same replica group (each rank must split the world once per distinct group, member or not,
/// or the ranks wait on each other for ever), and every rank trains rank 0's searched plan.
#[test]
fn six_ranks_skip_routes_over_two_data_nodes_equal_single_worker_training() {
    let _one = one_at_a_time();
    exact_under_mpi(6, &["--skip", "1", "--stages", "3", "--replicas", "2"]);
}

#[test]
fn a_rank_count_unlike_the_plan_is_refused_once() {
    let _one = one_at_a_time();
    let o = mpirun(3)
        .args([
            "train",
            "--transport",
            "mpi",
            "--stages",
            "2",
            "--no-checkpoint",
        ])
        .args(TINY)
        .args(SHORT)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    let ours: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(ours.len(), 1, "{err}");
    assert!(
        ours[0].contains("the plan has 2 workers but MPI started 3 ranks"),
        "{err}"
    );
}

/// The pid of `rank` among mpirun's children.
fn rank_pid(launcher: &Child, rank: usize) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    let kids =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", launcher.id())).ok()?;
    kids.split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == want.as_bytes()))
        })
}

#[test]
fn a_killed_rank_is_named_within_the_bound_and_the_checkpoint_resumes() {
    let _one = one_at_a_time();
    let d = dir("kill");
    let ck = d.join("ck");
    let timeout = 5;
    let mut job = mpirun(2)
        .args(["train", "--transport", "mpi", "--stages", "2"])
        .args(TINY)
        .args(["--steps", "100000", "--checkpoint-every", "2"])
        .args(["--peer-timeout", &timeout.to_string()])
        .arg("--checkpoint-dir")
        .arg(&ck)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a complete checkpoint, then kill rank 1.
    let t0 = Instant::now();
    while !ck.join("latest").exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "no checkpoint");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = rank_pid(&job, 1).expect("rank 1 is a child of mpirun");
    let killed = Instant::now();
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
    let bound = Duration::from_secs(timeout + 10);
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if killed.elapsed() > bound {
            let _ = job.kill();
            panic!("the job outlived rank 1 by more than {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = job.wait_with_output().unwrap();
    let all = text(&o);
    assert!(!status.success());
    // Rank 0 says what it was waiting for, which names rank 1 (a message from it, or a
    // collective with it). If it was computing when the launcher stopped it, it says so, and
    // the launcher's own line names the rank that died.
    let ours = all.lines().find(|l| l.contains("rank 0:")).unwrap_or("");
    let named = ours.contains("from rank 1") || ours.contains("ranks [0, 1]");
    let computing = ours.contains("while computing") && all.contains("process rank 1");
    assert!(named || computing, "rank 0 does not name rank 1: {all}");
    assert!(!all.contains("panicked"), "{all}");
    // The last complete checkpoint loads and training resumes from it.
    let name = std::fs::read_to_string(ck.join("latest")).unwrap();
    let step: u64 = name.trim().trim_start_matches("step-").parse().unwrap();
    assert!(step >= 2);
    let o = mpirun(2)
        .args(["train", "--transport", "mpi", "--stages", "2", "--resume"])
        .args(TINY)
        .args(["--steps", &(step + 2).to_string()])
        .arg("--checkpoint-dir")
        .arg(&ck)
        .output()
        .unwrap();
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(all.contains(&format!("at step {step}")), "{all}");
}

#[test]
fn a_switch_of_plan_moves_state_between_processes_exactly() {
    let _one = one_at_a_time();
    // 2 stages x 1 replica, then 1 stage x 2 replicas after step 2: the layers and AdamW
    // state move between the ranks; the end result equals training that re-plans in threads.
    let d = dir("switch");
    let sched = |args: &[&str], name: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["schedule", "--format", "json", "--layers", "4"])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let p = d.join(name);
        std::fs::write(&p, &o.stdout).unwrap();
        p
    };
    let first = sched(
        &["--schedule", "1f1b", "--stages", "2", "--microbatches", "4"],
        "a.json",
    );
    let second = sched(
        &[
            "--schedule",
            "1f1b",
            "--stages",
            "1",
            "--replicas",
            "2",
            "--microbatches",
            "2",
        ],
        "b.json",
    );
    let switch = format!("2:{}", second.display());
    let run = |launcher: Option<usize>, ck: &Path| {
        let mut c = match launcher {
            Some(np) => {
                let mut c = mpirun(np);
                c.args(["train", "--transport", "mpi"]);
                c
            }
            None => {
                let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
                c.arg("train");
                c
            }
        };
        let o = c
            .arg("--plan")
            .arg(&first)
            .args(["--switch-plan", &switch])
            .args(TINY)
            .args(["--steps", "4", "--eval-batches", "1"])
            .arg("--checkpoint-dir")
            .arg(ck)
            .output()
            .unwrap();
        let all = text(&o);
        assert!(o.status.success(), "{all}");
        assert!(all.contains("step 2: re-planned"), "{all}");
        checkpoint_params(ck).2
    };
    let mpi = run(Some(2), &d.join("ck-mpi"));
    let threads = run(None, &d.join("ck-threads"));
    let worst = max_diff(&mpi, &threads);
    assert!(worst <= 1e-5, "max |diff| {worst}");
}

/// Elastic freezing over worker processes: every rank takes the same freeze decisions (the
/// layer gradient norms are gathered to all), re-plans in step, and freed ranks join as
/// replicas (a layout under MPI uses every rank); the frozen count resumes from the checkpoint.
#[test]
fn elastic_freezing_under_mpi_turns_freed_ranks_into_replicas() {
    let _one = one_at_a_time();
    let d = dir("elastic");
    let m = d.join("m.jsonl");
    let ck = d.join("ck");
    let run = |steps: &str, resume: bool| {
        let mut c = mpirun(4);
        c.args([
            "train",
            "--transport",
            "mpi",
            "--stages",
            "4",
            "--microbatches",
            "8",
        ])
        .args(["--steps", steps, "--eval-every", "3", "--eval-batches", "2"])
        .args(FREEZE_EVERY_3)
        .args(["--elastic", "--cache-budget", "1M"])
        .args(TINY_L4)
        .arg("--metrics")
        .arg(&m)
        .arg("--checkpoint-dir")
        .arg(&ck);
        if resume {
            c.arg("--resume");
        }
        let o = c.output().unwrap();
        let all = text(&o);
        assert!(o.status.success(), "{all}");
        all
    };
    let all = run("10", false);
    // Rank 0 alone reports each transition.
    assert_eq!(
        all.matches("froze layer blocks 0-1 (0 before)").count(),
        1,
        "{all}"
    );
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let max = |k: &str| rows.iter().filter_map(|r| r[k].as_u64()).max().unwrap();
    let min = |k: &str| rows.iter().filter_map(|r| r[k].as_u64()).min().unwrap();
    assert!(max("frozen_layers") >= 2, "{all}");
    assert!(min("stages") < 4 && max("replicas") >= 2, "{all}");
    let vals: Vec<f64> = rows.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert!(vals.last().unwrap() < &vals[0], "{vals:?}");
    let all = run("11", true);
    assert!(all.contains("frozen again on"), "{all}");
    let _ = std::fs::remove_dir_all(&d);
}

/// `--freeze critical` over MPI: the blocks each step ran with frozen, whole or by weight only
/// (the metrics rows say which), and plain training that leaves the same blocks out of the
/// optimizer at the same steps end with the same parameters, with B/W split and without.
#[test]
fn critical_freezing_under_mpi_equals_plain_training_without_those_blocks() {
    let _one = one_at_a_time();
    for schedule in ["1f1b", "zbh1"] {
        let d = dir(&format!("critical-{schedule}"));
        let (m, ck) = (d.join("m.jsonl"), d.join("ck"));
        let o = mpirun(2)
            .args(["train", "--transport", "mpi", "--stages", "2"])
            .args([
                "--schedule",
                schedule,
                "--steps",
                "8",
                "--microbatches",
                "4",
            ])
            .args([
                "--eval-every",
                "8",
                "--eval-batches",
                "1",
                "--freeze",
                "critical",
            ])
            .args(["--freeze-every", "1", "--freeze-threshold", "10"])
            .args(TINY_L4)
            .arg("--metrics")
            .arg(&m)
            .arg("--checkpoint-dir")
            .arg(&ck)
            .output()
            .unwrap();
        let all = text(&o);
        assert!(o.status.success(), "{all}");
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["loss"].is_number())
            .collect();
        assert_eq!(rows.len(), 8, "{all}");
        let (cfg, plan, got) = checkpoint_params(&ck);
        let mut plain = PlainTrainer::new(cfg, &plan);
        let corpus = Corpus::builtin();
        let mut most = 0;
        for r in &rows {
            plain.frozen = r["frozen_layers"].as_u64().unwrap() as usize;
            plain.weight_only = r["weight_only_frozen"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as usize)
                .collect();
            most = most.max(plain.weight_only.len());
            plain.train_step(&corpus);
        }
        assert!(
            most >= 1,
            "{schedule}: no block frozen by weight only: {all}"
        );
        assert!(all.contains("simulated iteration"), "{all}");
        let want = plain.flat_params();
        let worst = max_diff(&got, &want);
        assert!(worst <= 1e-5, "{schedule}: max |diff| {worst}");
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Micro-batches padded only to their longest row, of different lengths within a step, flow
/// between worker processes (each activation carries its shape) and train as the same run in
/// threads does (which equals single-worker training: crates/runtime/tests/exact.rs).
#[test]
fn mixed_length_micro_batches_under_mpi_equal_the_threaded_run() {
    let _one = one_at_a_time();
    let d = dir("mixed");
    let (train, val) = (d.join("train.jsonl"), d.join("val.jsonl"));
    let rows = |n: usize| -> String {
        (0..n)
            .map(|i| {
                let text = "spam ham eggs ".repeat(3)[..1 + i * 7 % 30].to_string();
                format!(
                    "{{\"text\": \"{text}\", \"label\": \"{}\"}}\n",
                    ["a", "b"][i % 2]
                )
            })
            .collect()
    };
    std::fs::write(&train, rows(40)).unwrap();
    std::fs::write(&val, rows(8)).unwrap();
    let config = d.join("bert.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["BertForSequenceClassification"], "model_type": "bert",
        "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 32, "hidden_act": "gelu",
        "num_labels": 2}"#,
    )
    .unwrap();
    let run = |transport: &str, ck: &Path| {
        let mut c = match transport {
            "mpi" => mpirun(2),
            _ => Command::new(env!("CARGO_BIN_EXE_pipewright")),
        };
        c.args([
            "train",
            "--transport",
            transport,
            "--task",
            "classify",
            "--data",
        ])
        .arg(&train)
        .arg("--val-data")
        .arg(&val)
        .args(["--stages", "2", "--schedule", "zbh1", "--steps", "4"])
        .args(["--microbatches", "4", "--rows", "2", "--eval-every", "4"])
        .args(["--seq-len", "16", "--model-config"])
        .arg(&config)
        .arg("--checkpoint-dir")
        .arg(ck)
        .arg("--metrics")
        .arg(ck.with_extension("jsonl"));
        let o = c.output().unwrap();
        assert!(o.status.success(), "{transport}: {}", text(&o));
    };
    let (a, b) = (d.join("mpi"), d.join("threads"));
    run("mpi", &a);
    run("threads", &b);
    // Steps ran fewer positions than 8 rows of 16 (some of them), and not all as many.
    let tokens: Vec<u64> = std::fs::read_to_string(a.with_extension("jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["tokens_per_s"].as_f64()? * r["seconds"].as_f64()?).round() as u64))
        .collect();
    assert!(
        tokens.iter().any(|&t| t < 128) && tokens.iter().any(|&t| t != tokens[0]),
        "{tokens:?}"
    );
    let (_, _, got) = checkpoint_params(&a);
    let (_, _, want) = checkpoint_params(&b);
    let worst = max_diff(&got, &want);
    assert!(worst <= 1e-6, "max |diff| {worst}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Preemption: SIGUSR1 (Slurm's `--signal`) to the launcher reaches every rank; they agree to
/// stop at the same step boundary, write the checkpoint and exit 0. Resuming continues to the
/// same parameters as a run that was never stopped.
#[test]
fn sigusr1_checkpoints_every_rank_at_one_step_and_resume_continues_exactly() {
    preempt("preempt-usr1", |launcher, _| {
        // SAFETY: sends a signal to the launcher this test started.
        unsafe { libc::kill(launcher as i32, libc::SIGUSR1) };
    });
}

/// SIGTERM to every rank (what `scancel` and a Slurm time limit send) is a stop, not a peer's
/// failure: the ranks checkpoint at one step, exit 0, and the resume continues exactly.
#[test]
fn sigterm_to_every_rank_checkpoints_and_resume_continues_exactly() {
    preempt("preempt-term", |_, ck| {
        let ranks = common::pids_with_arg("pipewright", ck);
        assert_eq!(ranks.len(), 2, "two ranks running: {ranks:?}");
        for pid in ranks {
            // SAFETY: sends a signal to a rank of the job this test started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    });
}

/// Start a long 2-rank run, `signal` it (given the launcher's PID and the checkpoint
/// directory), and check that it stopped at one step with a checkpoint from which a resume
/// reaches the parameters of a run that was never stopped.
fn preempt(name: &str, signal: impl Fn(u32, &Path)) {
    let _one = one_at_a_time();
    let d = dir(name);
    let (ck, straight) = (d.join("ck"), d.join("straight"));
    // A constant learning rate: the schedule then does not depend on --steps, which differs
    // between the stopped run and the ones compared.
    let config = d.join("constant-lr.toml");
    std::fs::write(&config, "lr = 0.003\nmin_lr = 0.003\n").unwrap();
    let run = |ck: &Path, steps: &str, resume: bool| {
        let mut c = mpirun(2);
        c.args(["train", "--transport", "mpi", "--stages", "2", "--config"])
            .arg(&config)
            .args(TINY)
            .args(["--steps", steps, "--eval-batches", "1", "--checkpoint-dir"])
            .arg(ck);
        if resume {
            c.arg("--resume");
        }
        c
    };
    let job = run(&ck, "100000", false)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(4));
    signal(job.id(), &ck);
    let o = job.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let at = common::stopped_at(&err);
    assert_eq!(
        err.matches("stopped on request").count(),
        1,
        "rank 0 speaks: {err}"
    );
    let (_, _, _) = checkpoint_params(&ck);
    let target = (at + 2).to_string();
    let o = run(&ck, &target, true).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&straight, &target, false).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let (a, b) = (checkpoint_params(&ck).2, checkpoint_params(&straight).2);
    let worst = max_diff(&a, &b);
    assert!(worst <= 1e-6, "resumed after the stop differs by {worst}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A peer that stops after the final checkpoint (here rank 1 stops itself, through the test
/// hook) cannot hold rank 0 for ever in MPI's finalisation: rank 0 prints its summary, waits
/// the peer timeout, says why it gives up, and exits 0; the launcher then ends the job.
#[test]
fn a_peer_stopped_after_the_final_checkpoint_cannot_hold_the_job() {
    let _one = one_at_a_time();
    let d = dir("stopped-peer");
    let ck = d.join("ck");
    let t0 = Instant::now();
    let o = mpirun(2)
        .env("PIPEWRIGHT_TEST_STOP_BEFORE_FINISH", "1")
        .args([
            "train",
            "--transport",
            "mpi",
            "--stages",
            "2",
            "--peer-timeout",
            "2",
        ])
        .args(TINY)
        .args(SHORT)
        .arg("--checkpoint-dir")
        .arg(&ck)
        .output()
        .unwrap();
    let (secs, all) = (t0.elapsed().as_secs_f64(), text(&o));
    assert!(secs < 30.0, "the job ended after {secs:.1} s: {all}");
    assert!(all.contains("val loss"), "the summary came first: {all}");
    assert!(
        all.contains("rank 0: MPI did not finish within the peer timeout (2.0 s)"),
        "{all}"
    );
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step-000003");
    let _ = std::fs::remove_dir_all(&d);
}

/// A LLaMA with tied embeddings over 4 ranks (2 stages x 2 replicas, ZB-H1): the tied matrix's
/// two copies sit on different ranks and sum their gradients through their own group; the
/// result is the same run as the same plan's worker threads in one process.
#[test]
fn tied_llama_over_mpi_equals_the_same_plan_in_threads_zbh1_and_dualpipev() {
    let _one = one_at_a_time();
    let d = dir("tied");
    let cfg = d.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    // ZB-H1 with replicas; DualPipeV holds the embedding and the head on rank 0, in a V.
    for (schedule, replicas, np) in [("zbh1", "2", 4), ("dualpipev", "1", 2)] {
        let ck = d.join(format!("ck-{schedule}"));
        let o = mpirun(np)
            .args(["train", "--transport", "mpi", "--model-config"])
            .arg(&cfg)
            .args(["--seq-len", "16", "--schedule", schedule, "--stages", "2"])
            .args(["--replicas", replicas])
            .args(SHORT)
            .arg("--checkpoint-dir")
            .arg(&ck)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "tied llama {schedule} over MPI: {}",
            text(&o)
        );
        let (cfg, plan, got) = checkpoint_params(&ck);
        let mut threads = Trainer::new(cfg, plan).unwrap();
        let corpus = Corpus::builtin();
        for _ in 0..3 {
            threads.train_step(&corpus).unwrap();
        }
        let want = threads.flat_params().unwrap();
        let worst = max_diff(&got, &want);
        assert!(
            got.len() == want.len() && worst <= 1e-5,
            "{schedule}: max |diff| {worst}"
        );
    }
}

/// A measured trace over MPI shows where time goes besides compute: each rank's sends, its
/// waits for a peer, the all-reduce and the optimizer step, on both ranks' rows, and the
/// messages on the links' own tracks.
#[test]
fn measured_mpi_traces_carry_communication_and_optimizer_spans() {
    let _one = one_at_a_time();
    let d = dir("trace");
    let trace = d.join("t.json");
    let o = mpirun(2)
        .args([
            "train",
            "--transport",
            "mpi",
            "--stages",
            "2",
            "--no-checkpoint",
        ])
        .args(TINY)
        .args(SHORT)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    for cat in ["send", "receive wait", "all-reduce", "optimizer step"] {
        let workers: std::collections::BTreeSet<u64> = t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == cat)
            .map(|e| e["tid"].as_u64().unwrap())
            .collect();
        assert_eq!(
            workers.into_iter().collect::<Vec<_>>(),
            [0, 1],
            "{cat} spans"
        );
    }
    // Links are tracks of their own (pid 1): activations w0 -> w1, gradients w1 -> w0, each
    // message from its send to its receive.
    let links: std::collections::BTreeSet<u64> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "transfer" && e["pid"] == 1)
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(
        links.into_iter().collect::<Vec<_>>(),
        [1, 2],
        "w0->w1 and w1->w0"
    );
}

/// Started as several tasks without --transport mpi, each would train the whole plan alone on
/// the same files: refused, once, naming the launcher and the fix.
#[test]
fn several_tasks_with_threads_are_refused() {
    let _one = one_at_a_time();
    let o = mpirun(2)
        .args([
            "train",
            "--steps",
            "1",
            "--no-checkpoint",
            "--transport",
            "threads",
        ])
        .args(TINY)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert_eq!(err.matches("add --transport mpi").count(), 1, "{err}");
    assert!(err.contains("mpirun (OMPI_COMM_WORLD_SIZE=2)"), "{err}");
}

/// `train` with several workers and no launcher starts them as processes under mpirun, each
/// bound to its own core, and trains exactly as the same plan in threads does.
#[test]
fn a_pipeline_runs_as_worker_processes_by_default() {
    let _one = one_at_a_time();
    let run = |transport: &str| {
        Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["train", "--stages", "2", "--transport", transport])
            .args(SHORT)
            .args(TINY)
            .arg("--no-checkpoint")
            .output()
            .unwrap()
    };
    let (auto, threads) = (run("auto"), run("threads"));
    let err = String::from_utf8_lossy(&auto.stderr);
    assert!(auto.status.success(), "{err}");
    assert!(
        err.contains("workers: 2 processes (started by pipewright under mpirun)"),
        "{err}"
    );
    // The final validation loss (`val loss A -> B ...`): the same training, to print precision.
    let last = |o: &Output| -> f64 {
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let line = out.lines().find(|l| l.starts_with("val loss"));
        let b = line.and_then(|l| l.split(" -> ").nth(1)?.split(' ').next()?.parse().ok());
        b.unwrap_or_else(|| panic!("no final loss: {}", text(o)))
    };
    let (a, t) = (last(&auto), last(&threads));
    assert!((a - t).abs() < 1e-3, "processes {a}, threads {t}");
}

/// Ranks that lend their idle cores split large products with a helper on the waiting
/// rank's core: training is the same to the bit as without (`PIPEWRIGHT_LEND=0`). Products
/// here are 512 x 128 x 128 and larger, at or above the size that is split. The launcher lends
/// when the ranks have a core each, as on a 2-core machine (CI's).
#[test]
fn cores_lent_to_a_busy_rank_change_no_value() {
    let _one = one_at_a_time();
    let d = dir("lend");
    let run = |lend: &str| {
        let m = d.join(format!("m{lend}.jsonl"));
        let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args([
                "train",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--steps",
                "3",
            ])
            .args(["--d-model", "128", "--seq-len", "128", "--rows", "4"])
            .args(["--layers", "2", "--heads", "4", "--eval-every", "3"])
            .args(["--eval-batches", "1", "--no-checkpoint", "--metrics"])
            .arg(&m)
            .env("PIPEWRIGHT_LEND", lend)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let lines = std::fs::read_to_string(&m).unwrap();
        let values: Vec<String> = lines
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!(
                    "{} {} {} {}",
                    v["step"], v["loss"], v["grad_norm"], v["val_loss"]
                )
            })
            .collect();
        (values, String::from_utf8_lossy(&o.stderr).to_string())
    };
    let ((lent, err), (alone, err0)) = (run("1"), run("0"));
    let note = "large products also run on the cores of ranks that wait";
    assert!(!err0.contains(note), "{err0}");
    if std::thread::available_parallelism().map_or(0, |n| n.get()) == 2 {
        assert!(err.contains(note), "{err}");
    }
    assert_eq!(lent.len(), 4, "{lent:?}");
    assert_eq!(lent, alone);
}

/// An mpirun that cannot start the workers (here a script that fails as a broken launcher
/// would, and one of another MPI) leaves the run to threads, said once with the reason.
#[test]
fn a_launcher_that_cannot_start_the_workers_leaves_them_threads() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir("fake-mpirun");
    for (name, script, why) in [
        (
            "broken",
            "if [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 4.1.4'; exit 0; fi\nexit 3",
            "exited with 3 before any worker started",
        ),
        (
            "mpich",
            "echo 'HYDRA build details'",
            "is not Open MPI's mpirun",
        ),
    ] {
        let bin = d.join(name);
        std::fs::create_dir_all(&bin).unwrap();
        let f = bin.join("mpirun");
        std::fs::write(&f, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        let o = Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args(["train", "--stages", "2", "--no-checkpoint"])
            .args(SHORT)
            .args(TINY)
            .env("PATH", path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: {err}");
        assert_eq!(err.matches("workers run as threads").count(), 1, "{err}");
        assert!(err.contains(why), "{name}: {err}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
