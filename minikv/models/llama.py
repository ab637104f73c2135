"""Llama, Mistral and Qwen2: one pre-norm block, RMSNorm, gated SiLU MLP, GQA attention.

What differs between the three is config, not code: Qwen2 puts a bias on q, k, v; Mistral
limits attention to a sliding window; Llama 3 scales RoPE frequencies (rope.py). Parameter
names follow Hugging Face checkpoints so that safetensors load without renaming.
"""
from __future__ import annotations

import torch.nn as nn

from ..config import ModelConfig
from .decoder import DecoderLM
from .layers import GatedMLP, RMSNorm, StackedLinear, attend, merge_heads, split_heads, stacked_in
from .rope import apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C, D = cfg.hidden_size, cfg.head_dim
        # q_proj, k_proj, v_proj of the checkpoint, stacked: one matmul computes q, k and v
        parts = {"q_proj": cfg.n_heads * D, "k_proj": cfg.n_kv_heads * D, "v_proj": cfg.n_kv_heads * D}
        self.qkv_proj = StackedLinear(C, parts, bias=cfg.attention_bias)
        stacked_in(self, "qkv_proj")
        self.o_proj = nn.Linear(cfg.n_heads * D, C, bias=cfg.attention_out_bias)

    def project(self, x, rope):
        # x (B, T, C) -> q (B, Hq, T, D), k, v (B, Hkv, T, D); q and k rotated at `rope`
        q, k, v = self.qkv_proj.parts_of(x)  # (B, T, Hq * D), (B, T, Hkv * D) x 2
        q = split_heads(q, self.cfg.n_heads)  # (B, Hq, T, D)
        k = split_heads(k, self.cfg.n_kv_heads)  # (B, Hkv, T, D)
        v = split_heads(v, self.cfg.n_kv_heads)  # (B, Hkv, T, D)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)

    # A block is three steps: `project` (norm, q/k/v, RoPE), the policy's attention, `finish`
    # (output projection, residual, MLP). The first and last are pure functions of tensors, so a
    # compiled decode step (minikv/fast/compiled.py) can compile them and leave the policy's Python eager.
    def forward(self, x, positions, rope, layer_kv, decoding):
        q, k, v = self.project(x, rope)
        y = attend(q, k, v, positions, layer_kv, self.self_attn.cfg.sliding_window, decoding)
        return self.finish(x, y)

    def project(self, x, rope):
        # x (B, T, C) -> q (B, Hq, T, D), k, v (B, Hkv, T, D)
        return self.self_attn.project(self.input_layernorm(x), rope)

    def finish(self, x, y):
        # x (B, T, C), y (B, Hq, T, D) attention's output -> (B, T, C)
        x = x + self.self_attn.o_proj(merge_heads(y))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LlamaForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # the names the shared DecoderLM loop uses (properties, so nothing is registered twice)
    embed = property(lambda self: self.model.embed_tokens)
    blocks = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.norm)
