"""Barriers on every worker, then one on the chief only (a broken script): it must end
with an error that says what happened, within its timeout, never hang."""

import time

import tfdist

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
