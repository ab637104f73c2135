"""minikv: a small, readable LLM runtime whose reason to exist is its KV cache.

    model, tokenizer = minikv.load("smollm2")
    result = minikv.generate(model, tokenizer, "Hello", policy="streaming:sink=4,window=252")
"""
import os as _os
import signal as _signal
import sys as _sys


def _interrupted_while_importing(signum, _frame):
    terminated = signum == _signal.SIGTERM
    _os.write(2, b"terminated\n" if terminated else b"interrupted\n")
    _os._exit(128 + signum)  # 130 after Ctrl-C, 143 after SIGTERM, as minikv.cli's commands end


if _sys.argv[:1] == ["-m"] and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    # `python -m minikv.<command>`: a Ctrl-C (or SIGTERM) while torch imports (seconds) is one
    # line, not a traceback; minikv.cli.run_command gives them their usual meaning back
    _signal.signal(_signal.SIGINT, _interrupted_while_importing)
    if _signal.getsignal(_signal.SIGTERM) is _signal.SIG_DFL:
        _signal.signal(_signal.SIGTERM, _interrupted_while_importing)

from .kernels import select_interpreter_without_cuda  # noqa: E402

select_interpreter_without_cuda()  # before anything imports triton (see minikv.kernels)

from .config import ModelConfig  # noqa: E402
from .generate import BatchResults, GenerationResult, generate  # noqa: E402
from .loading import load, load_model  # noqa: E402
from .policies import available as available_policies  # noqa: E402
from .policies import make as make_policy  # noqa: E402
from .policies import Policy, LayerKV, register_policy  # noqa: E402

__all__ = ["BatchResults", "GenerationResult", "ModelConfig", "generate", "available_policies", "load", "load_model", "make_policy", "Policy", "LayerKV", "register_policy"]
__version__ = "0.1.0"
