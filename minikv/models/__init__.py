"""Model families. `build_model(cfg)` picks the class for a config."""
from ..config import ModelConfig
from .decoder import DecoderLM
from .gpt_neox import GPTNeoXForCausalLM
from .llama import LlamaForCausalLM


def build_model(cfg: ModelConfig) -> DecoderLM:
    return GPTNeoXForCausalLM(cfg) if cfg.family == "gpt_neox" else LlamaForCausalLM(cfg)


__all__ = ["DecoderLM", "GPTNeoXForCausalLM", "LlamaForCausalLM", "build_model"]
