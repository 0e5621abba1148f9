"""Data-parallel update workers on CPU: ``torch.distributed`` with the gloo backend.

The update phase prepares the inputs once (samples, advantages, old and reference
log-probs) and starts ``resources.update.workers`` processes on this machine. Each
worker loads the same policy version and optimizer state, takes its contiguous
share of every minibatch's rows (same seeded permutation as one process), and
weights its loss by its share of the minibatch's tokens (``token-mean``) or
sequences (``seq-mean-*``), so the all-reduced *sum* of the workers' gradients is
the one-process gradient of the whole minibatch up to float summation order.
Then every worker clips and steps identically. Rank 0 writes the weights
(``save_policy``), the optimizer state (``save_optimizer``: keyed by parameter
name, no rank or world size anywhere) and the metric sums; the phase commits them.

A worker that fails makes the phase raise ``PhaseFailed`` with the workers' log
tails; the others are stopped. Collectives time out (``COLLECTIVE_TIMEOUT_S``), the
whole run times out at ``fault_tolerance.timeout_s.update``, and a worker whose
parent died exits. NCCL on GPUs would be the analogue; it is not built here.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from verl_tasks.config import AlgorithmConfig, ExperimentConfig
from verl_tasks.errors import PhaseFailed
from verl_tasks.models.checkpoint import OPTIMIZER, load_optimizer, load_policy, save_optimizer, save_policy
from verl_tasks.phases.update_steps import UpdateInputs, accumulate, minibatch_loss, minibatch_rows, set_lr

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0
DEFAULT_RUN_TIMEOUT_S = 6 * 3600.0
RESULT = "result.json"
# Metrics that are token means whatever the loss aggregation mode (see ``policy_loss_vanilla``).
TOKEN_MEAN_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
_WORKER_CODE = "import sys; from verl_tasks.phases.update_parallel import worker_main; sys.exit(worker_main(sys.argv[1:]))"


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker reads (written as JSON next to the inputs)."""

    policy_dir: str
    optimizer_path: str | None
    inputs_path: str
    out_dir: str
    rendezvous: str
    algorithm: dict[str, Any]
    temperature: float
    seed: int
    dtype: str
    threads: int
    world_size: int
    collective_timeout_s: float
    first_step: int = 0


@dataclass(frozen=True)
class ParallelResult:
    totals: dict[str, float]
    steps: int
    optimizer: dict[str, Any]


# ---------------------------------------------------------------- the parent side


def train_parallel(
    *, unit: str, config: ExperimentConfig, inputs: UpdateInputs, policy_dir: Path, optimizer_path: Path | None,
    seed: int, out: Path, first_step: int = 0,
) -> ParallelResult:
    """Run the optimisation on ``config.resources.update.workers`` processes.

    Args:
        unit: the update unit (for error messages).
        inputs: the prepared batch; ``policy_dir``/``optimizer_path``: the version to train.
        first_step: the global optimizer step the version was trained to (sets the learning rates).
        out: an empty folder; receives ``policy/``, ``optimizer.safetensors`` and ``result.json``.

    Returns:
        Metric sums over the optimizer steps (global minibatch values), steps, optimizer hyperparameters.

    Raises:
        PhaseFailed: a worker exited non-zero, or the run exceeded its time limit.
    """
    workers = config.phase_resources("update").workers
    timeout_s = config.fault_tolerance.timeout_s.get("update", DEFAULT_RUN_TIMEOUT_S)
    inputs.save(out / "inputs.safetensors")
    plan = WorkerPlan(
        policy_dir=str(policy_dir), optimizer_path=str(optimizer_path) if optimizer_path else None,
        inputs_path=str(out / "inputs.safetensors"), out_dir=str(out), rendezvous=f"file://{out / 'rendezvous'}",
        algorithm=config.algorithm.model_dump(mode="json"), temperature=config.rollout.temperature, seed=seed,
        dtype=config.model.dtype, threads=max(1, config.torch_threads // workers), world_size=workers,
        collective_timeout_s=min(COLLECTIVE_TIMEOUT_S, timeout_s), first_step=first_step,
    )
    (out / "plan.json").write_text(json.dumps(asdict(plan)))
    procs = [_start_worker(out, rank) for rank in range(workers)]
    try:
        _wait(procs, unit, out, timeout_s)
    finally:
        _stop(procs)
    result = json.loads((out / RESULT).read_text())
    return ParallelResult(totals=result["totals"], steps=result["steps"], optimizer=result["optimizer"])


def _start_worker(out: Path, rank: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    logfile = open(out / f"worker{rank}.log", "wb")
    with logfile:
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, str(out / "plan.json"), str(rank)],
            stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS): workers talk on this host only."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def _wait(procs: list[subprocess.Popen], unit: str, out: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(code == 0 for code in codes):
            return
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            time.sleep(0.5)  # let the peers of a failed worker report too
            codes = [p.poll() for p in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            detail = "\n".join(f"--- worker {r} (exit code {codes[r]}):\n{_tail(out, r)}" for r in failed)
            raise PhaseFailed(unit, f"update worker(s) {failed} of {len(procs)} failed; the others were stopped\n{detail}")
        if time.monotonic() > deadline:
            raise PhaseFailed(
                unit, f"update workers did not finish within {timeout_s:.0f} s (fault_tolerance.timeout_s.update); "
                f"worker 0 log tail:\n{_tail(out, 0)}",
            )
        time.sleep(0.1)


def _tail(out: Path, rank: int, chars: int = 2000) -> str:
    path = out / f"worker{rank}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<no log>"


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate workers still running (only those this phase started), then kill what ignores it."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the worker side


def worker_main(argv: list[str]) -> int:
    """Entry point of one worker: ``PLAN_JSON RANK``. Exit code 0 on success; raises otherwise."""
    import torch.distributed as dist

    plan = WorkerPlan(**json.loads(Path(argv[0]).read_text()))
    rank = int(argv[1])
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"[update worker {rank}] %(levelname)s %(message)s")
    torch.set_num_threads(plan.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group(
        "gloo", init_method=plan.rendezvous, rank=rank, world_size=plan.world_size,
        timeout=timedelta(seconds=plan.collective_timeout_s),
    )
    try:
        _run_worker(plan, rank)
    finally:
        dist.destroy_process_group()
    return 0


def _exit_with_parent() -> None:
    """A daemon thread that ends this worker if the phase process that started it dies."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _run_worker(plan: WorkerPlan, rank: int) -> None:
    model, tokenizer = load_policy(Path(plan.policy_dir), plan.dtype)
    algo = AlgorithmConfig.model_validate(plan.algorithm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    if plan.optimizer_path:
        load_optimizer(optimizer, model, Path(plan.optimizer_path))
    inputs = UpdateInputs.load(Path(plan.inputs_path))
    totals, steps = train_shard(model, optimizer, inputs, algo, plan.temperature, plan.seed, rank, plan.world_size,
                                plan.first_step)
    if rank == 0:
        out = Path(plan.out_dir)
        model.eval()
        save_policy(model, tokenizer, out / "policy")
        hyper = save_optimizer(optimizer, model, out / OPTIMIZER)
        (out / RESULT).write_text(json.dumps({"totals": totals, "steps": steps, "optimizer": hyper}))


def train_shard(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: UpdateInputs, algo: AlgorithmConfig,
    temperature: float, seed: int, rank: int, world_size: int, first_step: int = 0,
) -> tuple[dict[str, float], int]:
    """This worker's part of the optimisation from global step ``first_step``. Returns (global metric sums, steps)."""
    import torch.distributed as dist

    model.train()
    totals: dict[str, float] = {}
    steps = 0
    for rows in minibatch_rows(len(inputs), algo, seed):
        shard, loss_w, token_w = shard_rows(inputs, rows, rank, world_size, algo.loss_agg_mode.value)
        loss, metrics = minibatch_loss(model, inputs, shard, algo, temperature)
        optimizer.zero_grad(set_to_none=True)
        (loss * loss_w).backward()
        all_reduce_gradients(model, dist)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip)
        set_lr(optimizer, algo, first_step + steps)
        optimizer.step()
        metrics["actor/loss"] = loss.item()
        weighted = {k: v * (token_w if k in TOKEN_MEAN_METRICS else loss_w) for k, v in metrics.items()}
        weighted["actor/grad_norm"] = float(grad_norm) if rank == 0 else 0.0  # the same on every worker
        accumulate(totals, weighted)
        steps += 1
    keys = list(totals)
    sums = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(sums)
    return dict(zip(keys, sums.tolist())), steps


def shard_rows(
    inputs: UpdateInputs, rows: torch.Tensor, rank: int, world_size: int, loss_agg_mode: str
) -> tuple[torch.Tensor, float, float]:
    """This worker's rows of a minibatch and its weights (loss weight, token-mean weight).

    The rows are split into ``world_size`` contiguous parts. A worker left without rows
    (a minibatch shorter than the worker count) runs one row with weight 0, so every
    worker's autograd graph, and so its gradient list, has the same shape.
    """
    shard = torch.tensor_split(rows, world_size)[rank]
    if len(shard) == 0:
        return rows[:1], 0.0, 0.0
    mask = inputs.data["response_mask"]
    token_w = float(mask[shard].sum()) / max(float(mask[rows].sum()), 1.0)
    loss_w = token_w if loss_agg_mode == "token-mean" else len(shard) / len(rows)
    return shard, loss_w, token_w


def all_reduce_gradients(model: torch.nn.Module, dist: Any) -> None:
    """Sum every gradient over the workers, in one flat buffer."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
