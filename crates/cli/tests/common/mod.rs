//! What the CLI test suites share.

/// Model flags of a tiny model that trains in moments.
#[allow(dead_code)]
pub const TINY: [&str; 8] = [
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "2",
    "--seq-len",
    "16",
];

/// The tiny model with 4 transformer blocks (6 layer blocks): enough stages for skipping.
#[allow(dead_code)]
pub const TINY_L4: [&str; 8] = [
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "4",
    "--seq-len",
    "16",
];

/// The released PipeTransformer freezing rule, deciding every 3 steps: the first blocks
/// freeze within a few steps of a tiny run.
#[allow(dead_code)]
pub const FREEZE_EVERY_3: [&str; 6] = [
    "--freeze",
    "schedule",
    "--freeze-alpha",
    "0.5",
    "--freeze-every",
    "3",
];

/// An empty scratch directory for one test of this process.
#[allow(dead_code)]
pub fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pw-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The step at which a run stopped on request (SIGTERM, SIGUSR1), from its log.
#[allow(dead_code)]
pub fn stopped_at(log: &str) -> u64 {
    log.split("stopped on request at step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no stop message: {log}"))
}

/// PIDs of running processes whose program name ends with `program` and one of whose
/// arguments is `arg` (Linux /proc): the ranks of a job, told apart by a path of their own.
#[allow(dead_code)]
pub fn pids_with_arg(program: &str, arg: &std::path::Path) -> Vec<i32> {
    let want = arg.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let prog = args.first().copied().unwrap_or_default();
        if prog.ends_with(program.as_bytes()) && args.contains(&want) {
            out.push(pid);
        }
    }
    out
}

/// Busy loops on `n` cores while it lives: the machine's load as a user's other work makes it.
#[allow(dead_code)]
pub struct Busy(Vec<std::process::Child>);

#[allow(dead_code)]
impl Busy {
    pub fn cores(n: usize) -> Busy {
        Busy(
            (0..n)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("sh starts")
                })
                .collect(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
