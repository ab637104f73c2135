"""Helpers the benchmarks share: the common flags, the model, the long text, tables, --json.

    add_common_arguments(parser)   --model --device --dtype --threads --json --compile
    model, tok = load_model(args)  the model (and tokenizer) those flags name
    text_ids(tok, n)               the first n tokens of the standard library's pydoc_data.topics
    print_table(rows, columns)     a plain text table; columns: (header, key, format)
    write_json(path, payload)      the numbers, plus the machine they were measured on
    measure_read_bandwidth()       the machine's read bandwidth with the current thread count (generate's)
"""
from __future__ import annotations

import platform

import torch

from ..generate import measure_read_bandwidth  # noqa: F401  (the benchmarks' name for it)
from ..loading import MODEL_HELP


def add_common_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the loader's choice)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the numbers to this JSON file")
    p.add_argument("--compile", action="store_true",
                   help="decode with the compiled step (torch.compile; docs/speed.md)")


def load_model(args):
    """(model, tokenizer) named by the common flags; sets the CPU thread count first."""
    from ..loading import load

    if args.threads:
        torch.set_num_threads(args.threads)
    return load(args.model, device=args.device, dtype=args.dtype, progress=False, compile=args.compile)


def long_text() -> str:
    """About 465 kB of English documentation that ships with Python: no download needed."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of long_text() (the text holds ~110k SmolLM2 tokens)."""
    text = long_text()
    ids = tokenizer.encode(text[: 8 * n])  # ~4 characters a token: encode only what is needed
    if len(ids) < n:
        ids = tokenizer.encode(text)
    if n > len(ids):
        raise ValueError(f"{n} tokens asked, the text has {len(ids)}")
    return ids[:n]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], title: str | None = None) -> None:
    """columns: (header, key, format spec such as '.2f'); a missing key prints '-'."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f) if r.get(k) is not None else "-" for _, k, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    if title:
        print(title)
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def environment() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_json(path: str | None, payload: dict) -> None:
    """Strict JSON (minikv.cli.dumps: NaN and infinities as null), written atomically: a failed
    write leaves the previous file whole."""
    from ..atomic import atomic_write
    from ..cli import dumps

    if path:
        atomic_write(path, dumps({**payload, "environment": environment()}, indent=2))
