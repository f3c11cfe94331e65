"""Reward plugins (file, module, entry point) and failure isolation in the worker pool."""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from posttrain.config import RewardsSection
from posttrain.errors import UserError
from rewards.pool import RewardError, RewardPool

PLUGIN = textwrap.dedent('''
    import asyncio, time

    def echo_len(prompts, completions, *, scale=1.0, answer=None, **columns):
        # proves the arguments: prompts, completions and every column arrive, row-aligned
        assert len(prompts) == len(completions) == len(answer)
        assert "completion_ids" in columns
        return [scale * len(c) + (1.0 if c == a else 0.0) for c, a in zip(completions, answer)]

    def boom(prompts, completions, **columns):
        raise ValueError("user bug")

    def sleepy(prompts, completions, **columns):
        time.sleep(60)
        return [1.0] * len(completions)

    def nan_second(prompts, completions, **columns):
        return [1.0, float("nan")] + [1.0] * (len(completions) - 2)

    def not_applicable(prompts, completions, **columns):
        return [None] * len(completions)

    async def async_one(prompts, completions, **columns):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": float(solution_str.strip() == ground_truth)}
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / "my_rewards.py").write_text(PLUGIN)
    return d / "my_rewards.py"


BATCH = dict(prompts=["p1", "p1", "p2", "p2"], completions=["a", "bb", "ccc", "x"],
             columns={"answer": ["a", "z", "ccc", "y"], "completion_ids": [[1], [1, 2], [1, 2, 3], [4]]})


def score(functions, group_size=2, **kw):
    with RewardPool(RewardsSection(functions=functions, **kw)) as pool:
        return pool.score(BATCH["prompts"], BATCH["completions"], BATCH["columns"], group_size)


def test_plugin_from_file_path(plugin):
    s = score([{"fn": f"{plugin}:echo_len", "kwargs": {"scale": 2.0}}])
    np.testing.assert_array_equal(s.per_function["echo_len"], [3.0, 4.0, 7.0, 2.0])


def test_plugin_from_module_path(plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin.parent))
    monkeypatch.setenv("PYTHONPATH", str(plugin.parent))  # the spawned workers import it too
    s = score([{"fn": "my_rewards:echo_len"}])
    np.testing.assert_array_equal(s.totals, [2.0, 2.0, 4.0, 1.0])


def test_plugin_from_entry_point(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "ptr_demo").mkdir(parents=True)
    (pkg / "ptr_demo" / "__init__.py").write_text(
        "def shout(prompts, completions, **columns):\n"
        "    return [float(c.isupper()) for c in completions]\n")
    (pkg / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "ptr-demo"
        version = "0.1"
        [project.entry-points."posttrain.rewards"]
        shout = "ptr_demo:shout"
    '''))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(pkg)], check=True,
                   timeout=300)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    with RewardPool(RewardsSection(functions=[{"fn": "shout"}])) as pool:
        s = pool.score(["p", "p"], ["LOUD", "quiet"], {}, group_size=2)
    np.testing.assert_array_equal(s.totals, [1.0, 0.0])


def test_verl_adapter_and_async(plugin):
    s = score([{"fn": f"{plugin}:compute_score", "adapter": "verl", "name": "verl"},
               {"fn": f"{plugin}:async_one", "weight": 0.5}],
              )
    np.testing.assert_array_equal(s.per_function["verl"], [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(s.totals, [1.5, 0.5, 1.5, 0.5])


def test_raise_timeout_and_nan_do_not_stop_the_batch(plugin):
    s = score([{"fn": f"{plugin}:echo_len"}, {"fn": f"{plugin}:boom"},
               {"fn": f"{plugin}:sleepy"}, {"fn": f"{plugin}:nan_second"}],
              timeout_s=3, fallback=-1.0, num_workers=4)
    m = s.metrics
    assert m["rewards/boom/errors"] == 1 and m["rewards/sleepy/timeouts"] == 1
    assert m["rewards/nan_second/nans"] == 1
    np.testing.assert_array_equal(s.per_function["boom"], [-1.0] * 4)
    np.testing.assert_array_equal(s.per_function["sleepy"], [-1.0] * 4)
    np.testing.assert_array_equal(s.per_function["nan_second"], [1.0, -1.0, 1.0, 1.0])
    # echo_len is unaffected and the weighted total adds every function
    np.testing.assert_array_equal(s.totals, np.array([2.0, 2.0, 4.0, 1.0]) - 1 - 1 + [1, -1, 1, 1])


def test_pool_recovers_after_a_timeout(plugin):
    with RewardPool(RewardsSection(functions=[{"fn": f"{plugin}:sleepy"}], timeout_s=1)) as pool:
        pool.score(["p"] * 2, ["a", "b"], {}, 2)
        s = pool.score(["p"] * 2, ["a", "b"], {}, 2)  # a fresh worker took the hung one's place
    assert s.metrics["rewards/sleepy/timeouts"] == 2


def test_drop_group_and_none(plugin):
    s = score([{"fn": f"{plugin}:nan_second"}, {"fn": f"{plugin}:not_applicable"}],
              fallback="drop_group")
    assert s.keep.tolist() == [False, False, True, True]
    assert math.isnan(s.totals[0]) and s.totals[2] == 1.0
    assert s.metrics["rewards/dropped_groups"] == 1
    assert math.isnan(s.metrics["rewards/not_applicable/mean"])  # None = not applicable


def test_group_statistics(plugin):
    s = score([{"fn": f"{plugin}:compute_score", "adapter": "verl"}])
    # groups: (1, 0) and (1, 0): none all-solved, none unsolved, none zero-variance
    assert (s.metrics["groups/all_solved"], s.metrics["groups/none_solved"],
            s.metrics["groups/zero_variance"]) == (0.0, 0.0, 0.0)


def test_fail_fast(plugin):
    with pytest.raises(RewardError, match="boom"):
        score([{"fn": f"{plugin}:boom"}], fail_fast=True)


def test_dry_run_names_the_problem(plugin):
    with RewardPool(RewardsSection(functions=[{"fn": f"{plugin}:echo_len"}])) as pool:
        with pytest.raises(UserError, match=r"reward echo_len .*dry run.*columns \['answer'\]"):
            pool.dry_run("p", {"answer": "a"})  # completion_ids missing: its assert fails
        pool.dry_run("p", {"answer": "a", "completion_ids": [1]})


def test_bad_specs_fail_at_start(plugin):
    for fn, msg in [("nosuch", "entry-point group posttrain.rewards"),
                    (f"{plugin}:missing", "defines no 'missing'"),
                    ("no_such_module_xyz:f", "cannot import"),
                    ("/nope/r.py:f", "no such file")]:
        with pytest.raises(UserError, match=msg):
            RewardPool(RewardsSection(functions=[{"fn": fn}]))
