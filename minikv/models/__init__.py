"""Model families. `build_model(cfg)` picks the class for a config."""
from ..config import ModelConfig
from .decoder import DecoderLM
from .gemma3 import Gemma3ForCausalLM
from .gpt_neox import GPTNeoXForCausalLM
from .llama import LlamaForCausalLM


def build_model(cfg: ModelConfig) -> DecoderLM:
    return {"gpt_neox": GPTNeoXForCausalLM, "gemma3": Gemma3ForCausalLM}.get(cfg.family, LlamaForCausalLM)(cfg)


__all__ = ["DecoderLM", "Gemma3ForCausalLM", "GPTNeoXForCausalLM", "LlamaForCausalLM", "build_model"]
