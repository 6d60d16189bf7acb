//! The model families, registered once: a new family adds its folder and one line here, which
//! gives it a [`Family`] name, a [`LayerBlock`] variant and a place in [`FAMILIES`].

use super::spec::Spec;
use super::ModelConfig;

// `Variant => folder`, the default family first.
super::layer::families! {
    Gpt => gpt,
    Llama => llama,
    Gpt2 => gpt2,
    Bert => bert,
    Vit => vit,
}

/// `family`'s entry.
pub fn spec(family: Family) -> &'static Spec {
    FAMILIES
        .iter()
        .find(|s| s.family == family)
        .expect("every family is registered")
}

/// The family of a Hugging Face `model_type`.
pub fn by_hf_type(model_type: &str) -> Option<&'static Spec> {
    FAMILIES
        .iter()
        .copied()
        .find(|s| s.hf_type == Some(model_type))
}

/// The `model_type`s pipewright reads, in registry order.
pub fn hf_types() -> Vec<&'static str> {
    FAMILIES.iter().filter_map(|s| s.hf_type).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_registered_once() {
        for f in [
            Family::Gpt,
            Family::Llama,
            Family::Gpt2,
            Family::Bert,
            Family::Vit,
        ] {
            let n = FAMILIES.iter().filter(|s| s.family == f).count();
            assert_eq!(n, 1, "{f:?} registered {n} times");
            assert_eq!(spec(f).family, f);
        }
        assert_eq!(
            hf_types(),
            ["pipewright_gpt", "llama", "gpt2", "bert", "vit"]
        );
        assert_eq!(by_hf_type("bert").map(|s| s.family), Some(Family::Bert));
        assert_eq!(
            by_hf_type("pipewright_gpt").map(|s| s.family),
            Some(Family::Gpt)
        );
        assert!(by_hf_type("gpt").is_none());
    }
}
