"""A Conv1D autoencoder for anomaly detection that calls ``predict``.

The shape of Keras's "Timeseries anomaly detection using an Autoencoder" example:
Conv1D layers with strides 2 encode a window, Conv1DTranspose layers decode it, the
model trains to reconstruct its input, then ``predict`` on the training windows gives
the reconstruction error whose maximum is the anomaly threshold, and ``predict`` on new
windows finds the anomalies. A noisy periodic signal stands in for the NAB data.
"""

import keras
import numpy as np
from keras import layers

keras.utils.set_random_seed(17)
rng = np.random.default_rng(17)
time_steps = 32


def windows(count, anomaly=False):
    t = np.arange(count + time_steps, dtype=np.float32)
    signal = np.sin(t / 4) + rng.normal(0, 0.05, t.size)
    if anomaly:
        signal[40:50] += 2.0
    signal = ((signal - signal.mean()) / signal.std()).astype(np.float32)
    return np.stack([signal[i : i + time_steps] for i in range(count)])[..., None]


x_train = windows(250)
x_test = windows(66, anomaly=True)

model = keras.Sequential(
    [
        layers.Input(shape=(time_steps, 1)),
        layers.Conv1D(filters=16, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Conv1D(filters=8, kernel_size=7, padding="same", strides=2, activation="relu"),
        layers.Conv1DTranspose(
            filters=8, kernel_size=7, padding="same", strides=2, activation="relu"
        ),
        layers.Conv1DTranspose(
            filters=16, kernel_size=7, padding="same", strides=2, activation="relu"
        ),
        layers.Conv1DTranspose(filters=1, kernel_size=7, padding="same"),
    ]
)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
history = model.fit(x_train, x_train, epochs=2, batch_size=32, shuffle=False, verbose=2)

x_train_pred = model.predict(x_train, verbose=0)
train_mae_loss = np.mean(np.abs(x_train_pred - x_train), axis=1)
threshold = np.max(train_mae_loss)
x_test_pred = model.predict(x_test, verbose=0)
test_mae_loss = np.mean(np.abs(x_test_pred - x_test), axis=1).reshape(-1)
anomalies = test_mae_loss > threshold
print("Reconstruction error threshold:", threshold, "anomalous windows:", np.sum(anomalies))

if __name__ == "__main__":
    import record

    record.save(__file__, model, history, outputs=[x_train_pred, x_test_pred])
