"""Shared fixtures: the test device, the real model, loaded once per test session (imported by
conftest.py).

The test device is one value, minikv.testing.default_device(): "cuda" when present (Triton's
kernels run compiled), else the CPU (Triton's interpreter). Tests take it as the `device` fixture
(conftest.py) or, in module-level helpers, as DEVICE. A test that needs the CPU whatever the test
device is (a host tier, a CPU-only kernel or compiled path, a loader's own checks) says so with
CPU_ONLY and a comment giving the reason, so that `grep -rn '"cpu"' tests/` finds none unexplained."""
import pytest
import torch

from minikv.testing import default_device

DEVICE = default_device()  # the test device: the `device` fixture returns it
CPU_ONLY = torch.device("cpu")  # the CPU on purpose, whatever the test device; each use says why


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct, float32 on the test device."""
    import minikv

    torch.manual_seed(0)
    return minikv.load("smollm2", device=DEVICE, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def smollm2_cpu(request):
    """SmolLM2 on CPU_ONLY, for tests of CPU-only paths (the compiled CPU model); the `smollm2`
    fixture itself where the test device is the CPU."""
    import minikv

    if DEVICE.type == "cpu":
        return request.getfixturevalue("smollm2")
    torch.manual_seed(0)
    return minikv.load("smollm2", device=CPU_ONLY, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def reference_dir():
    """reference/: data made by independent implementations (transformers), read-only."""
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "reference"


@pytest.fixture(scope="session")
def hf_smollm2():
    """SmolLM2 as transformers loads it from the bundled GGUF: float32, CPU (needs the hf extra).

    transformers spends ~25 s of CPU dequantizing the GGUF and refuses to save a GGUF-loaded model,
    so the first session writes the tensors it loaded (safetensors, the config without its GGUF
    quantization entry) into minikv's cache, and later sessions, and the other xdist worker, load
    those with transformers: the same tensors, bit for bit. A lock keeps two workers from both
    converting."""
    import copy
    import fcntl

    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from minikv.loading import cache_dir, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    saved = root / f"hf-{gguf.stem}-{gguf.stat().st_size}-transformers-{transformers.__version__}"
    with open(root / ".hf-smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (saved / "model.safetensors").is_file():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tmp = saved.with_name(saved.name + ".tmp")
            tmp.mkdir(exist_ok=True)
            config = copy.deepcopy(model.config)
            del config.quantization_config
            config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"))  # tied lm_head: stored once
            tmp.rename(saved)
    return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()


# ~330 tokens of "Item i is j." lines: a SmolLM2 prompt long enough for every policy to page,
# select and offload, short enough for the default run
ITEMS_PROMPT = " ".join(f"Item {i} is {i * 7 % 100}." for i in range(34)) + " Item 13 is"


def greedy_logits(model, ids, spec: str, steps: int):
    """Prefill ids (1, T) under a freshly bound `spec`, then `steps` greedy decode steps ->
    (logits (steps + 1, V) of every step, the bound policy)."""
    from minikv.policies import make

    T, device = ids.shape[1], model.embed.weight.device  # the test device, or CPU_ONLY's
    ids = ids.to(device)
    policy = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=T + steps + 2)
    out = [model(ids, policy=policy, logits_at=torch.tensor([T - 1], device=device))]
    for t in range(T, T + steps):
        nxt = out[-1].argmax(-1)
        out.append(model(nxt[:, None], positions=torch.tensor([[t]], device=device), policy=policy,
                         logits_at=torch.tensor([0], device=device)))
    return torch.cat(out), policy
