"""The CUDA ordering of the recalls (freekv's pages, synckv's bank fetches), checked on the CPU.

Every copy between the tiers goes through Tiers (policies/tiers.py), which issues its
asynchronous copies through a small stream API (CudaStreams, beside it). Here a recorder stands in
for CUDA: it logs every stream operation, and `replay` applies CUDA's rules (work on one stream
runs in issue order; wait_event orders a stream after what was recorded; wait_stream after
everything issued so far on the other stream; an event's host synchronize waits for what was
recorded). The real policies run on top, on the CPU whatever the test device (CPU_ONLY: on a GPU
the copies would also run on CUDA's real streams, which the log does not see). The properties:
  * every copy into a pool is ordered after the one before it into that pool (two copies may
    write the same slot), whichever stream each ran on;
  * every attention over a pool is ordered after every copy into it issued before it;
  * a staging buffer is refilled on the host only after the copy that last read it has ended.
Each fails if Tiers.copy_in drops the corresponding wait (see the mutation checks below)."""
import contextlib

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make
from minikv.policies.synckv import layer as synckv_layer
from minikv.policies.tiers import Tiers

from ..fixtures import CPU_ONLY
from .test_synckv import TINY as SYNCKV_TINY
from .test_synckv import TINY_CLUSTERS, write_clusters


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


def install(policy, rec, monkeypatch):
    """Route the policy's tier copies through the recorder, and log on the host side which
    staging buffer each copy fills and which pool it writes ("fill", buffer, pool)."""
    tiers = policy.tiers
    tiers.use_streams(rec)
    copy_in = tiers.copy_in

    def logged_copy_in(staging, gather, scatter, into, background=False):
        def logged_gather(buffer):
            rec.log.append(("fill", buffer.data_ptr(), id(into)))
            return gather(buffer)
        return copy_in(staging, logged_gather, scatter, into, background)

    monkeypatch.setattr(tiers, "copy_in", logged_copy_in)


def log_attention(rec, pool):
    """A callable's wrapper that logs one attention over `pool` on the current stream."""
    def wrap(fn):
        def logged(*args, **kwargs):
            rec.log.append(("work", rec.current(), ("attend", id(pool))))
            return fn(*args, **kwargs)
        return logged
    return wrap


def replay(log):
    """CUDA's rules over the log -> (work items (index, stream, kind, pool, the earlier items the
    GPU has finished before starting it)), and the staging refills that did not wait)."""
    before = {}  # stream -> work items ordered before the next work on it
    recorded = {}  # event -> work items ordered before its last record
    host_done = set()  # work items the host has waited for
    items, reader_of, bad_refills = [], {}, []
    pending = None  # (buffer, pool) of the fill whose copy comes next
    for op, a, b in log:
        if op == "fill":
            last = reader_of.get(a)
            if last is not None and last not in host_done:
                bad_refills.append((last, len(items)))
            pending = (a, b)
        elif op == "work":
            kind, pool = (b[0], b[1]) if isinstance(b, tuple) else (b, pending[1])
            items.append((len(items), a, kind, pool, frozenset(before.get(a, set()))))
            before.setdefault(a, set()).add(len(items) - 1)
            if kind == "copy":
                reader_of[pending[0]] = len(items) - 1
        elif op == "record":
            recorded[a] = set(before.get(b, set()))
        elif op == "host_sync":
            host_done |= recorded.get(a, set())
        elif op == "wait_event":
            before.setdefault(a, set()).update(recorded.get(b, set()))
        elif op == "wait_stream":
            before.setdefault(a, set()).update(before.get(b, set()))
    return items, bad_refills


def check_order(log):
    items, bad_refills = replay(log)
    copies = [i for i in items if i[2] == "copy"]
    attends = [i for i in items if i[2] == "attend"]
    assert copies and attends
    for pool in {c[3] for c in copies}:
        mine = [c for c in copies if c[3] == pool]
        for earlier, later in zip(mine, mine[1:]):
            assert earlier[0] in later[4], f"copy {later[0]} on {later[1]} may overtake copy {earlier[0]} on {earlier[1]}"
    for item in attends:
        issued = {c[0] for c in copies if c[0] < item[0] and c[3] == item[3]}
        assert issued <= item[4], f"attention {item[0]} may read slots while copies {issued - item[4]} still write"
    assert not bad_refills, f"staging buffer refilled while its copy may still read it: {bad_refills}"
    return copies


def run_freekv(monkeypatch):
    rec = Recorder()
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    policy = make("freekv:page_size=2,budget=12,sink=2,window=2,tau=0.5").bind(
        cfg, device=CPU_ONLY, dtype=torch.float32, max_len=80)  # the recorder stands in for CUDA (module docstring)
    install(policy, rec, monkeypatch)
    for layer in policy.layers:
        pool = layer.kv.pool
        monkeypatch.setattr(pool, "attend", log_attention(rec, pool)(pool.attend))
    g = torch.Generator().manual_seed(0)
    x = lambda H, T: torch.randn(1, H, T, cfg.head_dim, generator=g)
    for layer in policy.layers:
        layer.prefill(x(6, 30), x(3, 30), x(3, 30), None)
    prev = [None] * cfg.n_layers
    for step in range(12):
        for i, layer in enumerate(policy.layers):  # the layers take turns, sharing the staging buffers
            q = x(6, 1)
            if prev[i] is not None and step % 3:  # some steps: no group moves, or two of three
                moved = 4 if step % 3 == 1 else 6
                q[0, :moved] = prev[i][0, :moved] + 0.05 * q[0, :moved]
            layer.decode(q, x(3, 1), x(3, 1), None)
            prev[i] = q
    s = policy.stats()
    assert s["correction_step_rate"] > 0 and s["pages_recalled"] > 0  # both kinds of recall ran
    return rec.log


def run_synckv(monkeypatch, tmp_path):
    rec = Recorder()
    clusters = write_clusters(tmp_path / "tiny.json", SYNCKV_TINY, TINY_CLUSTERS)
    policy = make(f"synckv:budget=12,window=2,m=2,rho=0.3,wide_layers=0,clusters={clusters}").bind(
        SYNCKV_TINY, device=CPU_ONLY, dtype=torch.float32, max_len=80)  # the recorder stands in for CUDA
    install(policy, rec, monkeypatch)
    gathered = synckv_layer.gathered_attention
    current = {}  # the layer decoding now, whose bank the attention reads

    def logged_gathered(*args, **kwargs):
        return log_attention(rec, current["bank"])(gathered)(*args, **kwargs)

    monkeypatch.setattr(synckv_layer, "gathered_attention", logged_gathered)
    g = torch.Generator().manual_seed(1)
    x = lambda H, T: torch.randn(1, H, T, SYNCKV_TINY.head_dim, generator=g)
    for layer in policy.layers:
        layer.prefill(x(6, 30), x(3, 30), x(3, 30), None)
    for step in range(12):
        for layer in policy.layers:
            current["bank"] = layer.bank
            layer.decode(x(6, 1), x(3, 1), x(3, 1), None)
    assert policy.stats()["tokens_fetched"] > 0
    return rec.log


def test_freekv_recalls_are_chained_waited_for_and_never_overwrite_a_staging_buffer_in_flight(monkeypatch):
    copies = check_order(run_freekv(monkeypatch))
    assert {repr(c[1]) for c in copies} == {"main", "side"}  # corrections on main, speculation on the side stream


def test_synckv_fetches_are_chained_waited_for_and_never_overwrite_a_staging_buffer_in_flight(monkeypatch, tmp_path):
    copies = check_order(run_synckv(monkeypatch, tmp_path))
    assert {repr(c[1]) for c in copies} == {"side"}  # fetches overlap the rest of the forward


# synckv's fetches all run on the side stream, in issue order: without the chain they stay ordered
@pytest.mark.parametrize("run, drop", [(run_freekv, "chain"), (run_freekv, "attend"), (run_freekv, "staging"),
                                       (run_synckv, "attend"), (run_synckv, "staging")])
def test_the_checks_catch_a_missing_wait(run, drop, monkeypatch, tmp_path):
    """Mutation check: a Tiers.copy_in without one of its waits (on the previous copy into the
    pool, on the staging buffer's last reader) or a wait() that does nothing fails the checks."""
    real_event = Tiers._event

    class Blind:  # an event whose waits and synchronizes are never logged
        def __init__(self, event):
            self.event = event

        def record(self, stream):
            self.event.record(stream)

        def synchronize(self):
            pass

    def mutated_event(self, owner, name="ready"):
        event = real_event(self, owner, name)
        if drop == "staging" and name != "ready":
            return Blind(event)
        return event

    monkeypatch.setattr(Tiers, "_event", mutated_event)
    if drop == "attend":
        monkeypatch.setattr(Tiers, "wait", lambda self, into: None)
    if drop == "chain":
        real_copy_in = Tiers.copy_in

        def no_chain(self, staging, gather, scatter, into, background=False):
            self._events[into, "ready"] = self.streams.event()  # a fresh event each time: no chain
            return real_copy_in(self, staging, gather, scatter, into, background)

        monkeypatch.setattr(Tiers, "copy_in", no_chain)
    log = run(monkeypatch, tmp_path) if run is run_synckv else run(monkeypatch)
    with pytest.raises(AssertionError):
        check_order(log)
