"""Runs every corpus script in sequence in this one process, as ``python SCRIPT`` would.

    python tests/corpus/run_all.py [NAME ...]                       # one device
    TFDIST_CPU_DEVICES=2 python -m tfdist.bootstrap tests/corpus/run_all.py
    python -m tfdist launch -n 2 tests/corpus/run_all.py

A process costs seconds of TensorFlow start-up, so one process per topology runs them all:
each script through ``runpy`` with ``run_name="__main__"``, ``keras.backend.clear_session()``
between two. Scripts write their files (checkpoints, saved models) to the current
directory. A script that raises does not stop the others: its error's last line goes to
``CORPUS_OUT/<script>-<RANK>.error``. On JAX the scripts that need TensorFlow
(``TENSORFLOW_ONLY``) are left out.
"""

import os
import runpy
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = [
    "mnist_convnet",
    "image_augmentation",
    "structured_data",
    "text_classification",
    "timeseries_lstm",
    "conv1d_autoencoder",
    "vae",
    "gan",
    "distiller",
    "endpoint_layer",
    "seq2seq",
    "tensordot_model",
    "custom_loop",
]
# Their train_step or loop is written with tf.GradientTape, as the examples' TensorFlow versions.
TENSORFLOW_ONLY = {"vae", "gan", "distiller", "custom_loop"}


def wanted(names, backend):
    chosen = names or SCRIPTS
    unknown = sorted(set(chosen) - set(SCRIPTS))
    if unknown:
        raise SystemExit(f"run_all.py: no corpus script named {unknown}; these exist: {SCRIPTS}")
    return [name for name in chosen if backend == "tensorflow" or name not in TENSORFLOW_ONLY]


def main(names):
    import keras

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    failed = []
    for name in wanted(names, keras.backend.backend()):
        keras.backend.clear_session()
        print(f"run_all.py: {name}", flush=True)
        try:
            runpy.run_path(os.path.join(HERE, f"{name}.py"), run_name="__main__")
        except Exception as error:  # noqa: BLE001 - recorded; the next script still runs
            traceback.print_exc()
            failed.append(name)
            out = os.environ.get("CORPUS_OUT")
            if out:
                os.makedirs(out, exist_ok=True)
                last = f"{type(error).__name__}: {error}".strip().splitlines()
                path = os.path.join(out, f"{name}-{os.environ.get('RANK', '0')}.error")
                with open(path, "w") as file:
                    file.write(last[0] if len(last) == 1 else "\n".join(last[:40]))
    print(f"run_all.py: {len(failed)} failed: {failed}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
