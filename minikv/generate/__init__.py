"""Text generation: one prefill over the prompt, then one decode step per new token.

    prefill()           the prompt in one forward; the policy stores the prompt's KV
    decode_one_token()  one token in, next-token logits out
    decode_n_tokens()   the loop: sample, feed, until EOS or n tokens
    generate()          check the request, bind the policy, run the above, report

What is not the loop lives beside it: the checks of a request (inputs.py), the results, their
statistics, the clock that times them from outside and the prefill's progress (results.py), the bandwidth figures
(timing.py), the command line (__main__.py: `python -m minikv.generate --prompt "..."`).
"""
from __future__ import annotations

import torch

from ..policies import Policy, StepAction
from .inputs import as_int, check_request, check_sampling, encode_prompt, exclusive, is_batch  # noqa: F401
from .results import BatchResults, Clock, GenerationResult, results, tokens_progress  # noqa: F401
from .timing import decode_bandwidth, measure_read_bandwidth, synchronize, weight_bytes_per_step  # noqa: F401

DEFAULT_MAX_NEW_TOKENS = 128  # the API's and the command line's default


def sample(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    # logits (B, V) float32 -> token ids (B,)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # nucleus: keep the smallest set of tokens whose probability reaches top_p
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def prefill(model, ids: torch.Tensor, lengths: torch.Tensor, policy: Policy, progress=None) -> torch.Tensor:
    # ids (B, T) right-padded, lengths (B,) -> logits (B, V) at each row's last prompt token
    T = ids.shape[1]
    positions = torch.arange(T, device=ids.device).expand_as(ids)
    positions = torch.where(positions < lengths[:, None], positions, -1)  # -1 marks padding
    return model(ids, positions=positions, policy=policy, logits_at=lengths - 1,
                 progress=tokens_progress(progress, int(lengths.sum())))


def decode_one_token(model, token: torch.Tensor, position: torch.Tensor, policy: Policy) -> torch.Tensor:
    # token (B,), position (B,) -> logits (B, V)
    return model(token[:, None], positions=position[:, None], policy=policy, logits_at=torch.zeros_like(token))


def decode_n_tokens(model, logits, lengths, policy, n, eos_ids, sampling, generator, on_token=None) -> list[list[int]]:
    """Sample up to n tokens per row after the prefill (logits (B, V) at each row's last prompt
    token, lengths (B,)); a row stops at a token of eos_ids. Returns the new tokens per row."""
    rows = Rows(lengths, n, eos_ids, on_token)
    token = sample(logits, *sampling, generator=generator)
    while rows.take(token):
        logits = decode_one_token(model, token, rows.position, policy)
        token = sample(logits, *sampling, generator=generator)
        token = rows.rewind(token, policy.last_action)  # a policy that dropped its last tokens' KV
    return rows.out


class Rows:
    """What the loop keeps per row: the tokens produced, whether the row is done (EOS or n
    tokens), and the position the token fed next takes. on_token(row, id) sees each token."""

    def __init__(self, lengths: torch.Tensor, n: int, eos_ids, on_token=None):
        self.n, self.eos_ids, self.on_token = n, eos_ids, on_token
        self.out: list[list[int]] = [[] for _ in range(len(lengths))]
        self.done = [False] * len(lengths)
        self.position = lengths - 1  # (B,) advanced as each token is taken

    def take(self, token: torch.Tensor) -> bool:
        """token (B,), sampled at the last position: each row not done keeps it. True while some
        row goes on (its token is then fed at `position`)."""
        self.position = self.position + 1
        for b, tok in enumerate(token.tolist()):
            if not self.done[b]:
                self.out[b].append(tok)
                if self.on_token is not None:
                    self.on_token(b, tok)
                self.done[b] = tok in self.eos_ids or len(self.out[b]) >= self.n
        return not all(self.done)

    def rewind(self, token: torch.Tensor, action: StepAction | None) -> torch.Tensor:
        """The policy removed the KV of the last r tokens fed (action.rewind = r, softfreeze's
        rewalk): drop `token` and those r from the output, and feed the first of them again at its
        old position; everything after it is generated anew."""
        r = action.rewind if action is not None else 0
        if not r:
            return token
        if len(self.out) != 1:
            raise RuntimeError("rewind is only defined for a single sequence")
        r = min(r, len(self.out[0]))
        token = torch.tensor([self.out[0][-r]], device=token.device)
        del self.out[0][-r:]
        self.position = self.position - r  # take() advances it to the old position of `token`
        if self.on_token is not None:
            self.on_token(0, -r)  # tells a streaming printer to take back r tokens
        return token


def generate(model, tokenizer, prompt, policy="full", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             chat: bool = False, stop_at_eos: bool = True, on_token=None, progress=None, special_text: str = "tokens"):
    """Generate from one prompt (a string or token ids) or a batch (a list of them).

    One prompt: a GenerationResult whose `stats` hold the run's timing, the policy's KV numbers
    and its counters. A batch: BatchResults, a list with one GenerationResult per prompt, each
    with its own `prompt_tokens`, `new_tokens` and `finish` ("eos" or "length"), and the batch's
    timing and KV numbers once, in `.stats`. `policy` is a spec string or an unbound Policy; it is
    bound here to this model and sequence length, so a Policy object serves one generate at a
    time: a second one while it runs (another thread) is refused with a RuntimeError; give each
    thread its own (a spec string, or minikv.make_policy). on_token(row, id) is called as tokens are
    produced (a negative id -n means: take back the last n tokens). progress(done, total) is
    called during the prefill, in prompt tokens (see tokens_progress). special_text="literal"
    keeps special-token text in a str prompt as text (encode_prompt): for text from others.
    """
    sampling = (temperature, top_k, top_p)
    prompts, policy, max_new_tokens, seed = check_request(model, tokenizer, prompt, policy, max_new_tokens,
                                                          sampling, seed, chat, special_text)
    device, longest = model.device, max(len(p) for p in prompts)
    with exclusive(policy):
        policy.bind(model.cfg, device=device, dtype=model.dtype, max_len=longest + max_new_tokens,
                    batch_size=len(prompts))
        ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)  # right-padded
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        eos_ids = set(tokenizer.eos_ids) if stop_at_eos else set()
        clock = Clock(model)
        logits = prefill(model, ids, lengths, policy, progress)
        clock.prefill_done()
        new = decode_n_tokens(clock.timed, logits, lengths, policy, max_new_tokens, eos_ids, sampling, generator,
                              on_token)
        clock.done()
        return results(model, tokenizer, policy, prompts, new, eos_ids, max_new_tokens, clock, is_batch(prompt))
