"""Structured data classification: named dict inputs, adapted lookup and normalization.

The shape of Keras's structured-data examples: a table of numeric, integer-coded and
string-coded columns; StringLookup and IntegerLookup layers adapted on the training
columns one-hot encode the categories in a ``map`` over the batched ``tf.data``; Normalization layers adapted
on the numeric columns sit in a model with one named ``keras.Input`` per column.
A synthetic heart-disease-like table stands in for the CSV.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

keras.utils.set_random_seed(3)
rng = np.random.default_rng(3)
n = 250
raw = {
    "age": rng.normal(54, 9, n).astype(np.float32),
    "chol": rng.normal(246, 50, n).astype(np.float32),
    "cp": rng.integers(0, 5, n).astype(np.int64),
    "thal": rng.choice(["fixed", "normal", "reversible"], n),
}
target = ((raw["age"] > 55) ^ (raw["thal"] == "normal")).astype(np.float32)

thal_lookup = layers.StringLookup(output_mode="one_hot")
thal_lookup.adapt(raw["thal"])
cp_lookup = layers.IntegerLookup(output_mode="one_hot")
cp_lookup.adapt(raw["cp"])


def encode(features, label):
    return {
        "age": features["age"][:, None],
        "chol": features["chol"][:, None],
        "cp": cp_lookup(features["cp"]),
        "thal": thal_lookup(features["thal"]),
    }, label


train_ds = tf.data.Dataset.from_tensor_slices((raw, target)).batch(32).map(encode)

age_norm = layers.Normalization()
age_norm.adapt(raw["age"][:, None])
chol_norm = layers.Normalization()
chol_norm.adapt(raw["chol"][:, None])

inputs = {
    "age": keras.Input(shape=(1,), name="age"),
    "chol": keras.Input(shape=(1,), name="chol"),
    "cp": keras.Input(shape=(cp_lookup.vocabulary_size(),), name="cp"),
    "thal": keras.Input(shape=(thal_lookup.vocabulary_size(),), name="thal"),
}
x = layers.concatenate(
    [age_norm(inputs["age"]), chol_norm(inputs["chol"]), inputs["cp"], inputs["thal"]]
)
x = layers.Dense(16, activation="relu")(x)
output = layers.Dense(1, activation="sigmoid")(x)
model = keras.Model(inputs, output)
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
history = model.fit(train_ds, epochs=3, verbose=2)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
