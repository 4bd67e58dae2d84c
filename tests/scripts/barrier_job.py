"""Barriers on every worker, then one on the chief only (a broken script): it must end
with an error that says what happened, within its timeout, never hang.

``barrier_job.py CHIEF_DONE``: the other worker stays alive, not calling the barrier,
until the chief has written the file ``CHIEF_DONE`` after its barrier ended (60 s at most).

``barrier_job.py late``: worker 1 reaches a barrier 3 s after the chief, well within its
30 s timeout: both must pass it, nobody times out."""

import os
import sys
import time

import tfdist

if sys.argv[1:] == ["late"]:
    if tfdist.worker_index() == 1:
        time.sleep(3)  # a slow peer: still loading, say
    try:
        tfdist.barrier("late peer", timeout=30)
        print("PASSED", tfdist.worker_index(), flush=True)
    except RuntimeError as err:
        print(f"ERROR {tfdist.worker_index()}: {err}", flush=True)
    sys.exit(0)

chief_done = sys.argv[1]
tfdist.barrier("start")  # before any framework op: the process sets itself up first
tfdist.chief_print("all workers reached 'start'")
tfdist.barrier()
if tfdist.is_chief():
    start = time.monotonic()
    try:
        tfdist.barrier("chief only", timeout=2)
        print("NO ERROR")
    except RuntimeError as err:
        print(f"ERROR after {time.monotonic() - start:.0f}s: {err}", flush=True)
    with open(chief_done, "w"):
        pass
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(chief_done) and time.monotonic() < deadline:
        time.sleep(0.1)  # alive but not calling the barrier, until the chief's has ended
print("DONE", tfdist.worker_index())
