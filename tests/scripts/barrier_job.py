"""Barriers on every worker, then one on the chief only (a broken script): it must end
with an error that says what happened, within its timeout, never hang.

``barrier_job.py CHIEF_DONE``: the other worker stays alive, not calling the barrier,
until the chief has written the file ``CHIEF_DONE`` after its barrier ended (60 s at most).

``barrier_job.py late``: worker 1 reaches a barrier 3 s after the chief, well within its
30 s timeout: both must pass it, nobody times out. Then the chief writes a key and exits
while worker 1 reads that key from the coordination service 2 s later (the chief must
still be there, holding at exit), and with ``BARRIER_JOB_LINGER_S`` stays that long more."""

import os
import sys
import time

import tfdist
from tfdist import backends
from tfdist.backends import StoreGone

if sys.argv[1:] == ["late"]:
    me = tfdist.worker_index()
    if me == 1:
        time.sleep(3)  # a slow peer: still loading, say
    try:
        tfdist.barrier("late peer", timeout=30)
        print("PASSED", me, flush=True)
    except RuntimeError as err:
        print(f"ERROR {me}: {err}", flush=True)
        sys.exit(0)
    # The chief leaves first; worker 1 still uses the coordination service 2 s later.
    store = backends.get()
    if me == 0:
        store.key_value_set("barrier_job/chief left", "yes")
        sys.exit(0)
    time.sleep(2)
    try:
        print("READ", store.key_value_get("barrier_job/chief left", 10), flush=True)
    except StoreGone as err:
        print(f"ERROR {me}: the store is gone: {err}", flush=True)
    linger = float(os.environ.get("BARRIER_JOB_LINGER_S", "0"))
    if linger:  # past TFDIST_SHUTDOWN_TIMEOUT: the chief must leave without this worker
        time.sleep(linger)
        print("LINGERED", me, flush=True)
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
