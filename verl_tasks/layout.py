"""Where every phase of every epoch writes: the one place that builds storage keys.

::

    <experiment>/experiment.json                 config + hash, written once
    <experiment>/data/{train,eval}/              normalised prompts, pinned on first run
    <experiment>/epochs/00003/plan/              prompt ids per batch, seeds, policy version
    <experiment>/epochs/00003/skipped/           batches the epoch went on without (only when some were)
    <experiment>/epochs/00003/top_up/            dynamic sampling only: batches drawn, groups kept
    <experiment>/epochs/00003/rollout/b0007/     samples.jsonl
    <experiment>/epochs/00003/score/b0007/       scores.jsonl
    <experiment>/epochs/00003/validate/          report.json
    <experiment>/epochs/00003/critic/            PPO only: GAE advantages, critic version 4 (critic.* files)
    <experiment>/epochs/00003/update/            model + optimizer safetensors, metrics.json
    <experiment>/epochs/00003/evaluate/          accuracy of policy version 4
    <experiment>/snapshots/00004/                HF-loadable folder + optimizer + trainer_state.json (+ critic.*)
    <experiment>/snapshots/latest.json           pointer to the newest committed snapshot
    <experiment>/snapshots/best.json             the best snapshot by storage.keep_best_by (when set)
    <experiment>/snapshots/retention.json        retention's watermark: versions it need not look at again
    <experiment>/base/evaluate/                  accuracy of policy version 0
    <experiment>/events/                         one JSON object per event
    <experiment>/tombstones/                     markers of rolled-back units
    <experiment>/configs/<sha256>.json           each run's whole config, by content (written once)
    <experiment>/control/safe_mode.json          present while the experiment is halted
    <experiment>/control/generation.json         how many times the experiment left safe mode
    <experiment>/control/lifts/<digest>.json     who lifted one halt (claimed once: one resumed event)
    <experiment>/control/failures/00003/g00002/  one durable record per failed try of epoch 3's batches
                                                 since it last left safe mode (generation 2)
"""
from __future__ import annotations

from dataclasses import dataclass

from verl_tasks.config import check_name
from verl_tasks.errors import ConfigError

MAX_EPOCH = 99_999
MAX_BATCH = 9_999


def _check_index(value: int, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ConfigError(f"{what} must be an integer in [0, {limit}], got {value!r}")
    return value


@dataclass(frozen=True)
class Layout:
    experiment: str

    def __post_init__(self) -> None:
        check_name(self.experiment)

    @property
    def root(self) -> str:
        return self.experiment

    @property
    def experiment_json(self) -> str:
        return f"{self.root}/experiment.json"

    def data(self, split: str) -> str:
        if split not in ("train", "eval"):
            raise ConfigError(f"unknown data split {split!r}")
        return f"{self.root}/data/{split}"

    def epoch(self, epoch: int) -> str:
        return f"{self.root}/epochs/{_check_index(epoch, 'epoch', MAX_EPOCH):05d}"

    def plan(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/plan"

    def rollout(self, epoch: int, batch: int) -> str:
        return f"{self.epoch(epoch)}/rollout/b{_check_index(batch, 'batch', MAX_BATCH):04d}"

    def score(self, epoch: int, batch: int) -> str:
        return f"{self.epoch(epoch)}/score/b{_check_index(batch, 'batch', MAX_BATCH):04d}"

    def skipped(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/skipped"

    def top_up(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/top_up"

    def validate(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/validate"

    def critic(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/critic"

    def update(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/update"

    def evaluate(self, epoch: int) -> str:
        return f"{self.epoch(epoch)}/evaluate"

    @property
    def base_evaluate(self) -> str:
        return f"{self.root}/base/evaluate"

    @property
    def snapshots(self) -> str:
        return f"{self.root}/snapshots"

    def snapshot(self, version: int) -> str:
        return f"{self.snapshots}/{_check_index(version, 'snapshot version', MAX_EPOCH + 1):05d}"

    @property
    def latest(self) -> str:
        return f"{self.snapshots}/latest.json"

    @property
    def best(self) -> str:
        return f"{self.snapshots}/best.json"

    @property
    def retention(self) -> str:
        return f"{self.snapshots}/retention.json"

    @property
    def events(self) -> str:
        return f"{self.root}/events"

    @property
    def tombstones(self) -> str:
        return f"{self.root}/tombstones"

    @property
    def safe_mode(self) -> str:
        return f"{self.root}/control/safe_mode.json"

    @property
    def generation(self) -> str:
        """How many times the experiment left safe mode: the generation of the failure counts."""
        return f"{self.root}/control/generation.json"

    def run_config(self, digest: str) -> str:
        """One run's whole config (hashed and unhashed settings), named by its sha256: a Ray job reads its own."""
        return f"{self.root}/configs/{digest}.json"

    def safe_mode_lift(self, halt: str) -> str:
        """The claim of the one lift of a halt (``halt``: a digest of its safe-mode record)."""
        return f"{self.root}/control/lifts/{halt}.json"

    def failures(self, epoch: int, generation: int) -> str:
        """The failed tries of an epoch's batches that count toward safe mode, since the experiment
        last left it (``generation``)."""
        return (f"{self.root}/control/failures/{_check_index(epoch, 'epoch', MAX_EPOCH):05d}"
                f"/g{_check_index(generation, 'generation', 10**9):05d}")

    def tracking(self, tracker: str) -> str:
        """Where this experiment records its run in an outside tracker (``verl_tasks.tracking``)."""
        return f"{self.root}/tracking/{tracker}.json"

    def unit(self, phase: str, epoch: int, batch: int | None = None) -> str:
        """The unit key of a phase (batch only for the batched phases: rollout and score)."""
        from verl_tasks.phase_registry import phase as phase_spec

        return phase_spec(phase).unit(self, epoch, batch)

    def snapshot_version(self, key: str) -> int | None:
        """Version of a ``snapshots/NNNNN/...`` key, or None."""
        rest = key[len(self.snapshots) + 1 :] if key.startswith(self.snapshots + "/") else ""
        head = rest.split("/", 1)[0]
        return int(head) if head.isdigit() else None
