"""Barriers on every worker, then one on the chief only (a broken script): it must end
with an error that says what happened, within its timeout, never hang.

``barrier_job.py late``: worker 1 reaches a barrier 3 s after the chief, well within its
30 s timeout: both must pass it, nobody times out."""

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

tfdist.barrier("start")  # before any framework op: the process sets itself up first
tfdist.chief_print("all workers reached 'start'")
tfdist.barrier()
if tfdist.is_chief():
    start = time.monotonic()
    try:
        tfdist.barrier("chief only", timeout=5)
        print("NO ERROR")
    except RuntimeError as err:
        print(f"ERROR after {time.monotonic() - start:.0f}s: {err}")
else:
    time.sleep(8)  # alive but not calling the barrier
print("DONE", tfdist.worker_index())
