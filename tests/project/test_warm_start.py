"""Jobs forked from the warm process behave as jobs started fresh (tests/warm_start.py)."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from conftest import REPO, SCRIPTS, child_env, last_json_line, run_python, warm_start

PROBE = """
import json, os, random, sys
import numpy as np
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
    "pgid": os.getpgid(0), "probe": os.environ.get("PROBE"), "main": __name__,
    "random": random.random(), "numpy": float(np.random.rand()),
    "modules": sorted(m for m in ("tensorflow", "keras", "tfdist") if m in sys.modules),
}))
"""


def _warm(argv, timeout=120, **env):
    return warm_start.run(
        argv, env=child_env(**env), base_env=child_env(), cwd=REPO, timeout=timeout
    )


def test_a_warm_job_gets_its_own_argv_environment_path_group_and_seeds(tmp_path):
    first = last_json_line(_warm(["-c", PROBE, "a", "b"], PROBE="1").stdout)
    second = last_json_line(_warm(["-c", PROBE], PROBE="2").stdout)
    assert first["argv"] == ["-c", "a", "b"] and second["argv"] == ["-c"]
    assert (first["probe"], second["probe"]) == ("1", "2")
    assert first["cwd"] == str(REPO) and first["path0"] == "" and first["main"] == "__main__"
    assert first["pgid"] == first["pid"] != second["pid"]  # a process group of its own
    # Forked from one process, yet not one random stream.
    assert first["random"] != second["random"] and first["numpy"] != second["numpy"]
    # Imported once before the fork; tfdist is the job's own import.
    assert first["modules"] == ["keras", "tensorflow"]

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    as_script = last_json_line(_warm([str(script), "--x"]).stdout)
    assert as_script["argv"] == [str(script), "--x"] and as_script["path0"] == str(tmp_path)


def test_exit_codes_signals_errors_and_timeouts_are_the_jobs():
    assert _warm(["-c", "import sys; sys.exit(3)"]).returncode == 3
    assert _warm(["-c", "import os; os._exit(4)"]).returncode == 4
    killed = _warm(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == -signal.SIGKILL
    raised = _warm(["-c", "print('out'); raise ValueError('boom')"])
    assert raised.returncode == 1 and raised.stdout == "out\n"
    assert raised.stderr.strip().endswith("ValueError: boom")
    with pytest.raises(subprocess.TimeoutExpired):
        _warm(["-c", "import time; time.sleep(60)"], timeout=2)
    # The warm process outlives its children's crashes and timeouts.
    assert _warm(["-c", "print('still here')"]).stdout == "still here\n"


ENDINGS = """
import atexit, os, signal, sys
how = sys.argv[1]
def hook(kind, value, tb):
    print("hook", kind.__name__, value, flush=True)
sys.excepthook = hook
atexit.register(lambda: print("atexit 1 last", repr(getattr(sys, "last_value", None)), flush=True))
atexit.register(lambda: print("atexit 2", flush=True))
if how == "raise":
    raise ValueError("from the script")
if how == "exit":
    sys.exit(3)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
print("returned", flush=True)
"""


@pytest.mark.parametrize("how", ["raise", "exit", "sigterm", "return"])
def test_a_warm_job_ends_as_a_fresh_process_does(how):
    """Exit code, excepthook, sys.last_value and the atexit order, warm against cold."""
    warm = _warm(["-c", ENDINGS, how])
    cold = run_python(ENDINGS.replace("sys.argv[1]", repr(how)), warm=False, check=False)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout)
    expected = {"raise": 1, "exit": 3, "sigterm": -signal.SIGTERM, "return": 0}[how]
    assert warm.returncode == expected
    if how == "raise":
        assert warm.stdout.splitlines()[0] == "hook ValueError from the script"
        assert "atexit 2\natexit 1 last ValueError('from the script')" in warm.stdout


def test_each_job_sets_up_its_own_devices_and_fixes_like_a_fresh_process():
    code = (
        "import json, keras, numpy as np, tfdist\n"
        "from tfdist import compat\n"
        "with tfdist.scope():\n"
        "    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    m.compile('sgd', 'mse')\n"
        "m.fit(np.ones((10, 3)), np.ones((10, 2)), batch_size=4, verbose=0)\n"
        "print(json.dumps({'replicas': tfdist.num_replicas(), 'applied': sorted(compat.applied()),"
        " 'kernel': m.layers[0].kernel.numpy().tolist()}))\n"
    )
    seed = "import keras; keras.utils.set_random_seed(5)\n"
    cold = last_json_line(run_python(seed + code, warm=False, TFDIST_CPU_DEVICES="2").stdout)
    for devices, excluded in (("2", None), ("1", None), ("2", "all")):
        env = {"TFDIST_CPU_DEVICES": devices, "TFDIST_COMPAT_EXCLUDE": excluded}
        warm = last_json_line(run_python(seed + code, **env).stdout)
        assert warm["replicas"] == int(devices)
        assert (warm["applied"] == []) == (excluded == "all")
        if devices == "2" and excluded is None:
            assert warm["applied"] == cold["applied"]
            assert json.dumps(warm["kernel"]) == json.dumps(cold["kernel"])  # bit for bit


@pytest.mark.jax
def test_a_jax_job_gets_the_devices_it_asks_for_from_its_own_warm_process():
    code = (
        "import json, jax, keras, numpy as np, tfdist\n"
        "with tfdist.scope():\n"
        "    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    m.compile('sgd', 'mse')\n"
        "m.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0)\n"
        "print(json.dumps([jax.device_count(), len(m.weights[0].value.sharding.device_set)]))\n"
    )
    for devices in ("2", "1", "4"):
        out = _warm(["-c", code], KERAS_BACKEND="jax", TFDIST_CPU_DEVICES=devices).stdout
        assert last_json_line(out) == [int(devices)] * 2


def test_a_job_that_changes_an_import_time_variable_starts_cold():
    code = "import sys; print(sorted(m for m in ('tensorflow', 'jax') if m in sys.modules))"
    assert _warm(["-c", code]).stdout.strip() == "['tensorflow']"
    assert _warm(["-c", code], TF_ENABLE_ONEDNN_OPTS="0").stdout.strip() == "[]"
    assert _warm(["-c", code], KERAS_BACKEND="jax").stdout.strip() == "['jax', 'tensorflow']"
    # jax's own import-time flags: a warm process of their own, started with them.
    x64 = "import jax, sys; print('tensorflow' in sys.modules, jax.config.jax_enable_x64)"
    assert _warm(["-c", x64], KERAS_BACKEND="jax").stdout.split() == ["True", "False"]
    assert _warm(["-c", x64], KERAS_BACKEND="jax", JAX_ENABLE_X64="1").stdout.split() == [
        "True",
        "True",
    ]
    popen = warm_start.popen(
        [str(SCRIPTS / "faults.py")], env=child_env(), base_env=child_env(), cwd=REPO
    )
    assert isinstance(popen, warm_start.WarmProcess) and popen.wait(60) == 0


def test_a_warm_process_started_from_a_thread_outlives_the_thread():
    """Jobs start from thread pools too: the warm process a pool's thread started keeps
    serving after that thread ended (it once died with it, under the next test's job)."""
    import threading

    made = {}
    thread = threading.Thread(target=lambda: made.update(server=warm_start._Server(child_env())))
    thread.start()
    thread.join(timeout=300)
    server = made["server"]
    try:
        job = server.start(["-c", "print('served')"], child_env(), str(REPO), text=True)
        out, _ = job.communicate(timeout=120)
        assert (job.returncode, out.strip()) == (0, "served")
    finally:
        server.close()


def _shim(*argv, **env):
    """``tfdist launch``'s warm worker interpreter (tests/warm_python.py), started as the
    launcher starts it."""
    child = child_env(**env)
    warm_start.prepare(child, child_env())
    python = warm_start.LAUNCH_ENV["TFDIST_LAUNCH_PYTHON"]
    return subprocess.Popen(
        [python, *argv],
        env=child,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


SHIM_PROBE = """
import json, os, sys
print(json.dumps({"pid": os.getpid(), "net": os.readlink("/proc/self/ns/net"),
                  "tensorflow": "tensorflow" in sys.modules, "argv": sys.argv}), flush=True)
"""


def test_the_launch_workers_python_forks_the_job_and_stands_in_for_it():
    """What tfdist launch sees of a worker (its pid's exit code or signal, signals sent to
    its group, its death) is the forked job's; the job joins the worker's network."""
    import os
    import time

    shim = _shim("-c", SHIM_PROBE, "x")
    out, _ = shim.communicate(timeout=120)
    job = last_json_line(out)
    assert job["tensorflow"] and job["argv"] == ["-c", "x"] and job["pid"] != shim.pid
    for code, expected in (("import sys; sys.exit(3)", 3), ("import os; os._exit(0)", 0)):
        assert _shim("-c", code).wait(120) == expected
    killed = _shim("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.wait(120) == -signal.SIGKILL

    # A signal to the worker's group reaches the job, which ends as it chooses.
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    term = _shim("-c", code)
    assert term.stdout.readline().strip() == "ready"
    os.killpg(term.pid, signal.SIGTERM)
    assert term.wait(60) == 7 and term.stdout.read().strip() == "term"

    # A worker killed -9 (its launcher's death, a fault test): its job goes too.
    orphan = _shim("-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    job_pid = int(orphan.stdout.readline())
    os.killpg(orphan.pid, signal.SIGKILL)
    orphan.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{job_pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{job_pid}")

    # In a network namespace of its own (the launcher's private network), so is the job.
    python = warm_start.LAUNCH_ENV["TFDIST_LAUNCH_PYTHON"]
    netns = subprocess.run(
        ["unshare", "--net", python, "-c", SHIM_PROBE],
        env=child_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    inside = last_json_line(netns.stdout)
    assert inside["tensorflow"] and inside["net"] != os.readlink("/proc/self/ns/net")

    # An import-time variable the warm process did not start with: a cold start.
    cold, _ = _shim("-c", SHIM_PROBE, TF_ENABLE_ONEDNN_OPTS="0").communicate(timeout=120)
    assert not last_json_line(cold)["tensorflow"]


def test_a_stand_in_whose_warm_process_ends_before_forking_starts_the_job_cold(tmp_path):
    """The launcher's worker still runs (cold) when the warm process closes the connection
    instead of forking: no traceback, no lost worker."""
    import socket
    import threading
    import time

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / "tensorflow.sock"))  # warm_python.warm_key: the backend
    listener.listen(1)

    def accept_and_close():
        conn, _ = listener.accept()
        time.sleep(1)  # its request arrives, unread: the stand-in's read is reset
        conn.close()  # as by a warm process that ended

    thread = threading.Thread(target=accept_and_close)
    thread.start()
    try:
        python = warm_start.LAUNCH_ENV["TFDIST_LAUNCH_PYTHON"]
        proc = subprocess.run(
            [python, "-c", SHIM_PROBE],
            env=child_env(TFDIST_TEST_WARM_DIR=str(tmp_path)),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        thread.join(timeout=60)
        listener.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = last_json_line(proc.stdout)
    assert not job["tensorflow"]  # a fresh interpreter ran it, not a warm fork
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
