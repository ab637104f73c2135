"""Selection off the critical path (policies/worker.py): the worker's jobs return their values in
order and re-raise their errors at the join, on the model's thread; freekv's select_next on the
worker (overlap=true) gives the same logits, tokens and stats as the synchronous form, on a tiny
model (hypothesis) and on SmolLM2; and the join comes before every read or write of the layer's
paged store (the order recorded on a real thread)."""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.policies import make
from minikv.policies.worker import Worker, thread_counts, threads
from minikv.testing import tiny_model

from ..fixtures import ITEMS_PROMPT, greedy_logits


# -- the worker ----------------------------------------------------------------------------------
@pytest.mark.parametrize("background", [True, False])
def test_jobs_return_their_values_in_order(background):
    worker, seen = Worker(background), []
    jobs = [worker.submit(lambda i: seen.append(i) or i * i, i) for i in range(20)]
    assert [job.join() for job in jobs] == [i * i for i in range(20)]
    assert seen == list(range(20))  # one thread: submitted order


@pytest.mark.parametrize("background", [True, False])
def test_an_error_in_the_worker_surfaces_at_the_join_with_its_message(background):
    worker = Worker(background)

    def fails(x):
        raise ValueError(f"page {x} is not a candidate")

    job = worker.submit(fails, 7)
    after = worker.submit(lambda: "still serving")
    with pytest.raises(ValueError, match="page 7 is not a candidate"):
        job.join()
    assert after.join() == "still serving"  # the thread survives a failed job


def test_the_job_runs_on_another_thread_under_the_submitters_modes():
    worker, main = Worker(True), threading.get_ident()
    with torch.inference_mode():
        job = worker.submit(lambda: (threading.get_ident(), torch.is_inference_mode_enabled()))
        ident, inference = job.join()
    assert ident != main and inference
    ident, inference = Worker(False).submit(lambda: (threading.get_ident(), torch.is_inference_mode_enabled())).join()
    assert ident == main and not inference


def test_reset_waits_for_queued_jobs_and_the_thread_is_a_daemon():
    worker, gate, done = Worker(True), threading.Event(), []
    worker.submit(lambda: gate.wait(5) and done.append(1))
    threading.Timer(0.05, gate.set).start()
    worker.reset()
    assert done == [1] and worker._thread.daemon
    assert worker._thread.name == "minikv-worker"  # how a profile or a thread dump names it


def test_a_policy_keeps_its_worker_across_binds_and_counts_its_thread():
    """One worker per policy object, kept by a second bind (a second generate call); a policy
    without one counts no thread beside torch's."""
    cfg = tiny_model("llama_gqa").cfg
    policy = make("freekv").bind(cfg, device="cpu", dtype=torch.float32, max_len=64)
    worker = policy.worker
    assert policy.bind(cfg, device="cpu", dtype=torch.float32, max_len=64).worker is worker
    assert threads(policy) == 1
    assert thread_counts(policy, 2) == {"intra_op_threads": 2, "worker_threads": 1, "threads": 3}
    plain = make("streaming:budget=64").bind(cfg, device="cpu", dtype=torch.float32, max_len=64)
    assert threads(plain) == 0 and thread_counts(plain, 2)["threads"] == 2


# -- freekv: the same results -------------------------------------------------------------------
SPECS = ["freekv:page_size=4,budget=24,sink=4,window=8", "freekv:page_size=4,budget=32,sink=4,window=4,tau=0.95",
         "freekv:page_size=4,budget=24,sink=4,window=8,digest=minmax,tau=-1"]


def stats_of_equal_logits(model, ids, spec, steps):
    """Greedy logits of `spec` with overlap=false and overlap=true (its worker on a thread):
    equal bit for bit -> the two policies' stats."""
    sync, p0 = greedy_logits(model, ids, f"{spec},overlap=false", steps)
    over, p1 = greedy_logits(model, ids, f"{spec},overlap=true", steps)
    assert threads(p0) == 0 and threads(p1) == 1
    assert torch.equal(sync, over)
    return p0.stats(), p1.stats()


@settings(max_examples=8, deadline=None)
@given(spec=st.sampled_from(SPECS), seed=st.integers(0, 2 ** 16), prompt=st.integers(20, 90),
       rescore=st.sampled_from([0, 2]))
def test_freekv_worker_gives_the_synchronous_logits_bit_for_bit(spec, seed, prompt, rescore):
    model = tiny_model("llama_gqa")
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    s0, s1 = stats_of_equal_logits(model, ids, f"{spec},rescore={rescore}", 24)
    for key in ("pages_recalled", "speculative_exact_rate", "correction_rate", "device_tokens_peak",
                "kv_bytes_read_per_step", "bytes_to_device"):
        assert s0[key] == s1[key] or (s0[key] != s0[key] and s1[key] != s1[key]), key  # nan: none compared


def test_freekv_worker_gives_the_synchronous_tokens_on_smollm2(smollm2):
    from minikv.generate import generate

    model, tok = smollm2
    spec = "freekv:page_size=8,budget=64,sink=8,window=8"
    policy = make(f"{spec},overlap=true")
    sync = generate(model, tok, ITEMS_PROMPT, policy=f"{spec},overlap=false", max_new_tokens=12)
    for _ in range(2):  # one policy object, reused: its worker serves the second generate too
        over = generate(model, tok, ITEMS_PROMPT, policy=policy, max_new_tokens=12)
        assert over.token_ids == sync.token_ids
        assert over.stats["pages_recalled"] == sync.stats["pages_recalled"] > 0
    assert over.stats["threads"] == sync.stats["threads"] + 1 == torch.get_num_threads() + 1


def test_reference_and_plain_quest_stay_synchronous():
    """The synchronous form is the rule's class as written (no kept recall to land); overlap.py's
    background form only where the worker runs in the background."""
    cfg = tiny_model("llama_gqa").cfg
    for spec in ("freekv:backend=reference", "freekv:backend=triton", "freekv:speculative=false",
                 "freekv:overlap=false"):
        policy = make(spec).bind(cfg, device="cpu", dtype=torch.float32, max_len=64)
        assert threads(policy) == 0 and thread_counts(policy, 1) == {"intra_op_threads": 1, "worker_threads": 0,
                                                                     "threads": 1}
        assert not any(hasattr(layer, "land") for layer in policy.layers)
    policy = make("freekv:overlap=true").bind(cfg, device="cpu", dtype=torch.float32, max_len=64)
    assert all(hasattr(layer, "land") for layer in policy.layers)


def test_the_rules_modules_leave_the_worker_to_overlap():
    """freekv.py and synckv's layer.py and policy.py import no worker: policies/overlap.py
    schedules the selection beside the model."""
    import ast
    import pathlib

    import minikv.policies.freekv as freekv
    import minikv.policies.synckv.layer as layer
    import minikv.policies.synckv.policy as policy

    for module in (freekv, layer, policy):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "worker" not in imported and not any(name.endswith(".worker") for name in imported if name), module


# -- freekv: the join precedes every read or write of the layer's store ---------------------------
class RecordingWorker(Worker):
    """A real background worker that logs each submit and join, per layer."""

    def __init__(self, log):
        super().__init__(background=True)
        self.log = log

    def submit(self, fn, *args):
        layer = fn.__self__.index
        job = super().submit(fn, *args)
        self.log.append(("submit", layer))
        join = job.join

        def logged_join():
            out = join()
            self.log.append(("join", layer))
            return out

        job.join = logged_join
        return job


STORE_METHODS = ("append", "roll", "recall", "attend", "store", "prefill")  # each writes the store
READS = ("count_speculation",)  # the layer's, which reads the store's slots (freekv_counts.py)


def test_the_join_comes_before_every_read_or_write_of_the_layers_store():
    """On the model's thread a layer's store is read or written only once its selection has been
    joined; the job itself (the worker's thread: select_next, and the speculation count beside
    it) only reads it."""
    model, log, main = tiny_model("llama_gqa"), [], threading.get_ident()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 60), generator=torch.Generator().manual_seed(3))
    T = ids.shape[1]
    policy = make("freekv:page_size=4,budget=24,sink=4,window=8,tau=-1")
    policy.bind(model.cfg, device="cpu", dtype=torch.float32, max_len=T + 30)
    policy.worker = RecordingWorker(log)
    for layer in policy.layers:
        for name in STORE_METHODS:
            method = getattr(layer.kv, name)

            def recorded(*a, _m=method, _n=name, _i=layer.index, **k):
                log.append((_n, _i) if threading.get_ident() == main else (f"worker {_n}", _i))
                return _m(*a, **k)
            setattr(layer.kv, name, recorded)
        for name in READS:
            method = getattr(layer, name)

            def recorded(*a, _m=method, _n=name, _i=layer.index, **k):
                log.append((_n, _i) if threading.get_ident() == main else (f"worker {_n}", _i))
                return _m(*a, **k)
            setattr(layer, name, recorded)
    out = model(ids, policy=policy, logits_at=torch.tensor([T - 1]))
    for t in range(T, T + 24):
        out = model(out.argmax(-1)[:, None], positions=torch.tensor([[t]]), policy=policy, logits_at=torch.tensor([0]))
    assert sum(e == "submit" for e, _ in log) > 24  # most steps selected on the worker, in both layers
    assert any(e == "worker count_speculation" for e, _ in log)  # tau=-1: no correction, q_t's pages compared there
    pending = set()
    for event, layer in log:
        if event == "submit":
            pending.add(layer)
        elif event == "join":
            pending.discard(layer)
        elif event.startswith("worker "):
            assert event.removeprefix("worker ") in READS and layer in pending, (event, layer)
        else:  # a read or write of the layer's paged store: its selection has been joined
            assert layer not in pending, (event, layer)
    assert not pending  # end_step joined the last step's


# -- synckv: the anticipation's top-k on the worker -------------------------------------------------
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 16), prompt=st.integers(40, 100), m=st.integers(1, 4),
       nr_reads=st.sampled_from(["cluster", "union"]))
def test_synckv_worker_gives_the_synchronous_logits_bit_for_bit(tmp_path_factory, seed, prompt, m, nr_reads):
    from minikv.policies.synckv.policy import SyncKV

    model = tiny_model("llama_gqa")
    spec = SyncKV.spec_for_model(f"synckv:budget=24,window=4,m={m},n_r=1,wide_layers=0,nr_reads={nr_reads}",
                                 model.cfg, tmp_path_factory.mktemp("synckv"))
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    s0, s1 = stats_of_equal_logits(model, ids, spec, 16)
    assert s1["tokens_fetched"] == s0["tokens_fetched"] > 0
    assert s1["anticipation_steps"] == s0["anticipation_steps"]


def test_synckv_worker_gives_the_synchronous_tokens_on_smollm2(smollm2):
    from minikv.generate import generate

    model, tok = smollm2
    spec = "synckv:budget=48,window=8,m=2"
    sync = generate(model, tok, ITEMS_PROMPT, policy=f"{spec},overlap=false", max_new_tokens=12)
    over = generate(model, tok, ITEMS_PROMPT, policy=f"{spec},overlap=true", max_new_tokens=12)
    assert over.token_ids == sync.token_ids
    assert over.stats["tokens_fetched"] == sync.stats["tokens_fetched"] > 0
    assert over.stats["worker_threads"] == 1 and sync.stats["worker_threads"] == 0
