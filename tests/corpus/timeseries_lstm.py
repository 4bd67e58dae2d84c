"""Time-series forecasting with an LSTM, EarlyStopping and ModelCheckpoint.

The shape of Keras's weather-forecasting example: windows of past readings of a few
features predict a value ahead; an LSTM and a Dense head trained with mean squared error;
EarlyStopping on the validation loss (best weights restored) and a ModelCheckpoint that
keeps the best weights on disk, loaded back at the end. A noisy sine stands in for the
weather record.
"""

import keras
import numpy as np
from keras import layers

keras.utils.set_random_seed(13)
rng = np.random.default_rng(13)
steps = np.arange(400, dtype=np.float32)
series = np.stack([np.sin(steps / 8), np.cos(steps / 13), rng.normal(0, 0.1, 400)], axis=1)
series = series.astype(np.float32)
past, ahead = 24, 4
starts = np.arange(len(series) - past - ahead)
windows = np.stack([series[s : s + past] for s in starts])
targets = series[starts + past + ahead - 1, :1]
x_train, y_train = windows[:250], targets[:250]
x_val, y_val = windows[250:316], targets[250:316]

inputs = keras.layers.Input(shape=(past, 3))
lstm_out = layers.LSTM(16)(inputs)
outputs = layers.Dense(1)(lstm_out)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3), loss="mse")

path_checkpoint = "forecaster.weights.h5"
es_callback = keras.callbacks.EarlyStopping(
    monitor="val_loss", min_delta=0, patience=2, restore_best_weights=True
)
modelckpt_callback = keras.callbacks.ModelCheckpoint(
    monitor="val_loss",
    filepath=path_checkpoint,
    verbose=1,
    save_weights_only=True,
    save_best_only=True,
)
history = model.fit(
    x_train,
    y_train,
    epochs=3,
    batch_size=32,
    validation_data=(x_val, y_val),
    callbacks=[es_callback, modelckpt_callback],
    shuffle=False,
    verbose=2,
)
model.load_weights(path_checkpoint)
forecast = model.predict(x_val, verbose=0)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history, outputs=[forecast])
