//! Model profile: what each layer costs (docs/formats.md, "Model profile").

use crate::error::{parse_toml, Error, Result};
use crate::inputs::read_file;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Copies of a stage's parameters that training keeps: weights, gradients and AdamW's two
/// moments. The one memory model's static part (the simulator, the planners, the profile
/// checks and the runtime's estimate all use it).
pub const STATE_COPIES: u64 = 4;

/// Bytes a stage holds besides activations, for `param_bytes` bytes of parameters.
pub fn static_bytes(param_bytes: u64) -> u64 {
    STATE_COPIES * param_bytes
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub model: ModelInfo,
    pub layers: Vec<Layer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    #[serde(default)]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub name: String,
    /// Seconds for one micro-batch forward on a device of speed 1.0.
    pub forward: f64,
    /// Full backward (input + weight gradients); default 2 x forward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<f64>,
    /// The weight-gradient part (W) of the backward; default backward / 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_grad: Option<f64>,
    /// The input-gradient backward (B) of a split backward, when measured: splitting may cost
    /// more than `backward - weight_grad` (pipewright's own profiler measures it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_grad: Option<f64>,
    /// Seconds of one optimizer step over this layer's parameters (default 0: not modelled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<f64>,
    /// Bytes of weights.
    #[serde(default)]
    pub params: u64,
    /// Bytes of this layer's output for one micro-batch.
    #[serde(default)]
    pub activation: u64,
}

impl Layer {
    pub fn backward(&self) -> f64 {
        self.backward.unwrap_or(2.0 * self.forward)
    }
    pub fn weight_grad(&self) -> f64 {
        self.weight_grad.unwrap_or(self.backward() / 2.0)
    }
    /// Input-gradient part (B) of the backward.
    pub fn input_grad(&self) -> f64 {
        self.input_grad
            .unwrap_or(self.backward() - self.weight_grad())
    }
}

/// Costs of a contiguous run of layers (a stage) on a device of speed 1.0.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StageCost {
    pub forward: f64,
    /// Input-gradient part of the backward (B).
    pub backward_input: f64,
    /// Weight-gradient part of the backward (W).
    pub backward_weight: f64,
    /// Bytes of weights.
    pub params: u64,
    /// Bytes of activations kept for the backward of one micro-batch (all layers' outputs).
    pub activation_kept: u64,
    /// Bytes of the stage's output (what is sent to the next stage).
    pub activation_out: u64,
    /// The fused backward (BW), when it is not `backward_input + backward_weight` (a split
    /// backward measured to cost more than the fused one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<f64>,
    /// One optimizer step over the stage's parameters, after its gradients are reduced.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub update: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl StageCost {
    /// Uniform costs, the same for every stage (the `--cost-f/b/w` flags).
    pub fn uniform(f: f64, b: f64, w: f64) -> Self {
        StageCost {
            forward: f,
            backward_input: b,
            backward_weight: w,
            ..Default::default()
        }
    }
    pub fn full_backward(&self) -> f64 {
        self.backward
            .unwrap_or(self.backward_input + self.backward_weight)
    }
}

impl Profile {
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_file(path)?;
        Self::parse(&path.display().to_string(), &text)
    }

    pub fn parse(file: &str, text: &str) -> Result<Self> {
        let p: Profile = parse_toml(file, text)?;
        p.check(file)?;
        Ok(p)
    }

    /// Rules TOML types cannot express: non-negative, finite costs; W within the backward.
    pub fn check(&self, file: &str) -> Result<()> {
        if self.layers.is_empty() {
            return Err(Error::input(
                file,
                "no [[layers]]: a profile needs at least one layer",
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let at = format!("layers[{i}] (\"{}\")", l.name);
            for (key, v) in [
                ("forward", Some(l.forward)),
                ("backward", l.backward),
                ("weight_grad", l.weight_grad),
                ("input_grad", l.input_grad),
                ("optimizer", l.optimizer),
            ] {
                if let Some(v) = v {
                    if !v.is_finite() || v < 0.0 {
                        return Err(Error::input(
                            file,
                            format!("{at}: {key} = {v} must be a finite number >= 0"),
                        ));
                    }
                }
            }
            if l.weight_grad() > l.backward() + 1e-12 {
                return Err(Error::input(
                    file,
                    format!(
                        "{at}: weight_grad = {} exceeds backward = {}",
                        l.weight_grad(),
                        l.backward()
                    ),
                ));
            }
        }
        // Memory figures add weights, gradients and AdamW (4 x params) and activations of up to
        // MAX_ACTIONS micro-batch passes: keep every such sum inside u64, or refuse.
        let limit: u64 = 1 << 60;
        let static_bytes = self.layers.iter().try_fold(0u64, |acc, l| {
            l.params
                .checked_mul(STATE_COPIES)
                .and_then(|b| acc.checked_add(b))
        });
        let act = self
            .layers
            .iter()
            .try_fold(0u64, |acc, l| acc.checked_add(l.activation));
        let act_peak = act.and_then(|a| a.checked_mul(crate::limits::MAX_ACTIONS));
        if static_bytes.is_none_or(|b| b > limit) || act_peak.is_none_or(|b| b > limit) {
            return Err(Error::input(
                file,
                format!(
                    "parameter or activation bytes too large: 4 x total params and total activation x {} in-flight passes must stay under 2^60 bytes, so memory figures cannot overflow",
                    crate::limits::MAX_ACTIONS
                ),
            ));
        }
        Ok(())
    }

    /// The profile as TOML in the layout of docs/formats.md.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("profile serialises")
    }

    /// Costs of layers `lo..hi`.
    pub fn stage_cost(&self, lo: usize, hi: usize) -> StageCost {
        let ls = &self.layers[lo..hi];
        StageCost {
            forward: ls.iter().map(|l| l.forward).sum(),
            backward_input: ls.iter().map(|l| l.input_grad()).sum(),
            backward_weight: ls.iter().map(|l| l.weight_grad()).sum(),
            // The fused backward, where a measured split does not add up to it.
            backward: ls
                .iter()
                .any(|l| l.input_grad.is_some())
                .then(|| ls.iter().map(|l| l.backward()).sum()),
            update: ls.iter().filter_map(|l| l.optimizer).sum(),
            params: ls.iter().map(|l| l.params).sum(),
            activation_kept: ls.iter().map(|l| l.activation).sum(),
            activation_out: ls.last().map_or(0, |l| l.activation),
        }
    }

    /// Stage costs for a partition given as layers per stage.
    pub fn stage_costs(&self, layers_per_stage: &[usize]) -> Vec<StageCost> {
        let mut lo = 0;
        layers_per_stage
            .iter()
            .map(|&n| {
                let c = self.stage_cost(lo, lo + n);
                lo += n;
                c
            })
            .collect()
    }
}

/// `n` layers of forward 1 and backward 2, `params` bytes of weights and `activation` bytes kept
/// each: the planners' tests' model.
#[cfg(test)]
pub(crate) fn uniform_layers(n: usize, params: u64, activation: u64) -> Profile {
    let mut toml = String::from("[model]\nname = \"m\"\n");
    for i in 0..n {
        toml += &format!("[[layers]]\nname = \"l{i}\"\nforward = 1\nbackward = 2\nparams = {params}\nactivation = {activation}\n");
    }
    Profile::parse("m.toml", &toml).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
[model]
name = "t"
[[layers]]
name = "a"
forward = 1.0
params = 10
activation = 4
[[layers]]
name = "b"
forward = 2.0
backward = 3.0
weight_grad = 1.0
activation = 8
"#;

    #[test]
    fn defaults_follow_formats_md() {
        let p = Profile::parse("p.toml", SMALL).unwrap();
        assert_eq!(p.layers[0].backward(), 2.0);
        assert_eq!(p.layers[0].weight_grad(), 1.0);
        assert_eq!(p.layers[1].input_grad(), 2.0);
        let c = p.stage_cost(0, 2);
        assert_eq!(
            (c.forward, c.backward_input, c.backward_weight),
            (3.0, 3.0, 2.0)
        );
        assert_eq!((c.params, c.activation_kept, c.activation_out), (10, 12, 8));
    }

    #[test]
    fn a_measured_split_backward_prices_b_and_keeps_the_fused_one() {
        let p = Profile::parse(
            "p.toml",
            &SMALL.replace("weight_grad = 1.0", "weight_grad = 1.0\ninput_grad = 2.5"),
        )
        .unwrap();
        assert_eq!(p.layers[1].input_grad(), 2.5);
        let c = p.stage_cost(0, 2);
        // B is the measured split part; BW stays the fused backward (2 + 3), not B + W.
        assert_eq!((c.backward_input, c.backward_weight), (3.5, 2.0));
        assert_eq!(c.full_backward(), 5.0);
        // Without it, nothing changes (and plans carry no extra field).
        let q = Profile::parse("p.toml", SMALL).unwrap().stage_cost(0, 2);
        assert_eq!((q.backward, q.full_backward()), (None, 5.0));
        assert!(Profile::parse(
            "p.toml",
            &SMALL.replace("weight_grad = 1.0", "weight_grad = 1.0\ninput_grad = -1")
        )
        .is_err());
    }

    #[test]
    fn unknown_key_is_named_with_line() {
        let e = Profile::parse("p.toml", &SMALL.replace("params = 10", "parms = 10")).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("p.toml: line 7, column 1"), "{s}");
        assert!(s.contains("parms"), "{s}");
        assert!(!s.contains('\n'));
    }

    #[test]
    fn toml_round_trip() {
        let p = Profile::parse("p.toml", SMALL).unwrap();
        assert_eq!(Profile::parse("q.toml", &p.to_toml()).unwrap(), p);
    }

    #[test]
    fn negative_cost_is_rejected() {
        let e = Profile::parse("p.toml", &SMALL.replace("forward = 2.0", "forward = -2.0"))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "p.toml: layers[1] (\"b\"): forward = -2 must be a finite number >= 0"
        );
    }

    #[test]
    fn malformed_toml_is_one_line() {
        let e = Profile::parse("p.toml", "[model\nname = 1")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("p.toml: line 1"), "{e}");
        assert!(!e.contains('\n'));
    }
}
