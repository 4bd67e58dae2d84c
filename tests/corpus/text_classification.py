"""Text classification from scratch: TextVectorization adapted, then mapped over the batches.

The shape of Keras's "Text classification from scratch" example: a batched ``tf.data`` of
raw strings, a TextVectorization layer adapted on the text alone and applied in a ``map``
to the batches, then Embedding, Conv1D, GlobalMaxPooling1D and a sigmoid output. Random
sentences over a small vocabulary stand in for the movie reviews.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

keras.utils.set_random_seed(5)
rng = np.random.default_rng(5)
words = np.array([f"w{i}" for i in range(60)] + ["great", "awful"])
sentences, labels = [], []
for _ in range(250):
    sentence = rng.choice(words[:60], rng.integers(5, 15)).tolist()
    label = int(rng.integers(0, 2))
    sentence.insert(int(rng.integers(0, len(sentence))), "great" if label else "awful")
    sentences.append(" ".join(sentence))
    labels.append(label)

raw_train_ds = tf.data.Dataset.from_tensor_slices((sentences, labels)).batch(32)

max_features, sequence_length = 100, 16
vectorize_layer = layers.TextVectorization(
    max_tokens=max_features, output_mode="int", output_sequence_length=sequence_length
)
vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))


def vectorize_text(text, label):
    return vectorize_layer(tf.expand_dims(text, -1)), label


train_ds = raw_train_ds.map(vectorize_text).prefetch(2)

inputs = keras.Input(shape=(None,), dtype="int64")
x = layers.Embedding(max_features, 16)(inputs)
x = layers.Conv1D(16, 3, padding="valid", activation="relu")(x)
x = layers.GlobalMaxPooling1D()(x)
x = layers.Dense(16, activation="relu")(x)
predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
model = keras.Model(inputs, predictions)
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(train_ds, epochs=2, verbose=2)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history)
