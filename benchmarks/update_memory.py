"""Peak memory per update worker: one ddp worker vs two fsdp2 workers, on a ~0.5B-parameter model.

    .venv/bin/python benchmarks/update_memory.py [--steps 1] [--seq 32] [--batch 2] [--json out.json]

The model is Qwen2.5-0.5B's shape (24 layers, hidden 896, vocabulary 151,936, tied embeddings;
494M parameters) built from a config with random weights (nothing is downloaded), saved once as
an HF folder. Each variant runs the update's own code in fresh processes: ``1-ddp`` the one-process
path (``load_policy``, AdamW, ``train_single``, ``save_policy`` + ``save_optimizer``), ``2-fsdp2``
two Ray Train workers (``train.worker.build``: meta init and each worker's rows only, AdamW,
``train_steps``, ``write_full_weights`` streamed by rank 0, one optimizer shard per rank). Peak RSS
is each process's ``ru_maxrss``; "before" is its RSS once imports are done, so the model's share is
the difference (a Ray worker imports more than a plain process).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=True, rope_theta=1000000.0)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_model(folder: Path) -> int:
    """A random-weight Qwen2-shaped policy folder (run in a child process, so its memory is returned)."""
    code = (
        "import sys, torch; from transformers import Qwen2Config, Qwen2ForCausalLM; "
        "from verl_tasks.models.tiny import build_tokenizer; torch.manual_seed(0); "
        f"m = Qwen2ForCausalLM(Qwen2Config(**{QWEN_05B!r})); m.save_pretrained(sys.argv[1]); "
        "build_tokenizer().save_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(folder)], check=True, capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return int(done.stdout.strip().splitlines()[-1])


def config(workers: int, strategy: str, batch: int):
    from verl_tasks.config import load_config

    return load_config(CONFIG, {"resources.update.workers": workers, "resources.update.strategy": strategy,
                                "algorithm.minibatch_size": batch})


def synthetic_inputs(batch: int, seq: int, vocab: int):
    """A batch of random prompts+responses (half each), random advantages: one minibatch per step."""
    import torch

    from verl_tasks.phases.update_steps import UpdateInputs

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    half = seq // 2
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "positions": torch.arange(half - 1, seq - 1).expand(batch, -1).contiguous(),
            "response_ids": ids[:, half:].contiguous(), "response_mask": torch.ones(batch, seq - half)}
    return UpdateInputs(data, None, torch.randn(batch, seq - half, generator=generator), None)


def one_ddp(folder: str, steps: int, seq: int, batch: int) -> None:
    """Child process: the one-process update path; prints its memory as JSON."""
    import torch

    from verl_tasks.models.checkpoint import load_policy, save_optimizer, save_policy
    from verl_tasks.phases.update_steps import train_single

    cfg = config(1, "ddp", batch)
    torch.set_num_threads(cfg.torch_threads)
    before = rss_mib()
    started = time.monotonic()
    model, tokenizer = load_policy(Path(folder))
    algo = cfg.algorithm.model_copy(update={"ppo_epochs": steps})
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr)
    train_single(model, optimizer, synthetic_inputs(batch, seq, model.config.vocab_size), algo, 1.0, 0, lambda s: None)
    with tempfile.TemporaryDirectory() as out:
        save_policy(model, tokenizer, Path(out))
        save_optimizer(optimizer, model, Path(out))
    print(json.dumps({"rank": 0, "before_mib": before, "peak_mib": peak_mib(), "s": time.monotonic() - started}))


def fsdp2_loop(job: dict) -> None:
    """Ray Train worker: the fsdp2 update path; puts its memory into the queue."""
    import ray.train
    import torch

    from verl_tasks.models.checkpoint import optimizer_shard_name, save_optimizer_shard
    from verl_tasks.train import sharding
    from verl_tasks.train.worker import build, train_steps

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    cfg = config(world, "fsdp2", job["batch"])
    torch.set_num_threads(max(1, cfg.torch_threads // world))
    before = rss_mib()
    started = time.monotonic()
    model, _ = build(Path(job["folder"]), cfg, torch.device("cpu"), world, train=True)
    algo = cfg.algorithm.model_copy(update={"ppo_epochs": job["steps"]})
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr)
    inputs = synthetic_inputs(job["batch"], job["seq"], model.config.vocab_size)
    train_steps(model, optimizer, inputs, algo, 1.0, 0, 0, lambda s: None)
    with tempfile.TemporaryDirectory() as out:
        sharding.write_full_weights(model, Path(out) / "model.safetensors" if rank == 0 else None)
        save_optimizer_shard(optimizer, model, Path(out) / optimizer_shard_name(rank))
    job["results"].put({"rank": rank, "before_mib": before, "peak_mib": peak_mib(), "s": time.monotonic() - started})


def two_fsdp2(folder: Path, steps: int, seq: int, batch: int) -> list[dict]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Queue

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    results = Queue(actor_options={"num_cpus": 0})
    with tempfile.TemporaryDirectory() as storage:
        TorchTrainer(fsdp2_loop, train_loop_config={"folder": str(folder), "steps": steps, "seq": seq, "batch": batch,
                                                    "results": results},
                     scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                     torch_config=TorchConfig(backend="gloo"),
                     run_config=RunConfig(name="update-memory", storage_path=storage)).fit()
    out = sorted((results.get(timeout=60) for _ in range(2)), key=lambda r: r["rank"])
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-ddp", help=argparse.SUPPRESS)  # the child process of the 1-ddp variant
    args = parser.parse_args()
    if args.one_ddp:
        one_ddp(args.one_ddp, args.steps, args.seq, args.batch)
        return
    with tempfile.TemporaryDirectory(prefix="vt-memory-") as tmp:
        folder = Path(tmp) / "policy"
        params = make_model(folder)
        child = subprocess.run([sys.executable, __file__, "--one-ddp", str(folder), "--steps", str(args.steps),
                                "--seq", str(args.seq), "--batch", str(args.batch)],
                               check=True, capture_output=True, text=True, cwd=ROOT)
        ddp = [json.loads(child.stdout.strip().splitlines()[-1])]
        fsdp2 = two_fsdp2(folder, args.steps, args.seq, args.batch)
    load = os.getloadavg()
    print(f"{params / 1e6:.0f}M parameters (fp32 {params * 4 / 2**30:.2f} GiB); {args.steps} optimizer step(s), "
          f"batch {args.batch} x {args.seq} tokens; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| variant | worker | RSS after imports (MiB) | peak RSS (MiB) | peak - imports (MiB) | seconds |")
    print("|---|---|---|---|---|---|")
    for name, rows in (("1 worker ddp", ddp), ("2 workers fsdp2", fsdp2)):
        for r in rows:
            print(f"| {name} | {r['rank']} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | "
                  f"{r['peak_mib'] - r['before_mib']:.0f} | {r['s']:.0f} |")
    ratio = max(r["peak_mib"] - r["before_mib"] for r in fsdp2) / (ddp[0]["peak_mib"] - ddp[0]["before_mib"])
    print(f"largest fsdp2 worker / ddp worker (model's share): {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "ddp": ddp, "fsdp2": fsdp2, "load_average": load}, indent=1))


if __name__ == "__main__":
    main()
