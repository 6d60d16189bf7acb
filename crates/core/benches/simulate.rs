//! Simulator and partitioner scaling: 64 workers x 1,024 micro-batches; 1,000 layers into 64 stages.

use criterion::{criterion_group, criterion_main, Criterion};
use pipewright_core::cluster::{Cluster, Link};
use pipewright_core::plan::validate::validate;
use pipewright_core::profile::StageCost;
use pipewright_core::schedule::{generate, ScheduleKind};
use pipewright_core::search::partition::{min_max_split, prefix};
use pipewright_core::sim::{simulate, SimSetup};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("64x1024");
    g.sample_size(10);
    let link = Link {
        latency: 1e-5,
        bandwidth: 1e10,
        overhead: 0.0,
    };
    let cluster = Cluster::homogeneous(64, link);
    for (kind, v) in [
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::ZbH1, 1),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::ZbV, 2),
    ] {
        let plan = generate(kind, 64, 1024, v).unwrap();
        let stages = vec![
            StageCost {
                activation_out: 1 << 20,
                ..StageCost::uniform(1.0, 1.0, 1.0)
            };
            plan.num_stages()
        ];
        g.bench_function(format!("simulate {kind}"), |b| {
            b.iter(|| {
                simulate(&SimSetup {
                    plan: black_box(&plan),
                    stages: &stages,
                    cluster: &cluster,
                })
                .unwrap()
                .makespan
            })
        });
        g.bench_function(format!("generate+validate {kind}"), |b| {
            b.iter(|| validate(&generate(kind, 64, black_box(1024), v).unwrap()).unwrap())
        });
    }
    g.finish();
    let mut g = c.benchmark_group("partition");
    g.sample_size(10);
    let w: Vec<f64> = (0..1000).map(|i| 1.0 + ((i * 7919) % 13) as f64).collect();
    let pre = prefix(w.iter().copied());
    g.bench_function("1000 layers into 64 stages", |b| {
        b.iter(|| {
            min_max_split(1000, black_box(64), |_, lo, hi| pre[hi] - pre[lo])
                .unwrap()
                .bottleneck
        })
    });
    g.finish();
    let profile = pipewright_core::profile::Profile::parse(
        "vit",
        include_str!("../../../examples/vit_b16_params.toml"),
    )
    .unwrap();
    let cluster = Cluster::parse(
        "pt",
        include_str!("../../../examples/pipetransformer_2x8.toml"),
    )
    .unwrap();
    let mut g = c.benchmark_group("plan");
    g.sample_size(10);
    g.bench_function("vit-b16 on pipetransformer_2x8, global batch 64", |b| {
        b.iter(|| {
            pipewright_core::job::planner::search(&profile, &cluster, black_box(64))
                .unwrap()
                .len()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
