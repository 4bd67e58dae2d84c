"""The exit hold end to end (TensorFlow, 2 workers): the chief leaves because worker 1
said it leaves, while worker 1's process still answers.

``exit_word_job.py FLAG``: both workers meet at a barrier (tfdist arms its exit hold
there), then return. Each registered, before that, an exit hook that runs after tfdist's
(``atexit`` runs last-registered first):

* the chief's writes the file ``FLAG``: its hold let it go;
* worker 1's, after its hold said it leaves, stays alive until ``FLAG`` appears, at most
  ``EXIT_WORD_WAIT_S`` seconds, then prints ``SAW THE CHIEF LEAVE`` or ``THE CHIEF STAYED``.

Worker 1 answers the chief's health probe all that time, so only its word can let the
chief go before worker 1 gave up waiting.
"""

import atexit
import os
import sys
import time

import tfdist

flag = sys.argv[1]
me = tfdist.worker_index()


def after_the_hold() -> None:
    if me == 0:
        with open(flag, "w"):
            pass
        print("CHIEF PAST THE HOLD", flush=True)
        return
    deadline = time.monotonic() + float(os.environ["EXIT_WORD_WAIT_S"])
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("SAW THE CHIEF LEAVE" if os.path.exists(flag) else "THE CHIEF STAYED", flush=True)


atexit.register(after_the_hold)  # before tfdist arms its hold: runs after it
tfdist.barrier("exit word")

from tfdist.core import exit_hold  # noqa: E402  (after the barrier, which armed it)

print("ARMED", me, exit_hold.armed(), flush=True)
