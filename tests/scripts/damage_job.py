"""A restart of a job whose checkpoint directory may be damaged (tests/checkpoint/test_damage.py).

It builds the tests' model, calls ``make_or_restore`` exactly as a user script would
(on one process, or on every worker under ``tfdist launch``), optionally trains more
epochs with the checkpoint callback, and prints one JSON line: the checkpoint restored,
``initial_epoch``, the restored weights, the warnings raised, or the error.

    python damage_job.py --dir /tmp/ckpt [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import numpy as np

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = X @ np.ones((4, 1), "float32")


def build():
    """The tests' model: small, with a Dropout layer (an RNG state to restore)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def restart(directory: str, epochs: int) -> dict:
    import tfdist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, initial_epoch = tfdist.make_or_restore(build, directory)
        except Exception as err:  # noqa: BLE001 - the test checks the message
            return {"error": f"{type(err).__name__}: {err}"}
    state = tfdist.resume_state(model)
    result = {
        "restored": None if state is None else os.path.basename(state.path),
        "initial_epoch": initial_epoch,
        "weights": [w.tolist() for w in model.get_weights()],
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }
    if epochs > initial_epoch:
        callback = tfdist.callbacks.checkpoint(directory)
        model.fit(X, Y, batch_size=8, shuffle=False, epochs=epochs, verbose=0,
                  initial_epoch=initial_epoch, callbacks=[callback])  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=0, help="train up to this epoch")
    args = parser.parse_args()
    print(json.dumps(restart(args.dir, args.epochs)), flush=True)


if __name__ == "__main__":
    main()
