"""Every path that reads an experiment YAML (the CLI's load_config, the DAG factory's and the Training page's
read_yaml) refuses an alias bomb and an oversized file at once, before anything walks the values."""
from __future__ import annotations

import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError

from .conftest import TINY_YAML

# 10^8 items under `experiment:` through nine levels of ten aliases each: a few hundred bytes.
BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)) + "experiment: [" + ", ".join(
    ["*a8"] * 10) + "]\n"


@pytest.fixture
def bomb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(TINY_YAML.read_text().replace("experiment: tiny-arith\n", "") + BOMB)
    return path


def test_an_alias_bomb_is_refused_by_every_reader_at_once(bomb, tmp_path):
    from verl_tasks.airflow.plugin import open_source
    from verl_tasks.airflow.runconfig import read_yaml

    for read in (load_config, read_yaml):
        with pytest.raises(ConfigError, match="aliases expand to more than"):
            read(bomb)
    page_source = open_source("bomb", bomb)  # the Training page: one calm line for this YAML
    assert page_source.error and "aliases expand to more than" in page_source.error


def test_an_oversized_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(TINY_YAML.read_text() + "# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"bytes; a configuration is at most 1048576 bytes"):
        load_config(path)


def test_a_few_aliases_are_fine(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text(TINY_YAML.read_text() + "tracking: &t {}\n")
    assert load_config(path).experiment == "tiny-arith"
