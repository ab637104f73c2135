"""Selection off the critical path: one background thread that runs a layer's selection for the
next step while the model computes the following layers (FreeKV's speculative retrieval, "FreeKV:
Boosting KV Cache Retrieval for Efficient LLM Inference", G. Liu et al., ICLR 2026,
https://arxiv.org/abs/2505.13109: the next step's pages are selected with q_t while the model
works).

    job = worker.submit(fn, *args)    at the end of layer l's step t: fn(*args) starts on the thread
    job.join()                        where step t + 1 of layer l first needs the result, before
                                      anything reads or writes what it depends on: fn's value, or
                                      its exception re-raised here, on the model's thread

The synchronous form (`Worker(background=False)`) runs fn inside submit and keeps its value or
exception in the same Job, so the two forms differ only in the thread fn runs on: they give the
same results by construction, provided fn reads nothing the model writes between submit and
join (the callers' join points guarantee that; tests/policies/test_worker.py checks the order).

Cores: the thread is a second OS thread beside the model's. Torch ops release the GIL, so a
selection's tensor work runs beside the model's (on CPU with `--threads 1`: two cores, one the
model's intra-op thread, one the worker's; an op the worker issues runs on the worker's thread);
its Python bookkeeping does not (it takes the GIL). `threads(policy)` counts the worker for the
speed benchmark's fair comparison (full KV on as many threads).

The thread is a daemon: it never keeps the interpreter alive, and a job that fails never hangs
its join (every job ends by setting its event). `reset()` (at each bind) forgets jobs nobody
joined, so a policy object serves generate call after generate call.
"""
from __future__ import annotations

import queue
import threading

import torch


class Job:
    """One submitted call: its value or its exception, once `done` is set."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.value = self.error = None
        self.done = threading.Event()
        # the submitter's autograd and inference modes are thread-local: the job runs under them
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        # on CUDA the job's kernels go to the submitter's stream, in order with what it issued
        self.stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run(self) -> None:
        try:
            with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.value = self.fn(*self.args)
                else:
                    self.value = self.fn(*self.args)
        except BaseException as err:  # kept for the join, on the model's thread
            self.error = err
        finally:
            self.done.set()

    def join(self):
        """fn's value; its exception raised here (with the worker's traceback)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Worker:
    """Runs submitted jobs in order on one daemon thread (background=True) or inline (False)."""

    def __init__(self, background: bool = True):
        self.background = background
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def submit(self, fn, *args) -> Job:
        job = Job(fn, args)
        if not self.background:
            job.run()  # the synchronous form: the same Job, run on the caller's thread
            return job
        if self._thread is None or not self._thread.is_alive():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name="minikv-worker", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get().run()

    def reset(self) -> None:
        """Before a new sequence: wait for what is queued (it may still read the old layers'
        tensors; its results and errors are dropped with those layers)."""
        if self._thread is not None and self._thread.is_alive():
            self.submit(lambda: None).done.wait()

    @property
    def threads(self) -> int:
        """OS threads besides the model's this worker runs on: 1 in the background, else 0."""
        return int(self.background)


def policy_worker(policy, background: bool) -> Worker:
    """The worker of a policy being bound: one per policy object, kept across binds (generate
    calls) and reset; a new one where `background` changed."""
    worker = getattr(policy, "worker", None)
    if not isinstance(worker, Worker) or worker.background != background:
        worker = Worker(background)
    worker.reset()
    return worker


def threads(policy) -> int:
    """The threads a bound policy's decoding uses besides torch's intra-op pool (its worker's)."""
    worker = getattr(policy, "worker", None)
    return worker.threads if isinstance(worker, Worker) else 0


def thread_counts(policy, intra_op: int) -> dict:
    """What a run's stats say about its threads: torch's intra-op ones, the worker's, their sum."""
    return {"intra_op_threads": intra_op, "worker_threads": threads(policy), "threads": intra_op + threads(policy)}
