"""A trainer over several hosts: `trainer.hosts` Ray actors that run one JAX program.

    posttrain run recipes/sft_tiny.yaml trainer.hosts=2 trainer.devices_per_host=2

Start-up, in order, each step bounded by `trainer.init_timeout_s`:
  1. a Ray placement group of one bundle per host (`trainer.cpus_per_host`, `gpus_per_host`,
     `resources`; `placement_strategy`), so the hosts are reserved together or not at all;
  2. one `TrainerHost` actor per bundle; rank 0 picks its node's address and a free port;
  3. every actor calls `jax.distributed.initialize(coordinator, hosts, rank)` at once (CPU
     hosts use gloo collectives); the mesh covers every host's devices, `mesh.dcn` axes span
     hosts;
  4. every actor builds the same `Trainer` (`posttrain.train.trainer`) over the global mesh.
The driver sends every call to all ranks (the same program on every host) and takes rank 0's
result. A batch travels as per-host slices: rank r gets only the rows its devices hold and puts
them on the mesh with `jax.make_array_from_process_local_data`; the data position stays with the
driver and goes into checkpoints as one global position, so a resumed run sees the same
examples whatever the host count. Checkpoints are Orbax's multi-host ones (each host writes its
shards, the primary host the metadata) and restore into any host count or a single process.

Weights leave for the rollout engines from process 0: every host takes part in gathering each
exported tensor (a collective per tensor, at most a bucket of them alive), and rank 0 puts each
bucket into Ray's object store, where the engines load it (`rollout.transfer.ObjectStore`).
Engines load whole HF tensors in their own layout (vLLM's tensor parallelism slices them its
own way), so a full tensor has to be assembled somewhere; gathering one bucket at a time onto
one host bounds that host's extra memory to a bucket and keeps the engines' side unchanged.

Failures end the run, never hang it: the driver waits on every rank at once, and the first rank
that dies (its actor's process is gone) or raises ends the call with `ClusterError` naming it;
the other ranks, stuck in a collective with the dead one, are killed. Running the same command
again resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from pathlib import Path

import numpy as np
import ray

from posttrain.config import RunConfig
from posttrain.errors import ClusterError, UserError, warn
from posttrain.models.config import ModelConfig
from posttrain.train.trainer import Trainer

# Fault injection for tests: the rank that never calls jax.distributed.initialize.
SKIP_JOIN_ENV = "POSTTRAIN_TEST_SKIP_JOIN_RANK"


# buckets of an export whose refs rank 0 keeps: the streamed generator runs up to 2 items ahead
# of the driver, which keeps 1 load in flight (`rollout.transfer.ObjectStore`)
EXPORT_REFS_KEPT = 4


@ray.remote(max_restarts=0)
class TrainerHost:
    """One host of the group: joins jax.distributed, then runs a `Trainer` over the global mesh."""

    def __init__(self, rank: int):
        from posttrain import host_memory

        host_memory.keep_freed_memory()  # a process that trains: before JAX starts its threads
        self.rank, self.trainer = rank, None
        self._recent_buckets: deque = deque(maxlen=EXPORT_REFS_KEPT)

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.util.get_node_ip_address()}

    def coordinator_address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str, hosts: int, platform: str, timeout_s: float) -> dict:
        if os.environ.get(SKIP_JOIN_ENV) == str(self.rank):
            time.sleep(10 * timeout_s)  # a host that never shows up
        import jax

        if platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, hosts, self.rank,
                                   initialization_timeout=max(1, int(timeout_s)))
        return {"process_index": jax.process_index(), "devices": jax.device_count(),
                "local_devices": jax.local_device_count(), "backend": jax.default_backend()}

    def build(self, cfg: RunConfig, run_dir: str, model_cfg: ModelConfig, loss_fn) -> None:
        self.trainer = Trainer(cfg, Path(run_dir), model_cfg, loss_fn)

    def call(self, method: str, *args, **kw):
        return getattr(self.trainer, method)(*args, **kw)

    def train_step(self, batch: dict, rows: int) -> dict:
        return self.trainer.train_step(batch, rows)()

    def save_hf(self, out: str, lora_scale) -> None:
        self.trainer.save_hf(Path(out), lora_scale, write=self.rank == 0)

    def export_plan(self, kw: dict):
        ex = self.trainer.exporter(**kw)
        return ex.plan, ex.nbytes, ex.layout

    def export(self, kw: dict):
        """Every rank gathers each tensor of the export (collectives); rank 0 yields
        (bucket meta, object ref of its arrays) bucket by bucket."""
        for meta, arrays in self.trainer.exporter(**kw).host_arrays():
            if self.rank == 0:
                # The owner holds its newest refs itself: one that only travels inside a
                # streamed item could be released before the driver has taken it (seen once:
                # a worker's load_bucket failed with ReferenceCountingAssertionError).
                ref = ray.put(arrays)
                self._recent_buckets.append(ref)
                yield meta, ref
            del arrays

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()


def host_env(cfg: RunConfig) -> dict[str, str]:
    """What a trainer actor's process needs before JAX starts."""
    t = cfg.trainer
    platform = t.resolved_platform
    if platform == "cpu":
        return {"JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={t.devices_per_host or 1}"}
    return {"JAX_PLATFORMS": {"gpu": "cuda", "tpu": "tpu"}[platform], "XLA_FLAGS": ""}


def _root_cause(err: BaseException) -> BaseException:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


class TrainerGroup:
    """The `Trainer` interface over `trainer.hosts` Ray actors (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, model_cfg: ModelConfig, loss_fn=None):
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from posttrain.cluster import init_ray

        init_ray(cfg)
        t = cfg.trainer
        self.cfg, self.model_cfg, self.n = cfg, model_cfg, t.hosts
        self.timeout_s = t.init_timeout_s
        self.hosts: list = []
        self.info: list[dict] = [{"rank": r} for r in range(self.n)]
        self._rows: dict[int, list[tuple[int, int]]] = {}
        bundle = {k: v for k, v in {"CPU": t.cpus_per_host, "GPU": t.gpus_per_host,
                                    **t.resources}.items() if v}
        self.pg = placement_group([bundle or {"CPU": 0.001}] * self.n,
                                  strategy=t.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=self.timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise ClusterError(
                f"trainer.hosts={self.n}: Ray could not reserve {self.n} x {bundle} "
                f"({t.placement_strategy}) within {self.timeout_s:g} s; the cluster has "
                f"{ray.cluster_resources()} (trainer.cpus_per_host / gpus_per_host / resources)")
        try:
            env = {"env_vars": host_env(cfg)}
            self.hosts = [TrainerHost.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, r),
                num_cpus=t.cpus_per_host, num_gpus=t.gpus_per_host, resources=t.resources or None,
                runtime_env=env).remote(r) for r in range(self.n)]
            self.info = self._gather([h.info.remote() for h in self.hosts], "start",
                                     self.timeout_s)
            coordinator = self._gather([self.hosts[0].coordinator_address.remote()], "start",
                                       self.timeout_s)[0]
            joined = self._gather([h.join.remote(coordinator, self.n, t.resolved_platform,
                                                 self.timeout_s) for h in self.hosts],
                                  f"joining jax.distributed at {coordinator}",
                                  self.timeout_s + 30, joining=True)
            for i, j in zip(self.info, joined):
                i.update(j)
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "trainer_group.json").write_text(json.dumps(
                {"coordinator": coordinator, "hosts": self.info}, indent=2))
            self._gather([h.build.remote(cfg, str(run_dir), model_cfg, loss_fn)
                          for h in self.hosts], "building the trainer")
        except BaseException:
            self.kill()
            raise

    def __repr__(self) -> str:
        return f"TrainerGroup({self.n} hosts)"

    # ---- calls on every rank --------------------------------------------------------------------
    def _who(self, rank: int) -> str:
        i = self.info[rank]
        where = f" (pid {i['pid']} on {i['node']})" if "pid" in i else ""
        return f"trainer rank {rank}{where}"

    def _gather(self, refs: list, what: str, timeout_s: float | None = None,
                ranks: list[int] | None = None, joining: bool = False) -> list:
        """Every ref's value, in order (`ranks`: the rank behind each ref, default 0, 1, ...).
        The first rank that died or raised ends the wait (the others may be blocked in a
        collective with it): `ClusterError` naming the rank, or the rank's own `UserError`; a
        timeout names the ranks still running; ranks still running after
        `watchdog.warn_after_s` (and each doubling of it) are reported by name while the others
        are done: a straggler or a rank stuck in a collective. `joining`: a rank that fails while others have
        not joined gave up waiting for them (JAX ends the process when initialize times
        out), so the error names those that never joined."""
        ranks = ranks or list(range(len(refs)))
        index = {r: ranks[i] for i, r in enumerate(refs)}
        slot = {r: i for i, r in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        warn_at = self.cfg.watchdog.warn_after_s
        while pending:
            now = time.monotonic()
            waits = ([deadline - now] if deadline is not None else []) + \
                ([t0 + warn_at - now] if warn_at > 0 else [])
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, min(waits)) if waits else None)
            if not ready and (deadline is None or time.monotonic() < deadline):
                warn(f"waiting {time.monotonic() - t0:.0f} s on "
                     f"{', '.join(self._who(index[r]) for r in pending)} ({what}; "
                     f"{len(refs) - len(pending)} of {len(refs)} ranks done)")
                warn_at *= 2
                continue
            if not ready:
                late = sorted(index[r] for r in pending)
                self.kill()
                raise ClusterError(f"{', '.join(self._who(r) for r in late)}: not done "
                                   f"{what} after {timeout_s:g} s (trainer.init_timeout_s)")
            ref = ready[0]
            rank = index[ref]
            try:
                out[slot[ref]] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.RayTaskError) as e:
                self.kill()
                cause = _root_cause(e)
                if isinstance(cause, UserError):
                    raise cause from None
                if joining and pending:
                    late = sorted(index[r] for r in pending)
                    raise ClusterError(
                        f"{', '.join(self._who(r) for r in late)}: never joined ({what}); "
                        f"{self._who(rank)} gave up after trainer.init_timeout_s = "
                        f"{self.timeout_s:g} s") from None
                if isinstance(e, ray.exceptions.RayTaskError):
                    raise ClusterError(f"{self._who(rank)} failed while {what}: {cause!r}") from e
                raise ClusterError(f"{self._who(rank)} died while {what}: "
                                   f"{type(e).__name__}") from None
        return out

    def _call(self, method: str, *args, what: str | None = None, **kw):
        refs = [h.call.remote(method, *args, **kw) for h in self.hosts]
        return self._gather(refs, what or method)[0]

    def _slices(self, batch: dict) -> tuple[list[dict], int]:
        """Each rank's rows of `batch` (those its devices hold) and the global row count."""
        rows = len(next(iter(batch.values())))
        if rows not in self._rows:
            self._rows[rows] = self._gather([h.call.remote("local_rows", rows)
                                             for h in self.hosts], "planning the batch")
        return [{k: np.asarray(v)[lo:hi] for k, v in batch.items()}
                for lo, hi in self._rows[rows]], rows

    # ---- the Trainer interface --------------------------------------------------------------------
    def restore(self) -> dict | None:
        return self._call("restore", what="restoring the checkpoint")

    def latest_step(self) -> int | None:
        return self._call("latest_step")

    def train_step(self, batch: dict):
        parts, rows = self._slices(batch)
        refs = [h.train_step.remote(p, rows) for h, p in zip(self.hosts, parts)]
        return lambda: self._gather(refs, "a train step")[0]

    def eval_loss(self, batches: list[dict]) -> float:
        if not batches:
            return 0.0
        per_rank = [self._slices(b)[0] for b in batches]
        rows = len(next(iter(batches[0].values())))
        refs = [h.call.remote("eval_loss", [p[r] for p in per_rank], rows)
                for r, h in enumerate(self.hosts)]
        return self._gather(refs, "evaluating")[0]

    def update(self, batch: dict):
        parts, rows = self._slices(batch)
        refs = [h.call.remote("update", p, rows) for h, p in zip(self.hosts, parts)]
        return self._gather(refs, "a policy update")[0]

    def reference_logps(self, batch: dict) -> dict:
        parts, rows = self._slices(batch)
        refs = [h.call.remote("reference_logps", p, rows) for h, p in zip(self.hosts, parts)]
        return self._gather(refs, "reference log-probs")[0]

    def save(self, step: int, data_state: dict, **meta) -> None:
        self._call("save", step, data_state, what=f"saving checkpoint {step}", **meta)

    def wait(self) -> None:
        self._call("wait", what="finishing the checkpoint writes")

    def row_unit(self) -> int:
        return self._call("row_unit")

    def score(self, sequences):
        return self._call("score", sequences, what="scoring the probe")

    def save_hf(self, out: Path, lora_scale: float | None = None) -> None:
        self._gather([h.save_hf.remote(str(out), lora_scale) for h in self.hosts],
                     "exporting the HF checkpoint")

    def exporter(self, **kw) -> GroupExporter:
        plan, nbytes, layout = self._gather([h.export_plan.remote(kw) for h in self.hosts],
                                            "planning the weight export")[0]
        return GroupExporter(self, kw, plan, nbytes, layout)

    def policy(self):
        raise RuntimeError("a trainer group has no policy in this process (rollout.placement "
                           "must be disaggregated)")

    policy_state = policy

    def close(self) -> None:
        if self.hosts:
            try:
                self._gather([h.close.remote() for h in self.hosts], "closing", 120)
            finally:
                self.kill()

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        hosts, self.hosts = self.hosts, []
        for h in hosts:
            try:
                ray.kill(h)
            except Exception:
                pass
        if getattr(self, "pg", None) is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


class GroupExporter:
    """A trainer group's export, as the object-store transport consumes it: the plan (known up
    front, from rank 0) and, per bucket, the object ref rank 0 put its arrays under."""

    views_only = False

    def __init__(self, group: TrainerGroup, kw: dict, plan, nbytes: int, layout: str):
        self.group, self.kw, self.plan, self.nbytes, self.layout = group, kw, plan, nbytes, layout

    def host_arrays(self):
        g = self.group
        others = [h.export.options(num_returns="streaming").remote(self.kw) for h in g.hosts[1:]]
        first = g.hosts[0].export.options(num_returns="streaming",
                                          _generator_backpressure_num_objects=2).remote(self.kw)
        try:
            for item in first:
                yield g._gather([item], "exporting weights", ranks=[0])[0]
            for r, gen in enumerate(others, start=1):  # their part ends with rank 0's
                for item in gen:
                    g._gather([item], "exporting weights", ranks=[r])
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
            g.kill()
            raise ClusterError(f"a trainer rank died while exporting weights: {e}") from None

    def largest_bucket(self) -> int:
        return max(b.nbytes for b in self.plan)

    def buckets(self, buffers=None):
        raise NotImplementedError("a trainer group exports through the object store")


def make_trainer(cfg: RunConfig, run_dir: Path, model_cfg: ModelConfig, loss_fn=None):
    """`Trainer` in this process, or a `TrainerGroup` of `trainer.hosts` Ray actors."""
    if cfg.trainer.hosts > 1:
        return TrainerGroup(cfg, run_dir, model_cfg, loss_fn)
    return Trainer(cfg, run_dir, model_cfg, loss_fn)
