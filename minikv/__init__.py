"""minikv: a small, readable LLM runtime whose reason to exist is its KV cache.

    model, tokenizer = minikv.load("smollm2")
    result = minikv.generate(model, tokenizer, "Hello", policy="streaming:sink=4,window=252")
"""
from .kernels import select_interpreter_without_cuda

select_interpreter_without_cuda()  # before anything imports triton (see minikv.kernels)

from .config import ModelConfig  # noqa: E402
from .generate import BatchResults, GenerationResult, generate  # noqa: E402
from .loading import load, load_model  # noqa: E402
from .policies import available as available_policies  # noqa: E402
from .policies import make as make_policy  # noqa: E402
from .policies import Policy, LayerKV, register_policy  # noqa: E402

__all__ = ["BatchResults", "GenerationResult", "ModelConfig", "generate", "available_policies", "load", "load_model", "make_policy", "Policy", "LayerKV", "register_policy"]
__version__ = "0.1.0"
