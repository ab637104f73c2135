"""GPT-NeoX (Pythia): LayerNorm with bias, a fused query_key_value projection laid out per
head, partial rotary (only the first rotary_pct of each head's channels rotate), a plain GELU
MLP, untied `embed_out`, and, usually, the parallel residual x + attn(ln1(x)) + mlp(ln2(x)).
"""
from __future__ import annotations

import torch.nn as nn

from ..config import ModelConfig
from .decoder import DecoderLM
from .layers import PlainMLP, attend, merge_heads
from .rope import apply_rotary


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.hidden_size
        self.query_key_value = nn.Linear(C, 3 * C, bias=cfg.attention_bias)
        self.dense = nn.Linear(C, C, bias=cfg.attention_out_bias)

    def project(self, x, rope):
        # x (B, T, C) -> q, k, v (B, H, T, D), q and k rotated at `rope`. The fused output is
        # per head [q | k | v], not [all q | all k | all v].
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.cfg.n_heads, 3 * self.cfg.head_dim)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)  # each (B, H, T, D)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v


class GPTNeoXBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attention = GPTNeoXAttention(cfg)
        self.mlp = PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    # project -> the policy's attention -> finish, as in llama.py's block
    def forward(self, x, positions, rope, layer_kv, decoding):
        q, k, v = self.project(x, rope)
        return self.finish(x, attend(q, k, v, positions, layer_kv, None, decoding))

    def project(self, x, rope):
        # x (B, T, C) -> q, k, v (B, H, T, D)
        return self.attention.project(self.input_layernorm(x), rope)

    def finish(self, x, y):
        # x (B, T, C), y (B, H, T, D) attention's output -> (B, T, C)
        attn = self.attention.dense(merge_heads(y))
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoXModel(nn.Module):
    """The `gpt_neox.` prefix of HF checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXBlock(cfg) for _ in range(cfg.n_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class GPTNeoXForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.gpt_neox = GPTNeoXModel(cfg)
        self.embed_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.embed_out.weight = self.gpt_neox.embed_in.weight

    # the names the shared DecoderLM loop uses (properties, so nothing is registered twice)
    embed = property(lambda self: self.gpt_neox.embed_in)
    blocks = property(lambda self: self.gpt_neox.layers)
    final_norm = property(lambda self: self.gpt_neox.final_layer_norm)
    lm_head = property(lambda self: self.embed_out)
