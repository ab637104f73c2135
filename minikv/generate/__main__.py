"""python -m minikv.generate --model smollm2 --prompt "..." [--chat] [--policy SPEC] [--stats]

Streams the generated text to stdout as it is produced; --stats prints a table of speed and
KV-cache numbers on stderr, --json prints the result as JSON on stdout instead of the text.
Ctrl-C stops generation and keeps what was generated.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import check_sampling, decode_bandwidth, generate
from ..policies import make


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minikv.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled), a HF safetensors directory or a .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--policy", default="full", help="KV-cache policy spec, e.g. 'streaming:sink=4,window=252'")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed: same seed, same text")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)")
    p.add_argument("--stats", action="store_true", help="print speed and KV-cache statistics on stderr")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming text")
    return p.parse_args(argv)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    with open(args.prompt_file, encoding="utf-8") as f:
        return f.read()


class StreamPrinter:
    """Prints tokens as they come, holding back incomplete UTF-8 (the tokenizer's stream)."""

    def __init__(self, tokenizer, enabled: bool):
        self.tokenizer, self.enabled = tokenizer, enabled
        self.ids: list[int] = []
        self.stream = tokenizer.stream()

    def __call__(self, row: int, token: int) -> None:
        if token < 0:  # the policy rewound: restart the stream from the kept tokens, say so
            del self.ids[token:]
            if self.enabled:
                sys.stdout.write(f"\n[rewind {-token} tokens]\n")
            self.stream = self.tokenizer.stream()
            for t in self.ids:
                text = self.stream.push(t)
            return
        self.ids.append(token)
        if token in self.tokenizer.eos_ids:
            return
        text = self.stream.push(token)
        if self.enabled and text:
            sys.stdout.write(text)
            sys.stdout.flush()


def print_stats(stats: dict) -> None:
    rows = [(k, v) for k, v in stats.items() if not isinstance(v, (list, dict))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        shown = f"{v:.4g}" if isinstance(v, float) else str(v)
        print(f"{k:<{width}}  {shown}", file=sys.stderr)


def main(argv=None) -> int:
    from ..loading import load
    from ..progress import progress_bar

    args = parse_args(argv)
    try:
        prompt = read_prompt(args)
        model, tokenizer = load(args.model, device=args.device, dtype=args.dtype)
        check_sampling(args.temperature, args.top_k, args.top_p)
        make(args.policy)  # a bad spec fails here, before any work
    except (ValueError, OSError, ModuleNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    printer = StreamPrinter(tokenizer, enabled=not args.json)
    bar = progress_bar(total=model.cfg.n_layers, desc="prefill", enabled=None)  # shown on a terminal

    def progress(layer: int, n_layers: int) -> None:  # called after each layer of the prefill
        bar.update(1)
        if layer == n_layers:
            bar.close()  # erase the bar before the first token is printed on its line

    interrupted = False
    try:
        result = generate(model, tokenizer, prompt, policy=args.policy, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          chat=args.chat, stop_at_eos=not args.ignore_eos, on_token=printer, progress=progress)
        text, ids, stats = result.text, result.token_ids, result.stats
    except ValueError as err:  # prompt past the context, impossible policy parameters
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        interrupted = True
        ids = [t for t in printer.ids if t not in tokenizer.eos_ids]
        text, stats = tokenizer.decode(ids), {"interrupted": True, "new_tokens": len(ids)}
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids, "stats": stats}))
    else:
        sys.stdout.write(printer.stream.flush() + "\n")
        sys.stdout.flush()
    if args.stats and "bytes_per_token" in stats:  # the achieved bandwidth's share of the machine's
        from ..bench.common import measure_read_bandwidth

        stats.update(decode_bandwidth(stats["bytes_per_token"], stats["tpot_s"], measure_read_bandwidth(model.device)))
    if args.stats or interrupted:
        print_stats(stats)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
