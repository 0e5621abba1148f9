"""From an update's commit to a rollout worker's first sampled token of the new policy: through Ray's object
store (the update's in-memory handover) vs through the store, on a local store and on S3 (moto server).

    .venv/bin/python benchmarks/weights_handover.py [--repeats 3] [--engines hf,vllm] [--output BENCHMARKS.md]

For each store, SmolLM2-135M-Instruct (``dags/experiments/smollm2_arith.yaml``, no evaluation) trains
two epochs with the update on two resident ddp workers, which commit policy 2 and hand its weights
to Ray's object store. A rollout worker (a Ray actor in its own process, as a pool worker is) holds
policies 0 and 1 warm, as it does in the middle of a run, and is then asked for policy 2: it loads
it (from memory, or from the store when the handover is withdrawn) and samples one token. Timed:
that load plus the first token, per engine (HF: the weights loaded in place into the held model of
the oldest version; vLLM: the weights written to a local folder or read from the store's, then
reloaded into the held engine).
Counted: the bytes the worker read from the store and received from memory for that version, and
what reading every file of the snapshot (optimizer state included) would be. Medians over repeats.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "smollm2_arith.yaml"
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
OWNER = "benchmarks/weights_handover.py"
EPOCHS = 2  # the worker holds policies 0 and 1, then loads 2


def overrides(store_uri: str, engine: str) -> dict[str, Any]:
    return {"experiment": "bench-handover", "storage.uri": store_uri, "epochs": EPOCHS,
            "model.name_or_path": str(MODEL), "evaluate.every": 0, "resources.update.workers": 2,
            "rollout.engine": engine}


class RolloutWorker:
    """A process that samples like a rollout pool worker: one warm policy, the next one loaded on demand."""

    def __init__(self, config_json: dict[str, Any], cache: str) -> None:
        os.environ["VERL_TASKS_CACHE"] = cache  # read by phases.common at import: a cold cache per worker
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from verl_tasks.config import parse_config
        from verl_tasks.runner import make_context

        self.ctx = make_context(parse_config(config_json))

    def first_token(self, version: int) -> dict[str, Any]:
        from verl_tasks.models.engines import SamplingSpec, engine_options, get_engine
        from verl_tasks.phases.common import POLICY_BYTES, sampling_policy

        before = dict(POLICY_BYTES)
        started = time.perf_counter()
        policy = sampling_policy(self.ctx, version)
        loaded = time.perf_counter() - started
        prompt = policy.tokenizer("What is 12+34?", add_special_tokens=False)["input_ids"]
        spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=version)
        get_engine(self.ctx.config.rollout.engine)(policy, [prompt], spec, engine_options(self.ctx.config))
        return {"seconds": time.perf_counter() - started, "load_s": loaded,
                **{f"{k}_bytes": POLICY_BYTES[k] - before[k] for k in POLICY_BYTES}}


def train_run(store_uri: str, endpoint: str | None) -> Any:
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, train

    ctx = make_context(load_config(CONFIG, {**overrides(store_uri, "hf"), "storage.endpoint_url": endpoint}))
    train(ctx, EPOCHS)
    return ctx


def measure(ctx, engine: str, repeats: int, tmp: Path) -> dict[str, Any]:
    """Median seconds to the newest policy's first token, both ways, and the bytes of one load each way."""
    import ray

    from verl_tasks.models import handover
    from verl_tasks.store.conventions import WEIGHTS
    from verl_tasks.store.units import read_marker

    config = ctx.config.model_copy(update={"rollout": ctx.config.rollout.model_copy(update={"engine": engine})})
    snapshot = read_marker(ctx.store, ctx.layout.snapshot(EPOCHS))
    update = read_marker(ctx.store, ctx.layout.update(EPOCHS - 1))
    registry = handover._registry(ctx.config, create=True)
    published = ray.get(registry.lookup.remote(update.files[WEIGHTS].sha256))
    assert published is not None, "the last update handed nothing over"
    out: dict[str, Any] = {"engine": engine, "all_files_bytes": sum(e.size for e in snapshot.files.values())}
    actor_class = ray.remote(num_cpus=1)(RolloutWorker)
    for way in ("memory", "store"):  # the way the weights come
        runs = []
        for i in range(repeats):
            ray.get(registry.publish.remote(snapshot.files[WEIGHTS].sha256 if way == "memory"
                                            else "withdrawn", published))
            worker = actor_class.remote(config.model_dump(mode="json"), str(tmp / f"cache-{engine}-{way}-{i}"))
            for version in range(EPOCHS):  # the policies it holds warm
                ray.get(worker.first_token.remote(version))
            runs.append(ray.get(worker.first_token.remote(EPOCHS)))
            ray.kill(worker)
        out[f"via_{way}"] = {"seconds": statistics.median(r["seconds"] for r in runs),
                             "load_s": statistics.median(r["load_s"] for r in runs),
                    "store_bytes": runs[-1]["store_bytes"], "memory_bytes": runs[-1]["memory_bytes"]}
    ray.get(registry.publish.remote(snapshot.files[WEIGHTS].sha256, published))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from benchmarks.run import write_section
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2
    from verl_tasks.train import group

    logging.basicConfig(level=logging.WARNING)
    import_gguf(packaged_smollm2(), MODEL)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address  # noqa: SLF001 - the bound port
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"local": ("local disk", f"file://{tmp}/store", None), "s3": ("S3 (moto server)", "s3://bench/p",
                                                                                endpoint)}
        for label, uri, url in (stores[name] for name in args.stores.split(",")):
            ctx = train_run(uri, url)
            for engine in args.engines.split(","):
                rows.append({"store": label, **measure(ctx, engine, args.repeats, Path(tmp))})
                print(rows[-1], flush=True)
            group.release()
    server.stop()
    command = "python benchmarks/weights_handover.py " + " ".join(sys.argv[1:])
    lines = [
        "## New weights to a rollout worker: Ray's object store vs the store",
        "",
        f"Produced by `{command.strip()}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; medians of {args.repeats}. SmolLM2-135M-Instruct "
        "(float32, 538 MB of weights) trained two epochs with the update on two resident ddp workers; a rollout "
        "worker in its own process, holding policies 0 and 1, is asked for policy 2: seconds from the request to its "
        "first sampled token, with the update's in-memory handover and with it withdrawn (the store). Bytes: what "
        "that worker read from the store / received from memory for the version; the snapshot's files, "
        "optimizer state included, are what a worker read from a remote store before it read inference files only.",
        "",
        "| store | engine | from memory (s) | from the store (s) | store / memory | bytes read from the store, "
        "memory way | bytes read from the store, store way | snapshot's files |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem, sto = r["via_memory"], r["via_store"]
        lines.append(f"| {r['store']} | {r['engine']} | {mem['seconds']:.2f} | {sto['seconds']:.2f} | "
                     f"{sto['seconds'] / mem['seconds']:.1f}x | {mem['store_bytes'] / 1e6:.0f} MB | "
                     f"{sto['store_bytes'] / 1e6:.0f} MB | {r['all_files_bytes'] / 1e6:.0f} MB |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
