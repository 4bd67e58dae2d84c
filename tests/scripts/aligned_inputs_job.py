"""The PyDataset and generator idioms of ``idioms_job.py`` with their arrays on a 64-byte
boundary, where ``tf.data.Dataset.from_generator`` takes a yielded array's memory as its
tensor's (whether the job's own arrays lie there depends on the process's heap).

    python aligned_inputs_job.py                     # 1 device
    TFDIST_CPU_DEVICES=2 python aligned_inputs_job.py
    tfdist launch -n 2 aligned_inputs_job.py

Prints one JSON line on the chief: each idiom's values, the rows of the label array
(``Y``) that were different after its ``fit`` (each idiom starts from pristine arrays),
and the topology.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import idioms_job  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402

ALIGN = 64


def aligned(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` whose first byte is on an ``ALIGN``-byte boundary."""
    raw = np.empty(array.size + ALIGN, array.dtype)
    start = (-raw.ctypes.data % ALIGN) // array.itemsize
    out = raw[start : start + array.size].reshape(array.shape)
    out[...] = array
    return out


def run() -> dict:
    pristine_x, pristine_y = idioms_job.X.copy(), idioms_job.Y.copy()
    results = {}
    for name in ("pydataset", "generator"):
        idioms_job.X, idioms_job.Y = aligned(pristine_x), aligned(pristine_y)
        values = idioms_job.IDIOMS[name][2]()
        changed = np.nonzero(np.any(idioms_job.Y != pristine_y, axis=1))[0]
        results[name] = {"values": values, "changed_rows": changed.tolist()}
    return results


if __name__ == "__main__":
    out = {"idioms": run(), "topology": idioms_job.topology()}
    if tfdist.is_chief():
        print("ALIGNED " + json.dumps(out), flush=True)
