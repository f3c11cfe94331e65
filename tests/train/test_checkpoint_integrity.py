"""Checkpoint integrity: a latest checkpoint that is torn, truncated, bit-flipped or missing its
metadata is detected on resume and the run falls back to the previous one with a warning naming
both; none usable is an error, never a silent fresh start; a checkpoint from a different recipe
is a user error that moves nothing; a full disk during a save is one clear error that leaves the
previous checkpoint intact. (The whole run resuming through a corrupt latest checkpoint:
tests/train/test_faults.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.errors import CheckpointError, UserError
from posttrain.train.checkpoint import Checkpointer, digests


def state(step: int, n: int = 64):
    k1, k2 = jax.random.split(jax.random.key(step))  # random bits: nothing compresses them
    params = {"w": jax.random.normal(k1, (n, n), jnp.float32),
              "b": jnp.full((n,), step, jnp.bfloat16)}
    train = {"step": jnp.int32(step), "rng": jax.random.key_data(jax.random.key(step)),
             "mu": jax.random.normal(k2, (n, n), jnp.float32)}
    return params, train


def save_steps(directory: Path, steps, n: int = 64, keep: int = 5) -> Checkpointer:
    ck = Checkpointer(directory, keep=keep)
    for s in steps:
        ck.save(s, *state(s, n), {"step": s})
    ck.wait()
    return ck


def restore_fn(ck: Checkpointer, n: int = 64):
    return lambda step: ck.restore(step, *state(0, n))


def largest(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(s: Path):
    f = largest(s / "params")
    os.truncate(f, f.stat().st_size // 2)


def _flip_bytes(s: Path):
    f = largest(s / "params")
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
    f.write_bytes(bytes(b))


def _no_meta(s: Path):
    shutil.rmtree(s / "meta")


def _no_array_index(s: Path):
    (s / "train" / "manifest.ocdbt").unlink()


def _no_tree_metadata(s: Path):
    (s / "params" / "_METADATA").unlink()


@pytest.mark.parametrize("corrupt", [_truncate, _flip_bytes, _no_meta, _no_array_index,
                                     _no_tree_metadata], ids=lambda f: f.__name__.strip("_"))
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, corrupt):
    ck = save_steps(tmp_path, [1, 2, 3])
    ck.close()
    corrupt(tmp_path / "3")
    ck = Checkpointer(tmp_path, keep=5)
    capsys.readouterr()
    step, (params, train, meta) = ck.restore_latest(restore_fn(ck))
    err = capsys.readouterr().err.strip().splitlines()
    assert step == 2 and meta["step"] == 2
    want_p, want_t = state(2)
    for k in want_p:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(want_p[k]))
    for k in want_t:
        np.testing.assert_array_equal(np.asarray(train[k]), np.asarray(want_t[k]))
    assert len(err) == 1 and err[0].startswith("posttrain: warning: checkpoint "), err
    assert f"{tmp_path / '3'} is unusable" in err[0] and "falling back to step 2" in err[0], err
    # moved aside, kept for inspection; later saves of step 3 do not collide with it
    assert not (tmp_path / "3").exists() and len(list(tmp_path.glob("corrupt-3-*"))) == 1
    assert ck.latest_step() == 2
    ck.save(3, *state(3), {"step": 3})
    ck.wait()
    assert ck.restore_latest(restore_fn(ck))[0] == 3
    ck.close()


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, capsys):
    ck = save_steps(tmp_path, [1, 2])
    ck.close()
    _flip_bytes(tmp_path / "2")
    _no_meta(tmp_path / "1")
    ck = Checkpointer(tmp_path, keep=5)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint \(2: .*digests.*; 1: .*meta"):
        ck.restore_latest(restore_fn(ck))
    assert "no earlier checkpoint" in capsys.readouterr().err


def test_an_unfinished_write_is_reported_and_cleaned_up(tmp_path, capsys):
    ck = save_steps(tmp_path, [1, 2])
    ck.close()
    # what a SIGKILL during an asynchronous save leaves: the step's temporary directory
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1764633600")
    capsys.readouterr()
    ck = Checkpointer(tmp_path, keep=5)
    assert "3.orbax-checkpoint-tmp-1764633600: discarding an unfinished checkpoint write" in \
        capsys.readouterr().err
    assert ck.restore_latest(restore_fn(ck))[0] == 2
    ck.wait()
    assert not list(tmp_path.glob("*tmp*"))


def test_a_checkpoint_of_a_different_recipe_is_a_user_error_and_moves_nothing(tmp_path):
    ck = save_steps(tmp_path, [1])
    with pytest.raises(UserError, match=r"1: params/b: saved as \(64,\) bfloat16, this recipe "
                                        r"builds \(32,\) bfloat16; use a new run_dir") as e:
        ck.restore_latest(restore_fn(ck, n=32))
    assert not isinstance(e.value, CheckpointError) and (tmp_path / "1").is_dir()


def test_digests_catch_one_flipped_bit_and_a_swap():
    x = jnp.arange(1000, dtype=jnp.float32).reshape(10, 100)
    base = digests({"x": x})["x"]
    flipped = np.asarray(x).view(np.uint32).copy()
    flipped[3, 7] ^= 1 << 20
    assert digests({"x": jnp.asarray(flipped.view(np.float32))})["x"] != base
    swapped = np.asarray(x).copy()
    swapped[0, [1, 2]] = swapped[0, [2, 1]]
    d = digests({"x": jnp.asarray(swapped)})["x"]
    assert d[0] == base[0] and d[1] != base[1]  # same sum, different positions
    # the same values under another sharding give the same digest
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    assert digests({"x": sharded})["x"] == base


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB filesystem (tmpfs) at tmp_path/disk; needs permission to mount."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12M", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a size-capped tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays_intact(small_disk):
    n = 1024  # a checkpoint holds 8 MiB (two 4 MiB arrays): the first fits, the second not
    ck = save_steps(small_disk, [1], n=n)
    with pytest.raises(CheckpointError) as e:
        ck.save(2, *state(2, n), {"step": 2})  # asynchronous: the failure may come at wait()
        ck.wait()
    msg = str(e.value)
    assert msg.startswith(f"{small_disk}: writing checkpoint 2 failed: No space left on device "
                          "(ENOSPC); checkpoint 1 is intact"), msg
    assert not list(small_disk.glob("*tmp*"))  # the partial write's space is given back
    ck2 = Checkpointer(small_disk, keep=5)
    step, (params, train, _) = ck2.restore_latest(restore_fn(ck2, n))
    assert step == 1
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(state(1, n)[0]["w"]))
    np.testing.assert_array_equal(np.asarray(train["mu"]), np.asarray(state(1, n)[1]["mu"]))
