"""Executors run a step on every tensor-parallel rank.

`InProcExecutor` (t = 1): the worker lives in the caller's process.
`MultiProcExecutor` (t > 1, or t = 1 with ParallelConfig.worker_process: a node's
--worker-process): one process per rank, forked from a server that imported torch and the worker
once for the process (`rank_context`), joined by torch.distributed
(gloo on CPU, nccl on CUDA), rank r on the device engine/devices.py maps it to; each step is
pickled once into a buffer every rank maps (engine/step_channel.py), its length sent down each
rank's pipe, and rank 0 answers.
`Executor` is what both offer: a step, and `call_all(fn, ...)` -> fn(worker, ...) on every rank
(what a transfer connector drives its rank endpoints with).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from engine import heap, shm_all_reduce
from engine.cache.allocator import Capacity
from engine.config import EngineConfig
from engine.devices import bind, node_devices
from engine.step import StepInput, StepOutput
from engine.step_channel import StepReader, StepWriter, messages

log = logging.getLogger("pdserve.executor")
STARTUP_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 600.0


_T = TypeVar("_T")


class WorkerError(RuntimeError):
    """A rank failed: its traceback, as text. An exception class with a true `crosses_ranks`
    attribute (the transfer layer's errors) is raised by `call_all` as the rank raised it instead,
    so that the caller handles it by its type as with one rank; it must pickle."""


class WorkerLost(WorkerError):
    """A tensor-parallel rank is gone (its process exited or its pipe broke): the engine cannot
    step again; the node stops so that it is restarted (docs/serving.md)."""


class Executor(Protocol):
    capacity: Capacity

    def execute(self, step: StepInput) -> StepOutput: ...

    def call_all(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> list[_T]:
        """fn(worker, *args, **kwargs) on every rank; results by rank."""
        ...

    def close(self) -> None: ...

    def lost(self) -> str | None:
        """Why a rank is gone (WorkerLost's message), or None while every rank runs."""
        ...


class InProcExecutor:
    def __init__(self, cfg: EngineConfig):
        from engine.worker import Worker

        self.worker = Worker(cfg)
        self.capacity: Capacity = self.worker.capacity

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def call_all(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> list[_T]:
        """fn(worker, *args, **kwargs) on every rank (here, the one): results by rank."""
        return [self.worker.call(fn, *args, **kwargs)]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker = None

    def lost(self) -> str | None:
        return None  # the one rank is this process


def _rendezvous_store(t: int):
    """The ranks' rendezvous store, served by the parent on a port the OS picks and the parent
    holds for the executor's life: no port is chosen free and then lost to another process
    before a rank binds it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=t, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S))  # fmt: skip


def rank_context():
    """Where ranks start: a fork server that has imported the worker (torch with it) once, in the
    first executor's process. A spawned rank imported them again, about 3 s of CPU per rank on a
    2-core AVX2 host (docs/benchmarks.md, "Start-up and the test suite"). The server starts no
    thread and touches no CUDA device before a rank forks; each rank takes the environment its
    executor had when it started (`_rank_main`), not the server's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["engine.worker"])
    return ctx


def _rank_main(
    cfg: EngineConfig,
    rank: int,
    port: int,
    conn,
    device: str,
    steps_path: str,
    env: dict[str, str],
    reduce_path: str | None = None,
) -> None:
    import signal

    os.environ.clear()
    os.environ.update(env)  # the executor's, as a spawned rank would inherit it

    import torch.distributed as dist

    # A rank follows its engine: it exits when the pipe closes (close() or the parent's death),
    # never on a signal to the process group, so a node can drain on SIGTERM with its ranks alive.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from engine.worker import Worker

    try:
        t = cfg.parallel.tensor_parallel_size
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // t))  # the CPUs a node is bound to
        dev = torch.device(device)
        bind(dev)  # before the process group and any allocation: NCCL's communicator lives on it
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        if dev.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=rank, world_size=t, device_id=dev)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=t)

        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

        shm = shm_all_reduce.ShmAllReduce(reduce_path, rank, t) if reduce_path is not None else None  # the CPU's

        def broadcast(x: torch.Tensor) -> torch.Tensor:
            dist.broadcast(x, src=0)
            return x

        worker = Worker(cfg, rank, shm or all_reduce, broadcast, dev)
        steps = StepReader(steps_path)
        heap.settle()  # the rank's weights and modules: out of the collector's walk
        conn.send(("ready", worker.capacity))
    except ValueError as e:  # a setting to change (the cache too small, ...): its message, as with one rank
        log.debug("rank %d: start-up refused", rank, exc_info=True)
        conn.send(("invalid", str(e)))
        return
    except BaseException:  # report start-up failures to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    for msg in messages(conn):
        try:
            if isinstance(msg, tuple) and msg and msg[0] == "call":
                _, fn, args, kwargs = msg
                try:
                    conn.send(("ok", worker.call(fn, *args, **kwargs)))
                except Exception as e:
                    if not getattr(type(e), "crosses_ranks", False):
                        raise
                    conn.send(("raise", e))  # handled by its type (pickled first: a failure sends nothing)
                continue
            if isinstance(msg, int | bytes):  # the step's length in the shared buffer, or the step pickled
                msg = steps.read(msg)
            conn.send(("ok", worker.execute(msg)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    worker.close()  # its transfer endpoints drain their writes before the process's sockets close
    steps.close()
    if shm is not None:
        shm.close()
    dist.destroy_process_group()


# executors whose ranks are up: closed at interpreter exit, before multiprocessing's own exit
# hook (registered earlier, so run later) joins the ranks, which ignore its SIGTERM and would
# wait for a pipe that only close() ends: a script that never called close() hung at exit
_LIVE: weakref.WeakSet[MultiProcExecutor] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for ex in list(_LIVE):
        ex.close()


@contextlib.contextmanager
def _without_callers_main():
    """Ranks start without running the caller's `__main__` again. multiprocessing has a started
    process re-import the parent's main module (a script: run again from its path); a rank needs
    none of it (it runs `_rank_main` with engine objects), and a user's script without an
    `if __name__ == "__main__":` guard would build its LLM again inside each rank, which
    multiprocessing refuses: the rank died at start."""
    prepare = mp_spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        d = prepare(name)
        d.pop("init_main_from_path", None)
        d.pop("init_main_from_name", None)
        return d

    mp_spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = prepare


class MultiProcExecutor:
    def __init__(self, cfg: EngineConfig):
        t = cfg.parallel.tensor_parallel_size
        devices = node_devices(cfg.device, t)  # raises before any rank starts
        ctx = rank_context()
        self._store = _rendezvous_store(t)
        self._steps = StepWriter()  # each step pickled once, for every rank (engine/step_channel.py)
        # CPU ranks sum their activations over shared memory (engine/shm_all_reduce.py), not gloo's TCP
        cpu = all(torch.device(d).type == "cpu" for d in devices)
        self._reduce = shm_all_reduce.create(t) if t > 1 and cpu and shm_all_reduce.supported() else None
        port = self._store.port
        self.conns, self.procs = [], []
        self._lost: str | None = None  # why a rank is gone, once one is (`lost`)
        for rank in range(t):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(cfg, rank, port, child, str(devices[rank]), self._steps.path, dict(os.environ), self._reduce),
                daemon=True,
                name=f"pdserve-rank{rank}",
            )
            with _without_callers_main():
                p.start()
            child.close()  # the rank has its own copy: ours open, its pipe would never show it gone
            self.conns.append(parent)
            self.procs.append(p)
        _LIVE.add(self)
        caps = [self._recv(c, STARTUP_TIMEOUT_S, "start") for c in self.conns]
        self._steps.unlink()  # every rank has mapped it
        self._unlink_reduce()
        self.capacity: Capacity = caps[0]

    def _recv(self, conn, timeout: float, what: str, fatal: bool = True):
        if not conn.poll(timeout):
            self.close()
            raise WorkerError(f"a tensor-parallel worker did not answer {what} within {timeout:.0f} s")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            why = self._lost = self.lost() or "its pipe closed"
            self.close()
            raise WorkerLost(f"a tensor-parallel worker died during {what} ({why}); see its log above") from None
        if kind == "invalid":  # start-up refused a setting: the one line a single rank would raise
            self.close()
            raise ValueError(payload)
        if kind == "raise":  # a typed error the caller handles (a class with `crosses_ranks`): as the rank raised it
            raise payload
        if kind == "error":
            if fatal:
                self.close()
            raise WorkerError(f"a tensor-parallel worker failed during {what}:\n{payload}")
        return payload

    def _send(self, msg: Any, what: str) -> None:
        for c in self.conns:
            try:
                c.send(msg)
            except OSError:  # a broken pipe: the rank exited
                why = self._lost = self.lost() or "its pipe broke"
                self.close()
                raise WorkerLost(f"a tensor-parallel worker is gone before {what} ({why})") from None

    def lost(self) -> str | None:
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._lost = f"rank {rank}, pid {p.pid}, exited with status {p.exitcode}"
        return self._lost

    def execute(self, step: StepInput) -> StepOutput:
        if not self.conns:
            raise WorkerLost("the tensor-parallel workers were stopped after one was lost")
        self._send(self._steps.write(step), "a step")  # its length in the buffer, or (too large) the pickled step
        outs = [self._recv(c, STEP_TIMEOUT_S, "a step") for c in self.conns]
        return outs[0]

    def call_all(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> list[_T]:
        """fn(worker, *args, **kwargs) on every rank (fn must be importable by name); results by rank."""
        what = f"call {getattr(fn, '__name__', fn)}"
        self._send(("call", fn, args, kwargs), what)
        outs, err = [], None
        for c in self.conns:  # drain every rank's answer before raising, to keep the pipes in step
            try:
                outs.append(self._recv(c, STEP_TIMEOUT_S, what, fatal=False))
            except Exception as e:  # a WorkerError, or a rank's typed error (`crosses_ranks`)
                if not self.conns:
                    raise
                err = err or e
        if err is not None:
            raise err
        return outs

    def close(self) -> None:
        _LIVE.discard(self)
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for c, p in zip(self.conns, self.procs):
            if not _closed(c, 10.0):  # a rank's exit status passes through the fork server, which a
                p.kill()  # signal to the node's group may have stopped: its pipe's end says it exited
            p.join(timeout=1)
        self.conns, self.procs = [], []
        self._store = None  # after the ranks: they may use the store until they exit
        self._steps.close()
        self._unlink_reduce()

    def _unlink_reduce(self) -> None:
        if self._reduce is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._reduce)
            self._reduce = None


def _closed(conn, timeout: float) -> bool:
    """True once the other end of `conn` has closed (its rank exited) within `timeout` s."""
    end = time.monotonic() + timeout
    try:
        while conn.poll(max(0.0, end - time.monotonic())):
            conn.recv()  # an answer still in the pipe
    except (EOFError, OSError):
        return True
    return False


def make_executor(cfg: EngineConfig) -> InProcExecutor | MultiProcExecutor:
    if cfg.parallel.tensor_parallel_size == 1 and not cfg.parallel.worker_process:
        return InProcExecutor(cfg)
    return MultiProcExecutor(cfg)
