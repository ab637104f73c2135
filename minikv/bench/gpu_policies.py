"""gpu-check's parts (c) and (d): every policy end to end, backend=triton against backend=eager,
and time per token at long contexts (bench/gpu_check.py runs them).

(c) compares the two backends on the same sequence: eager decodes greedily, and triton is fed
eager's tokens (teacher forcing), so that its logits at every step answer the same input and
are compared with eager's, not only its argmax. A greedy token that differs where eager's two
candidates are within NEAR_TIE in logit is rounding, not a bug.
"""
from __future__ import annotations

import time

import torch

from ..testing.tolerances import relative_rms
from .gpu_models import model_for

NEAR_TIE = 0.1  # a first difference where eager's two candidates are this close in logit: rounding
# dtype -> the most relative RMS error of a step's logits, triton against eager, that rounding
# explains: each layer's attention output may differ by an ulp or two of the dtype (REL_RMS of
# testing/tolerances.py), and 24-30 layers carry it to the logits. A kernel that drops or
# repeats a token, or reads a wrong head, moves the logits by tens of percent.
LOGITS_REL_RMS = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def with_backend(spec: str, backend: str) -> str:
    return f"{spec}{',' if ':' in spec else ':'}backend={backend}"


def decode(model, ids: list[int], spec: str, steps: int, forced: list[int] | None = None):
    """Prefill `ids`, then steps - 1 decode steps under `spec`, feeding each step's greedy token,
    or forced[t] when given -> (greedy tokens, logits (V,) float32 of each step, seconds of each
    decode step between two synchronisations)."""
    from ..generate import decode_one_token, prefill, synchronize
    from ..policies import make

    device = model.device
    policy = make(spec)
    policy.bind(model.cfg, device=device, dtype=model.dtype, max_len=len(ids) + steps, batch_size=1)
    logits = prefill(model, torch.tensor([ids], device=device), torch.tensor([len(ids)], device=device), policy)
    tokens, all_logits, times = [], [], []
    for t in range(steps):
        all_logits.append(logits[0].float())
        tokens.append(int(logits[0].argmax()))
        if t == steps - 1:
            break
        feed = forced[t] if forced is not None else tokens[-1]
        synchronize(device)
        start = time.perf_counter()
        logits = decode_one_token(model, torch.tensor([feed], device=device),
                                  torch.tensor([len(ids) + t], device=device), policy)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return tokens, all_logits, times


def compare_backends(model, ids: list[int], spec: str, steps: int) -> dict:
    """One row of (c): eager greedy, triton teacher-forced on eager's tokens."""
    eager, eager_logits, _ = decode(model, ids, with_backend(spec, "eager"), steps)
    triton, triton_logits, _ = decode(model, ids, with_backend(spec, "triton"), steps, forced=eager)
    first = next((i for i, (a, b) in enumerate(zip(eager, triton)) if a != b), None)
    margin = None if first is None else (eager_logits[first][eager[first]] - eager_logits[first][triton[first]]).item()
    rms = max(relative_rms(t, e) for t, e in zip(triton_logits, eager_logits))
    return {"policy": spec, "tokens": len(eager), "equal": first is None, "first_difference": first,
            "eager_margin": margin, "logits_rel_rms": rms,
            "ok": (first is None or margin <= NEAR_TIE) and rms <= LOGITS_REL_RMS[model.dtype]}


def check_policies(sizes, device, report) -> None:
    """(c) on sizes.model in sizes.model_dtype: one row per policy into report["policies"]."""
    model, ids_of, source = model_for(sizes.model, device, sizes.model_dtype)
    name = sizes.model if isinstance(sizes.model, str) else "a config"
    report.note("policies", model=name, weights=source, dtype=sizes.model_dtype, prompt_tokens=sizes.prompt_tokens)
    ids = ids_of(sizes.prompt_tokens)
    for spec in sizes.policies:
        if report.out_of_time("policies", spec):
            break
        report.add("policies", report.guarded(lambda: compare_backends(model, ids, spec, sizes.new_tokens),
                                              policy=spec))
    report.table("policies", [("policy", "policy", "s"), ("tokens", "tokens", "d"), ("equal", "equal", ""),
                              ("first diff", "first_difference", "d"), ("logit margin there", "eager_margin", ".3f"),
                              ("logits rel RMS", "logits_rel_rms", ".2e"), ("ok", "ok", "")],
                 f"(c) policies end to end on {name} ({source} weights) {sizes.model_dtype}: backend=triton vs eager")
    del model
    _free(device)


def time_per_token(model, ids: list[int], spec: str, steps: int) -> float:
    """The median seconds of a decode step, the first left out (Triton compiles there)."""
    _, _, times = decode(model, ids, with_backend(spec, "triton"), steps)
    rest = times[1:] or times
    return sorted(rest)[len(rest) // 2]


def check_speed(sizes, device, report) -> None:
    """(d): time per token of every policy against full KV on sizes.speed_model, backend=triton."""
    model, ids_of, source = model_for(sizes.speed_model, device, sizes.model_dtype)
    name = sizes.speed_model if isinstance(sizes.speed_model, str) else "a config"
    report.note("speed", model=name, weights=source, dtype=sizes.model_dtype, new_tokens=sizes.new_tokens)
    for context in sizes.speed_contexts:  # the prompt and the new tokens fill `context` positions
        ids, base = ids_of(context - sizes.new_tokens), None
        for spec in ("full", *[p for p in sizes.policies if p != "full"]):
            if report.out_of_time("speed", f"{spec} at {context}"):
                break

            def row(spec=spec):
                tpot = time_per_token(model, ids, spec, sizes.new_tokens)
                return {"tpot_ms": tpot * 1e3, "x_full": 1.0 if spec == "full" else tpot / base if base else None,
                        "ok": True}

            got = report.add("speed", report.guarded(row, context=context, policy=spec))
            if spec == "full" and got.get("tpot_ms"):
                base = got["tpot_ms"] / 1e3
    report.table("speed", [("context", "context", "d"), ("policy", "policy", "s"), ("TPOT ms", "tpot_ms", ".2f"),
                           ("x full", "x_full", ".2f")],
                 f"(d) time per token on {name} ({source} weights), backend=triton, synchronised")
    del model
    _free(device)


def _free(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
