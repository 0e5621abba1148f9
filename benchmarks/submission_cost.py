"""Submission cost with 1,000 finished jobs in the cluster against none; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/submission_cost.py [--jobs 1000] [--rounds 25] [--history true|driver]
                                                   [--output BENCHMARKS.md]

Two project-local Ray heads run side by side (own state folders, ports and ``RAY_TMPDIR``;
both stopped by their PIDs at the end): ``empty`` keeps no history; ``history`` gets
``--jobs`` finished jobs. Measurement rounds alternate between the heads (which one goes
first alternates too), before and after the history is made, so both see the same load.

One round on one head times the backend's per-unit submission path, as the operator runs it:

* ``submit``: ``RayJobBackend.submit`` of a unit with no job yet (one ``get_job_info`` that
  answers 404, then ``submit_job``);
* ``find``: ``RayJobBackend.unit_jobs`` of that unit once its job finished (two ``get_job_info``:
  attempt 1 found, attempt 2 not);
* ``resubmit``: ``submit(..., resubmit_succeeded=True)``, i.e. the retry path (two look-ups, then
  ``submit_job`` of attempt 2).

The measured jobs carry the real entrypoint's arguments (the real config, base64) but run
``true`` (``RayJobBackend(python="true")``), and each is waited for (untimed) before the next
step, so no job runs while a call is timed. The history jobs run ``true`` by default (each
still costs Ray a job supervisor actor, about a CPU second here); ``--history driver`` makes
each a driver that connects to the cluster (``python -c "import ray; ray.init()"``, as the phase
entrypoint does), which also leaves a record in the GCS job table, at about twice the cost.
They run ``--parallel`` at a time. SIGTERM or Ctrl-C stops both heads before exiting.
The section between this script's markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
STEPS = ("submit", "find", "resubmit")
OWNER = "benchmarks/submission_cost.py"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Head:
    """One local head and a backend on it whose jobs run ``true``."""

    def __init__(self, name: str, stop: ExitStack):
        from verl_tasks.execution import local_head
        from verl_tasks.execution.cli_cluster import _free_ports
        from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, read_token

        self.name = name
        state = Path(tempfile.mkdtemp(prefix=f"vt-subcost-{name}-"))
        os.chmod(state, 0o700)
        port, dashboard = _free_ports()
        stop.callback(shutil.rmtree, state, True)
        stop.callback(shutil.rmtree, f"/tmp/vt-ray-{port}", True)
        stop.callback(local_head.stop, state)
        started = time.monotonic()
        self.info = local_head.start(state, port=port, dashboard_port=dashboard)
        say(f"head {name}: pid {self.info.pid} at {self.info.address} (ready in {time.monotonic() - started:.1f}s)")
        self.backend = RayJobBackend(RayTarget(self.info.address, read_token(self.info.token_file)), python="true")
        self.units = 0
        self.times: dict[str, dict[str, list[float]]] = {}

    def wait(self, job_id: str, timeout_s: float = 300) -> str:
        return self.backend.wait(job_id, timeout_s=timeout_s, poll_s=0.05)

    def round(self, config, phase: str) -> None:
        """Time the three steps on a fresh unit of this head (jobs waited for between steps, untimed)."""
        from verl_tasks.execution import UnitSpec

        self.units += 1
        spec = UnitSpec(config.experiment, "rollout", 0, self.units)
        t0 = time.perf_counter()
        first = self.backend.submit(config, spec)
        t1 = time.perf_counter()
        assert first.submitted and first.attempt == 1, first
        assert self.wait(first.submission_id) == "SUCCEEDED", self.backend.logs(first.submission_id)
        t2 = time.perf_counter()
        jobs = self.backend.unit_jobs(spec)
        t3 = time.perf_counter()
        assert [j.attempt for j in jobs] == [1], jobs
        second = self.backend.submit(config, spec, resubmit_succeeded=True)
        t4 = time.perf_counter()
        assert second.submitted and second.attempt == 2, second
        assert self.wait(second.submission_id) == "SUCCEEDED"
        if phase:
            times = self.times.setdefault(phase, {step: [] for step in STEPS})
            for step, took in zip(STEPS, (t1 - t0, t3 - t2, t4 - t3), strict=True):
                times[step].append(took * 1000)


def measure(heads: list[Head], config, phase: str, rounds: int) -> None:
    for i in range(rounds):
        for head in (heads if i % 2 == 0 else heads[::-1]):
            head.round(config, phase)
        if (i + 1) % 5 == 0 or i + 1 == rounds:
            medians = {h.name: round(statistics.median(h.times[phase]["submit"]), 1) for h in heads}
            say(f"{phase}: {i + 1}/{rounds} rounds; median submit ms so far {medians}; load {os.getloadavg()[0]:.2f}")


def make_history(head: Head, count: int, kind: str, parallel: int) -> dict:
    """``count`` finished jobs on ``head``, ``parallel`` at a time; returns what was made and how fast."""
    entrypoint = "true" if kind == "true" else f"{shlex.quote(sys.executable)} -c 'import ray; ray.init()'"
    client = head.backend.client
    started = time.monotonic()
    live: set[str] = set()
    made = done = 0
    statuses: dict[str, int] = {}
    last_said = 0
    while done < count:
        while made < count and len(live) < parallel:
            made += 1
            job_id = f"history-{made:05d}"
            client.submit_job(entrypoint=entrypoint, submission_id=job_id,
                              metadata={"verl_tasks_unit": f"history-{made}", "experiment": "history"})
            live.add(job_id)
        time.sleep(0.2)
        for job_id in list(live):
            status = str(getattr(s := client.get_job_status(job_id), "value", s))
            if status in TERMINAL:
                live.discard(job_id)
                done += 1
                statuses[status] = statuses.get(status, 0) + 1
        if done - last_said >= 50 or done == count:
            last_said = done
            took = time.monotonic() - started
            eta = took / max(done, 1) * (count - done)
            say(f"history: {done}/{count} finished ({statuses}) in {took:.0f}s, {done / took:.1f} jobs/s, "
                f"ETA {eta:.0f}s; load {os.getloadavg()[0]:.2f}")
    took = time.monotonic() - started
    return {"jobs": count, "kind": kind, "entrypoint": entrypoint, "statuses": statuses, "seconds": round(took, 1)}


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def report(heads: dict[str, Head], history: dict, args: argparse.Namespace, loads: list[tuple]) -> dict:
    empty, full = heads["empty"], heads["history"]
    rows, result = [], {"history": history, "rounds": args.rounds, "load": loads, "steps": {}}
    for step in STEPS:
        b_empty, b_full = median(empty.times["before"][step]), median(full.times["before"][step])
        a_empty, a_full = median(empty.times["after"][step]), median(full.times["after"][step])
        ratio = round(a_full / a_empty, 2)
        result["steps"][step] = {"before": {"empty": b_empty, "history": b_full},
                                 "after": {"empty": a_empty, "history": a_full},
                                 "ratio_after": ratio, "ratio_before": round(b_full / b_empty, 2),
                                 "history_after_vs_before": round(a_full / b_full, 2)}
        rows.append(f"| `{step}` | {b_empty} | {b_full} | {round(b_full / b_empty, 2)} | {a_empty} | {a_full} "
                    f"| **{ratio}** | {round(a_full / b_full, 2)} |")
    table = ["| step (median ms) | empty head | history head, still empty | ratio | empty head | history head, "
             f"{history['jobs']} finished jobs | ratio | history head after / before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|", *rows]
    result["markdown"] = "\n".join(table)
    return result


def section(result: dict, args: argparse.Namespace) -> str:
    from benchmarks.run import provenance

    history = result["history"]
    kind = ("`true`" if history["kind"] == "true"
            else "a driver that connects to the cluster (`python -c 'import ray; ray.init()'`)")
    worst = max(step["ratio_after"] for step in result["steps"].values())
    lines = [
        f"## Submission cost with {history['jobs']:,} finished jobs in the cluster vs none",
        "",
        provenance(" ".join([".venv/bin/python benchmarks/submission_cost.py", *sys.argv[1:]])),
        "",
        "Two local heads side by side (`verl_tasks.execution.local_head`, own state folders and ports); "
        "measurement rounds alternate between them. `empty` never gets a history; `history` gets "
        f"{history['jobs']:,} finished jobs between the two halves of the measurement (each job runs {kind}, "
        f"{args.parallel} at a time: {history['seconds']:.0f} s; the head then held {history['cluster_jobs']:,} jobs). "
        "One round times `RayJobBackend.submit` of a new unit (`submit`: one `get_job_info` answering 404, then "
        "`submit_job`), `unit_jobs` of that unit once its job finished (`find`: two `get_job_info` by id, no "
        "`list_jobs`), and the retry path `submit(..., resubmit_succeeded=True)` (`resubmit`: two look-ups, then "
        "`submit_job` of attempt 2). The measured jobs carry the real entrypoint's config and run `true`; each "
        f"is waited for, untimed, before the next step. Medians of {args.rounds} rounds per head and half.",
        "",
        result["markdown"],
        "",
        f"Largest ratio history / empty after the history was made: **{worst:.2f}**. The \"history head, still "
        "empty\" column shows how far two identical heads differ on this machine.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="finished jobs to put in the history head")
    parser.add_argument("--rounds", type=int, default=25, help="measurement rounds per head, before and after")
    parser.add_argument("--history", choices=("true", "driver"), default="true",
                        help="history jobs: a driver that connects to the cluster, or plain `true`")
    parser.add_argument("--parallel", type=int, default=8, help="history jobs running at a time")
    parser.add_argument("--json", type=Path, help="write the result here too")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section
    from verl_tasks.config import load_config

    def interrupted(signum: int, _frame: object) -> None:  # the heads are stopped on the way out
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)  # also when started in the background (SIGINT ignored)

    config = load_config(CONFIG)
    loads = [("start", os.getloadavg())]
    say(f"load average at start {os.getloadavg()} on {os.cpu_count()} cores")
    with ExitStack() as stop:
        heads = {name: Head(name, stop) for name in ("empty", "history")}
        ordered = list(heads.values())
        for head in ordered:  # the first submit of a fresh head starts its job agent (seconds): untimed
            head.round(config, "")
            head.round(config, "")
        measure(ordered, config, "before", args.rounds)
        loads.append(("before measured", os.getloadavg()))
        history = make_history(heads["history"], args.jobs, args.history, args.parallel)
        jobs = heads["history"].backend.client.list_jobs()  # only to report what the cluster holds
        history["cluster_jobs"] = len(jobs)
        history["with_driver"] = sum(1 for j in jobs if j.job_id)
        say(f"history head holds {len(jobs)} jobs ({history['with_driver']} with a driver record)")
        loads.append(("history made", os.getloadavg()))
        measure(ordered, config, "after", args.rounds)
        loads.append(("after measured", os.getloadavg()))
        result = report(heads, history, args, loads)
    print(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    text = section(result, args)
    print(text)
    write_section(args.output, text, OWNER)
    worst = max(step["ratio_after"] for step in result["steps"].values())
    say(f"worst ratio (history / empty, after): {worst} ({'within' if worst <= 1.2 else 'over'} 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
