"""Every ``tfdist`` command is quiet into a pipe: each line it prints is its own or on
tfdist.core.quiet's harmless list, and none carries a progress-bar redraw (``\\r``), a colour
code or a backspace. Run as a user runs them: TF_CPP_MIN_LOG_LEVEL unset, output piped.
``train mnist`` runs with ``--devices 2`` and ``--workers 2``: both must train.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tfdist.core import quiet

from conftest import REPO, child_env

# What each command may print besides the harmless list: its own lines.
OWN = {
    "info": re.compile(r".*"),  # the report is the command's output
    "train": re.compile(
        r"tfdist train mnist: .*|Epoch \d+/\d+|Learning rate for epoch \d+ is .*|"
        r"\d+/\d+ - \d+m?s - .*step - .*|test_accuracy=.*"
    ),
    "launch": re.compile(r"tfdist launch: .*|\[w[01]\] trained rank=[01] loss=[0-9.]+"),
}
OWN["train --workers"] = re.compile(rf"tfdist launch: .*|(\[w[01]\] )?(?:{OWN['train'].pattern})")
CONTROL = re.compile(r"\r|\x1b\[|\x08")

SCRIPT = """
import numpy as np, keras, tfdist
with tfdist.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((32, 4), "float32")
history = model.fit(x, x[:, :1], batch_size=tfdist.global_batch_size(8), epochs=1, verbose=0)
print(f"trained rank={tfdist.worker_index()} loss={history.history['loss'][-1]:.4f}")
"""


TRAIN = ["train", "mnist", "--epochs", "1", "--train-split", "train[:2%]"]


def _run(argv, cwd):
    env = child_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # as a user's shell has it: tfdist must quiet TensorFlow
    return subprocess.run(
        [sys.executable, "-m", "tfdist", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _noise(command: str, proc) -> list[str]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    bad = [repr(line) for line in (proc.stdout + proc.stderr).splitlines() if CONTROL.search(line)]
    for line in (proc.stdout + proc.stderr).splitlines():
        blank = not re.sub(r"^\[w\d\]", "", line).strip()  # an empty line, prefixed or not
        if not blank and not OWN[command].fullmatch(line) and not quiet.is_harmless(line):
            bad.append(line)
    return bad


@pytest.mark.slow
@pytest.mark.mnist
def test_every_command_is_quiet_into_a_pipe(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    runs = {
        "info": _run(["info"], REPO),
        "train": _run([*TRAIN, "--devices", "2", "--output", "devices"], tmp_path),
        "train --workers": _run([*TRAIN, "--workers", "2", "--output", "workers"], tmp_path),
        "launch": _run(["launch", "-n", "2", "job.py"], tmp_path),
    }
    noise = {command: _noise(command, proc) for command, proc in runs.items()}
    assert noise == {command: [] for command in runs}, noise
    # train mnist writes one line per epoch into a pipe (Keras's verbose=2), not a bar,
    # and trains on 2 devices and as 2 workers (2 replicas, better than chance).
    for command in ("train", "train --workers"):
        assert len(re.findall(r"^(\[w0\] )?\d+/\d+ - ", runs[command].stdout, re.M)) == 1
        final = re.search(r"test_accuracy=([0-9.]+) .* replicas=2 ", runs[command].stdout)
        # 4 steps on 2% of MNIST: well above chance (0.1), which is all such a run shows.
        assert final and float(final.group(1)) > 0.3, runs[command].stdout[-2000:]
    assert len(re.findall(r"trained rank=", runs["launch"].stdout)) == 2
