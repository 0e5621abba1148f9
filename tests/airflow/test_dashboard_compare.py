"""The Training page beside its parent: a run that started from another experiment's snapshot draws its
per-epoch curves over its parent's (when the reader may see the parent), and every experiment shows a few
rollout samples of its newest epochs, read from the units it committed. Real runs on a real store; the
page is rendered by the plugin's own functions, the ones its routes call after Airflow's auth."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_YAML, small_overrides

PARENT, CHILD = "cmp-parent", "cmp-child"


@pytest.fixture(scope="module")
def parent_and_child(tmp_path_factory):
    """A parent trained 2 epochs and a child started from its latest snapshot, trained 1; both in one store."""
    from verl_tasks.config import load_config
    from verl_tasks.execution.lineage import start_experiment
    from verl_tasks.runner import make_context, train

    root = tmp_path_factory.mktemp("compare")
    store = f"file://{root / 'store'}"
    raw = yaml.safe_load(TINY_YAML.read_text())
    for dotted, value in {**small_overrides(), "model.tiny.warm_start_steps": 100}.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    raw.update(storage={"uri": store})
    paths = {}
    for dag_id, name, epochs in (("dag_parent", PARENT, 2), ("dag_child", CHILD, 1)):
        path = root / "experiments" / f"{dag_id}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump({**raw, "experiment": name, "epochs": epochs}))
        paths[dag_id] = path
    train(make_context(load_config(paths["dag_parent"])), 2)
    child = make_context(load_config(paths["dag_child"]))
    start_experiment(child.store, child.config, resume="snapshot", parent=PARENT, version=None)
    train(child, 1)
    return paths


def _sources(paths: dict[str, Path], readable: list[str]):
    from verl_tasks.airflow.plugin import _unopened, open_source

    everyone = [open_source(d, p) if d in readable else _unopened(d, p) for d, p in paths.items()]
    return [s for s in everyone if s.dag_id in readable], everyone


def test_a_child_is_drawn_over_its_parent_and_shows_its_rollout_samples(parent_and_child):
    from verl_tasks.airflow.plugin import render_page

    readable, everyone = _sources(parent_and_child, ["dag_parent", "dag_child"])
    page = render_page(readable, everyone, experiment=CHILD)
    assert re.search(rf"Against <a [^>]*>{PARENT}</a>, its parent: this run starts from its snapshot 2", page), page
    compare = page.split('class="chart compare"', 1)[1].split("</div>", 1)[0]
    assert compare.count("<svg") == 1 and PARENT in compare and CHILD in compare  # the legend names both
    samples = page.split('<table class="samples">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td class=\"text\">([^<]*)</td><td class=\"text\">([^<]*)</td>", samples)
    assert len(rows) == 4 and {epoch for epoch, _, _ in rows} == {"0"}, samples
    assert all(re.fullmatch(r"\d+\+\d+=", prompt) for _, prompt, _ in rows), rows  # the prompts as pinned
    assert render_page(readable, everyone, experiment=CHILD) == page  # the same samples on every reload


def test_a_parent_the_reader_may_not_see_is_not_drawn(parent_and_child):
    from verl_tasks.airflow.plugin import render_page

    readable, everyone = _sources(parent_and_child, ["dag_child"])
    page = render_page(readable, everyone, experiment=CHILD)
    assert "<h2>cmp-child</h2>" in page and 'class="chart compare"' not in page and PARENT not in page
    asked = render_page(readable, everyone, experiment=CHILD, compare=PARENT)  # asking by name changes nothing
    assert PARENT not in asked
