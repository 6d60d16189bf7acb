"""pipewright's own GPT, as `pipewright export` writes it: the configuration.

Loaded by transformers through the `auto_map` of config.json (`trust_remote_code=True`).
"""
from transformers import PretrainedConfig


class PipewrightGptConfig(PretrainedConfig):
    model_type = "pipewright_gpt"

    def __init__(self, vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                 intermediate_size=256, max_position_embeddings=64, layer_norm_eps=1e-5,
                 use_cache=False, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
