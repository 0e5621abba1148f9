"""``model.device``: inside a Ray worker the GPUs Ray assigned decide, not what CUDA happens to see.

The decision is a pure function of the facts, so every case of a GPU node is checked here without
one; a real Ray head with a logical GPU then shows the facts a worker gathers, and what it decides
where CUDA is absent.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import ROOT
from verl_tasks.errors import ConfigError
from verl_tasks.models.device import DeviceFacts, choose_device, device_facts, hide_unreserved_gpus, resolve_device

CUDA = {"cuda_usable": True}


def device(requested: str, **facts) -> torch.device:
    return choose_device(requested, DeviceFacts(**{"ray_gpu_ids": None, "cuda_usable": False, "visible": None,
                                                   **facts}))[0]


@pytest.mark.parametrize("facts, auto", [
    ({}, "cpu"),  # outside Ray, no CUDA
    (CUDA, "cuda:0"),  # outside Ray: the first visible device, as before
    ({**CUDA, "ray_gpu_ids": ()}, "cpu"),  # Ray 2.60 leaves every GPU visible to a worker that reserved none
    ({**CUDA, "ray_gpu_ids": (), "visible": ("0", "1")}, "cpu"),
    ({**CUDA, "ray_gpu_ids": ("3",), "visible": ("3",)}, "cuda:0"),  # Ray narrowed CUDA_VISIBLE_DEVICES
    ({**CUDA, "ray_gpu_ids": ("5", "2"), "visible": ("2", "5")}, "cuda:0"),  # ids in any order: the first visible
    ({**CUDA, "ray_gpu_ids": ("3",), "visible": None}, "cuda:3"),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    ({**CUDA, "ray_gpu_ids": ("5",), "visible": ("1", "5", "7")}, "cuda:1"),  # ... on a node that narrowed it
    ({"ray_gpu_ids": ("0",), "visible": ("0",)}, "cpu"),  # a logical GPU where CUDA is absent (this machine)
], ids=["no-ray-no-cuda", "no-ray-cuda", "ray-none-reserved", "ray-none-reserved-node-narrowed", "ray-narrowed",
        "ray-narrowed-two", "ray-noset", "ray-noset-node-narrowed", "ray-logical-gpu-no-cuda"])
def test_auto_follows_what_ray_assigned(facts, auto):
    assert device("auto", **facts) == torch.device(auto)
    assert device("cpu", **facts) == torch.device("cpu")
    if auto == "cpu":
        with pytest.raises(ConfigError, match="num_gpus >= 1"):
            device("cuda", **facts)
    else:
        assert device("cuda", **facts) == torch.device(auto)


def test_a_worker_that_reserved_no_gpu_is_told_to_reserve_one():
    with pytest.raises(ConfigError, match="this Ray worker reserved no GPU"):
        device("cuda", **CUDA, ray_gpu_ids=(), visible=None)


def test_assigned_gpus_the_worker_cannot_see_are_a_clear_error():
    with pytest.raises(ConfigError, match=r"Ray assigned this worker GPUs it cannot see .*'0'.*\['3'\]"):
        device("auto", **CUDA, ray_gpu_ids=("3",), visible=("0",))


def test_a_process_that_is_no_ray_worker_has_no_ray_assignment():
    assert device_facts().ray_gpu_ids is None  # this test process: no Ray at all, or a driver (it holds no GPUs)


@pytest.fixture(scope="module")
def head_with_a_logical_gpu(tmp_path_factory):
    """A head offering 1 logical GPU (2 CPUs); this process joins it as a driver; its workers import the tests."""
    import ray

    from tests.test_pools import join_loopback_head
    from verl_tasks.execution import local_head
    from verl_tasks.execution.cli_cluster import _free_ports

    state = local_head.private_dir(tmp_path_factory.mktemp("gpu-head") / "ray-head")
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=2, num_gpus=1, dashboard=False)
        try:
            join_loopback_head(mp, info)
            ray.init(address=info.gcs_address, log_to_driver=False, logging_level="WARNING")
            yield
        finally:
            ray.shutdown()
            local_head.stop(state, timeout_s=0)


class Probe:
    """An actor that says what it sees and decides."""

    def report(self) -> dict:
        facts = device_facts()
        decided = {}
        for requested in ("auto", "cuda"):
            try:
                decided[requested] = str(resolve_device(requested))
            except ConfigError as err:
                decided[requested] = f"ConfigError: {err}"
        hidden = hide_unreserved_gpus()
        return {"ray_gpu_ids": facts.ray_gpu_ids, "visible": facts.visible, **decided, "hid": hidden,
                "visible_after": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_a_ray_actor_decides_from_the_gpus_it_reserved(head_with_a_logical_gpu):
    import ray

    probe = ray.remote(Probe)
    without, with_gpu = probe.options(num_gpus=0).remote(), probe.options(num_gpus=1).remote()
    none, one = ray.get([without.report.remote(), with_gpu.report.remote()], timeout=120)
    assert none["ray_gpu_ids"] == () and none["auto"] == "cpu", none
    assert none["cuda"].startswith("ConfigError: model.device is 'cuda' but this Ray worker reserved no GPU"), none
    assert one["ray_gpu_ids"] == ("0",) and one["visible"] == ("0",), one  # Ray narrowed CUDA_VISIBLE_DEVICES
    assert one["auto"] == "cpu", one  # no CUDA on this machine
    assert one["cuda"].startswith("ConfigError: model.device is 'cuda' but this worker sees no CUDA device"), one
    # What the pool and update workers do first: one that reserved no GPU sees none (a library that takes
    # "the first visible GPU" by itself, as vLLM does, would otherwise use one another actor reserved).
    assert (none["hid"], none["visible_after"]) == (True, ""), none
    assert (one["hid"], one["visible_after"]) == (False, "0"), one
