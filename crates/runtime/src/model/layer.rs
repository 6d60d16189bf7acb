//! A layer block as each family defines it, and the one enum over the families that a plan's
//! stages hold. A family writes its `Layer` (embedding, block, head) with [`family_layer!`]
//! and its forward with [`FamilyLayer`]; [`families!`] (invoked once, in the registry) makes
//! [`Family`](super::Family), the `LayerBlock` over every family, and their dispatch.

use super::{Ctx, Deferred, StageInput};
use burn::nn::Linear;
use burn::tensor::Tensor;

/// What a family's layer does beyond holding parameters. The defaults fit a family without
/// a tied LM head.
pub(crate) trait FamilyLayer {
    /// Hidden states out (or logits, from a head); a wrong input is an error, since plans from
    /// files decide what reaches a layer.
    fn forward_with(
        &self,
        x: StageInput,
        ctx: &Ctx,
        cap: &mut Option<&mut Deferred>,
    ) -> Result<Tensor<3>, String>;

    /// The token embedding's matrix `[vocab, d]`, from an embedding that has one (what a
    /// tied LM head starts as).
    fn token_embedding(&self) -> Option<Tensor<2>> {
        None
    }

    /// The LM head of a head that has one.
    fn lm_head_mut(&mut self) -> Option<&mut Linear> {
        None
    }
}

/// Why `x` cannot enter a layer: what every family answers for an input in the wrong place.
pub(crate) fn misplaced(is_embed: bool, x: &StageInput) -> String {
    match x {
        StageInput::Pixels(_) => "pixels go to a vit model's patch embedding only".into(),
        _ if is_embed => "the embedding got hidden states (it must come first on a route)".into(),
        _ => "a layer after the embedding got tokens (routes start at the embedding)".into(),
    }
}

/// A family's `Layer`: its embedding, block and head types as one module enum, with the
/// plumbing every family shares (which kind it is, visiting the module inside).
macro_rules! family_layer {
    ($embed:ty, $block:ty, $head:ty) => {
        /// One of this family's layer blocks.
        // A model has a few dozen of these; boxing the large variant would buy nothing.
        #[allow(clippy::large_enum_variant)]
        #[derive(burn::module::Module, Debug)]
        pub enum Layer {
            Embed($embed),
            Block($block),
            Head($head),
        }

        impl Layer {
            pub(crate) fn is_embed(&self) -> bool {
                matches!(self, Layer::Embed(_))
            }
            pub(crate) fn is_head(&self) -> bool {
                matches!(self, Layer::Head(_))
            }
            /// Visit the module inside, so names start at its own fields.
            pub(crate) fn visit_inner<V: burn::module::ModuleVisitor>(&self, v: &mut V) {
                use burn::module::Module;
                match self {
                    Layer::Embed(m) => m.visit(v),
                    Layer::Block(m) => m.visit(v),
                    Layer::Head(m) => m.visit(v),
                }
            }
            pub(crate) fn map_inner<M: burn::module::ModuleMapper>(self, m: &mut M) -> Self {
                use burn::module::Module;
                match self {
                    Layer::Embed(x) => Layer::Embed(x.map(m)),
                    Layer::Block(x) => Layer::Block(x.map(m)),
                    Layer::Head(x) => Layer::Head(x.map(m)),
                }
            }
        }
    };
}
pub(crate) use family_layer;

/// Every family, from one list `Variant => folder`: the [`Family`](super::Family) enum (its
/// serde and display name is the folder's), the `LayerBlock` enum with a variant per family
/// holding the folder's `Layer`, the table of the folders' `hf::SPEC`s, and the dispatch from
/// a layer block to its family's code. Each folder has `build(cfg, device) -> Vec<Layer>`;
/// `ModelConfig` and `Spec` are the invoking file's (so this file imports neither).
macro_rules! families {
    ($first:ident => $first_dir:ident $(, $variant:ident => $dir:ident)* $(,)?) => {
        /// A family of transformers: how a layer block is built (see each folder's docs).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Family {
            #[default]
            $first,
            $($variant,)*
        }

        impl Family {
            /// Its name in configs and logs: its folder's.
            pub fn name(self) -> &'static str {
                match self {
                    Family::$first => stringify!($first_dir),
                    $(Family::$variant => stringify!($dir),)*
                }
            }
        }

        /// Every family's entry.
        pub const FAMILIES: &[&Spec] =
            &[&super::$first_dir::hf::SPEC $(, &super::$dir::hf::SPEC)*];

        /// One layer block of the model: what a plan's stages are made of, and the unit that
        /// owns parameters and optimizer state (so state survives any change of plan).
        #[allow(clippy::large_enum_variant)]
        #[derive(burn::module::Module, Debug)]
        pub enum LayerBlock {
            $first(super::$first_dir::Layer),
            $($variant(super::$dir::Layer),)*
        }

        /// `$e` for the family's `Layer` inside a layer block, bound to `$l`.
        macro_rules! each_family {
            ($b:expr, $l:ident => $e:expr) => {
                match $b {
                    LayerBlock::$first($l) => $e,
                    $(LayerBlock::$variant($l) => $e,)*
                }
            };
        }

        impl LayerBlock {
            /// A fresh model's layer blocks, from its family's folder.
            pub(crate) fn build(
                cfg: &ModelConfig,
                device: &burn::tensor::Device,
            ) -> Vec<LayerBlock> {
                match cfg.family {
                    Family::$first => super::$first_dir::build(cfg, device)
                        .into_iter()
                        .map(LayerBlock::$first)
                        .collect(),
                    $(Family::$variant => super::$dir::build(cfg, device)
                        .into_iter()
                        .map(LayerBlock::$variant)
                        .collect(),)*
                }
            }

            pub fn family(&self) -> Family {
                match self {
                    LayerBlock::$first(_) => Family::$first,
                    $(LayerBlock::$variant(_) => Family::$variant,)*
                }
            }
        }

        impl LayerBlock {
            pub fn is_head(&self) -> bool {
                each_family!(self, l => l.is_head())
            }
            pub(crate) fn forward_with(
                &self,
                x: super::StageInput,
                ctx: &super::Ctx,
                cap: &mut Option<&mut super::Deferred>,
            ) -> Result<burn::tensor::Tensor<3>, String> {
                use super::layer::FamilyLayer;
                each_family!(self, l => l.forward_with(x, ctx, cap))
            }
            pub(crate) fn token_embedding(&self) -> Option<burn::tensor::Tensor<2>> {
                use super::layer::FamilyLayer;
                each_family!(self, l => l.token_embedding())
            }
            pub(crate) fn lm_head_mut(&mut self) -> Option<&mut burn::nn::Linear> {
                use super::layer::FamilyLayer;
                each_family!(self, l => l.lm_head_mut())
            }
            /// Visit the module inside the block, so names start at the block's own fields.
            pub(crate) fn visit_inner<V: burn::module::ModuleVisitor>(&self, v: &mut V) {
                each_family!(self, l => l.visit_inner(v))
            }
            pub(crate) fn map_inner<M: burn::module::ModuleMapper>(self, m: &mut M) -> Self {
                match self {
                    LayerBlock::$first(l) => LayerBlock::$first(l.map_inner(m)),
                    $(LayerBlock::$variant(l) => LayerBlock::$variant(l.map_inner(m)),)*
                }
            }
        }
    };
}
pub(crate) use families;
