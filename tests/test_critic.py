"""PPO's critic: its config, its place in the epoch, its value model, its committed state and GAE inputs.

A PPO run of the small tiny experiment (``algorithm.adv_estimator: gae`` with a critic section) is trained
once per module and read by several tests; the value model is tested on the tiny architecture directly.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from verl_tasks.algos import AdvantageInputs, estimator
from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError, PhaseFailed
from verl_tasks.phase_registry import phases_for
from verl_tasks.runner import make_context, train
from verl_tasks.store.conventions import is_critic_file
from verl_tasks.store.units import read_bytes, read_json, read_jsonl, read_marker

from .conftest import TINY_YAML, small_overrides

PPO = {"algorithm.adv_estimator": "gae", "critic": {"lr": 1e-4}}


def config(tmp_path, **extra):
    return load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/store", **PPO, **extra}))


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("ppo")
    ctx = make_context(config(work, **{"tracking.tensorboard": str(work / "tb")}))
    return ctx, train(ctx, ctx.config.epochs)


@pytest.mark.parametrize("overrides, says", [
    ({"algorithm.adv_estimator": "gae"}, "add a critic section"),
    ({"critic": {"lr": 1e-4}}, "set adv_estimator: gae, or remove the critic section"),
    ({**PPO, "resources": {"critic": {"workers": 2, "strategy": "fsdp2"}}}, "strategy, cpu_offload and mixed_"),
    ({**PPO, "critic": {"name_or_path": "HuggingFaceTB/SmolLM2-135M"}}, "model.source is tiny"),
])
def test_a_critic_config_that_cannot_run_is_refused_on_load(tmp_path, overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s", **overrides}))


def test_the_critic_phase_exists_only_in_a_ppo_experiment(tmp_path):
    grpo = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s"}))
    assert "critic" not in phases_for(grpo)
    names = list(phases_for(config(tmp_path)))
    assert names.index("validate") < names.index("critic") < names.index("update")


def test_a_value_is_read_from_the_state_before_its_token_whatever_the_padding():
    """The value of response token t comes from the hidden state at the position predicting it; a row's values
    do not change when it is batched with a longer row (right padding), and are 0 past its response."""
    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.critic import new_critic
    from verl_tasks.models.tiny import build_model
    from verl_tasks.phases.update_steps import collate

    model = new_critic(build_model(TinyModelConfig(), vocab_size=40, seed=3), seed=5).eval()
    short = {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}
    long = {"prompt_ids": [5, 6, 7, 10, 11], "response_ids": [12, 13, 14, 15]}
    keys = ("input_ids", "attention_mask", "positions", "response_mask")
    with torch.no_grad():
        both = model(**{k: v for k, v in collate([short, long], pad_id=0).items() if k in keys})
        alone = model(**{k: v for k, v in collate([short], pad_id=0).items() if k in keys})
        hidden = model.decoder(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).last_hidden_state[0]
    by_hand = model.head(hidden[[2, 3]]).squeeze(-1)  # the prompt's last token, then the first response token
    torch.testing.assert_close(alone[0], by_hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(both[0, :2], alone[0], rtol=1e-5, atol=1e-6)
    assert both[0, 2:].abs().sum() == 0


def test_a_saved_critic_loads_with_the_same_values_and_moments(tmp_path):
    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.checkpoint import load_optimizer
    from verl_tasks.models.critic import load_critic, new_critic, save_critic
    from verl_tasks.models.tiny import build_model

    model = new_critic(build_model(TinyModelConfig(), vocab_size=40, seed=3), seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "positions": torch.tensor([[2, 3]]), "response_mask": torch.ones(1, 2)}
    model(**batch).square().sum().backward()
    optimizer.step()
    save_critic(model, optimizer, tmp_path)
    again = load_critic(tmp_path, "float32")
    resumed = torch.optim.AdamW(again.parameters(), lr=1e-3)
    assert load_optimizer(resumed, again, tmp_path)
    with torch.no_grad():  # the same weights; CPU kernels may sum in another order from call to call
        torch.testing.assert_close(again(**batch), model(**batch), rtol=0, atol=1e-6)
    for (name, param), held in zip(again.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(param, held, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(resumed.state[param]["exp_avg_sq"], optimizer.state[held]["exp_avg_sq"],
                                   rtol=0, atol=0, msg=name)


def test_train_critic_fits_the_returns_it_is_given(tmp_path):
    """Real behaviour of the critic's loop: over a few passes on one batch its value loss falls (the return is 1
    where the prompt starts with token 5, else 0: a value the decoder can read off the prompt)."""
    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.critic import new_critic
    from verl_tasks.models.tiny import build_model
    from verl_tasks.phases.common import PhaseContext
    from verl_tasks.phases.critic import train_critic, values_of
    from verl_tasks.phases.update_steps import collate
    from verl_tasks.store import store_for

    cfg = config(tmp_path, **{"critic": {"lr": 3e-3, "cliprange_value": 10.0}})
    ctx = PhaseContext(cfg, store_for(cfg))
    generator = torch.Generator().manual_seed(0)
    samples = [{"prompt_ids": [5 + i % 2] + torch.randint(7, 40, (3,), generator=generator).tolist(),
                "response_ids": torch.randint(7, 40, (3,), generator=generator).tolist()} for i in range(32)]
    data = collate(samples, pad_id=0)
    returns = (torch.arange(32) % 2 == 0).float().unsqueeze(-1) * data["response_mask"]
    model = new_critic(build_model(TinyModelConfig(), vocab_size=40, seed=3), seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for epoch in range(10):
        old = values_of(model, data, None)
        losses.append(train_critic(model, optimizer, data, old, returns, ctx, seed=epoch, epoch=epoch)[0]
                      ["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_critic_unit_holds_gae_of_its_values_and_the_snapshot_the_critic(ppo_run):
    ctx, status = ppo_run
    for epoch in range(ctx.config.epochs):
        record = read_marker(ctx.store, ctx.layout.critic(epoch))
        tensors = load(read_bytes(ctx.store, record, "advantages.safetensors"))
        rows = read_json(ctx.store, record, "advantages.json")["sample_ids"]
        scores, lengths = {}, {}
        for b in range(ctx.config.rollout.batches_per_epoch):
            scores.update({r["sample_id"]: r["score"] for r in
                           read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.score(epoch, b)), "scores.jsonl")})
            lengths.update({r["sample_id"]: len(r["response_ids"]) for r in
                            read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.rollout(epoch, b)),
                                       "samples.jsonl")})
        assert sorted(rows) == sorted(scores)
        width = tensors["values"].shape[1]
        mask = torch.tensor([[1.0] * lengths[r] + [0.0] * (width - lengths[r]) for r in rows])
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(len(rows)), mask.sum(-1).long() - 1] = torch.tensor([scores[r] for r in rows])
        groups = [r.rsplit("-", 1)[0] for r in rows]
        advantages, returns = estimator("gae")(AdvantageInputs(rewards, mask, groups, values=tensors["values"],
                                                               gamma=1.0, lam=1.0))
        torch.testing.assert_close(tensors["advantages"], advantages, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tensors["returns"], returns, rtol=1e-5, atol=1e-5)
        snapshot = read_marker(ctx.store, ctx.layout.snapshot(epoch + 1))
        critic_files = {n: e.sha256 for n, e in record.files.items() if is_critic_file(n)}
        assert critic_files and critic_files == {n: e.sha256 for n, e in snapshot.files.items() if is_critic_file(n)}
    base = read_marker(ctx.store, ctx.layout.snapshot(0)).files  # critic version 0, pinned with the base
    assert {"critic.model.safetensors", "critic.config.json"} <= set(base)
    assert not [n for n in base if n.startswith("critic.optimizer")]
    row = status["epochs"][-1]["metrics"]
    assert {"critic/vf_loss", "critic/explained_variance", "critic/vf_clipfrac"} <= set(row)
    assert status["phases"] == list(phases_for(ctx.config))


def test_a_ppo_snapshot_stays_a_policy_folder(ppo_run, tmp_path):
    """HF loads it, vLLM's view and an export leave the critic out, a fork's base takes the critic's weights
    without its optimizer state."""
    from verl_tasks.execution.lineage import seed_base_from
    from verl_tasks.models.vllm_engine import is_inference_file
    from verl_tasks.ops.checkpoint import SnapshotRef, export_hf

    ctx, _ = ppo_run
    files = export_hf(SnapshotRef(ctx.store, ctx.layout, 1), tmp_path / "export")
    assert not [f.name for f in files if is_critic_file(f.name)]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert not is_inference_file("critic.model.safetensors")
    seed_base_from(ctx.store, "ppo-fork", ctx.config.experiment, 1, seed=0)
    base = read_marker(ctx.store, "ppo-fork/snapshots/00000")
    parent = read_marker(ctx.store, ctx.layout.snapshot(1))
    assert base.files["critic.model.safetensors"].sha256 == parent.files["critic.model.safetensors"].sha256
    assert not [n for n in base.files if n.startswith("critic.optimizer")]


def test_the_update_refuses_advantages_of_other_samples(ppo_run):
    from verl_tasks.phases.update_inputs import critic_advantages, read_update_source

    ctx, _ = ppo_run
    source = read_update_source(ctx, 0, critic=False)
    samples, inputs = source.samples, source.inputs
    assert critic_advantages(ctx, 0, samples, inputs).shape[0] == len(samples)
    with pytest.raises(PhaseFailed, match="start it again under a new experiment name"):
        critic_advantages(ctx, 0, samples[1:] + samples[:1], inputs)
    recomputed = {**inputs, ctx.layout.rollout(0, 1): "20990101T000000-another"}  # a batch committed again
    with pytest.raises(PhaseFailed, match="other rollout or score units"):
        critic_advantages(ctx, 0, samples, recomputed)


def test_the_critics_metrics_reach_the_trackers_once_per_epoch(ppo_run):
    """Each committed critic unit's metrics (value loss, clip fraction, explained variance, ...) are logged to
    TensorBoard under their own ``critic/`` names, one value per epoch, as the update's are under ``update/``."""
    from tests.test_tracking import _tensorboard_counts

    ctx, _ = ppo_run
    counts = _tensorboard_counts(Path(ctx.config.tracking.tensorboard))
    critic = read_marker(ctx.store, ctx.layout.critic(0)).meta["metrics"]
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance"} <= set(critic)
    for name in critic:
        assert sorted(step for (tag, step) in counts if tag == name) == list(range(ctx.config.epochs)), name
    assert not any(tag.startswith("critic/critic/") for tag, _ in counts)
    assert {step for (tag, step) in counts if tag == "update/reward_mean"} == set(range(ctx.config.epochs))


def test_checkpoint_verify_loads_the_critic_and_finds_one_that_cannot_value(ppo_run, tmp_path):
    """A PPO snapshot verifies OK with its critic loaded and run; a critic whose weights are not finite, or do
    not fit its config, is a problem named by the check verify runs on it."""
    from safetensors.torch import load_file, save_file

    from verl_tasks.ops.checkpoint import SnapshotRef, critic_check, fetch, verify

    ctx, _ = ppo_run
    ref = SnapshotRef(ctx.store, ctx.layout, 2)
    verdict = verify(ref)
    assert verdict.ok and verdict.state == "OK", verdict
    record = read_marker(ctx.store, ref.unit)
    for damage, says in (("nan", "non-finite values"), ("drop", "critic weights do not fit its config")):
        work = tmp_path / damage
        folder = fetch(ref, record, work / "snapshot", ["critic.config.json", "critic.model.safetensors"])
        weights = load_file(str(folder / "critic.model.safetensors"))
        if damage == "nan":
            weights["head.weight"] = torch.full_like(weights["head.weight"], float("nan"))
        else:
            weights.pop(next(name for name in weights if name.startswith("decoder.")))
        save_file(weights, str(folder / "critic.model.safetensors"))
        problems = critic_check(folder)
        assert any(says in problem for problem in problems), (damage, problems)
