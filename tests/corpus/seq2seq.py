"""Character-level sequence to sequence: a two-input LSTM encoder/decoder, saved and reloaded.

The shape of Keras's "Character-level recurrent sequence-to-sequence model" example:
one-hot encoder and decoder sequences are the model's two inputs, the encoder LSTM's
final states start the decoder LSTM, a softmax Dense predicts the next character
(teacher forcing), ``model.save`` writes the model and ``keras.models.load_model`` reads
it back for inference. Random "sentences" over small alphabets stand in for the pairs.
"""

import keras
import numpy as np

keras.utils.set_random_seed(19)
rng = np.random.default_rng(19)
num_samples, latent_dim = 250, 32
num_encoder_tokens, num_decoder_tokens = 12, 14
max_encoder_seq_length, max_decoder_seq_length = 10, 12

encoder_input_data = np.zeros((num_samples, max_encoder_seq_length, num_encoder_tokens), "float32")
decoder_input_data = np.zeros((num_samples, max_decoder_seq_length, num_decoder_tokens), "float32")
decoder_target_data = np.zeros((num_samples, max_decoder_seq_length, num_decoder_tokens), "float32")
for i in range(num_samples):
    source = rng.integers(0, num_encoder_tokens, max_encoder_seq_length)
    encoder_input_data[i, np.arange(max_encoder_seq_length), source] = 1.0
    target = np.concatenate([[0], source[: max_decoder_seq_length - 3] + 2, [1, 1]])
    decoder_input_data[i, np.arange(max_decoder_seq_length), target] = 1.0
    decoder_target_data[i, np.arange(max_decoder_seq_length - 1), target[1:]] = 1.0

encoder_inputs = keras.Input(shape=(None, num_encoder_tokens))
encoder = keras.layers.LSTM(latent_dim, return_state=True)
encoder_outputs, state_h, state_c = encoder(encoder_inputs)
encoder_states = [state_h, state_c]

decoder_inputs = keras.Input(shape=(None, num_decoder_tokens))
decoder_lstm = keras.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
decoder_dense = keras.layers.Dense(num_decoder_tokens, activation="softmax")
decoder_outputs = decoder_dense(decoder_outputs)

model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
history = model.fit(
    [encoder_input_data, decoder_input_data],
    decoder_target_data,
    batch_size=32,
    epochs=2,
    shuffle=False,
    verbose=2,
)
model.save("s2s_model.keras")

model = keras.models.load_model("s2s_model.keras")
decoded = model.predict([encoder_input_data[:66], decoder_input_data[:66]], verbose=0)

if __name__ == "__main__":
    import record

    record.save(__file__, model, history, outputs=[decoded])
