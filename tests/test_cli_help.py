"""Every command and option of `verl-tasks` says what it does, in plain help without type placeholders."""
from __future__ import annotations

import click
import typer
from typer.testing import CliRunner

from verl_tasks.cli import app


def _commands(group: click.Command, path: tuple[str, ...] = ()):
    yield path, group
    if isinstance(group, click.Group):
        for name, sub in group.commands.items():
            yield from _commands(sub, (*path, name))


def test_every_option_of_every_command_has_help_and_no_flag_shows_a_placeholder():
    root = typer.main.get_command(app)
    missing = [f"{' '.join(path)} {param.opts[0]}" for path, command in _commands(root) for param in command.params
               if isinstance(param, click.Option) and not param.help]
    assert missing == [], missing
    runner = CliRunner()
    for path, command in _commands(root):
        shown = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "120"}).output
        assert "<bool>" not in shown and "``" not in shown, (path, shown)
        assert command.help or command.short_help, path
