"""minikv: a small, readable LLM runtime whose reason to exist is its KV cache.

    model, tokenizer = minikv.load("smollm2")
    result = minikv.generate(model, tokenizer, "Hello", policy="streaming:sink=4,window=252")
"""
from .config import ModelConfig
from .generate import GenerationResult, generate
from .loading import load, load_model
from .policies import available as available_policies
from .policies import make as make_policy

__all__ = ["GenerationResult", "ModelConfig", "generate", "available_policies", "load", "load_model", "make_policy"]
__version__ = "0.1.0"
