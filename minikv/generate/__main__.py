"""python -m minikv.generate --prompt "..." [--chat] [--policy SPEC] [--stats]

Streams the generated text to stdout as it is produced, then prints one summary line on stderr
(prompt and prefill speed, new tokens and decode speed, the policy, the KV cache on each tier);
--quiet leaves the summary out, --stats adds the full table, --json prints the result as JSON on
stdout instead of the text. Every flag is checked before the model loads. Ctrl-C stops
generation and keeps what was generated, printing it and one line `interrupted: ...` (exit code
130; SIGTERM likewise, `terminated: ...`, 143); a policy that fails mid-generation (a plugin's)
keeps it too, and its error follows on a line of its own; a reader that stops reading (`| head -c 5`) ends it quietly (exit code 0); a bad flag or
input, a closed stdin included, prints one line `error: ...` and exits with 2.
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import DEFAULT_MAX_NEW_TOKENS, check_sampling, decode_bandwidth, generate, measure_read_bandwidth
from ..cli import (check_common, check_output_paths, check_positive, dumps, interrupted as say_interrupted,
                   one_line, run_command, stdout_reader_gone)
from ..loading import MODEL_HELP
from ..plugins import add_import_argument, import_from_argv

DEFAULT_THREADS = 1  # see --threads


def policy_epilog() -> str:
    """The policies, each parameter with its default, bounds and meaning (their declarations in
    minikv/policies), for --help."""
    from ..policies.registry import _REGISTRY
    from ..policies.params import describe

    lines = ["policies (--policy NAME:key=value,...; each parameter with its default, bounds and meaning):"]
    for name in sorted(_REGISTRY):
        cls = _REGISTRY[name]
        lines.append(f"  {name}: {' '.join((cls.__doc__ or '').split())}")
        lines += [f"    {line}" for line in describe(cls)]
    lines.append("booleans take true/false, on/off, yes/no or 1/0. Sizes (budget, window, history, ...) are capped by")
    lines.append("the context, prompt + new tokens: a budget larger than the context costs what full KV costs.")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minikv.generate", description=__doc__, epilog=policy_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--special-text", choices=("tokens", "literal"), default=None,
                   help="what special-token text in the prompt (<|im_end|>, <s>) becomes: 'tokens', the special "
                        "tokens, as transformers encodes it, or 'literal', plain text that cannot end a chat turn "
                        "(default: tokens with --prompt, literal with --prompt-file)")
    p.add_argument("--policy", default="full", help="KV-cache policy spec, e.g. 'streaming:sink=4,window=252' "
                                                   "(default: %(default)s; the list is below)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="most tokens to generate (default: %(default)s, as minikv.generate)")
    p.add_argument("--temperature", type=float, default=0.0, help="a finite number >= 0; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed: same seed, same text")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with torch.compile: faster per token, some 20 s to compile the "
                        "first time (then cached), needs a C++ compiler (docs/speed.md)")
    p.add_argument("--plain", action="store_true",
                   help="run the plain model of minikv/models, without the CPU speed layer of minikv/fast "
                        "(same tokens to float rounding, slower; not with --compile)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="torch CPU threads (default: %(default)s; on cores shared with other busy processes more "
                        "threads can make decoding many times slower, see the README)")
    p.add_argument("--stats", action="store_true", help="also print the full table of speed and KV-cache statistics")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming text")
    add_import_argument(p)
    return p.parse_args(argv)


def read_stdin() -> str:
    """stdin's text, checked as a file's is: UTF-8, or an error (not U+FFFD in its place)."""
    if sys.stdin is None:
        raise ValueError("--prompt-file -: stdin is closed; give the prompt with --prompt or --prompt-file FILE")
    try:
        if not hasattr(sys.stdin, "buffer"):  # a text stream put in its place (an embedding program's)
            return sys.stdin.read()
        data = sys.stdin.buffer.read()
    except (OSError, ValueError) as err:  # ValueError: a closed file
        raise ValueError(f"--prompt-file -: cannot read stdin ({err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the prompt on stdin is not UTF-8 text ({err.reason} at byte {err.start})") from None


def check_text(text: str, where: str) -> str:
    """A prompt the tokenizer can take: not empty, no lone surrogates (bytes that were not UTF-8
    on the command line arrive as those)."""
    if not text.strip():
        raise ValueError(f"the prompt{where} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the prompt{where} is not UTF-8 text (character {err.start} is a lone surrogate, "
                         "from bytes that were not UTF-8)") from None
    return text


def read_prompt(args) -> str:
    if args.prompt is not None:
        return check_text(args.prompt, "")
    if args.prompt_file == "-":
        text = read_stdin()
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"prompt file {args.prompt_file} does not exist") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"prompt file {args.prompt_file} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except IsADirectoryError:
            raise ValueError(f"prompt file {args.prompt_file} is a directory") from None
    return check_text(text, " on stdin" if args.prompt_file == "-" else f" in {args.prompt_file}")


def check_args(args) -> str:
    """Everything that needs no model, before it loads. Returns the prompt."""
    check_common(args)  # --model --device --dtype --threads --policy
    check_output_paths(args)  # none today (--json prints on stdout); every command checks them the same way
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_positive("--max-new-tokens", args.max_new_tokens)
    if args.plain and args.compile:
        raise ValueError("--plain and --compile exclude each other: the compiled step is part of the speed layer")
    return read_prompt(args)


class StreamPrinter:
    """Prints tokens as they come, holding back incomplete UTF-8 (the tokenizer's stream)."""

    def __init__(self, tokenizer, enabled: bool):
        self.tokenizer, self.enabled = tokenizer, enabled
        self.ids: list[int] = []
        self.stream = tokenizer.stream()
        self.reader_gone = stdout_reader_gone()  # --json prints at the end: stop early if no one will read it

    def __call__(self, row: int, token: int) -> None:
        if token < 0:  # the policy rewound: restart the stream from the kept tokens, say so
            del self.ids[token:]
            if self.enabled:
                sys.stdout.write(f"\n[rewind {-token} tokens]\n")
            self.stream = self.tokenizer.stream()
            for t in self.ids:
                self.stream.push(t)
            return
        self.ids.append(token)
        if not self.enabled and self.reader_gone():
            raise BrokenPipeError("stdout's reader has gone")
        if token in self.tokenizer.eos_ids:
            return
        text = self.stream.push(token)
        if self.enabled and text:
            sys.stdout.write(text)
            sys.stdout.flush()


def json_result(text: str, ids: list[int], stats: dict, spec: str) -> str:
    """--json's output. A statistic JSON cannot hold (a tensor a plugin's stats() returned) is a
    ValueError naming the policy and its module, raised after the result is printed with null there."""
    try:
        return dumps({"text": text, "token_ids": ids, "stats": stats})
    except (TypeError, ValueError):
        bad = [k for k, v in stats.items() if not _json_holds(v)]
        print(dumps({"text": text, "token_ids": ids, "stats": {k: None if k in bad else v for k, v in stats.items()}}))
        sys.stdout.flush()
        from ..policies.registry import _REGISTRY

        cls = _REGISTRY.get(spec.partition(":")[0].strip())
        who = f"policy {cls.name!r} (module {cls.__module__})" if cls else f"policy {spec!r}"
        raise ValueError(f"{who}: stats() gave {', '.join(f'{k!r}, a {type(stats[k]).__name__},' for k in bad)} "
                         "which JSON cannot hold (give numbers, strings, lists or dicts); the text is printed "
                         "above with null for it") from None


def _json_holds(value) -> bool:
    try:
        dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_line(stats: dict) -> str:
    """One line, as llama-cli ends a run: what was read and how fast, what was generated and how
    fast, and where the KV cache sits. KV tokens are per KV head, mean over layers; bytes are the
    KV in use (all layers and heads), or the allocation where the policy does not report use."""
    device_bytes = stats.get("device_bytes", 0)
    host_bytes = stats.get("host_bytes", 0)
    return (f"prompt {stats['prompt_tokens']} tokens, {_rate(stats.get('prefill_tokens_per_s'))} tok/s | "
            f"generated {stats['new_tokens']} tokens, {_rate(stats.get('tokens_per_s'))} tok/s | "
            f"policy {stats.get('policy', '?')} | "
            f"device KV {stats.get('device_tokens', 0):.0f} tokens, {human_bytes(device_bytes)} | "
            f"host KV {stats.get('host_tokens', 0):.0f} tokens, {human_bytes(host_bytes)}")


def print_stats(stats: dict) -> None:
    """The full table: byte counts in human units, missing values (a single-token run has no
    time per token) as '-'."""
    rows = [(k, v) for k, v in stats.items() if not isinstance(v, (list, dict))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        if v is None:
            shown = "-"
        elif "bytes" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
            shown = human_bytes(v)
        elif isinstance(v, float):
            shown = f"{v:.4g}"
        else:
            shown = str(v)
        print(f"{k:<{width}}  {shown}", file=sys.stderr)


def main(argv=None) -> int:
    import_from_argv(argv)  # --import MODULE: its policies in --help and --policy
    args = parse_args(argv)
    prompt = check_args(args)
    torch.set_num_threads(args.threads)

    from ..loading import load
    from ..progress import progress_bar

    model, tokenizer = load(args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                            fast=not args.plain)
    printer = StreamPrinter(tokenizer, enabled=not args.json)
    bar = None

    def progress(done: int, total: int) -> None:  # prefill progress, in prompt tokens
        nonlocal bar
        if bar is None:
            bar = progress_bar(total=total, desc="prefill", unit="tok", enabled=None)  # on a terminal only
        bar.update(done - bar.n)
        if done >= total:
            bar.close()  # erase the bar before the first token is printed on its line

    interrupted, failed = False, None
    try:
        result = generate(model, tokenizer, prompt, policy=args.policy, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          chat=args.chat, stop_at_eos=not args.ignore_eos, on_token=printer, progress=progress,
                          special_text=args.special_text or ("tokens" if args.prompt is not None else "literal"))
        text, ids, stats = result.text, result.token_ids, result.stats
    except KeyboardInterrupt:
        interrupted = True
        ids = [t for t in printer.ids if t not in tokenizer.eos_ids]
        text, stats = tokenizer.decode(ids), {"interrupted": True, "new_tokens": len(ids)}
    except BrokenPipeError:  # stdout's reader has gone: nothing more to print (minikv.cli ends quietly)
        raise
    except Exception as err:  # a policy failing mid-generation (a plugin's decode, its stats()): the text first
        if not printer.ids:
            raise
        failed = err
        ids = [t for t in printer.ids if t not in tokenizer.eos_ids]
        text, stats = tokenizer.decode(ids), {"error": f"{type(err).__name__}: {one_line(err)}", "new_tokens": len(ids)}
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json_result(text, ids, stats, args.policy))
    else:
        sys.stdout.write(printer.stream.flush() + "\n")
        sys.stdout.flush()
    if failed is not None:  # the error's one line (minikv.cli: whose bug it is) after the text
        raise failed
    if interrupted:  # one line, as every command's Ctrl-C and SIGTERM
        return say_interrupted(f"{len(ids)} tokens generated, kept above")
    if not args.quiet:
        print(summary_line(stats), file=sys.stderr)
    if args.stats and "bytes_per_token" in stats:  # the achieved bandwidth's share of the machine's
        stats.update(decode_bandwidth(stats["bytes_per_token"], stats["tpot_s"], measure_read_bandwidth(model.device)))
    if args.stats:
        print_stats(stats)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
