"""Checkpoints and saves on a URL (fsspec's in-process ``memory://``), end to end.

One process, several checks, one JSON line: a fit checkpointed to the URL is stopped
mid-epoch and ``make_or_restore`` resumes from the URL (the resumed step and, with
``--reference DIR``, the max weight difference to an uninterrupted run on a local folder
in this same process); a damaged newest checkpoint falls back to the previous one and is
moved aside; ``tfdist.save``/``load`` round trips (``.keras``, ``.weights.h5``, and a
SavedModel on TensorFlow); no staging object is left behind. Both Keras backends.

    KERAS_BACKEND=jax python storage_job.py
"""

import json
import tempfile

import builders
import equivalence
import fsspec
import keras
import numpy as np

import tfdist

URL = "memory://bucket/run"
EPOCHS, GLOBAL_BATCH, EXAMPLES = 2, 32, 256  # 8 steps an epoch
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 6)).astype("float32")
y = rng.integers(0, 3, EXAMPLES)
train = tfdist.data.pipeline((x, y), global_batch=GLOBAL_BATCH, seed=0)
fs = fsspec.filesystem("memory")


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit(directory, *extra):
    model, initial_epoch = tfdist.make_or_restore(build, directory)
    resumed = tfdist.resume_state(model)
    callbacks = [tfdist.callbacks.checkpoint(directory, save_freq=5), *extra]
    try:
        model.fit(train, epochs=EPOCHS, initial_epoch=initial_epoch, callbacks=callbacks, verbose=0)
    except KeyboardInterrupt:
        pass
    return model, resumed


def names():
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/bucket/run", detail=False))


reference, _ = fit(tempfile.mkdtemp(prefix="storage-job-"))
fit(URL, builders.StopAfter(13))  # checkpoints at steps 5 and 10 (epoch 1, batch 2)
after_stop = names()
resumed_model, resumed = fit(URL)
diff = equivalence.max_difference(reference.get_weights(), resumed_model.get_weights())
after_resume = names()

# Damage the newest: truncate it in the store; the next restore falls back.
newest = "/bucket/run/" + tfdist.checkpoint.list_checkpoints(URL)[-1][1].rsplit("/", 1)[-1]
fs.pipe(newest, fs.cat(newest)[:1000])
fallback_model, fallback = fit(URL, builders.StopAfter(-1))
after_damage = names()

# tfdist.save / load through the URL.
saved = tfdist.save(reference, "memory://bucket/models/model.keras")
loaded = tfdist.load(saved)
tfdist.save(reference, "memory://bucket/models/model.weights.h5")
into = tfdist.load("memory://bucket/models/model.weights.h5", model=build())
round_trip = equivalence.max_difference(
    [reference.get_weights()] * 2, [loaded.get_weights(), into.get_weights()]
)
served_diff = None
if keras.backend.backend() == "tensorflow":  # a SavedModel directory lands file by file
    tfdist.save(reference, "memory://bucket/models/export/1")
    served = tfdist.load("memory://bucket/models/export/1")
    expected = reference.predict(x[:4], verbose=0)
    served_diff = equivalence.max_difference(expected, served.serve(x[:4]))
print(
    json.dumps(
        {
            "after_stop": after_stop,
            "resumed_step": resumed.step,
            "resume_diff": diff,
            "after_resume": after_resume,
            "fallback": fallback.path,
            "after_damage": after_damage,
            "saved": saved,
            "models": sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/bucket/models", detail=False)),
            "round_trip_diff": round_trip,
            "served_diff": served_diff,
            "staging_left": [p for p in fs.find("/bucket") if "/.tmp-" in p],
        }
    )
)
