"""The MNIST recipes: models, the guides' decay, linear scaling + warm-up, serialisation.

No training here: the recipes' accuracy and speed are measured by tools/bench/recipes.py.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.core import upstream
from tfdist_examples import recipes
from tfdist_examples.recipes import get_recipe, peak_learning_rate, scaled_warmup_cosine_decay

from conftest import equivalence

CosineDecay = keras.optimizers.schedules.CosineDecay

BASE = recipes.FAST.base_learning_rate


def _lr(schedule, step) -> float:
    return float(schedule(step))


def _schedule_of(optimizer):
    # The schedule object itself; ``optimizer.learning_rate`` is its value now.
    return upstream.keras_optimizer_learning_rate(optimizer)


# --- models ------------------------------------------------------------------------


def test_tutorial_model_is_the_guides_convnet():
    model = recipes.tutorial_model()
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
    conv, _, _, hidden, out = model.layers
    assert (conv.filters, conv.kernel_size, conv.activation.__name__) == (32, (3, 3), "relu")
    assert (hidden.units, hidden.activation.__name__) == (64, "relu")
    assert (out.units, out.activation.__name__) == (10, "linear")  # logits
    # 3*3*32+32 + (13*13*32)*64+64 + 64*10+10
    assert model.count_params() == 320 + 346_176 + 650


def test_fast_recipe_is_what_the_docs_say():
    # docs/mnist.md, literally: Conv2D(16) + MaxPooling + Conv2D(32) + MaxPooling +
    # Dense(128) + Dense(10), Adam, 7 epochs, 128 per replica, peak 5e-3 x global / 128,
    # shifts of up to 2 pixels.
    model = recipes.fast_model()
    described = [
        (type(layer).__name__, getattr(layer, "filters", None) or getattr(layer, "units", None))
        for layer in model.layers
    ]
    assert described == [
        ("Conv2D", 16), ("MaxPooling2D", None), ("Conv2D", 32), ("MaxPooling2D", None),
        ("Flatten", None), ("Dense", 128), ("Dense", 10),
    ]  # fmt: skip
    fast = recipes.get_recipe("fast")
    assert (fast.epochs, fast.per_replica_batch) == (7, 128)
    assert fast.augment is recipes.shift_augment and recipes.MAX_SHIFT == 2
    assert (fast.base_learning_rate, fast.reference_batch) == (5e-3, 128)
    assert (fast.warmup_epochs, fast.min_warmup_steps) == (0.5, 100)


def test_shifts_move_each_image_by_at_most_two_pixels_and_depend_on_the_batch_only():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(16, 28, 28, 1))
    images = tf.constant(raw / 255.0, tf.float32)
    labels = tf.constant(rng.integers(0, 10, size=16))
    shifted, same_labels = recipes.shift_augment(images, labels)
    assert np.array_equal(same_labels.numpy(), labels.numpy())
    padded = np.pad(raw[..., 0] / 255.0, ((0, 0), (2, 2), (2, 2)))
    moves = set()
    for i in range(16):  # each output is the padded input cropped at one offset
        found = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if np.allclose(padded[i, dy : dy + 28, dx : dx + 28], shifted[i, ..., 0].numpy())
        ]
        assert len(found) == 1, i
        moves.add(found[0])
    assert len(moves) > 3  # the offsets vary across images
    # A pure function of the batch: the same batch again (another replica count, a
    # resume), the same shifts; another batch, other shifts.
    again, _ = recipes.shift_augment(images, labels)
    assert np.array_equal(again.numpy(), shifted.numpy())
    other, _ = recipes.shift_augment(images, tf.roll(labels, 1, axis=0))
    assert not np.array_equal(other.numpy(), shifted.numpy())


def test_fast_model_has_no_per_replica_statistics_or_unsaved_randomness():
    # BatchNormalization would normalise each replica's slice separately (N replicas would
    # not train the 1-device model); Dropout's seed state is not in .weights.h5 checkpoints.
    kinds = {type(layer).__name__ for layer in recipes.fast_model().layers}
    assert kinds == {"Conv2D", "MaxPooling2D", "Flatten", "Dense"}
    assert recipes.fast_model().layers[-1].activation.__name__ == "linear"


@pytest.mark.parametrize("name", ["tutorial", "fast"])
def test_models_map_mnist_batches_to_ten_logits(name):
    model = get_recipe(name).build_model()
    logits = model(np.zeros((3, 28, 28, 1), "float32"))
    assert tuple(logits.shape) == (3, 10)
    # A new, independently initialised model on every call (make_or_restore relies on it).
    assert model is not get_recipe(name).build_model()


# --- the tutorial recipe -------------------------------------------------------------


@pytest.mark.parametrize(
    "epoch, lr", [(0, 1e-3), (2, 1e-3), (3, 1e-4), (6, 1e-4), (7, 1e-5), (11, 1e-5), (50, 1e-5)]
)
def test_tutorial_decay_at_epoch_boundaries(epoch, lr):
    assert recipes.tutorial_decay(epoch) == lr


def test_tutorial_recipe_is_the_guides_walkthrough():
    r = get_recipe("tutorial")
    assert (r.epochs, r.per_replica_batch, r.epoch_decay) == (12, 64, recipes.tutorial_decay)
    assert [r.global_batch(n) for n in (1, 2, 4)] == [64, 128, 256]
    # As in the guides, the rate does not grow with the replicas; the callback decays it.
    assert r.learning_rate(4, steps_per_epoch=235) == 1e-3
    assert r.steps_per_epoch(1) == 938  # ceil(60000 / 64)


def test_tutorial_decay_callback_sets_the_decayed_rate_on_the_recipe_optimizer():
    # What the job does: tfdist.callbacks.standard(..., decay=recipe.epoch_decay).
    r = get_recipe("tutorial")
    model = r.build_and_compile(1, steps_per_epoch=938)
    callback = tfdist.callbacks.decay(r.epoch_decay)
    callback.set_model(model)
    for epoch, want in [(0, 1e-3), (3, 1e-4), (7, 1e-5)]:
        callback.on_epoch_begin(epoch)
        assert math.isclose(float(model.optimizer.learning_rate), want, rel_tol=1e-6)
    loss = model.loss
    assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
    assert loss.get_config()["from_logits"] is True


# --- the fast recipe: linear scaling + warm-up ----------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_fast_schedule_scales_linearly_with_a_linear_warmup(replicas):
    r = get_recipe("fast")
    steps = r.steps_per_epoch(replicas)
    s = r.learning_rate(replicas, steps_per_epoch=steps)
    assert type(s) is CosineDecay  # Keras' own class: loads without tfdist
    peak = BASE * replicas * r.per_replica_batch / r.reference_batch
    warm = s.warmup_steps
    assert warm == max(round(r.warmup_epochs * steps), r.min_warmup_steps) > 0
    assert warm + s.decay_steps == r.epochs * steps  # the schedule spans the whole run
    assert math.isclose(peak_learning_rate(s), peak)
    assert _lr(s, 0) == 0.0
    assert math.isclose(_lr(s, warm), peak, rel_tol=1e-5)
    assert _lr(s, r.epochs * steps) == pytest.approx(0.0, abs=1e-9)
    assert _lr(s, 10 * r.epochs * steps) == pytest.approx(0.0, abs=1e-9)  # stays at the end

    def expected(step):  # linear 0 -> peak, then half a cosine peak -> 0
        if step < warm:
            return peak * step / warm
        done = min(step - warm, s.decay_steps) / s.decay_steps
        return peak * 0.5 * (1 + math.cos(math.pi * done))

    for step in (1, warm // 2, warm - 1, warm + 1, warm + s.decay_steps // 2, 3 * steps):
        assert math.isclose(_lr(s, step), expected(step), rel_tol=1e-4), step


def test_warmup_lasts_at_least_min_warmup_steps_but_leaves_steps_to_decay():
    r = get_recipe("fast")
    many = r.learning_rate(8, steps_per_epoch=r.steps_per_epoch(8))  # 59 steps an epoch
    assert round(r.warmup_epochs * r.steps_per_epoch(8)) < r.min_warmup_steps
    assert many.warmup_steps == r.min_warmup_steps
    assert math.isclose(_lr(many, r.min_warmup_steps), 8 * BASE, rel_tol=1e-5)
    few = r.learning_rate(1, steps_per_epoch=20)  # a short smoke run: 7 x 20 steps
    assert (few.warmup_steps, few.decay_steps) == (70, 70)  # at most half the run
    tiny = get_recipe("fast", epochs=1).learning_rate(1, steps_per_epoch=1)
    assert (tiny.warmup_steps, tiny.decay_steps) == (0, 1)


def test_fast_schedule_scales_with_the_global_batch_not_the_replica_count():
    r = get_recipe("fast", per_replica_batch=2 * recipes.FAST.per_replica_batch)
    s = r.learning_rate(1, steps_per_epoch=r.steps_per_epoch(1))
    assert math.isclose(peak_learning_rate(s), 2 * BASE)


def test_schedule_without_warmup_starts_at_the_scaled_peak():
    s = scaled_warmup_cosine_decay(
        1e-3, global_batch=512, reference_batch=128, warmup_steps=0, decay_steps=100
    )
    assert math.isclose(_lr(s, 0), 4e-3, rel_tol=1e-6)
    assert math.isclose(_lr(s, 50), 2e-3, rel_tol=1e-5)


def test_optimizer_rate_follows_its_iterations_so_a_restore_resumes_exactly():
    r = get_recipe("fast")
    opt = r.optimizer(2, steps_per_epoch=100)
    schedule = _schedule_of(opt)
    for step in (0, 7, 25, 400):
        opt.iterations.assign(step)
        assert math.isclose(float(opt.learning_rate), _lr(schedule, step), rel_tol=1e-6)


# --- serialisation (checkpoints save the optimizer) ----------------------------------


def _fast_schedule(**overrides):
    kwargs = dict(global_batch=384, reference_batch=128, warmup_steps=30, decay_steps=270)
    kwargs.update(overrides)
    return scaled_warmup_cosine_decay(2e-3, **kwargs)


def _same_values(a, b):
    steps = [0, 1, 15, 30, 31, 150, 299, 300, 1000]
    equivalence.assert_allclose([_lr(a, t) for t in steps], [_lr(b, t) for t in steps], rtol=1e-7)


def test_schedule_is_keras_cosine_decay_with_the_scaled_peak_as_warmup_target():
    s = _fast_schedule(alpha=0.1)
    config = s.get_config()
    assert config["warmup_target"] == pytest.approx(2e-3 * 384 / 128)
    assert (config["warmup_steps"], config["decay_steps"], config["alpha"]) == (30, 270, 0.1)
    assert config["initial_learning_rate"] == 0.0
    _same_values(s, CosineDecay.from_config(config))


def test_schedule_round_trips_through_keras_serialization():
    s = _fast_schedule()
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
    assert type(restored) is CosineDecay
    _same_values(s, restored)
    opt = keras.optimizers.Adam(s)
    opt_again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(_schedule_of(opt_again)) is CosineDecay
    _same_values(s, _schedule_of(opt_again))


def test_saved_model_restores_the_schedule_and_its_step(tmp_path):
    r = get_recipe("fast")
    model = r.build_and_compile(2, steps_per_epoch=50)
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(37)
    path = tmp_path / "fast.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations) == 37
    assert type(_schedule_of(loaded.optimizer)) is CosineDecay
    assert _schedule_of(loaded.optimizer).get_config() == _schedule_of(model.optimizer).get_config()
    assert math.isclose(
        float(loaded.optimizer.learning_rate), float(model.optimizer.learning_rate), rel_tol=1e-7
    )


# --- input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tutorial", "fast"])
def test_maps_scale_uint8_pixels_to_unit_floats(name):
    r = get_recipe(name)
    images = tf.constant(np.arange(256, dtype="uint8").reshape(1, 16, 16, 1))
    labels = tf.constant([4])
    for fn in (r.train_map, r.eval_map):
        x, y = fn(images, labels)
        assert x.dtype == tf.float32 and x.shape == images.shape
        assert float(tf.reduce_min(x)) == 0.0 and float(tf.reduce_max(x)) == 1.0
        assert int(y[0]) == 4


def test_augment_applies_to_training_batches_only():
    r = get_recipe("tutorial", augment=lambda x, y: (1.0 - x, y))
    images, labels = tf.zeros([2, 28, 28, 1], tf.uint8), tf.constant([1, 2])
    assert float(tf.reduce_min(r.train_map(images, labels)[0])) == 1.0
    assert float(tf.reduce_max(r.eval_map(images, labels)[0])) == 0.0


# --- validation ----------------------------------------------------------------------


def test_recipe_names_and_default():
    assert recipes.recipe_names() == ["fast", "tutorial"]
    assert get_recipe() is recipes.FAST


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: get_recipe("big"),
            r"name must be one of \('fast', 'tutorial'\)\. Received: name='big'",
        ),
        (lambda: get_recipe("fast", epoch=3), r"unknown recipe field\(s\) \['epoch'\]"),
        (
            lambda: get_recipe("fast", epochs=0),
            r"epochs must be a positive int\. Received: epochs=0",
        ),
        (
            lambda: get_recipe("fast", base_learning_rate=-1.0),
            r"Received: base_learning_rate=-1\.0",
        ),
        (lambda: get_recipe("fast", base_learning_rate=float("nan")), r"base_learning_rate=nan"),
        (lambda: get_recipe("fast", warmup_epochs=-0.5), r"Received: warmup_epochs=-0\.5"),
        (lambda: get_recipe("fast", min_warmup_steps=-1), r"Received: min_warmup_steps=-1"),
        (
            lambda: get_recipe("fast", epoch_decay=recipes.tutorial_decay),
            r"either epoch_decay .* or reference_batch",
        ),
        (
            lambda: get_recipe("fast").global_batch(0),
            r"num_replicas must be a positive int\. Received: num_replicas=0",
        ),
        (
            lambda: get_recipe("fast").learning_rate(2, steps_per_epoch=0),
            r"steps_per_epoch must be a positive int\. Received: steps_per_epoch=0",
        ),
        (
            lambda: get_recipe("fast").steps_per_epoch(1, num_examples=-5),
            r"Received: num_examples=-5",
        ),
        (lambda: recipes.tutorial_decay(-1), r"epoch must be an int >= 0\. Received: epoch=-1"),
        (lambda: _fast_schedule(global_batch=0), r"Received: global_batch=0"),
        (lambda: _fast_schedule(warmup_steps=-1), r"Received: warmup_steps=-1"),
        (lambda: _fast_schedule(decay_steps=0), r"Received: decay_steps=0"),
        (lambda: _fast_schedule(alpha=1.5), r"alpha must be in \[0, 1\]\. Received: alpha=1\.5"),
        (
            lambda: scaled_warmup_cosine_decay(
                0, global_batch=128, reference_batch=128, warmup_steps=0, decay_steps=1
            ),
            r"base_learning_rate must be a finite number > 0.0\. Received: base_learning_rate=0",
        ),
    ],
)
def test_invalid_arguments_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_recipe("fast", per_replica_batch=2.5), r"Received: per_replica_batch=2\.5"),
        (lambda: get_recipe("fast", build_model="cnn"), r"build_model must be callable"),
        (lambda: get_recipe("fast").global_batch(True), r"Received: num_replicas=True"),
        (lambda: _fast_schedule(reference_batch=None), r"Received: reference_batch=None"),
    ],
)
def test_arguments_of_the_wrong_type_raise_type_errors(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipes.FAST.epochs = 1


# --- the benchmark's bookkeeping (tools/bench/recipes.py) ------------------------------


def _bench():
    from tools.bench import recipes

    return recipes


def test_benchmark_interleaves_recipes_in_counterbalanced_rounds():
    order = _bench().run_order(["tutorial", "fast"], 4)
    assert [name[0] for _, name in order] == list("tffttfft")
    assert [i for i, _ in order] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_benchmark_ratio_pairs_runs_of_the_same_round():
    runs = [
        {"recipe": "tutorial", "seed": 0, "round": 0, "train_s": 100.0, "test_accuracy": 0.986},
        {"recipe": "fast", "seed": 0, "round": 0, "train_s": 50.0, "test_accuracy": 0.993},
        {"recipe": "fast", "seed": 0, "round": 1, "train_s": 90.0, "test_accuracy": 0.989},
        {"recipe": "tutorial", "seed": 0, "round": 1, "train_s": 200.0, "test_accuracy": 0.987},
    ]
    s = _bench().summarize(runs)
    assert s["ratios_by_round"] == [0.5, 0.45]  # not 0.47 (=140/150): a slow round pairs up
    assert s["ratio_fast_over_tutorial"] == 0.475
    assert s["recipes"]["fast"]["all_reach_0.99"] is False
    assert s["recipes"]["fast"]["test_accuracy_min"] == 0.989
    assert s["recipes"]["tutorial"]["train_s_mean"] == 150.0


def test_benchmark_rejects_bad_arguments_before_starting_anything():
    bench = _bench()
    with pytest.raises(ValueError, match=r"recipes must be .* Received: recipes='fast'"):
        bench.benchmark(recipes="fast")
    with pytest.raises(ValueError, match=r"seeds must be .* Received: seeds=\[\]"):
        bench.benchmark(seeds=[])
    with pytest.raises(ValueError, match=r"timeout_s must be a positive number"):
        bench.benchmark(timeout_s=0)


def test_recipe_seeds_summary_flags_any_run_below_the_goal_and_renders_every_seed():
    from tools.bench import recipe_seeds

    def run(seed, topology, accuracy, seconds, recipe="fast"):
        return {"recipe": recipe, "seed": seed, "topology": topology,
                "test_accuracy": accuracy, "wall_time_s": seconds}  # fmt: skip

    runs = [
        run(0, "1 device", 0.9935, 40.0), run(0, "2 devices", 0.9931, 60.0),
        run(1, "1 device", 0.9940, 50.0), run(1, "2 devices", 0.9929, 70.0),
        run(0, "1 device", 0.9866, 100.0, recipe="tutorial"),
    ]  # fmt: skip
    summary = recipe_seeds.summarise(runs)
    assert summary["fast_accuracy_min"] == 0.9929 and summary["all_reach_goal"] is False
    assert summary["time_ratio"] == 0.45  # median(40, 50) / 100
    lines = recipe_seeds.table({**summary, "runs": runs})
    assert "| 1 | 99.40% in 50 s | 99.29% in 70 s |" in lines
    assert any("not met" in line for line in lines)
    assert recipe_seeds.summarise(runs[:4])["time_ratio"] is None
    with pytest.raises(ValueError, match=r"Received: seeds=\[\]"):
        recipe_seeds.measure([], [0])
