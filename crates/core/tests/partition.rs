//! The partitioner against brute force on small random profiles and heterogeneous clusters.

use pipewright_core::cluster::Cluster;
use pipewright_core::profile::Profile;
use pipewright_core::search::partition::{partition, Objective, PartitionProblem};
use proptest::prelude::*;

fn profile(layers: &[(f64, u64, u64)]) -> Profile {
    let mut t = String::from("[model]\nname = \"rand\"\n");
    for (i, (f, p, a)) in layers.iter().enumerate() {
        t += &format!(
            "[[layers]]\nname = \"l{i}\"\nforward = {f}\nparams = {p}\nactivation = {a}\n"
        );
    }
    Profile::parse("rand.toml", &t).unwrap()
}

fn cluster(speeds: &[f64], regions: &[usize], memory: u64) -> Cluster {
    let mut t = format!("[defaults]\nlatency = 0.01\nbandwidth = 1000.0\nmemory = {memory}\n");
    for (i, (s, r)) in speeds.iter().zip(regions).enumerate() {
        t += &format!("[[devices]]\nname = \"d{i}\"\nregion = \"r{r}\"\nspeed = {s}\n");
    }
    t += "[[links]]\na = \"r0\"\nb = \"r1\"\nlatency = 0.5\nbandwidth = 50.0\n";
    Cluster::parse("rand-cluster.toml", &t).unwrap()
}

/// Every contiguous split and every injective device assignment.
fn brute(p: &Profile, c: &Cluster, k: usize, in_flight: &[usize]) -> f64 {
    let n = p.layers.len();
    let mut best = f64::INFINITY;
    let mut cuts = vec![0usize; k + 1];
    cuts[k] = n;
    fn splits(n: usize, k: usize, at: usize, cuts: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
        if at == k {
            f(cuts);
            return;
        }
        for c in cuts[at - 1] + 1..=n - (k - at) {
            cuts[at] = c;
            splits(n, k, at + 1, cuts, f);
        }
    }
    fn perms(d: usize, k: usize, cur: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
        if cur.len() == k {
            f(cur);
            return;
        }
        for x in 0..d {
            if !cur.contains(&x) {
                cur.push(x);
                perms(d, k, cur, f);
                cur.pop();
            }
        }
    }
    let mut eval = |cuts: &[usize]| {
        perms(c.len(), k, &mut Vec::new(), &mut |devs| {
            let mut worst: f64 = 0.0;
            for st in 0..k {
                let ls = &p.layers[cuts[st]..cuts[st + 1]];
                let dev = &c.devices[devs[st]];
                let need: f64 = ls
                    .iter()
                    .map(|l| 4.0 * l.params as f64 + in_flight[st] as f64 * l.activation as f64)
                    .sum();
                if need > dev.memory.unwrap() as f64 {
                    worst = f64::INFINITY;
                    break;
                }
                let mut t = ls.iter().map(|l| l.forward + l.backward()).sum::<f64>() / dev.speed;
                if st + 1 < k {
                    t += c.transfer_time(devs[st], devs[st + 1], ls.last().unwrap().activation);
                }
                worst = worst.max(t);
            }
            best = best.min(worst);
        });
    };
    splits(n, k, 1, &mut cuts, &mut eval);
    best
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]
    #[test]
    fn exact_equals_brute_force(
        layers in prop::collection::vec((0.1f64..3.0, 1u64..50, 1u64..200), 4..10),
        speeds in prop::collection::vec(prop::sample::select(vec![0.5, 1.0, 2.0]), 4..6),
        k in 1usize..5,
        memory in 200u64..3000,
    ) {
        let k = k.min(layers.len());
        let regions: Vec<usize> = (0..speeds.len()).map(|i| i % 2).collect();
        let p = profile(&layers);
        let c = cluster(&speeds, &regions, memory);
        let in_flight: Vec<usize> = (0..k).map(|s| k - s).collect();
        let want = brute(&p, &c, k, &in_flight);
        let got = partition(&PartitionProblem { profile: &p, cluster: &c, stages: k, objective: Objective::Time, in_flight });
        match got {
            Ok(a) => {
                prop_assert!(a.exact);
                prop_assert!((a.split.bottleneck - want).abs() <= 1e-9 * want.max(1.0), "dp {} brute {}", a.split.bottleneck, want);
                prop_assert_eq!(a.split.layers_per_stage.iter().sum::<usize>(), layers.len());
                let mut d = a.devices.clone();
                d.sort_unstable();
                d.dedup();
                prop_assert_eq!(d.len(), k, "a device used twice");
            }
            Err(e) => prop_assert!(want.is_infinite(), "dp says infeasible ({e}) but brute force found {want}"),
        }
    }
}

#[test]
fn vit_b16_params_matches_the_optimum() {
    let p = Profile::parse("vit", include_str!("../../../examples/vit_b16_params.toml")).unwrap();
    let c = Cluster::uniform(8);
    for (k, want) in [(8, 12.582376), (4, 22.034152)] {
        let a = partition(&PartitionProblem {
            profile: &p,
            cluster: &c,
            stages: k,
            objective: Objective::Params,
            in_flight: vec![],
        })
        .unwrap();
        assert!(
            (a.split.bottleneck / 4e6 - want).abs() < 1e-6,
            "K={k}: {}",
            a.split.bottleneck / 4e6
        );
    }
}

#[test]
fn a_layer_too_large_names_device_and_bytes() {
    let p = profile(&[(1.0, 1000, 10), (1.0, 10, 10)]);
    let c = cluster(&[1.0, 1.0], &[0, 1], 2000);
    let e = partition(&PartitionProblem {
        profile: &p,
        cluster: &c,
        stages: 2,
        objective: Objective::Time,
        in_flight: vec![2, 1],
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "layer 0 (\"l0\") needs 4010 bytes (4000 weights+grads+AdamW, 10 activations for 1 micro-batches in flight) but the largest device, \"d0\", has 2000"
    );
}
