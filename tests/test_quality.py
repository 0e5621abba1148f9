"""The Great Expectations gate: one context per process, one cheap pass for a good epoch, failures named."""
from __future__ import annotations

import json

import pytest

from verl_tasks.quality import suites
from verl_tasks.quality.suites import Limits, summarize, validate_epoch

LIMITS = Limits(rows_per_batch=4, rows_per_epoch=8, max_prompt_tokens=16, max_response_tokens=8,
                min_score=0.0, max_score=1.0, min_nonempty_fraction=0.5)


def _rows(batch: int, scores=(1.0, 0.0, 1.0, 0.0), response="12") -> list[dict]:
    return [{"sample_id": f"e0-b{batch}-s{i}", "response": response, "prompt_tokens": 5, "response_tokens": 2,
             "score": score} for i, score in enumerate(scores)]


@pytest.fixture
def passes(monkeypatch) -> list[str]:
    """The result format of each validation pass the test runs (``suites._run``, counted from outside)."""
    seen: list[str] = []
    run = suites._run

    def counted(frame, limits, result_format):
        seen.append(result_format)
        return run(frame, limits, result_format)

    monkeypatch.setattr(suites, "_run", counted)
    return seen


def test_a_good_epoch_is_one_validation_pass_and_the_context_is_built_once_per_process(passes, monkeypatch):
    import great_expectations as gx

    suites.warm_up()  # the process's context (built here, or by an earlier test)
    contexts = []
    get_context = gx.get_context
    monkeypatch.setattr(gx, "get_context", lambda *a, **k: (contexts.append(k), get_context(*a, **k))[1])
    for _ in range(3):
        report = validate_epoch({0: _rows(0), 1: _rows(1)}, LIMITS)
        assert report == {"success": True, "batches": {}, "epoch": [], "rows": 8}
    validate_epoch({0: _rows(0, scores=(0.5,) * 4)}, Limits(**{**LIMITS.__dict__, "rows_per_epoch": 4}))
    assert passes == ["BOOLEAN_ONLY"] * 4
    assert contexts == []  # other limits: another suite, the same context


def test_a_failing_epoch_names_its_batch_expectation_and_values(passes):
    report = validate_epoch({0: _rows(0), 1: _rows(1, scores=(1.0, 7.0, 1.0, 9.0))}, LIMITS)
    assert passes == ["BOOLEAN_ONLY", "COMPLETE"]  # the cheap pass, then the one that finds where
    assert not report["success"] and list(report["batches"]) == ["1"] and not report["epoch"]
    [failure] = report["batches"]["1"]
    assert failure["expectation"] == "expect_column_values_to_be_between" and failure["column"] == "score"
    assert failure["unexpected_count"] == 2 and failure["partial_unexpected_list"] == [7.0, 9.0]
    assert "batch 1: expect_column_values_to_be_between(score) failed" in summarize(report)


def test_epoch_level_and_per_batch_failures():
    empty = _rows(1, response="")
    report = validate_epoch({0: _rows(0), 1: empty, 2: _rows(2)}, LIMITS)  # 12 rows, 8 expected
    assert not report["success"]
    assert [f["expectation"] for f in report["epoch"]] == ["expect_table_row_count_to_equal"]
    assert report["epoch"][0]["observed_value"] == 12
    assert [f["column"] for f in report["batches"]["1"]] == ["batch_nonempty_fraction"]
    assert set(report["batches"]) == {"1"}


def test_memoized_configurations_give_the_same_reports_and_leave_ge_as_it_was(monkeypatch):
    import great_expectations as gx

    plain = gx.expectations.Expectation.__dict__["configuration"]
    epochs = [{0: _rows(0), 1: _rows(1)},
              {0: _rows(0, scores=(1.0, None, 3.0, 0.0)), 1: _rows(1, response="")},
              {0: _rows(0), 1: _rows(1), 2: _rows(2, scores=(0.0, 0.0, -1.0, 0.0))}]
    fast = [validate_epoch(rows, LIMITS) for rows in epochs]
    assert gx.expectations.Expectation.__dict__["configuration"] is plain
    monkeypatch.setattr(suites, "_memoized_configuration", lambda plain: plain)  # GE's own property throughout
    plain_reports = [validate_epoch(rows, LIMITS) for rows in epochs]
    assert json.dumps(plain_reports, sort_keys=True) == json.dumps(fast, sort_keys=True)  # NaN != NaN in ==
    assert [r["success"] for r in fast] == [True, False, False]
    assert {f["column"] for f in fast[1]["batches"]["0"]} == {"score"}


def _failing_epochs() -> dict[str, dict[int, list[dict]]]:
    """An epoch (2 batches of 4 rows under LIMITS) failing each expectation of the suite, and a good one."""
    def edited(batch: int, index: int, **change) -> list[dict]:
        rows = _rows(batch)
        rows[index] = {**rows[index], **change}
        return rows

    return {
        "good": {0: _rows(0), 1: _rows(1)},
        "expect_table_row_count_to_equal": {0: _rows(0), 1: _rows(1), 2: _rows(2)},
        "batch_rows": {0: _rows(0)[:3], 1: _rows(1) + [{**_rows(1)[0], "sample_id": "e0-b1-s4"}]},
        "sample_id": {0: _rows(0), 1: edited(1, 2, sample_id="e0-b0-s1")},
        "batch_nonempty_fraction": {0: _rows(0), 1: _rows(1, response="")},
        "prompt_tokens": {0: edited(0, 1, prompt_tokens=0), 1: _rows(1)},
        "response_tokens": {0: _rows(0), 1: edited(1, 3, response_tokens=9)},
        "score": {0: _rows(0, scores=(1.0, None, 0.0, 9.0)), 1: _rows(1)},
    }


def test_kept_dependency_graphs_give_the_same_reports_and_are_built_once_per_suite_and_format(monkeypatch):
    from great_expectations.validator.validator import Validator

    name = "_generate_metric_dependency_subgraphs_for_each_expectation_configuration"
    build = Validator.__dict__[name]
    builds = []

    def counted(self, *args, **kwargs):
        builds.append(self.active_batch_id)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(Validator, name, counted)
    # Graphs other tests kept are not this test's: it starts with none.
    monkeypatch.setattr(suites, "_CACHE", {k: v for k, v in suites._CACHE.items() if k[0] != "graphs"})
    epochs = _failing_epochs()
    kept = {case: validate_epoch(rows, LIMITS) for case, rows in epochs.items()}
    assert Validator.__dict__[name] is counted  # GE's method is back after each pass
    assert len(builds) == 2, builds  # one BOOLEAN_ONLY graph, one COMPLETE graph, for 8 + 7 passes
    monkeypatch.setattr(suites, "_graphs_kept_for", lambda key: lambda build: build)  # GE builds them every pass
    rebuilt = {case: validate_epoch(rows, LIMITS) for case, rows in epochs.items()}
    assert len(builds) == 2 + 15
    assert json.dumps(rebuilt, sort_keys=True) == json.dumps(kept, sort_keys=True)  # NaN != NaN in ==
    assert kept.pop("good")["success"]
    for case, report in kept.items():  # each epoch fails where it was made to, and only there
        failed = {f["expectation"] for f in report["epoch"]} | {
            f["column"] for failures in report["batches"].values() for f in failures}
        assert not report["success"] and case in failed and failed <= {case, "expect_table_row_count_to_equal"}, \
            (case, report)
    assert kept["score"]["batches"]["0"][1]["partial_unexpected_list"] == [9.0]


def test_ge_is_left_as_it_was_when_a_pass_raises(monkeypatch):
    import great_expectations as gx
    from great_expectations.validator.validator import Validator

    name = "_generate_metric_dependency_subgraphs_for_each_expectation_configuration"

    def broken(self, *args, **kwargs):
        raise RuntimeError("graph building failed")

    monkeypatch.setattr(Validator, name, broken)
    monkeypatch.setattr(suites, "_CACHE", {k: v for k, v in suites._CACHE.items() if k[0] != "graphs"})
    configuration = gx.expectations.Expectation.__dict__["configuration"]
    with pytest.raises(RuntimeError, match="graph building failed"):
        validate_epoch({0: _rows(0), 1: _rows(1)}, LIMITS)
    assert Validator.__dict__[name] is broken
    assert gx.expectations.Expectation.__dict__["configuration"] is configuration


def test_warm_up_in_a_background_thread_builds_the_one_context_a_validation_then_uses():
    import subprocess
    import sys
    from pathlib import Path

    # Contexts and passes are counted from outside: GE's get_context (wrapped when either thread
    # first reaches GE through suites._gx) and suites._run.
    code = (
        "import threading\n"
        "from verl_tasks.quality import suites\n"
        "contexts, passes, lock, plain_gx, plain_run = [], [], threading.Lock(), suites._gx, suites._run\n"
        "def counting_gx():\n"
        "    gx = plain_gx()\n"
        "    with lock:\n"
        "        if not hasattr(gx.get_context, 'counting'):\n"
        "            get_context = gx.get_context\n"
        "            def counted(*a, **k):\n"
        "                contexts.append(k)\n"
        "                return get_context(*a, **k)\n"
        "            counted.counting = True\n"
        "            gx.get_context = counted\n"
        "    return gx\n"
        "suites._gx = counting_gx\n"
        "suites._run = lambda *args: (passes.append(args[-1]), plain_run(*args))[1]\n"
        "warm = threading.Thread(target=suites.warm_up)\n"
        "warm.start()\n"
        "rows = {0: [{'sample_id': f's{i}', 'response': 'x', 'prompt_tokens': 3, 'response_tokens': 1,"
        " 'score': 1.0} for i in range(4)]}\n"
        "report = suites.validate_epoch(rows, suites.Limits(4, 4, 8, 8, 0.0, 1.0, 0.5))\n"
        "warm.join()\n"
        "print(report['success'], len(contexts), len(passes))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "1", "1"], out.stdout
