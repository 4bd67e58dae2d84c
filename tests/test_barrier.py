"""tfdist.barrier and chief_print: every worker waits for the others; a barrier called on
some workers only ends with a clear error within its timeout, never a hang."""

from __future__ import annotations

import time

import pytest

import tfdist

from conftest import SCRIPTS, launch_cli


def test_barrier_is_a_no_op_on_one_worker_and_checks_its_arguments():
    tfdist.barrier()
    tfdist.barrier("named", timeout=1)
    with pytest.raises(TypeError, match=r"barrier: name must be a str or None\. Received: name=3"):
        tfdist.barrier(3)
    with pytest.raises(ValueError, match=r"barrier: timeout must be a positive number"):
        tfdist.barrier("x", timeout=0)


def test_chief_print_prints_on_the_chief(capsys):
    tfdist.chief_print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_barrier_on_the_chief_only_fails_clearly_within_its_timeout(backend, tmp_path):
    """The chief's barrier has a 2 s timeout; the other worker stays alive, not calling
    it, until the chief's barrier ended."""
    chief_done = str(tmp_path / "chief done")
    proc = launch_cli(
        "-n", "2", str(SCRIPTS / "barrier_job.py"), chief_done, KERAS_BACKEND=backend
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-4000:]
    assert out.count("all workers reached 'start'") == 1  # chief_print: once, not per worker
    error = next(line for line in out.splitlines() if "ERROR after" in line)
    assert error.startswith("[w0]") and "tfdist.barrier('chief only')" in error
    assert "in the same order" in error
    seconds = int(error.split("ERROR after ")[1].split("s:")[0])
    assert seconds < 60
    assert "[w0] DONE 0" in out and "[w1] DONE 1" in out


@pytest.mark.multiworker
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_peer_arriving_late_but_within_the_timeout_passes_the_barrier(backend):
    """Worker 1 reaches the barrier 3 s after the chief (timeout 30 s): both return.

    Then the chief exits first and worker 1 reads a key the chief wrote, 2 s later, from the
    coordination service that lives in the chief's process: the chief must still be there,
    waiting at exit (TensorFlow: until worker 1 says it leaves; jax: its own shutdown
    barrier).
    On TensorFlow worker 1 then stays 7 s more, past TFDIST_SHUTDOWN_TIMEOUT=4: the chief
    leaves without it, saying so, and both exit 0."""
    tensorflow = backend == "tensorflow"
    linger = {"TFDIST_SHUTDOWN_TIMEOUT": "4", "BARRIER_JOB_LINGER_S": "7"} if tensorflow else {}
    proc = launch_cli(
        "-n", "2", str(SCRIPTS / "barrier_job.py"), "late", KERAS_BACKEND=backend, **linger
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-4000:]
    assert "ERROR" not in out, out[-3000:]
    assert "[w0] PASSED 0" in out and "[w1] PASSED 1" in out, out[-3000:]
    assert "[w1] READ yes" in out, out[-3000:]
    if tensorflow:  # the workers' stderr: the chief's one line, no other worker's
        left = [line for line in proc.stderr.splitlines() if "leaving without them" in line]
        assert len(left) == 1, proc.stderr[-4000:]
        assert left[0].startswith("[w0] tfdist: worker 0: worker 1 did not finish within 4 s")
        assert "[w1] LINGERED 1" in out


@pytest.mark.multiworker
def test_the_chief_leaves_because_a_worker_said_it_leaves(tmp_path):
    """TensorFlow's exit hold end to end: worker 1 writes its word and then stays alive
    (an exit hook that runs after tfdist's) until the chief has passed its hold, at most
    45 s; TFDIST_SHUTDOWN_TIMEOUT is 120 s. Worker 1 answers the health probe throughout,
    so the chief passing its hold while worker 1 still waits can only come from the word
    (a word the chief does not read keeps it until worker 1 gives up and is gone)."""
    flag = tmp_path / "chief past its hold"
    proc = launch_cli(
        "-n", "2", str(SCRIPTS / "exit_word_job.py"), str(flag), KERAS_BACKEND="tensorflow",
        TFDIST_SHUTDOWN_TIMEOUT="120", EXIT_WORD_WAIT_S="45",
    )  # fmt: skip
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-4000:]
    assert "[w0] ARMED 0 True" in out and "[w1] ARMED 1 True" in out, out[-3000:]
    assert "[w0] CHIEF PAST THE HOLD" in out, out[-3000:]
    assert "[w1] SAW THE CHIEF LEAVE" in out, out[-3000:] + err[-3000:]
    assert "THE CHIEF STAYED" not in out
    assert "leaving without them" not in err, err[-3000:]


@pytest.mark.multiworker
@pytest.mark.slow
def test_a_chief_only_predict_ends_with_one_line_naming_the_rule():
    """The other worker finishes; the chief's predict waits for it, then TensorFlow says
    "The tasks have crashed". The worker ends within 60 s with one line naming the lost
    worker and the every-worker rule, not a traceback. The heartbeat timeout, through
    which the chief learns of the loss, is set to 4 s (default 10 s)."""
    start = time.monotonic()
    proc = launch_cli(
        "-n", "2", str(SCRIPTS / "chief_only_predict.py"), TFDIST_HEARTBEAT_TIMEOUT="4"
    )  # fmt: skip
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    chief = [line for line in output.splitlines() if line.startswith("[w0]")]
    text = "\n".join(chief)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[w1] END 1" in proc.stdout and "END 0" not in text
    assert "Traceback" not in text, text[-3000:]
    verdict = next(line for line in chief if line.startswith("[w0] tfdist: UnavailableError"))
    assert "unhealthy" in verdict and "/job:worker/replica:0/task:1" in verdict, verdict
    assert "every worker must make the same calls" in verdict, verdict
    assert "failed: worker w0 exited with code 1" in proc.stderr
    assert elapsed < 120, f"{elapsed:.0f} s"  # start-up + the 4 s heartbeat, never a hang
