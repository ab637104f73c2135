"""Shared fixtures: the real model, loaded once per test session (imported by conftest.py)."""
import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct, float32 on the CPU."""
    import minikv

    torch.manual_seed(0)
    return minikv.load("smollm2", device="cpu", dtype=torch.float32, progress=False)


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

    T = ids.shape[1]
    policy = make(spec).bind(model.cfg, device="cpu", dtype=torch.float32, max_len=T + steps + 2)
    out = [model(ids, policy=policy, logits_at=torch.tensor([T - 1]))]
    for t in range(T, T + steps):
        nxt = out[-1].argmax(-1)
        out.append(model(nxt[:, None], positions=torch.tensor([[t]]), policy=policy, logits_at=torch.tensor([0])))
    return torch.cat(out), policy
