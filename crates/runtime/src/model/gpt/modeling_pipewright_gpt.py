"""pipewright's own GPT, as `pipewright export` writes it: the model, in PyTorch.

Learned token and position embeddings; pre-LayerNorm blocks of causal multi-head attention
(q, k, v and output projections with biases) and an exact-GELU MLP 4 times as wide; a final
LayerNorm and an untied LM head with a bias. No dropout. Module names are pipewright's
checkpoint names, so model.safetensors loads as written. There is no KV cache: generation
recomputes the whole prefix for each new token.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_pipewright_gpt import PipewrightGptConfig


class PipewrightGptEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.tok(input_ids) + self.pos(positions)[None]


class PipewrightGptBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.heads = config.num_attention_heads
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.fc = nn.Linear(d, config.intermediate_size)
        self.proj = nn.Linear(config.intermediate_size, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        a = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.q(a)), split(self.k(a)), split(self.v(a))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(att)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class PipewrightGptForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PipewrightGptConfig
    base_model_prefix = "pipewright_gpt"
    _no_split_modules = ["PipewrightGptBlock"]

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = PipewrightGptEmbeddings(config)
        self.blocks = nn.ModuleList(PipewrightGptBlock(config) for _ in range(config.num_hidden_layers))
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.out = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.embeddings.tok

    def set_input_embeddings(self, value):
        self.embeddings.tok = value

    def get_output_embeddings(self):
        return self.out

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        t = input_ids.shape[1]
        if t > self.config.max_position_embeddings:
            raise ValueError(f"{t} tokens; the model's learned positions end at "
                             f"{self.config.max_position_embeddings}")
        # Causal, and padded keys (attention_mask 0) are never attended to.
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.out(self.ln(x))
        loss = None
        if labels is not None:
            # Token i predicts token i + 1; labels of -100 are not scored.
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
