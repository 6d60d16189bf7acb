//! `pipewright`: plan, simulate and run pipeline-parallel training.

mod data;
mod elastic;
mod error;
mod eval;
mod files;
mod freeze;
mod launch;
mod log;
mod model;
mod output;
mod plan;
mod ranks;
mod report;
mod simulate;
mod skip;
mod tokenize;
mod train;

use error::BadInput;
use files::load_plan;
use ranks::RANK;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use pipewright_core::plan::validate::validate;
use std::path::PathBuf;

/// mimalloc, told to keep what is freed (see `keep_freed_memory`): training frees and allocates
/// the same large activations and gradients every micro-batch, and glibc's allocator handed
/// them back to the OS and took them again, a page fault and a zeroed page per 4 KiB each time.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay`, by its place in mimalloc.h's `mi_option_t` (libmimalloc-sys has no
/// constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Never return freed memory to the OS (purge delay -1), unless MIMALLOC_PURGE_DELAY says
/// otherwise. Memory stays at the run's peak, which training reaches every step anyway.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's options; any value is allowed at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

#[derive(Parser)]
#[command(
    name = "pipewright",
    version,
    about = "Plan, simulate and run pipeline-parallel training of transformers.",
    after_help = "Workflow: `profile --out p.toml`, `plan --profile p.toml --cluster c.toml --out run.json`, \
then `simulate --plan run.json --cluster c.toml` and `train --plan run.json --cluster c.toml`."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a schedule (or read a plan file) and print it as a grid (step x worker), JSON,
    /// CSV, or torch.distributed.pipelining's per-rank action CSV.
    Schedule {
        #[command(flatten)]
        sched: simulate::SchedArgs,
        /// Print this plan file (JSON or CSV) instead of generating one.
        #[arg(long, conflicts_with_all = ["kind", "stages", "microbatches", "chunks", "replicas", "layer_blocks", "mem_cap"])]
        plan: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "grid")]
        format: Format,
    },
    /// Simulate a plan on uniform costs, its own costs, or a profile + cluster: time, bubble, memory, links.
    Simulate(simulate::SimulateArgs),
    /// Cut a profile's layers into K stages and assign devices, minimising the bottleneck stage.
    Partition(plan::PartitionArgs),
    /// Search depth, replicas, micro-batches, schedule and layout for a model on a cluster; write the winning plan.
    Plan(plan::PlanArgs),
    /// SkipPipe: routes that skip and swap stages on a slow, uneven network, with baselines.
    SkipPlan(skip::SkipPlanArgs),
    /// Train a model (pipewright's GPT, or Hugging Face LLaMA, GPT-2, BERT, ViT) as the pipeline of a plan file or schedule flags (built-in corpus by default).
    Train(Box<train::TrainArgs>),
    /// Measure each layer block of the model on this machine and write a profile TOML.
    Profile(train::ProfileArgs),
    /// PipeTransformer's ablations on a profile and cluster: throughput per epoch and speedup of
    /// freeze only, + AutoPipe + AutoCache, + AutoPipe + AutoDP, and all four.
    ElasticSim(elastic::ElasticSimArgs),
    /// Turn text into token shards (llm.c's format) with a tokenizer, once for many runs.
    Tokenize(tokenize::TokenizeArgs),
    /// Write a checkpoint (whatever plan trained it) as a Hugging Face model directory.
    Export(model::ExportArgs),
    /// Run one batch through a pipeline plan: logits, loss and every gradient under Hugging
    /// Face names, to check pipewright against a reference.
    Forward(model::ForwardArgs),
    /// Continue a prompt with a causal model (greedy, or sampled), from a Hugging Face
    /// directory or a checkpoint.
    Generate(model::GenerateArgs),
    /// Validation loss and perplexity of a checkpoint, also with stages left out (skip-robust inference).
    Eval(eval::EvalArgs),
    /// Draw a run's metrics file as an SVG: loss, held-out loss and accuracy, throughput, and
    /// an elastic run's layout, against the step.
    Report(report::ReportArgs),
    /// Check a plan file (JSON or CSV) and say what is wrong, if anything.
    Validate {
        /// Plan file (.json or .csv).
        file: PathBuf,
        /// Also check SkipPipe's rules: each micro-batch skips exactly K middle stages (stage 0
        /// and the head stage on its data node; visits balanced within 1).
        #[arg(long, value_name = "K")]
        skip: Option<usize>,
        /// With --skip: swaps of neighbouring stages allowed per route.
        #[arg(long, default_value_t = 1, requires = "skip")]
        max_swaps: usize,
        /// With --skip: micro-batches a worker may hold in flight.
        #[arg(long, requires = "skip")]
        max_in_flight: Option<usize>,
        /// With --skip: micro-batches a middle stage's worker may serve per iteration.
        #[arg(long, requires = "skip")]
        max_node_load: Option<usize>,
    },
}

#[derive(Copy, Clone, ValueEnum)]
pub enum Format {
    Grid,
    Json,
    /// pipewright's plan CSV (routes, stages, actions).
    Csv,
    /// One row per rank of `{stage}{F|I|W|B}{micro-batch}` cells, as torch's `_load_csv` reads.
    TorchCsv,
}

impl Format {
    /// `plan` in this format.
    pub fn render(self, plan: &pipewright_core::plan::ir::Plan) -> Result<String> {
        Ok(match self {
            Format::Grid => plan.grid(),
            Format::Json => format!("{}\n", plan.to_json()),
            Format::Csv => plan.to_csv(),
            Format::TorchCsv => pipewright_core::plan::torch_csv::to_torch_csv(plan)?,
        })
    }
}

/// When the linked OpenBLAS picked kernels below this CPU's (an OpenBLAS older than the CPU falls
/// back to SSE3 on x86-64, to its generic ARMV8 kernels on aarch64), run this same command again with `OPENBLAS_CORETYPE` set to
/// the kernels that fit: the library reads it only as it initialises, before `main`.
fn fit_blas_kernels() {
    use pipewright_runtime::machine::blas_lib::{kernel_fit, KernelFit, CHOSEN_CORETYPE};
    let KernelFit::Restart(core) = kernel_fit() else {
        return;
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_default();
        let err = std::process::Command::new("/proc/self/exe")
            .arg0(arg0)
            .args(args)
            .env("OPENBLAS_CORETYPE", core)
            .env(CHOSEN_CORETYPE, core)
            .exec();
        eprintln!("warning: could not restart with OPENBLAS_CORETYPE={core} for this CPU's kernels ({err}); set it yourself for up to 3x faster matrix products");
    }
}

/// Say once when the matrix products run on kernels below the CPU's, and the fix.
fn warn_slow_kernels() {
    use pipewright_runtime::machine::blas_lib::{kernel_fit, KernelFit};
    if let KernelFit::Slow { core, best } = kernel_fit() {
        let fix = if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
            format!("unset OPENBLAS_CORETYPE, or set it to {best}")
        } else {
            format!("set OPENBLAS_CORETYPE={best} (OpenBLAS), or use a BLAS that knows this CPU")
        };
        eprintln!("warning: the BLAS runs {core} kernels, below the {best} kernels this CPU can run: matrix products may run up to 3x slower; {fix}");
    }
}

/// `--version` also says which BLAS library runs the matrix products (see blas_lib), and the
/// threads it and this process have.
fn long_version() -> String {
    use pipewright_runtime::machine::blas_lib;
    let blas = match blas_lib::blas() {
        Ok(b) => b.description.clone(),
        Err(e) => format!("unusable: {e}"),
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let threads = blas_lib::blas_threads().map_or("?".to_string(), |t| t.to_string());
    // In-process workers may move their products to MKL (blas_lib::split_products).
    let moved = match blas_lib::mkl_for_split() {
        Some(p) => format!(
            "\nin-process workers: MKL ({}, sequential; chosen for this Intel CPU, PIPEWRIGHT_BLAS=system overrides)",
            p.display()
        ),
        None => String::new(),
    };
    format!(
        "{}\nBLAS: {blas}{moved}\nthreads: BLAS {threads}, cores this process may use {cores}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Old spellings of flags, per command, still taken as hidden aliases: (commands, old, new).
const OLD_SPELLINGS: &[(&[&str], &str, &str)] = &[
    (
        &["schedule", "simulate", "elastic-sim"],
        "--kind",
        "--schedule",
    ),
    (&["skip-plan"], "--data-nodes", "--replicas"),
    (&["eval"], "--batches", "--eval-batches"),
    (&["eval"], "--keep", "--keep-stages"),
    (&["schedule", "simulate"], "--layers", "--layer-blocks"),
];

/// One line on stderr for each old spelling on the command line: it still works, but the
/// same thing has one name in every command.
fn hint_old_spellings(args: &[String]) {
    let Some(cmd) = args.get(1) else { return };
    for (cmds, old, new) in OLD_SPELLINGS {
        let used = args[2..]
            .iter()
            .any(|a| a == old || a.strip_prefix(old).is_some_and(|r| r.starts_with('=')));
        if cmds.contains(&cmd.as_str()) && used {
            eprintln!("hint: {old} is now spelled {new} (as in the other commands)");
        }
    }
}

fn main() {
    fit_blas_kernels();
    keep_freed_memory();
    pipewright_runtime::backend::pin_burn_default_device();
    // Die quietly on a closed pipe (`pipewright ... | head`) like other command-line tools.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let parsed = Cli::command()
        .long_version(&*Box::leak(long_version().into_boxed_str()))
        .try_get_matches()
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)))
        .map(|(mut cli, m)| {
            if let (Cmd::Train(a), Some(("train", t))) = (&mut cli.cmd, m.subcommand()) {
                a.given = given_flags(t);
            }
            cli
        });
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind::*;
            if matches!(
                e.kind(),
                DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            let text = e.to_string();
            let line: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| {
                    !l.is_empty()
                        && !l.starts_with("For more information")
                        && !l.starts_with("Usage:")
                })
                .collect();
            eprintln!("{} (see --help)", line.join(" "));
            std::process::exit(2);
        }
    };
    // After the parse, so that a command line clap refuses still gets one line; after
    // fit_blas_kernels, which may run the process again.
    hint_old_spellings(&std::env::args().collect::<Vec<_>>());
    let flags = match &cli.cmd {
        Cmd::Plan(_) => error::Flags::Planner,
        Cmd::ElasticSim(_) => error::Flags::ElasticSim,
        Cmd::Eval(_)
        | Cmd::Profile(_)
        | Cmd::Validate { .. }
        | Cmd::Export(_)
        | Cmd::Tokenize(_)
        | Cmd::Report(_)
        | Cmd::Generate(_) => error::Flags::None,
        _ => error::Flags::Pipeline,
    };
    if let Err(e) = run(cli) {
        let code = error::exit_code(&e);
        let text = error::message(&e, flags);
        match RANK.get() {
            // Every rank sees the same bad input; one message is enough.
            Some(&r) if code == 2 && r > 0 => {}
            Some(_) if code == 2 => say_error(&text),
            Some(&r) if text.contains(&format!("rank {r}:")) => say_error(&text),
            Some(&r) => say_error(&format!("rank {r}: {text}")),
            None => say_error(&text),
        }
        // Over MPI, exit without finalising: a peer may be dead.
        std::process::exit(code);
    }
}

/// The ids of the flags given on the command line (not defaults).
fn given_flags(m: &clap::ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}

/// `error: MESSAGE` on stderr in one write: `eprintln!` writes its pieces separately, and under
/// mpirun the launcher's own abort notice could land between them, splitting the line.
fn say_error(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: {text}\n").as_bytes());
}

/// A PIPEWRIGHT_BLAS that cannot be used stops the commands that multiply matrices before any
/// work, rather than quietly running on another library.
fn check_blas() -> Result<()> {
    pipewright_runtime::machine::blas_lib::blas().map_err(|e| {
        BadInput(match e.mkl_missing {
            true => format!("{e}; `scripts/install-deps --mkl` installs MKL"),
            false => e.to_string(),
        })
    })?;
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    if matches!(
        cli.cmd,
        Cmd::Train(_)
            | Cmd::Profile(_)
            | Cmd::Eval(_)
            | Cmd::Export(_)
            | Cmd::Forward(_)
            | Cmd::Generate(_)
    ) {
        check_blas()?;
        // Once per run: not in the ranks pipewright started (it said so itself), and of a
        // launcher's tasks only in task 0.
        let first = ranks::launcher_tasks().is_none_or(|(_, _, me)| me == 0);
        if first && !launch::launched() && ranks::RANK.get().is_none_or(|&r| r == 0) {
            warn_slow_kernels();
        }
    }
    match cli.cmd {
        Cmd::Schedule {
            sched,
            plan,
            format,
        } => {
            let plan = match plan {
                Some(f) => files::load_valid_plan(&f)?,
                None => sched.plan()?,
            };
            print!("{}", format.render(&plan)?);
            Ok(())
        }
        Cmd::Simulate(a) => simulate::cmd_simulate(a),
        Cmd::Partition(a) => plan::cmd_partition(a),
        Cmd::Plan(a) => plan::cmd_plan(a),
        Cmd::SkipPlan(a) => skip::cmd_skip_plan(a),
        Cmd::Train(a) => train::cmd_train(*a),
        Cmd::Profile(a) => train::cmd_profile(a),
        Cmd::Eval(a) => eval::cmd_eval(a),
        Cmd::Export(a) => model::cmd_export(a),
        Cmd::Tokenize(a) => tokenize::cmd_tokenize(a),
        Cmd::Report(a) => report::cmd_report(a),
        Cmd::Forward(a) => model::cmd_forward(a),
        Cmd::Generate(a) => model::cmd_generate(a),
        Cmd::ElasticSim(a) => elastic::cmd_elastic_sim(a),
        Cmd::Validate {
            file,
            skip,
            max_swaps,
            max_in_flight,
            max_node_load,
        } => {
            let plan = load_plan(&file)?;
            validate(&plan).map_err(|e| BadInput(format!("{}: {e}", file.display())))?;
            if let Some(skip) = skip {
                let rules = pipewright_core::search::skip::SkipRules {
                    skip,
                    max_swaps,
                    max_in_flight,
                    max_node_load,
                };
                pipewright_core::search::skip::check_skip_rules(&plan, &rules)
                    .map_err(|e| BadInput(format!("{}: {e}", file.display())))?;
            }
            println!(
                "{}: valid ({} workers, {} stages holding {} layers, {} micro-batches, {} actions)",
                file.display(),
                plan.num_workers(),
                plan.num_stages(),
                plan.num_layers(),
                plan.num_microbatches,
                plan.workers.iter().map(Vec::len).sum::<usize>()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MI_OPTION_PURGE_DELAY;
    use libmimalloc_sys::{mi_option_get, mi_option_set};

    /// The option number is ours (libmimalloc-sys names no constant): it must still be the
    /// purge delay, whose default in the mimalloc v3 that libmimalloc-sys builds is 1000 ms,
    /// and setting it must stick.
    #[test]
    fn the_purge_delay_option_is_the_one_we_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return; // the environment set it: the default is not observable
        }
        unsafe {
            assert_eq!(
                mi_option_get(MI_OPTION_PURGE_DELAY),
                1000,
                "not the purge delay"
            );
            // Its neighbours: (deprecated) eager_commit_delay (1) and use_numa_nodes (0).
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY - 1), 1);
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY + 1), 0);
            mi_option_set(MI_OPTION_PURGE_DELAY, -1);
            assert_eq!(mi_option_get(MI_OPTION_PURGE_DELAY), -1);
        }
    }
}

/// The vocabulary of flags: one name and one default for the same thing in every command.
#[cfg(test)]
mod vocabulary {
    use super::{Cli, OLD_SPELLINGS};
    use clap::CommandFactory;
    use std::collections::BTreeMap;

    /// Each flag's default in each command that takes it: clap's, or the `[default: X]` that
    /// `train` writes into its help; `None` for a flag with none.
    fn defaults() -> BTreeMap<String, BTreeMap<String, Option<String>>> {
        let mut out: BTreeMap<String, BTreeMap<String, Option<String>>> = BTreeMap::new();
        for cmd in Cli::command().get_subcommands() {
            for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                let Some(long) = arg.get_long() else { continue };
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                let from_help = help
                    .split_once("[default: ")
                    .and_then(|(_, r)| r.split_once(']'))
                    .map(|(d, _)| d.to_string());
                let from_clap = arg
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .reduce(|a, b| format!("{a},{b}"));
                out.entry(long.to_string())
                    .or_default()
                    .insert(cmd.get_name().to_string(), from_help.or(from_clap));
            }
        }
        out
    }

    /// Flags whose value is a different thing in each command: what it writes, and in what form.
    const EACH_ITS_OWN: &[&str] = &["out", "format"];

    /// A fixed default is the same wherever the flag is spelled. (A flag with none is required,
    /// or its default follows from the other inputs, and its help says how.)
    #[test]
    fn a_flag_in_several_commands_has_one_default() {
        let mut differ = Vec::new();
        for (flag, by_cmd) in defaults() {
            let mut fixed: Vec<&String> = by_cmd.values().flatten().collect();
            fixed.sort();
            fixed.dedup();
            if fixed.len() > 1 && !EACH_ITS_OWN.contains(&flag.as_str()) {
                differ.push(format!("--{flag}: {by_cmd:?}"));
            }
        }
        assert!(differ.is_empty(), "{}", differ.join("\n"));
        // The names users asked about have one default across these commands.
        let d = defaults();
        let sched = ["train", "schedule", "simulate"];
        for (flag, cmds, want) in [
            ("stages", &sched[..], "2"),
            ("microbatches", &sched[..], "4"),
            (
                "seed",
                &["train", "eval", "generate", "skip-plan"][..],
                "42",
            ),
            ("eval-batches", &["train", "eval"][..], "8"),
        ] {
            for c in cmds {
                assert_eq!(d[flag][*c].as_deref(), Some(want), "{c} --{flag}");
            }
        }
    }

    /// docs/flags.md: every flag, its default, and the commands that take it.
    fn flag_table() -> String {
        let mut out = String::from(
            "# Flags\n\nEvery flag of every command, with its default (`-`: none, the flag is \
             required or its default follows from other inputs, as `--help` says). One name and one \
             default for one thing: a test (`vocabulary` in crates/cli/src/main.rs) checks it and \
             writes this table (`PIPEWRIGHT_WRITE_DOCS=1 cargo test --release -p pipewright-cli --bin \
             pipewright vocabulary`). Old spellings still taken, with a hint: ",
        );
        let old: Vec<String> = OLD_SPELLINGS
            .iter()
            .map(|(c, o, n)| format!("`{o}` ({}: `{n}`)", c.join(", ")))
            .collect();
        out += &format!(
            "{}.\n\n| flag | default | commands |\n|---|---|---|\n",
            old.join("; ")
        );
        for (flag, by_cmd) in defaults() {
            let mut fixed: Vec<&String> = by_cmd.values().flatten().collect();
            fixed.dedup();
            let shared = fixed.len() == 1 || EACH_ITS_OWN.contains(&flag.as_str());
            let cmds: Vec<String> = by_cmd
                .iter()
                .map(|(c, d)| match (d, shared && fixed.len() == 1) {
                    (Some(d), false) => format!("{c} ({d})"),
                    _ => c.clone(),
                })
                .collect();
            let dflt = match fixed.as_slice() {
                [d] if by_cmd.values().all(Option::is_some) => format!("`{d}`"),
                [d] => format!("`{d}` where it has one"),
                [] => "-".into(),
                _ => "per command".into(),
            };
            out += &format!("| `--{flag}` | {dflt} | {} |\n", cmds.join(", "));
        }
        out
    }

    #[test]
    fn docs_flag_table_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/flags.md");
        let want = flag_table();
        if std::env::var_os("PIPEWRIGHT_WRITE_DOCS").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "docs/flags.md is stale: PIPEWRIGHT_WRITE_DOCS=1 cargo test --release -p pipewright-cli --bin pipewright vocabulary"
        );
    }

    /// An old spelling is a hidden alias of the one name, and the hint table says so.
    #[test]
    fn old_spellings_are_hidden_aliases() {
        let cli = Cli::command();
        for (cmds, old, new) in OLD_SPELLINGS {
            for c in *cmds {
                let cmd = cli.find_subcommand(c).unwrap();
                let (old, new) = (&old[2..], &new[2..]);
                let arg = cmd
                    .get_arguments()
                    .find(|a| a.get_long() == Some(new))
                    .unwrap_or_else(|| panic!("{c} has no --{new}"));
                let aliases = arg.get_all_aliases().unwrap_or_default();
                assert!(
                    aliases.contains(&old),
                    "{c}: --{old} is not an alias of --{new}"
                );
                assert!(
                    !arg.get_visible_aliases().unwrap_or_default().contains(&old),
                    "{c}: --{old} is shown"
                );
            }
        }
    }
}
