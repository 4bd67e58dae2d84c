"""Two strategies in one process (tfdist's and the script's own, in either order).

tests/scripts/two_strategies_job.py fits a model in ``tfdist.scope()`` on a pipeline with a
partial last batch and one in the script's own ``MirroredStrategy``. Models of one size:
upstream (every fix excluded) trains both, and so does tfdist, each equal to one device.
Models of two sizes: upstream aborts (the second strategy's first all-reduce reuses the
first's collective instance), as it does with only ``tf_mirrored_collective_keys_apart``
excluded; with the fixes each equals one device.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfdist.compat import collective_keys

from conftest import SCRIPTS, equivalence, run_python

JOB = str(SCRIPTS / "two_strategies_job.py")


def _job(order: str, out, *, devices: int, exclude="", check=True, same=False):
    argv = [JOB, order, str(out), *(["same"] if same else [])]
    code = f"import runpy, sys; sys.argv = {argv!r}; "
    code += f"runpy.run_path({JOB!r}, run_name='__main__')"
    env = {"TFDIST_COMPAT_EXCLUDE": exclude} if exclude else {}
    if devices > 1:
        env["TFDIST_CPU_DEVICES"] = str(devices)
    return run_python(code, check=check, timeout=300, **env)


def _loaded(path) -> dict:
    with np.load(path) as found:
        return {k: found[k] for k in found.files}


def _equal_to(one: dict, two: dict) -> None:
    for name in ("with_tfdist", "with_own"):
        assert int(two[name + "_replicas"]) == 2
        equivalence.assert_close(one[name], two[name], 1e-5, name)


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.parametrize("order", ["tfdist-first", "own-first"])
def test_two_strategies_in_one_process_each_equal_one_device(order, tmp_path):
    _job(order, tmp_path / "one.npz", devices=1)
    _job(order, tmp_path / "two.npz", devices=2)
    _equal_to(_loaded(tmp_path / "one.npz"), _loaded(tmp_path / "two.npz"))


@pytest.mark.slow
@pytest.mark.devices
def test_models_of_one_size_train_as_upstream_with_the_fixes_and_without(tmp_path):
    _job("tfdist-first", tmp_path / "one.npz", devices=1, same=True)
    one = _loaded(tmp_path / "one.npz")
    for exclude in ("", "all"):
        out = tmp_path / f"two-{exclude or 'fixes'}.npz"
        _job("tfdist-first", out, devices=2, exclude=exclude, same=True)
        _equal_to(one, _loaded(out))


def test_each_strategy_after_the_first_gets_its_own_keys_and_a_set_base_is_kept():
    import tensorflow as tf

    from tfdist.core import upstream

    collective_keys.tf_mirrored_collective_keys_apart()  # idempotent: applied already in tfdist
    first = tf.distribute.MirroredStrategy(["/cpu:0"])
    second = tf.distribute.MirroredStrategy(["/cpu:0"])
    bases = [upstream.tf_collective_key_base(s.extended) for s in (first, second)]
    assert bases[1] - bases[0] == collective_keys.KEY_SPAN

    class Chosen(tf.distribute.MirroredStrategy):
        _collective_key_base = 7  # the user's own base (as TensorFlow's tests set it)

    assert upstream.tf_collective_key_base(Chosen(["/cpu:0"]).extended) == 7


@pytest.mark.slow
@pytest.mark.devices
@pytest.mark.upstream_failure("tf_mirrored_collective_keys_apart")
@pytest.mark.parametrize("exclude", ["all", collective_keys.TF_MIRRORED_COLLECTIVE_KEYS_APART])
def test_models_of_two_sizes_abort_upstream_and_without_the_fix(exclude, tmp_path):
    proc = _job("tfdist-first", tmp_path / "broken.npz", devices=2, exclude=exclude, check=False)
    assert proc.returncode != 0
    assert "Shape mismatch in the collective instance" in proc.stderr, proc.stderr[-3000:]
