//! Tied embeddings (`tie_word_embeddings`): the embedding (layer 0) and the LM head (the last
//! layer block) use one matrix. Each holds a copy, usually on different workers; after every
//! backward the two gradients are summed (the head's transposed) and both copies take the
//! same AdamW step, so they stay equal to the last bit, as Megatron-LM keeps its first and
//! last stages' embeddings. The norm counts the matrix once.

use crate::exec::{ExecError, Worker, WorkerOutput};
use crate::model::hf::transpose;
use crate::model::ModelConfig;
use crate::transport::Transport;
use pipewright_core::plan::ir::{Plan, Topology};

/// Where a tied matrix's two copies live in a plan.
#[derive(Debug, Clone)]
pub(crate) struct Tied {
    /// Every host of the first and of the last stage, ascending: the group that sums.
    pub group: Vec<usize>,
    vocab: usize,
    d: usize,
    last_layer: usize,
    last_stage: usize,
}

impl Tied {
    /// The tie of `model` under `plan`, if its embeddings are tied.
    pub fn of(model: &ModelConfig, plan: &Plan) -> Option<Tied> {
        if !model.tie_embeddings {
            return None;
        }
        let topo = Topology::new(plan);
        let last_stage = plan.stages.len() - 1;
        let mut group = [topo.groups[0].clone(), topo.groups[last_stage].clone()].concat();
        group.sort_unstable();
        group.dedup();
        Some(Tied {
            group,
            vocab: model.vocab,
            d: model.d_model,
            last_layer: model.num_blocks() - 1,
            last_stage,
        })
    }

    /// The head's copy is its last parameter: the tail of the head block's gradient.
    pub fn head_len(&self) -> usize {
        self.vocab * self.d
    }

    /// Is (stage slot, layer k) of this worker the head block?
    fn is_head(&self, first_layer: usize, k: usize) -> bool {
        first_layer + k == self.last_layer
    }

    /// Sum the two copies' gradients (already summed over replicas) and give both the sum.
    /// Only the first host of each stage contributes, so replicas count once.
    pub fn sum(
        &self,
        worker: &Worker,
        out: &mut WorkerOutput,
        topo: &Topology,
        transport: &dyn Transport,
    ) -> Result<(), ExecError> {
        if !self.group.contains(&worker.rank) {
            return Ok(());
        }
        let n = self.head_len();
        let mut sum = vec![0f32; n];
        let mut add = |g: &[f32]| sum.iter_mut().zip(g).for_each(|(s, x)| *s += x);
        for (held, g) in worker.stages.iter().zip(&out.grads) {
            // The embedding's matrix is its block's first parameter.
            if held.first_layer == 0 && topo.leads(worker.rank, held.stage) && !g[0].is_empty() {
                add(&g[0][..n]);
            }
            let k = g.len() - 1;
            if self.is_head(held.first_layer, k) && topo.leads(worker.rank, self.last_stage) {
                let h = &g[k];
                add(&transpose(&h[h.len() - n..], self.d, self.vocab));
            }
        }
        if self.group.len() > 1 {
            transport.all_reduce_gradients(worker.rank, &self.group, &mut sum)?;
        }
        let head = transpose(&sum, self.vocab, self.d);
        for (held, g) in worker.stages.iter().zip(out.grads.iter_mut()) {
            if held.first_layer == 0 && !g[0].is_empty() {
                g[0][..n].copy_from_slice(&sum);
            }
            let k = g.len() - 1;
            if self.is_head(held.first_layer, k) {
                let len = g[k].len();
                g[k][len - n..].copy_from_slice(&head);
            }
        }
        Ok(())
    }
}

/// The groups a transport must know of for `plan`: each stage's replica group, and the tied
/// matrix's group if the model ties its embeddings.
pub(crate) fn groups(model: &ModelConfig, plan: &Plan) -> Vec<Vec<usize>> {
    let mut g = Topology::new(plan).groups;
    if let Some(t) = Tied::of(model, plan) {
        g.push(t.group);
    }
    g
}
