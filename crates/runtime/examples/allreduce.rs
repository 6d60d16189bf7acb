//! Gradient all-reduce time over MPI, through the same transport training uses: run as
//! `mpirun -np R target/release/examples/allreduce [MiB ...]` (default 4 and 64 MiB). Rank 0
//! prints the median of 10 rounds after 2 warm-up rounds per buffer size.

use pipewright_runtime::transport::mpi::Mpi;
use pipewright_runtime::transport::Transport;
use std::time::{Duration, Instant};

fn main() {
    let sizes: Vec<f64> = {
        let args: Vec<f64> = std::env::args()
            .skip(1)
            .map(|a| a.parse().expect("buffer sizes in MiB"))
            .collect();
        if args.is_empty() {
            vec![4.0, 64.0]
        } else {
            args
        }
    };
    let mpi = Mpi::start(Duration::from_secs(120)).expect("start under mpirun");
    let (rank, size) = (mpi.world().rank, mpi.world().size);
    let everyone: Vec<usize> = (0..size).collect();
    mpi.prepare(std::slice::from_ref(&everyone))
        .expect("prepare");
    for mib in sizes {
        let n = (mib * 1024.0 * 1024.0 / 4.0) as usize;
        let mut data = vec![1.0f32; n];
        let mut times = Vec::new();
        for round in 0..12 {
            let t = Instant::now();
            mpi.all_reduce(rank, &everyone, &mut data)
                .expect("all-reduce");
            if round >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        if rank == 0 {
            // Ring all-reduce moves 2 (R-1)/R of the buffer through each rank's link.
            let bus = 2.0 * (size as f64 - 1.0) / size as f64 * mib / 1024.0 / med;
            println!(
                "all-reduce {mib} MiB on {size} ranks: median {:.2} ms ({bus:.2} GiB/s bus bandwidth)",
                med * 1e3
            );
        }
    }
    mpi.finish();
}
