"""The CUDA ordering of freekv's recalls, checked on the CPU.

PagedKV issues its asynchronous copies through a small stream API (policies/streams.py). Here a
recorder stands in for CUDA: it logs every stream operation, and `happens_before` replays the log
with CUDA's rules (work on one stream runs in issue order; wait_event orders a stream after what
was recorded; wait_stream after everything issued so far on the other stream). The real policy
runs on top, on the CPU, through speculative steps (background recalls on the side stream) and
corrections (recalls on the main stream). The properties: every recall is ordered after the one
before it (two recalls may write the same slot), and every attention after every recall issued
before it. Both fail if `_copy_in` drops its wait on the previous recall's event."""
import contextlib

import torch

from minikv.config import ModelConfig
from minikv.policies import make
from minikv.policies import paged


class Recorder:
    """Streams and events that do nothing but append to one log."""

    def __init__(self):
        self.log = []
        self.main = self.stream("main")
        self._current = self.main

    def stream(self, name="side"):
        rec = self

        class Stream:
            def wait_stream(self, other):
                rec.log.append(("wait_stream", self, other))

            def wait_event(self, event):
                rec.log.append(("wait_event", self, event))

            def __repr__(self):
                return name

        return Stream()

    def event(self):
        rec = self

        class Event:
            def record(self, stream):
                rec.log.append(("record", self, stream))

            def synchronize(self):
                rec.log.append(("host_sync", self, None))

        return Event()

    def current(self):
        return self._current

    @contextlib.contextmanager
    def use(self, stream):
        before, self._current = self._current, stream
        self.log.append(("work", stream, "copy"))  # everything issued in here is one copy
        try:
            yield
        finally:
            self._current = before


def happens_before(log):
    """Replay the log: for each work item (index, stream, kind), the set of earlier work items
    the GPU would be guaranteed to have finished before starting it."""
    before = {}  # stream -> work items ordered before the next work on it
    recorded = {}  # event -> work items ordered before its last record
    items = []
    for op, a, b in log:
        if op == "work":
            items.append((len(items), a, b, frozenset(before.get(a, set()))))
            before.setdefault(a, set()).add(len(items) - 1)
        elif op == "record":
            recorded[a] = set(before.get(b, set()))
        elif op == "wait_event":
            before.setdefault(a, set()).update(recorded.get(b, set()))
        elif op == "wait_stream":
            before.setdefault(a, set()).update(before.get(b, set()))
    return items


def test_every_recall_is_ordered_after_the_last_and_before_attention(monkeypatch):
    rec = Recorder()
    real_attention = paged.paged_attention

    def logged_attention(*args, **kwargs):
        rec.log.append(("work", rec.current(), "attend"))
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(paged, "paged_attention", logged_attention)
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=1,
                      n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    policy = make("freekv:page_size=2,budget=12,sink=2,window=2,tau=0.5").bind(
        cfg, device="cpu", dtype=torch.float32, max_len=80)
    layer = policy.layers[0]
    layer.kv.use_streams(rec)
    g = torch.Generator().manual_seed(0)
    x = lambda H, T: torch.randn(1, H, T, cfg.head_dim, generator=g)
    layer.prefill(x(6, 30), x(3, 30), x(3, 30), None)
    prev = None
    for step in range(12):
        q = x(6, 1)
        if prev is not None and step % 3:  # some steps: two groups barely move, one jumps
            q[0, :4] = prev[0, :4] + 0.05 * q[0, :4]
        layer.decode(q, x(3, 1), x(3, 1), None)
        prev = q
    s = policy.stats()
    assert s["correction_step_rate"] > 0 and s["pages_recalled"] > 0  # both kinds of recall ran

    items = happens_before(rec.log)
    copies = [i for i in items if i[2] == "copy"]
    streams = {repr(i[1]) for i in copies}
    assert streams == {"main", "side"}, streams  # corrections on main, speculation on the side stream
    for earlier, later in zip(copies, copies[1:]):
        assert earlier[0] in later[3], f"recall {later[0]} on {later[1]} may overtake recall {earlier[0]} on {earlier[1]}"
    for item in items:
        if item[2] == "attend":
            issued = {c[0] for c in copies if c[0] < item[0]}
            assert issued <= item[3], f"attention {item[0]} may read slots while recalls {issued - item[3]} still write"
