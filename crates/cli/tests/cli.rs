//! The command-line contract: figures, files and bad-input handling.

mod common;
use common::{fresh_dir, FREEZE_EVERY_3, TINY, TINY_L4};
use std::path::PathBuf;
use std::process::{Command, Output};

fn pw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .output()
        .expect("runs")
}

fn shared(rel: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    p.to_str().unwrap().to_string()
}

fn tmp(name: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("pw-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Exit 2, one line on stderr containing `want`, nothing panicked.
fn bad(args: &[&str], want: &str) {
    let o = pw(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {err}"
    );
    assert!(err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    assert!(!err.contains("panicked"));
}

#[test]
fn acceptance_figures_from_the_cli() {
    let base = [
        "simulate",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--cost-f",
        "1",
        "--cost-b",
        "1",
        "--cost-w",
        "1",
        "--json",
    ];
    let run =
        |kind: &str, extra: &[&str]| json(&pw(&[&base[..], &["--schedule", kind], extra].concat()));
    let g = run("gpipe", &[]);
    assert_eq!(g["makespan"], 33.0);
    assert_eq!(g["peak_activations"], serde_json::json!([8, 8, 8, 8]));
    let o = run("1f1b", &[]);
    assert!((o["bubble_fraction"].as_f64().unwrap() - 3.0 / 11.0).abs() < 1e-12);
    assert_eq!(o["peak_activations"], serde_json::json!([4, 3, 2, 1]));
    assert_eq!(o["busy"].as_array().unwrap().len(), 4);
    assert_eq!(run("zbh1", &[])["makespan"], 27.0);
    assert_eq!(run("interleaved", &["--chunks", "2"])["makespan"], 57.0);
    assert!(run("zbv", &[])["bubble_fraction"].as_f64().unwrap() <= 0.06);
}

#[test]
fn examples_load_and_simulate_with_files() {
    let dir = std::env::temp_dir().join(format!("pw-cli-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, svg) = (dir.join("t.json"), dir.join("t.svg"));
    let j = json(&pw(&[
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "8",
        "--microbatches",
        "16",
        "--profile",
        &shared("examples/vit_b16_params.toml"),
        "--cluster",
        &shared("examples/pipetransformer_2x8.toml"),
        "--json",
        "--trace",
        trace.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    assert_eq!(
        j["layers_per_stage"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum::<u64>(),
        27
    );
    assert!(j["links"].as_array().unwrap().len() >= 7);
    // 8 of the 16 devices work: the other node's 8 are listed as idle, in the SVG too.
    let idle = j["idle_devices"].as_array().unwrap();
    assert_eq!(idle.len(), 8, "{idle:?}");
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("idle devices (8)"));
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert!(t["traceEvents"].as_array().unwrap().len() > 16 * 8 * 2);
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    json(&pw(&[
        "simulate",
        "--schedule",
        "gpipe",
        "--stages",
        "4",
        "--profile",
        &shared("examples/llama500m_skippipe.toml"),
        "--cluster",
        &shared("examples/geo20_skippipe.toml"),
        "--microbatches",
        "3",
        "--json",
    ]));
}

#[test]
fn plan_files_round_trip_through_the_cli() {
    for fmt in ["json", "csv"] {
        let o = pw(&[
            "schedule",
            "--schedule",
            "zbv",
            "--stages",
            "3",
            "--microbatches",
            "5",
            "--format",
            fmt,
        ]);
        assert!(o.status.success());
        let f = tmp(
            &format!("plan.{fmt}"),
            &String::from_utf8(o.stdout).unwrap(),
        );
        let v = pw(&["validate", &f]);
        assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
        let j = json(&pw(&["simulate", "--plan", &f, "--json"]));
        assert_eq!(j["workers"], 3);
    }
}

/// An old spelling still works, gives what the one name gives, and says the new name once.
#[test]
fn old_spellings_still_work_and_name_the_new_one() {
    for (old, new, args) in [
        ("--kind", "--schedule", &["simulate", "zbh1", "--json"][..]),
        (
            "--kind",
            "--schedule",
            &["schedule", "zbv", "--format", "json"][..],
        ),
    ] {
        let with = |flag: &str| pw(&[&args[..1], &[flag], &args[1..]].concat());
        let (o, n) = (with(old), with(new));
        assert!(o.status.success() && n.status.success());
        assert_eq!(o.stdout, n.stdout, "{args:?}");
        let hint = String::from_utf8_lossy(&o.stderr);
        assert_eq!(hint.matches(new).count(), 1, "{hint}");
        assert!(
            n.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&n.stderr)
        );
    }
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    bad(
        &["simulate", "--schedule", "pipedream"],
        "invalid value 'pipedream'",
    );
    // Sizes that would overflow or exhaust memory are refused before anything is allocated.
    let huge = "18446744073709551615";
    let vit = shared("examples/vit_b16_params.toml");
    for (args, want) in [
        (vec!["schedule", "--stages", huge], "more than 2^64 actions"),
        (
            vec![
                "simulate",
                "--schedule",
                "zbv",
                "--microbatches",
                "2000000000",
            ],
            "above the limit of 20000000",
        ),
        (
            vec!["schedule", "--replicas", huge],
            "more than 2^64 actions",
        ),
        (
            vec!["partition", "--profile", &vit, "--stages", "200000"],
            "has only 27 layers",
        ),
        (
            vec!["train", "--rows", huge, "--no-checkpoint"],
            "more than 2^31 values",
        ),
        (
            vec!["train", "--layers", huge, "--no-checkpoint"],
            "layers 18446744073709551615 is past the largest pipewright takes (65536)",
        ),
        (
            vec![
                "train",
                "--layers",
                "60000",
                "--d-model",
                "4096",
                "--heads",
                "32",
                "--no-checkpoint",
            ],
            "more than 2^34 parameters",
        ),
        (vec!["profile", "--rows", huge], "more than 2^31 values"),
        (
            vec!["profile", "--repeats", huge],
            "--repeats between 1 and 1000",
        ),
        (
            vec!["train", "--transport", "threads", "--peer-timeout", "nan"],
            "--peer-timeout NaN",
        ),
        (
            vec!["simulate", "--cost-f", "1e308", "--cost-b", "1e308"],
            "total compute time overflows",
        ),
    ] {
        bad(&args, want);
    }
    let wrap = tmp(
        "wrap.toml",
        &(0..8)
            .map(|i| {
                format!(
                    "[[layers]]\nname = \"l{i}\"\nforward = 1\nparams = {}\nactivation = 8\n",
                    (1u64 << 61) + i
                )
            })
            .fold("[model]\nname = \"w\"\n".to_string(), |a, b| a + &b),
    );
    bad(
        &["simulate", "--profile", &wrap, "--stages", "2"],
        "memory figures cannot overflow",
    );
    // SkipPipe's rules on request: a plain pipeline's routes end away from their data node.
    let plain = tmp(
        "plain-1f1b.json",
        &String::from_utf8(
            pw(&[
                "schedule",
                "--schedule",
                "1f1b",
                "--stages",
                "4",
                "--format",
                "json",
            ])
            .stdout,
        )
        .unwrap(),
    );
    bad(&["validate", &plain, "--skip", "1"], "(rule skip-ends)");
    // A valid plan whose route visits stages [4, 1, 5]: 4 and 1 are no neighbours, so that is
    // no SkipPipe swap.
    let hop = |s: usize, w: usize| format!("[{s},{w}]");
    let act = |op: &str, s: usize| format!("{{\"op\":\"{op}\",\"stage\":{s},\"mb\":0}}");
    let work = |s: usize| format!("[{},{}]", act("F", s), act("BW", s));
    let swap415 = format!(
        "{{\"kind\":\"custom\",\"num_microbatches\":1,\"stages\":[{}],\"routes\":[[{}]],\"workers\":[[{},{},{},{}],{},[],[],{},{}]}}",
        (0..7)
            .map(|s| format!("{{\"layers\":1,\"hosts\":[{}]}}", if s % 6 == 0 { 0 } else { s }))
            .collect::<Vec<_>>()
            .join(","),
        [hop(0, 0), hop(4, 4), hop(1, 1), hop(5, 5), hop(6, 0)].join(","),
        act("F", 0),
        act("F", 6),
        act("BW", 6),
        act("BW", 0),
        work(1),
        work(4),
        work(5)
    );
    let swap415 = tmp("swap415.json", &swap415);
    assert!(pw(&["validate", &swap415]).status.success());
    bad(
        &["validate", &swap415, "--skip", "2"],
        "visits stages [4, 1, 5]: only swaps of two neighbours may reorder them (rule skip-swaps)",
    );
    // skip-plan's own limits.
    let llama = shared("examples/llama500m_skippipe.toml");
    let geo = shared("examples/geo20_skippipe.toml");
    let sp = |extra: &[&str]| -> Vec<String> {
        [
            "skip-plan",
            "--profile",
            &llama,
            "--cluster",
            &geo,
            "--moves",
            "10",
            "--polish-moves",
            "10",
        ]
        .iter()
        .chain(extra)
        .map(|x| x.to_string())
        .collect()
    };
    let bad_sp = |args: Vec<String>, want: &str| {
        bad(&args.iter().map(String::as_str).collect::<Vec<_>>(), want)
    };
    bad_sp(sp(&["--stages", "6", "--skip", "2.5"]), "--skip 2.5");
    bad_sp(
        sp(&["--stages", "6", "--skip", "5"]),
        "cannot skip 5 of the 5 middle stages",
    );
    bad_sp(sp(&["--stages", "40", "--skip", "1"]), "--stages 40");
    bad_sp(
        sp(&[
            "--stages",
            "6",
            "--skip",
            "1",
            "--microbatches",
            "18446744073709551615",
        ]),
        "above the limit of 20000000",
    );
    bad_sp(
        sp(&["--stages", "6", "--skip", "1", "--replicas", "19"]),
        "cannot hold 19 data nodes",
    );
    // SkipPipe's per-node load cap must leave room: 30 micro-batches x 3 of 5 middle stages
    // over pools of 3 devices need 6 each.
    bad_sp(
        sp(&[
            "--stages",
            "6",
            "--skip",
            "2",
            "--replicas",
            "5",
            "--microbatches",
            "6",
            "--max-node-load",
            "5",
        ]),
        "a middle stage gets 18 micro-batch visits per iteration but its 3 workers may serve 5 each",
    );
    bad_sp(
        sp(&["--stages", "6", "--skip", "2", "--idle-gap=-1"]),
        "--idle-gap -1.0",
    );
    // Outputs replace only regular files: not a directory, not a symlink.
    let d = std::env::temp_dir().join(format!("pw-outdir-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    bad(
        &["simulate", "--svg", d.to_str().unwrap()],
        "is not a regular file",
    );
    let link = d.join("link.json");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("/dev/null", &link).unwrap();
    bad(
        &["train", "--metrics", link.to_str().unwrap(), "--steps", "1"],
        "is not a regular file",
    );
    bad(&["simulate", "--stages", "0"], "--stages 0");
    bad(&["simulate", "--cost-b", "-1"], "--cost-b -1");
    bad(
        &["schedule", "--schedule", "zbv", "--chunks", "3"],
        "exactly 2 chunks",
    );
    let good = std::fs::read_to_string(shared("examples/pipetransformer_2x8.toml")).unwrap();
    let prof = shared("examples/vit_b16_params.toml");
    let c = tmp("twice.toml", &good.replace("node0-gpu1", "node0-gpu0"));
    bad(
        &["simulate", "--profile", &prof, "--cluster", &c],
        "device \"node0-gpu0\" is named twice",
    );
    let c = tmp(
        "unknown.toml",
        &good.replace("overhead = 0.0", "overhed = 0.0"),
    );
    bad(
        &["simulate", "--profile", &prof, "--cluster", &c],
        "unknown field `overhed`",
    );
    let c = tmp("broken.toml", &good.replace("[[links]]", "[[links]"));
    bad(&["simulate", "--profile", &prof, "--cluster", &c], "line ");
    let pf = std::fs::read_to_string(&prof).unwrap();
    let p = tmp(
        "neg.toml",
        &pf.replacen("forward = 2.363904", "forward = -2.363904", 1),
    );
    bad(
        &["simulate", "--profile", &p],
        "layers[1] (\"att0\"): forward = -2.363904 must be a finite number >= 0",
    );
    bad(
        &["simulate", "--profile", "/nonexistent/p.toml"],
        "/nonexistent/p.toml: cannot read",
    );
    bad(
        &["simulate", "--profile", &prof, "--stages", "30"],
        "cannot cut 27 layers into 30",
    );
    let broken = tmp("broken.json", "{\"kind\": \"x\"");
    bad(&["validate", &broken], "broken.json");
    let o = pw(&[
        "schedule",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--format",
        "json",
    ]);
    let deadlock =
        String::from_utf8(o.stdout)
            .unwrap()
            .replacen("\"op\": \"F\"", "\"op\": \"W\"", 1);
    bad(&["validate", &tmp("w.json", &deadlock)], "worker 0");
}

#[test]
fn partition_and_plan() {
    let vit = shared("examples/vit_b16_params.toml");
    for (k, want) in [("8", 12.582376), ("4", 22.034152)] {
        let j = json(&pw(&[
            "partition",
            "--profile",
            &vit,
            "--stages",
            k,
            "--objective",
            "params",
            "--json",
        ]));
        assert!((j["bottleneck"].as_f64().unwrap() / 4e6 - want).abs() < 1e-6);
        assert_eq!(
            j["boundaries"].as_array().unwrap().len(),
            k.parse::<usize>().unwrap()
        );
        assert_eq!(
            j["stage_cost"].as_array().unwrap().len(),
            k.parse::<usize>().unwrap()
        );
    }
    let c = shared("examples/pipetransformer_2x8.toml");
    let j = json(&pw(&[
        "partition",
        "--profile",
        &vit,
        "--stages",
        "8",
        "--cluster",
        &c,
        "--json",
    ]));
    assert_eq!(j["devices"].as_array().unwrap().len(), 8);
    assert_eq!(j["exact"], true);
    let j = json(&pw(&["plan", "--profile", &vit, "--cluster", &c, "--json"]));
    let cands = j["candidates"].as_array().unwrap();
    assert!(cands.len() > 20);
    let times: Vec<f64> = cands
        .iter()
        .filter_map(|c| c["iteration_time"].as_f64())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "ranked best first");
    assert!(cands[1..]
        .iter()
        .all(|c| !c["reason"].as_str().unwrap().is_empty()));
    // A device too small for the largest layer: named, with the bytes it needs.
    let small = tmp(
        "small.toml",
        &std::fs::read_to_string(&c)
            .unwrap()
            .replace("memory = 17179869184", "memory = 1000000"),
    );
    bad(
        &[
            "partition",
            "--profile",
            &vit,
            "--stages",
            "8",
            "--cluster",
            &small,
        ],
        "needs 94949376 bytes",
    );
    bad(
        &["plan", "--profile", &vit, "--cluster", &small],
        "no candidate fits",
    );
}

#[test]
fn train_small_run_and_bad_input() {
    let dir = std::env::temp_dir().join(format!("pw-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let m = dir.join("m.jsonl");
    let ck = dir.join("ck");
    let tiny = TINY;
    let o = pw(&[
        &[
            "train",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--checkpoint-every",
            "2",
            "--metrics",
            m.to_str().unwrap(),
            "--checkpoint-dir",
            ck.to_str().unwrap(),
        ][..],
        &tiny,
    ]
    .concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 5, "step 0 validation + 4 steps");
    assert_eq!(rows.iter().filter(|r| r["val_loss"].is_f64()).count(), 3);
    assert!(rows[1]["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(rows[1]["busy"].as_array().unwrap().len(), 2);
    assert!(std::fs::read_to_string(ck.join("latest"))
        .unwrap()
        .starts_with("step-000004"));
    // Resume with a different model is refused; resume with the same settings continues.
    bad(
        &[&[
            "train",
            "--stages",
            "2",
            "--steps",
            "6",
            "--resume",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--layers",
            "3",
        ][..]]
        .concat(),
        "different model",
    );
    // The step-4 checkpoint is corrupt: resume falls back to step 2, says why, and the
    // metrics file keeps each step once.
    let w4 = ck.join("step-000004/weights.safetensors");
    let mut bytes = std::fs::read(&w4).unwrap();
    let i = bytes.len() / 2;
    bytes[i] ^= 1;
    std::fs::write(&w4, bytes).unwrap();
    let o = pw(&[
        &[
            "train",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--steps",
            "5",
            "--resume",
            "--no-checkpoint",
            "--metrics",
            m.to_str().unwrap(),
            "--checkpoint-dir",
            ck.to_str().unwrap(),
        ][..],
        &tiny,
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("step-000004/weights.safetensors: does not match the manifest")
            && err.contains("resuming from the newest checkpoint that verifies")
            && err.contains("at step 2"),
        "{err}"
    );
    let steps: Vec<u64> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4, 5]);
    // Bad input.
    bad(
        &["train", "--data", "/nonexistent/corpus.txt"],
        "/nonexistent/corpus.txt: cannot read data file",
    );
    // Zero-bubble schedules run with the real B/W split.
    let o = pw(&[
        &[
            "train",
            "--schedule",
            "zbv",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--steps",
            "2",
            "--no-checkpoint",
        ][..],
        &tiny,
    ]
    .concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    bad(&["train", "--stages", "7"], "only 6 layer blocks");
    bad(
        &[
            "train",
            "--resume",
            "--checkpoint-dir",
            dir.join("none").to_str().unwrap(),
        ],
        "no checkpoint to resume",
    );
    std::fs::write(ck.join("step-000002/weights.safetensors"), b"garbage").unwrap();
    bad(
        &[
            &[
                "train",
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--steps",
                "6",
                "--resume",
                "--checkpoint-dir",
                ck.to_str().unwrap(),
            ][..],
            &tiny,
        ]
        .concat(),
        "weights.safetensors: does not match the manifest",
    );
}

/// profile -> plan --out -> simulate --plan -> train --plan on examples/local4.toml, the same
/// file throughout; then a switch of plan mid-run and the errors of a plan that does not fit.
#[test]
fn whole_job_plan_workflow() {
    let model = tmp(
        "tiny-model.toml",
        "vocab = 256\nd_model = 16\nheads = 2\nlayers = 2\nseq_len = 16\n",
    );
    let tiny = TINY;
    let prof = tmp("tiny-prof.toml", "");
    let run = tmp("run.json", "");
    let local4 = shared("examples/local4.toml");
    let o = pw(&[
        "profile",
        "--model",
        &model,
        "--rows",
        "2",
        "--repeats",
        "1",
        "--out",
        &prof,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Where a block's time goes: every op, their sum, the whole block.
    let o = pw(&[
        "profile",
        "--ops",
        "--model",
        &model,
        "--rows",
        "2",
        "--repeats",
        "1",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    for op in [
        "GELU",
        "MLP up",
        "causal attention (fused)",
        "scores, causal softmax, x v as 3 ops",
        "sum of the ops",
        "whole block",
        "q, k, v as one d x 3d projection",
        "burn's attention op (causal)",
        "burn GELU (exact)",
        "burn Linear (flex GEMM), d x 4d",
        "burn GELU, tanh approximation",
    ] {
        assert!(out.contains(op), "{out}");
    }
    assert!(out.contains("100.0%"), "{out}");
    let o = pw(&[
        "plan",
        "--profile",
        &prof,
        "--cluster",
        &local4,
        "--global-batch",
        "4",
        "--out",
        &run,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run).unwrap()).unwrap();
    assert_eq!(plan["num_microbatches"], 4);
    let j = json(&pw(&[
        "simulate",
        "--plan",
        &run,
        "--cluster",
        &local4,
        "--json",
    ]));
    let layers: u64 = j["layers_per_stage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .sum();
    assert_eq!(layers, 4, "embedding, 2 blocks, head");
    assert!(j["iteration_time"].as_f64().unwrap() >= j["makespan"].as_f64().unwrap());
    let train = |extra: &[&str]| {
        pw(&[
            &[
                "train",
                "--plan",
                &run,
                "--cluster",
                &local4,
                "--rows",
                "2",
                "--no-checkpoint",
            ][..],
            &tiny,
            extra,
        ]
        .concat())
    };
    let o = train(&["--steps", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Switch to a deeper, replicated plan mid-run.
    let deeper = tmp("deeper.json", "");
    let o = pw(&[
        "schedule",
        "--schedule",
        "zbh1",
        "--stages",
        "2",
        "--replicas",
        "2",
        "--microbatches",
        "2",
        "--layers",
        "4",
        "--format",
        "json",
    ]);
    std::fs::write(&deeper, &o.stdout).unwrap();
    let o = train(&["--steps", "4", "--switch-plan", &format!("2:{deeper}")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("step 2: re-planned in") && err.contains("after:  zbh1 on 4 workers"),
        "{err}"
    );
    // A flag the plan makes meaningless is an error, and so is a plan for another model.
    bad(
        &["train", "--plan", &run, "--stages", "2"],
        "cannot be used with",
    );
    bad(&["train", "--plan", &run], "the plan holds 4 layers");
    bad(
        &[
            &[
                "train",
                "--plan",
                &deeper,
                "--cluster",
                &shared("examples/vit_b16_params.toml"),
            ][..],
            &tiny,
        ]
        .concat(),
        "vit_b16_params.toml",
    );
    // A route that does not start at the embedding is refused, naming the rule.
    let mut broken = plan.clone();
    let r0 = broken["routes"][0].as_array().unwrap().clone();
    if r0.len() == 1 {
        broken["routes"][0] = serde_json::json!([]);
        bad(
            &["validate", &tmp("empty-route.json", &broken.to_string())],
            "route of mb 0 is empty",
        );
    }
    let mut skip = serde_json::from_slice::<serde_json::Value>(
        &pw(&[
            "schedule",
            "--stages",
            "3",
            "--microbatches",
            "2",
            "--format",
            "json",
        ])
        .stdout,
    )
    .unwrap();
    skip["routes"][1] = serde_json::json!([[1, 1], [2, 2]]);
    bad(
        &["validate", &tmp("skip0.json", &skip.to_string())],
        "rule route-start",
    );
}

/// The CLI under fuzzed files: real plan, profile and cluster files with numbers replaced by
/// edge values (deterministic), through validate, simulate, partition and plan. Every run ends
/// in exit 0, 1 or 2 with no panic (101) and no abort.
#[test]
fn fuzzed_files_through_the_cli_never_panic() {
    let mut rng = pipewright_core::rng::Lcg(0x5eed);
    let plan = String::from_utf8(
        pw(&[
            "schedule",
            "--schedule",
            "1f1b",
            "--stages",
            "2",
            "--microbatches",
            "3",
            "--replicas",
            "2",
            "--format",
            "json",
        ])
        .stdout,
    )
    .unwrap();
    let profile = std::fs::read_to_string(shared("examples/vit_b16_params.toml")).unwrap();
    let cluster = std::fs::read_to_string(shared("examples/pipetransformer_2x8.toml")).unwrap();
    let mut ran = 0;
    for case in 0..60 {
        let (name, base) = match case % 3 {
            0 => ("f.json", &plan),
            1 => ("f-profile.toml", &profile),
            _ => ("f-cluster.toml", &cluster),
        };
        let picks: Vec<(usize, usize)> = (0..1 + rng.below(3))
            .map(|_| (rng.below(1 << 20), rng.below(1 << 20)))
            .collect();
        let text = pipewright_core::fuzz::mutate(base, &picks);
        let f = tmp(name, &text);
        let prof = shared("examples/vit_b16_params.toml");
        let clus = shared("examples/pipetransformer_2x8.toml");
        let runs: Vec<Vec<&str>> = match case % 3 {
            0 => vec![vec!["validate", &f], vec!["simulate", "--plan", &f]],
            1 => vec![
                vec![
                    "partition",
                    "--profile",
                    &f,
                    "--stages",
                    "4",
                    "--cluster",
                    &clus,
                ],
                vec![
                    "plan",
                    "--profile",
                    &f,
                    "--cluster",
                    &clus,
                    "--global-batch",
                    "16",
                ],
            ],
            _ => vec![
                vec![
                    "simulate",
                    "--profile",
                    &prof,
                    "--cluster",
                    &f,
                    "--stages",
                    "4",
                ],
                vec![
                    "plan",
                    "--profile",
                    &prof,
                    "--cluster",
                    &f,
                    "--global-batch",
                    "16",
                ],
            ],
        };
        for args in runs {
            let o = pw(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                matches!(o.status.code(), Some(0..=2)) && !err.contains("panicked"),
                "case {case}: {args:?} on\n{text}\nexit {:?}: {err}",
                o.status.code()
            );
            ran += 1;
        }
    }
    assert_eq!(ran, 120);
}

/// `train --skip` trains along the skip-plan scheduler's routes; `eval` reads its checkpoint
/// and reports perplexity with stages left out; bad requests are refused in one line.
#[test]
fn skip_training_and_skip_robust_eval() {
    let dir = fresh_dir("skip");
    let ck = dir.join("ck");
    let ck = ck.to_str().unwrap();
    let model = TINY_L4;
    let o = pw(&[
        &[
            "train",
            "--skip",
            "0.25",
            "--stages",
            "4",
            "--replicas",
            "2",
            "--microbatches",
            "2",
            "--steps",
            "3",
            "--eval-every",
            "3",
            "--checkpoint-dir",
            ck,
        ][..],
        &model,
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // 4 model stages and the head's own stage on 8 workers.
    assert!(err.contains("on 8 workers: 5 stages"), "{err}");
    let j = json(&pw(&["eval", "--checkpoint-dir", ck, "--json"]));
    assert_eq!(j["step"], 3);
    assert_eq!(j["may_omit"], serde_json::json!([1, 2, 3]));
    let rows = j["omitted"].as_array().unwrap();
    // Keep 3 of 4 and 2 of 4: every choice of 1 and 2 of the 3 middle stages.
    assert_eq!(rows[0]["omitted"].as_array().unwrap().len(), 3);
    assert_eq!(rows[1]["omitted"].as_array().unwrap().len(), 3);
    let full = j["val_loss"].as_f64().unwrap();
    assert!(full.is_finite() && full > 0.0);
    // Leaving stages out changes the loss (the blocks do something).
    assert!(rows[1]["val_losses"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| (l.as_f64().unwrap() - full).abs() > 1e-6));
    let one = json(&pw(&[
        "eval",
        "--checkpoint-dir",
        ck,
        "--omit",
        "2",
        "--json",
    ]));
    assert_eq!(one["omitted"][0]["omitted"], serde_json::json!([[2]]));
    bad(
        &["eval", "--checkpoint-dir", ck, "--omit", "0"],
        "holds the embedding or the head",
    );
    bad(
        &["eval", "--checkpoint-dir", ck, "--omit", "9"],
        "stages 0-4",
    );
    bad(
        &["eval", "--checkpoint-dir", ck, "--keep-stages", "1.5"],
        "--keep-stages 1.5",
    );
    bad(
        &["eval", "--checkpoint-dir", ck, "--draws", "0"],
        "--draws between 1 and 1000",
    );
    bad(
        &[
            "eval",
            "--checkpoint-dir",
            dir.join("none").to_str().unwrap(),
        ],
        "none",
    );
    bad(
        &[
            &["train", "--skip", "3", "--stages", "4", "--steps", "1"][..],
            &model,
        ]
        .concat(),
        "cannot skip 3 of the 3 middle stages",
    );
    bad(
        &[&["train", "--skip", "1.5", "--steps", "1"][..], &model].concat(),
        "--skip 1.5",
    );
    bad(
        &[
            &["train", "--skip", "1", "--stages", "4", "--replicas", "0"][..],
            &model,
        ]
        .concat(),
        "--replicas (data nodes)",
    );
    bad(
        &[&["train", "--skip", "1", "--plan", "x.json"][..], &model].concat(),
        "cannot be used with",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train --freeze schedule --elastic`: layers freeze at the decisions, the pipeline gets
/// shorter with more replicas, metrics rows say so; bad freeze requests are refused.
#[test]
fn freeze_and_elastic_training() {
    let dir = fresh_dir("freeze");
    let m = dir.join("m.jsonl");
    let model = TINY_L4;
    // The default model (6 layer blocks), as the E-elastic acceptance script runs it.
    let o = pw(&[
        &[
            "train",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--steps",
            "9",
            "--elastic",
            "--no-checkpoint",
            "--metrics",
            m.to_str().unwrap(),
            "--trace",
            dir.join("t.json").to_str().unwrap(),
        ][..],
        &FREEZE_EVERY_3,
    ]
    .concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("froze layer blocks 0-1"), "{err}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The flags reach the run (what it does with them is tested on the library, in
    // crates/runtime/tests/run.rs): frozen blocks in the metrics, the transition in the trace.
    let last = rows.last().unwrap();
    assert!(last["frozen_layers"].as_u64().unwrap() >= 3, "{last}");
    assert_eq!(rows[1]["frozen_layers"], 0);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("t.json")).unwrap()).unwrap();
    let marked = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["ph"] == "i" && e["name"].as_str().unwrap().contains("froze layer blocks"));
    assert!(marked, "the trace marks the freeze");
    let _ = std::fs::remove_dir_all(&dir);
    bad(
        &[&["train", "--elastic", "--steps", "1"][..], &model].concat(),
        "need --freeze adaptive, schedule or critical",
    );
    bad(
        &[
            &[
                "train",
                "--freeze",
                "schedule",
                "--freeze-alpha",
                "0",
                "--steps",
                "1",
            ][..],
            &model,
        ]
        .concat(),
        "--freeze: freeze alpha 0",
    );
    bad(
        &[
            &[
                "train",
                "--freeze",
                "adaptive",
                "--freeze-every",
                "0",
                "--steps",
                "1",
            ][..],
            &model,
        ]
        .concat(),
        "--freeze-every must be at least 1",
    );
}

/// `--kind zb-auto` orders for the given costs and memory cap; the cap is its own flag.
#[test]
fn zb_auto_from_the_cli() {
    let sim = |kind: &str, extra: &[&str]| {
        let args = [
            &[
                "simulate",
                "--schedule",
                kind,
                "--cost-f",
                "1",
                "--cost-b",
                "1.5",
                "--cost-w",
                "0.7",
                "--json",
            ][..],
            extra,
        ]
        .concat();
        json(&pw(&args))["makespan"].as_f64().unwrap()
    };
    let zbh1 = sim("zbh1", &[]);
    assert!(sim("zb-auto", &[]) <= zbh1 + 1e-9);
    assert!(sim("zb-auto", &["--mem-cap", "8"]) < zbh1 - 0.5);
    bad(
        &["simulate", "--schedule", "zbh1", "--mem-cap", "3"],
        "--mem-cap is a zb-auto setting",
    );
    bad(
        &["simulate", "--schedule", "zb-auto", "--mem-cap", "0"],
        "memory cap",
    );
    bad(
        &["schedule", "--schedule", "zb-auto", "--chunks", "2"],
        "--chunks 2",
    );
}

/// AutoCache from the CLI: epochs over a short text, a cache that spills, its figures in the
/// metrics; a resumed run freezes again what the checkpoint had frozen; `elastic-sim` replays
/// the ablations; bad cache and sampling flags get one line each.
#[test]
fn cached_elastic_training_resumes_frozen_and_elastic_sim() {
    let dir = fresh_dir("cache");
    let m = dir.join("m.jsonl");
    let data = dir.join("text.txt");
    // 1150 bytes: 1035 to train on = 64 samples of 16 = 2 steps of 32 an epoch.
    let text: String = "the quick brown fox jumps over the lazy dog. "
        .repeat(30)
        .chars()
        .take(1150)
        .collect();
    std::fs::write(&data, text).unwrap();
    let ck = dir.join("ck");
    let run = |steps: &str, resume: bool| {
        let mut args = vec![
            "train",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--steps",
            steps,
            "--freeze",
            "schedule",
            "--freeze-alpha",
            "0.5",
            "--freeze-every",
            "4",
            "--elastic",
            "--cache-budget",
            "4K",
            "--cache-dir",
            dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--metrics",
            m.to_str().unwrap(),
        ];
        if resume {
            args.push("--resume");
        }
        args.extend(TINY_L4);
        pw(&args)
    };
    let o = run("8", false);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}");
    assert!(err.contains("in epochs of 2"), "{err}");
    assert!(out.contains("frozen-prefix cache: "), "{out}");
    let rows = |f: &std::path::Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(f)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let last = rows(&m).last().unwrap().clone();
    let frozen = last["frozen_layers"].as_u64().unwrap();
    assert!(frozen >= 2, "{last}");
    assert!(last["cache"]["hits"].as_u64().unwrap() > 0, "{last}");
    assert!(last["cache"]["disk_bytes"].as_u64().unwrap() > 0, "{last}");
    assert!(
        last["cache"]["memory_bytes"].as_u64().unwrap() <= 4096,
        "{last}"
    );
    // The spill file is gone with the run.
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        3,
        "only m.jsonl, text.txt and ck remain"
    );
    // Resuming it frozen again is tested on the library (crates/runtime/tests/run.rs).
    // Flags that cannot work together, and a text too short for one step of epochs.
    let model = TINY_L4;
    fn t<'a>(extra: &[&'a str], model: &[&'a str]) -> Vec<&'a str> {
        [&["train", "--steps", "1"][..], extra, model].concat()
    }
    bad(&t(&["--cache-budget", "1M"], &model), "needs --freeze");
    bad(
        &t(
            &[
                "--freeze",
                "schedule",
                "--cache-budget",
                "1M",
                "--sampling",
                "windows",
            ],
            &model,
        ),
        "needs --sampling epochs",
    );
    bad(
        &t(
            &[
                "--freeze",
                "schedule",
                "--cache-budget",
                "1M",
                "--cache-dir",
                "/proc/nope",
            ],
            &model,
        ),
        "--cache-dir: frozen-prefix cache in /proc/nope",
    );
    bad(
        &t(&["--freeze", "schedule", "--cache-budget", "12Q"], &model),
        "expected bytes",
    );
    bad(
        &t(
            &["--freeze", "schedule", "--cache-budget", "99999999999G"],
            &model,
        ),
        "expected bytes",
    );
    bad(
        &t(
            &[
                "--sampling",
                "epochs",
                "--microbatches",
                "64",
                "--data",
                data.to_str().unwrap(),
            ],
            &model,
        ),
        "fewer than one step",
    );
    let _ = std::fs::remove_dir_all(&dir);
    // PipeTransformer's ablations on its own setting.
    let vit = shared("examples/vit_b16_rtx5000.toml");
    let c = shared("examples/pipetransformer_2x8.toml");
    let sim = |extra: &[&str]| -> Vec<String> {
        // The paper's setting: GPipe, 8 micro-batches, alpha 0.5 (2 x 8 from the cluster).
        [
            "elastic-sim",
            "--profile",
            &vit,
            "--cluster",
            &c,
            "--schedule",
            "gpipe",
            "--microbatches",
            "8",
            "--freeze-alpha",
            "0.5",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let args = sim(&["--epochs", "4", "--json"]);
    let j = json(&pw(&args.iter().map(String::as_str).collect::<Vec<_>>()));
    let speedup = |i: usize| j["ablations"][i]["speedup"].as_f64().unwrap();
    assert_eq!(j["trajectory"], serde_json::json!([0, 13, 19, 20]));
    assert_eq!(speedup(0), 1.0);
    assert!(speedup(3) > 1.0 && speedup(4) >= speedup(3), "{j}");
    assert!(speedup(4) >= speedup(2), "{j}");
    for (extra, want) in [
        (["--trajectory", "0,5,3"], "must not decrease"),
        (["--stages", "12"], "need 24 devices"),
        (["--trajectory", "0,27"], "always trains"),
        (["--rows", "18446744073709551615"], "too many to count"),
    ] {
        let args = sim(&extra);
        bad(&args.iter().map(String::as_str).collect::<Vec<_>>(), want);
    }
}

/// `--elastic-batch` needs `--elastic` (what `scale` does is tested on the library, in
/// crates/runtime/tests/run.rs).
#[test]
fn elastic_batch_needs_elastic() {
    bad(
        &["train", "--elastic-batch", "scale", "--steps", "1"],
        "--elastic",
    );
}

#[test]
fn compare_sim_models_serialised_threads() {
    // In-process workers: the simulation shares one compute resource, and says so beside the
    // one-device-per-worker figure; one worker needs no such line.
    let run = |stages: &str| {
        let o = pw(&[
            &[
                "train",
                "--stages",
                stages,
                "--microbatches",
                "2",
                "--steps",
                "4",
                "--no-checkpoint",
                "--compare-sim",
                "--transport",
                "threads",
            ][..],
            &TINY,
        ]
        .concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let two = run("2");
    assert!(two.contains("measured/simulated"), "{two}");
    assert!(two.contains("compute serialised"), "{two}");
    assert!(two.contains("with a device each"), "{two}");
    let one = run("1");
    assert!(one.contains("measured/simulated"), "{one}");
    assert!(!one.contains("compute serialised"), "{one}");
    // --compare-svg draws both timelines of the step in one SVG (and implies --compare-sim).
    let svg = std::env::temp_dir().join(format!("pw-compare-{}.svg", std::process::id()));
    let o = pw(&[
        &[
            "train",
            "--steps",
            "4",
            "--no-checkpoint",
            "--compare-svg",
            svg.to_str().unwrap(),
        ][..],
        &TINY,
    ]
    .concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(
        text.matches("<svg").count(),
        5,
        "an outer SVG holding two charts"
    );
    assert!(text.contains("simulated iteration") && text.contains("measured: last step"));
    let _ = std::fs::remove_file(&svg);
    bad(
        &[&["train", "--steps", "2", "--compare-sim"][..], &TINY].concat(),
        "--compare-sim needs at least 3 steps",
    );
    // The same model in `simulate`: GPipe P=2 M=2 at unit costs takes 9 with a device per
    // worker and 12, all of its work one unit after another, with one shared compute.
    let gpipe = [
        "simulate",
        "--schedule",
        "gpipe",
        "--stages",
        "2",
        "--microbatches",
        "2",
    ];
    let own = json(&pw(&[&gpipe[..], &["--json"]].concat()));
    let shared = json(&pw(&[&gpipe[..], &["--json", "--shared-compute"]].concat()));
    assert_eq!(own["makespan"], 9.0);
    assert_eq!(shared["makespan"], 12.0);
}

/// `report` draws a run's metrics: the loss panel with both curves, throughput; a layout panel
/// only when the layout changed. Bad metrics files are named, exit 2.
#[test]
fn report_draws_a_runs_metrics() {
    let dir = fresh_dir("report");
    let (m, svg) = (dir.join("m.jsonl"), dir.join("r.svg"));
    let (m_s, svg_s) = (m.to_str().unwrap(), svg.to_str().unwrap());
    let mut args = vec![
        "train",
        "--steps",
        "12",
        "--no-checkpoint",
        "--metrics",
        m_s,
    ];
    args.extend(TINY);
    let o = pw(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = pw(&["report", m_s, "--out", svg_s]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("12 steps; loss, throughput"), "{out}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    // Training loss, its running mean, held-out loss and throughput: a polyline each; the
    // unigram baseline dashed, ticks on both axes.
    assert_eq!(text.matches("<polyline").count(), 4, "{text}");
    assert!(text.contains(">held-out<") && !text.contains(">layout<"));
    assert!(text.contains(">training, running mean<") && text.contains("unigram baseline 3.055"));
    assert!(text.contains(">step<") && text.contains(">12<"), "{text}");
    // The same chart as a PNG; another extension is refused.
    let png = dir.join("r.png");
    let o = pw(&["report", m_s, "--out", png.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&png)
        .unwrap()
        .starts_with(b"\x89PNG\r\n\x1a\n"));
    bad(
        &["report", m_s, "--out", &dir.join("r.txt").to_string_lossy()],
        "write a .svg or a .png",
    );
    bad(&["report", &tmp("empty.jsonl", "")], "no training steps");
    bad(
        &["report", &tmp("bad.jsonl", "{\"step\": 1}\n[1]\n")],
        "bad.jsonl:2: not a metrics row",
    );
    bad(&["report", dir.to_str().unwrap()], "not a regular file");
    // Its own input as --out, by name or by a hard link: refused, the metrics kept (a
    // symlink is refused as every output symlink is).
    let before = std::fs::read(&m).unwrap();
    let (hard, link) = (dir.join("hard.jsonl"), dir.join("link.jsonl"));
    std::fs::hard_link(&m, &hard).unwrap();
    std::os::unix::fs::symlink(&m, &link).unwrap();
    for out in [m_s, hard.to_str().unwrap()] {
        bad(&["report", m_s, "--out", out], "an input of this command");
    }
    bad(
        &["report", m_s, "--out", link.to_str().unwrap()],
        "refusing to replace it",
    );
    assert_eq!(std::fs::read(&m).unwrap(), before);
    // Absurd values are listed, not drawn: every coordinate is a number.
    let mut rows: String = (0..10)
        .map(|i| format!("{{\"step\": {i}, \"loss\": {}}}\n", 3.0 - 0.1 * i as f64))
        .collect();
    rows += "{\"step\": 10, \"loss\": 1e308}\n{\"step\": 11, \"loss\": -1e308}\n";
    let absurd = tmp("absurd.jsonl", &rows);
    let o = pw(&["report", &absurd, "--out", svg_s]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("loss: not drawn (outside the scale): training 1e308 at step 10, training -1e308 at step 11"),
        "{out}"
    );
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
    assert!(text.contains("not drawn"), "{text}");
}

/// A run records its data: `--print-config` writes it as `[data]`, `--config` reads it back,
/// and `eval` of the checkpoint scores the same held-out data by default, with the same
/// number of batches as training's validation (the same loss).
#[test]
fn runs_record_their_data_for_config_and_eval() {
    let dir = fresh_dir("data-record");
    let text = dir.join("corpus.txt");
    std::fs::write(
        &text,
        "the pipeline cuts the model into stages. ".repeat(400),
    )
    .unwrap();
    let (ck, toml) = (dir.join("ck"), dir.join("run.toml"));
    let mut args = vec!["train", "--steps", "6", "--data", text.to_str().unwrap()];
    args.extend(TINY);
    let o = pw(&[&args[..], &["--print-config"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let printed = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        printed.contains("[data]") && printed.contains("corpus.txt"),
        "{printed}"
    );
    std::fs::write(&toml, &printed).unwrap();
    let o = pw(&[
        "train",
        "--config",
        toml.to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
    ]);
    let trained = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && trained.contains("-> "), "{trained}");
    let val = trained
        .split("-> ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let o = pw(&[
        "eval",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--keep",
        "1",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("corpus.txt (recorded in the checkpoint)"),
        "{out}"
    );
    assert!(
        out.contains(&format!("val loss {val}")),
        "train {val}: {out}"
    );
}

/// Timelines as pictures: `train --svg` draws the measured step with its sends and receive
/// waits; where a worker runs several stages (interleaved) each box names its stage.
#[test]
fn svg_timelines_show_waits_and_stages() {
    let dir = fresh_dir("svg");
    let (m, s) = (dir.join("m.svg"), dir.join("s.svg"));
    let mut args = vec![
        "train",
        "--steps",
        "2",
        "--no-checkpoint",
        "--svg",
        m.to_str().unwrap(),
    ];
    args.extend(TINY);
    let o = pw(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let svg = std::fs::read_to_string(&m).unwrap();
    assert!(svg.contains("measured: 1f1b on 2 workers") && svg.contains("send, receive wait"));
    assert!(
        svg.contains("<title>receive wait of stage"),
        "no receive waits drawn"
    );
    let o = pw(&[
        "simulate",
        "--schedule",
        "interleaved",
        "--stages",
        "2",
        "--chunks",
        "2",
        "--microbatches",
        "4",
        "--svg",
        s.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let svg = std::fs::read_to_string(&s).unwrap();
    assert!(
        svg.contains(">F0s0<") && svg.contains(">F0s2<"),
        "stage labels"
    );
    bad(
        &["train", "--steps", "1", "--svg", "/nonexistent/dir/m.svg"],
        "does not exist",
    );
}

/// Every optimizer setting has a flag (as in the TOML file), and `--micro-batch-size` names
/// the rows of a micro-batch; `--help` shows each default.
#[test]
fn optimizer_settings_are_flags_with_defaults_in_help() {
    let o = pw(&[
        "train",
        "--warmup",
        "7",
        "--min-lr",
        "0.0001",
        "--weight-decay",
        "0",
        "--clip",
        "0.5",
        "--micro-batch-size",
        "3",
        "--print-config",
    ]);
    let toml = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for line in [
        "warmup = 7",
        "min_lr = 0.0001",
        "weight_decay = 0.0",
        "clip = 0.5",
        "rows = 3",
    ] {
        assert!(toml.lines().any(|l| l == line), "{line} in {toml}");
    }
    let help = String::from_utf8_lossy(&pw(&["train", "--help"]).stdout).to_string();
    for d in [
        "[default: 2]",
        "[default: 60]",
        "[default: 0.003]",
        "[default: 1f1b]",
    ] {
        assert!(help.contains(d), "{d}");
    }
}

/// `profile --model` takes the configuration file `train --config` takes (its [model]), and a
/// partial [model] table is filled from the defaults.
#[test]
fn profile_takes_a_train_configuration() {
    let cfg = tmp(
        "run-config.toml",
        "steps = 3\nmicrobatches = 2\n[model]\nd_model = 16\nheads = 2\nlayers = 2\nseq_len = 16\n",
    );
    let out = tmp("run-profile.toml", "");
    let o = pw(&["profile", "--model", &cfg, "--out", &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("4 layer blocks"));
}

/// srun without PMIx (the environment of `srun --mpi=pmi2`, given by hand here) is named before
/// MPI's init dies on it, by task 0 only.
#[test]
fn srun_without_pmix_is_named_before_mpi_starts() {
    let run = |procid: &str| {
        Command::new(env!("CARGO_BIN_EXE_pipewright"))
            .args([
                "train",
                "--transport",
                "mpi",
                "--steps",
                "1",
                "--no-checkpoint",
            ])
            .env("SLURM_STEP_NUM_TASKS", "2")
            .env("SLURM_PROCID", procid)
            .env("PMI_RANK", procid)
            .env_remove("PMIX_RANK")
            .env_remove("OMPI_COMM_WORLD_SIZE")
            .output()
            .unwrap()
    };
    let o = run("0");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("srun --mpi=pmix"), "{err}");
    let o = run("1");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `--resume` takes the checkpoint's settings (model, plan, data), so no flag need be
/// repeated, and says what the flags given changed.
#[test]
fn resume_reuses_the_checkpoints_settings() {
    let dir = fresh_dir("resume-settings");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    let mut first = vec!["train", "--steps", "3", "--checkpoint-dir", ck_s];
    first.extend(TINY);
    assert!(pw(&first).status.success());
    let o = pw(&[
        "train",
        "--resume",
        "--checkpoint-dir",
        ck_s,
        "--steps",
        "5",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("with the checkpoint's settings; changed by flags: steps 3 -> 5"),
        "{err}"
    );
    assert!(err.contains("d_model 16"), "the checkpoint's model: {err}");
}
