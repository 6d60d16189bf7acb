//! Text generation with the causal families: the prompt's keys and values are computed once
//! and kept per layer (a KV cache, llama), each new token then costs one position's work.
//! Greedy by default (temperature 0), as transformers' `generate` is.

use super::error::Error;
use super::llama::{KvCache, Layer};
use super::{LayerBlock, Stage, StageInput};
use crate::backend::{autodiff_lock, plain_device};
use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};

/// How to pick each next token.
#[derive(Debug, Clone)]
pub struct Sampling {
    /// 0: greedy (the most likely token); else softmax(logits / temperature).
    pub temperature: f64,
    /// Sample among the `top_k` most likely tokens only (0: all).
    pub top_k: usize,
    pub seed: u64,
}

/// `max_new` tokens after `prompt` (token ids), never past `max_positions` in all. Returns
/// only the new tokens.
pub fn generate(
    blocks: &[LayerBlock],
    prompt: &[i64],
    max_new: usize,
    max_positions: usize,
    how: &Sampling,
) -> Result<Vec<i64>, Error> {
    sample(blocks, prompt, max_new, max_positions, how).map_err(Error::Input)
}

fn sample(
    blocks: &[LayerBlock],
    prompt: &[i64],
    max_new: usize,
    max_positions: usize,
    how: &Sampling,
) -> Result<Vec<i64>, String> {
    if prompt.is_empty() {
        return Err("the prompt is empty: generation needs at least one token".into());
    }
    if prompt.len() >= max_positions {
        return Err(format!(
            "the prompt is {} tokens; the model takes at most {max_positions} positions",
            prompt.len()
        ));
    }
    let model = {
        let _guard = autodiff_lock();
        Stage {
            layers: blocks.to_vec(),
        }
        .valid()
    };
    // A KV cache for llama; the other families recompute the whole window each token.
    let cached = model
        .layers
        .iter()
        .all(|l| l.family() == super::Family::Llama);
    let mut rng = pipewright_core::rng::SplitMix64::new(how.seed);
    let mut caches: Vec<KvCache> = vec![None; model.layers.len()];
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new && tokens.len() < max_positions {
        let logits = if cached {
            // The first pass runs the whole prompt; later ones only the newest token.
            let start = if out.is_empty() { 0 } else { tokens.len() - 1 };
            forward_cached(&model, &tokens[start..], start, &mut caches)
        } else {
            model.forward(StageInput::Tokens(ids(&tokens)))
        };
        let [_, t, v] = logits.dims();
        let last: Vec<f32> = logits
            .slice([0..1, t - 1..t, 0..v])
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| format!("logits: {e:?}"))?;
        let next = pick(&last, how, &mut rng);
        tokens.push(next as i64);
        out.push(next as i64);
    }
    Ok(out)
}

fn ids(tokens: &[i64]) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(tokens.to_vec(), [1, tokens.len()]),
        &plain_device(),
    )
}

/// New positions `start..` through every layer, each block reading and extending its cache.
fn forward_cached(model: &Stage, new: &[i64], start: usize, caches: &mut [KvCache]) -> Tensor<3> {
    let mut x: Option<Tensor<3>> = None;
    for (layer, cache) in model.layers.iter().zip(caches.iter_mut()) {
        x = Some(match (layer, x) {
            (LayerBlock::Llama(Layer::Embed(e)), _) => e.forward(ids(new)),
            (LayerBlock::Llama(Layer::Block(b)), Some(h)) => b.forward_cached(h, start, cache),
            (LayerBlock::Llama(Layer::Head(h)), Some(x)) => {
                h.forward_with(x, &super::Ctx::default(), &mut None)
            }
            _ => unreachable!("a cached model is llama's embedding, blocks and head in order"),
        });
    }
    x.expect("a model has layers")
}

/// The next token: the arg-max, or a draw from the tempered (top-k) softmax.
fn pick(logits: &[f32], how: &Sampling, rng: &mut pipewright_core::rng::SplitMix64) -> usize {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0
    };
    if how.temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if how.top_k > 0 {
        order.truncate(how.top_k);
    }
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / how.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i;
        }
        u -= w;
    }
    order[order.len() - 1]
}
