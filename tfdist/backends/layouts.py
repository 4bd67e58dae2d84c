"""Where a model's weights live: LayoutMap keys checked, layouts shown, memory estimated.

- ``ModelParallel``: Keras's ``keras.distribution.ModelParallel`` that remembers the variable
  (and layer output) paths it was asked about, so that ``tfdist.scope(layout_map=...)`` can
  refuse a ``LayoutMap`` key that matches nothing: upstream silently replicates the weights
  a typo'd key meant to shard (found later as an out-of-memory on the accelerators).
- ``describe(model)``: each variable's path, shape, dtype, layout and bytes per device.
- ``estimate_memory(model_or_builder, mesh=, layout_map=, optimizer=)``: parameters,
  optimizer state and gradients per device, before anything is allocated.

Example:
    >>> print(tfdist.describe(model))                             # doctest: +SKIP
    >>> tfdist.estimate_memory(build, layout_map=layout).fits(16 * 2**30)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
from collections.abc import Callable, Mapping

import keras
from keras import distribution as kd

from tfdist import backends
from tfdist.core import validate

__all__ = ["ModelParallel", "describe", "estimate_memory", "Report", "MemoryEstimate"]

logger = logging.getLogger(__name__)

MiB = 2**20
REPLICATED_WARNING_BYTES = 64 * MiB
_OPT_OUT = "tfdist.scope(layout_map=..., allow_unmatched_keys=True)"


def _matches(key: str, path: str) -> bool:
    """Keras's own rule (``LayoutMap.__getitem__``): the key itself, or a full regex match."""
    if key == path:
        return True
    try:
        return re.fullmatch(key, path) is not None
    except re.error:
        return False


def unmatched_keys(keys, paths) -> list[str]:
    """The keys of ``keys`` that match none of ``paths``.

    Example:
        >>> unmatched_keys(["dense.*kernel", "dense_one/kernal"], ["dense_one/kernel"])
        ['dense_one/kernal']
    """
    paths = list(paths)
    return [key for key in keys if not any(_matches(key, p) for p in paths)]


def _unmatched_message(missing: list[str], keys, paths) -> str:
    variables = sorted(p for p in paths if not p.endswith("/output"))
    lines = []
    for key in missing:
        near = difflib.get_close_matches(key, variables, n=3, cutoff=0.0)
        lines.append(f"  {key!r}: nearest variable paths {near}")
    return (
        f"tfdist.scope: {len(missing)} LayoutMap key(s) match no variable built under "
        "this ModelParallel, so the weights they meant to shard are replicated on every "
        "device:\n" + "\n".join(lines) + "\nKeys are regexes matched in full against "
        "variable.path (e.g. 'dense_1/kernel' or '.*dense.*kernel'). Received: "
        f"layout_map keys={list(keys)}. Fix the key, or, for keys meant for other models, "
        f"pass {_OPT_OUT}."
    )


class ModelParallel(kd.ModelParallel):
    """``keras.distribution.ModelParallel`` that refuses LayoutMap keys matching nothing.

    ``check_keys()`` runs when ``tfdist.scope`` exits after trainable variables were
    built inside it, else at the first batch ``fit``/``evaluate``/``predict`` places
    after a build.

    Example:
        >>> dist = ModelParallel(layout_map=layout, batch_dim_name="batch")  # doctest: +SKIP
    """

    def __init__(self, *args, allow_unmatched_keys: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_unmatched_keys = allow_unmatched_keys
        self.queried_paths: set[str] = set()
        self.variables_seen = 0
        self.keys_checked = allow_unmatched_keys

    def get_variable_layout(self, variable):
        self.queried_paths.add(variable.path)
        # Weights, not the metric trackers `compile` makes: a model compiled in the scope
        # but built by fit has nothing to check yet.
        self.variables_seen += bool(variable.trainable)
        return super().get_variable_layout(variable)

    def get_tensor_layout(self, path):
        self.queried_paths.add(path)  # keys may name layer outputs ("dense/output")
        return super().get_tensor_layout(path)

    def get_data_layout(self, data_shape):
        if not self.keys_checked and self.variables_seen:
            self.check_keys()  # a model built at fit, after the scope
        return super().get_data_layout(data_shape)

    def check_keys(self) -> None:
        """Raises ValueError naming every key that matched no path asked about so far."""
        self.keys_checked = True
        keys = list(self._layout_map)  # LayoutMap is a Mapping: its keys are public
        missing = unmatched_keys(keys, self.queried_paths)
        if missing and not self.allow_unmatched_keys:
            raise ValueError(_unmatched_message(missing, keys, self.queried_paths))

    def check_at_scope_exit(self) -> None:
        """The check, when the scope built something; otherwise it waits for ``fit``."""
        if not self.keys_checked and self.variables_seen:
            self.check_keys()


# ---- bytes and layouts ----------------------------------------------------------------


def itemsize(dtype) -> int:
    """Bytes of one element of a Keras dtype name (``bfloat16`` -> 2, ``bool`` -> 1)."""
    name = keras.backend.standardize_dtype(dtype)
    if name == "bool":
        return 1
    bits = re.search(r"(\d+)", name)
    return max(1, int(bits.group(1)) // 8) if bits else 4


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_bytes(shape, dtype, spec, axis_sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of a ``shape`` array split by ``spec`` over a mesh.

    Example:
        >>> shard_bytes((8, 16), "float32", (None, "model"), {"batch": 2, "model": 2})
        256
    """
    spec = tuple(spec or ())
    elements = 1
    for index, size in enumerate(shape):
        entry = spec[index] if index < len(spec) else None
        parts = math.prod(axis_sizes[a] for a in _spec_axes(entry))
        elements *= math.ceil(int(size) / parts)
    return elements * itemsize(dtype)


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


# ---- describe ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
    """``describe``'s result: ``rows`` (one dict per variable) and ``text``."""

    rows: list
    text: str
    warnings: list

    def __str__(self) -> str:
        return self.text


def _jax_layout(variable) -> tuple[str, int, int]:
    """(layout, bytes on one device, devices) of a JAX-backed variable."""
    sharding = getattr(variable.value, "sharding", None)
    shape = tuple(variable.shape)
    full = math.prod(shape) * itemsize(variable.dtype)
    if sharding is None:
        return "single device", full, 1
    per_device = math.prod(sharding.shard_shape(shape)) * itemsize(variable.dtype)
    spec = getattr(sharding, "spec", None)
    layout = f"PartitionSpec{tuple(spec)}" if spec is not None else type(sharding).__name__
    return layout, per_device, len(sharding.device_set)


def _tf_layout(variable, replicas: int) -> tuple[str, int, int]:
    full = math.prod(tuple(variable.shape)) * itemsize(variable.dtype)
    layout = f"mirrored x{replicas}" if replicas > 1 else "single device"
    return layout, full, replicas


def _row(variable, replicas: int) -> dict:
    if backends.name() == "jax":
        layout, per_device, devices = _jax_layout(variable)
    else:
        layout, per_device, devices = _tf_layout(variable, replicas)
    full = math.prod(tuple(variable.shape)) * itemsize(variable.dtype)
    return {
        "path": variable.path,
        "shape": tuple(int(s) for s in variable.shape),
        "dtype": keras.backend.standardize_dtype(variable.dtype),
        "layout": layout,
        "devices": devices,
        "bytes": full,
        "bytes_per_device": per_device,
        "replicated": devices > 1 and per_device == full,
        "trainable": bool(variable.trainable),
    }


def _report_text(rows: list, warnings: list, largest: int) -> str:
    width = max([len(r["path"]) for r in rows] + [4])
    lines = [f"{'path':<{width}}  {'shape':<16} {'dtype':<9} {'layout':<34} per device"]
    for r in rows:
        lines.append(
            f"{r['path']:<{width}}  {str(r['shape']):<16} {r['dtype']:<9} "
            f"{r['layout']:<34} {_fmt(r['bytes_per_device'])}"
        )
    total = sum(r["bytes_per_device"] for r in rows)
    lines.append(f"total per device: {_fmt(total)} ({len(rows)} variables)")
    replicated = sorted((r for r in rows if r["replicated"]), key=lambda r: -r["bytes"])
    if replicated:
        top = ", ".join(f"{r['path']} ({_fmt(r['bytes'])})" for r in replicated[:largest])
        lines.append(f"largest replicated: {top}")
    return "\n".join(lines + [f"WARNING: {w}" for w in warnings])


def describe(
    model=None, *, replicated_warning_bytes: int | None = REPLICATED_WARNING_BYTES, largest: int = 5
) -> Report:
    """Each variable of ``model``: path, shape, dtype, layout and bytes on one device.

    On JAX the layout is the variable's sharding (a ``PartitionSpec`` over the mesh); on
    TensorFlow a mirrored variable is whole on each of the strategy's replicas. A
    replicated variable over ``replicated_warning_bytes`` (None: never) is warned about.

    Example:
        >>> print(tfdist.describe(model))  # doctest: +SKIP
    """
    validate.instance(
        model,
        keras.Model,
        "model",
        "describe",
        "a keras.Model",
        "For the devices and distribution this process sees, run `tfdist info`.",
    )
    validate.positive_int(largest, "largest", "describe")
    if replicated_warning_bytes is not None:
        validate.non_negative_int(replicated_warning_bytes, "replicated_warning_bytes", "describe")
    strategy = getattr(model, "distribute_strategy", None)
    replicas = int(getattr(strategy, "num_replicas_in_sync", 1) or 1)
    rows = [_row(v, replicas) for v in model.variables]
    hint = (
        "shard it with a LayoutMap key (tfdist.scope(layout_map=...)) if memory is tight"
        if backends.name() == "jax"
        else "TensorFlow mirrors every variable: to shard it, run on KERAS_BACKEND=jax "
        "with tfdist.scope(layout_map=...)"
    )
    warnings = [
        f"{r['path']} is replicated on {r['devices']} devices ({_fmt(r['bytes'])} on each); {hint}."
        for r in rows
        if r["replicated"]
        and replicated_warning_bytes is not None
        and r["bytes"] > replicated_warning_bytes
    ]
    for warning in warnings:
        logger.warning("tfdist.describe: %s", warning)
    return Report(rows=rows, text=_report_text(rows, warnings, largest), warnings=warnings)


# ---- estimate_memory --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (the busiest one): parameters, optimizer state and gradients."""

    parameters: int
    optimizer_state: int
    gradients: int
    mesh: dict
    optimizer: str
    slots_per_weight: int
    abstract: bool

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_state + self.gradients

    def fits(self, device_bytes: int) -> bool:
        """Whether ``total`` fits in ``device_bytes`` (activations are not counted)."""
        validate.positive_int(device_bytes, "device_bytes", "MemoryEstimate.fits")
        return self.total <= device_bytes

    def __str__(self) -> str:
        return (
            f"per device on mesh {self.mesh}: parameters {_fmt(self.parameters)}, "
            f"optimizer state {_fmt(self.optimizer_state)} ({self.optimizer}, "
            f"{self.slots_per_weight} per weight), gradients {_fmt(self.gradients)}; "
            f"total {_fmt(self.total)} (activations not included)"
        )


def _axis_sizes(mesh, layout_map) -> dict:
    if mesh is None and isinstance(layout_map, kd.LayoutMap):
        mesh = layout_map.device_mesh
    if mesh is None:
        return {}
    if isinstance(mesh, kd.DeviceMesh):
        return dict(zip(mesh.axis_names, (int(s) for s in mesh.shape), strict=True))
    validate.instance(
        mesh,
        Mapping,
        "mesh",
        "estimate_memory",
        "a keras.distribution.DeviceMesh or a dict",
        "Pass e.g. mesh={'batch': 2, 'model': 4}.",
    )
    return {
        str(k): validate.positive_int(v, f"mesh[{k!r}]", "estimate_memory") for k, v in mesh.items()
    }


def _spec(path: str, layout_map) -> tuple:
    """The axes ``layout_map`` gives ``path`` (Keras's rule), () when none."""
    if layout_map is None:
        return ()
    if isinstance(layout_map, kd.LayoutMap):
        layout = layout_map[path]
        return tuple(layout.axes) if layout is not None else ()
    hits = [key for key in layout_map if _matches(key, path)]
    if len(hits) > 1:
        raise ValueError(
            f"estimate_memory: path {path!r} matches several layout_map keys {hits}. "
            f"Received: layout_map keys={list(layout_map)}. Make each path match one key."
        )
    return tuple(layout_map[hits[0]]) if hits else ()


class _NoDistribution:
    """Builds with no distribution set: shapes are wanted, not placements."""

    def __enter__(self):
        self.previous = kd.distribution()
        kd.set_distribution(None)

    def __exit__(self, *exc):
        kd.set_distribution(self.previous)


def _model(model_or_builder) -> tuple[keras.Model, bool]:
    """The model and whether it was built abstractly (JAX: ``jax.eval_shape``, no memory)."""
    if isinstance(model_or_builder, keras.Model):
        return model_or_builder, False
    builder = validate.callable_(
        model_or_builder,
        "model_or_builder",
        "estimate_memory",
        "Pass a keras.Model or a function that builds one.",
    )
    box = []
    if backends.name() == "jax":
        import jax

        # Variables hold tracers: shapes and dtypes without an allocated byte.
        jax.eval_shape(lambda: box.append(builder()))
        abstract = True
    else:
        with keras.device("cpu:0"):  # TensorFlow: built for real, on the host
            box.append(builder())
        abstract = False
    return validate.instance(
        box[0], keras.Model, "model_or_builder()", "estimate_memory", "a keras.Model"
    ), abstract


def _optimizer_slots(optimizer, model) -> tuple[str, int, int]:
    """(name, state variables per weight, bytes of its other variables) of ``optimizer``.

    Measured on a probe: a copy of the optimizer built for one (7, 3) weight.
    """
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None) or "adam"
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    validate.instance(
        optimizer,
        keras.optimizers.Optimizer,
        "optimizer",
        "estimate_memory",
        "a keras optimizer or its name",
        "Pass e.g. optimizer='adam'.",
    )
    probe = type(optimizer).from_config(optimizer.get_config())
    weight = keras.Variable(keras.ops.zeros((7, 3)), name="tfdist_probe")
    probe.build([weight])
    slots = [v for v in probe.variables if tuple(v.shape) == (7, 3)]
    other = sum(
        math.prod(tuple(v.shape)) * itemsize(v.dtype)
        for v in probe.variables
        if tuple(v.shape) != (7, 3)
    )
    return type(optimizer).__name__, len(slots), other


def estimate_memory(
    model_or_builder: keras.Model | Callable[[], keras.Model],
    mesh=None,
    layout_map=None,
    optimizer=None,
) -> MemoryEstimate:
    """Parameters, optimizer state and gradients on one device, for a mesh and layout.

    Like ``accelerate estimate-memory``. A builder is built shapes-only on JAX
    (``jax.eval_shape``) and for real on the CPU on TensorFlow. ``mesh`` is a
    ``DeviceMesh`` or ``{"axis": size}`` (default: the layout map's, else one device);
    ``layout_map`` a ``LayoutMap`` or ``{regex: axes}``; ``optimizer`` (default: the
    model's, else Adam) gives the state per weight (Adam 2, SGD with momentum 1).

    Example:
        >>> est = estimate_memory(build, mesh={"batch": 2, "model": 2},
        ...                       layout_map={".*kernel": (None, "model")})  # doctest: +SKIP
        >>> est.fits(16 * 2**30)  # doctest: +SKIP
        True
    """
    if layout_map is not None:
        validate.instance(
            layout_map,
            Mapping,
            "layout_map",
            "estimate_memory",
            "a keras.distribution.LayoutMap or a dict of regex -> axes",
        )
    sizes = _axis_sizes(mesh, layout_map)
    with _NoDistribution():
        model, abstract = _model(model_or_builder)
        name, slots, other = _optimizer_slots(optimizer, model)
    params = grads = 0
    for variable in model.variables:
        spec = _spec(variable.path, layout_map)
        unknown = [a for e in spec for a in _spec_axes(e) if a not in sizes]
        if unknown:
            raise ValueError(
                f"estimate_memory: {variable.path!r} is split over mesh axes {unknown} the "
                f"mesh lacks. Received: mesh={sizes}. Pass the mesh the layout_map was built for."
            )
        nbytes = shard_bytes(variable.shape, variable.dtype, spec, sizes)
        params += nbytes
        grads += nbytes if variable.trainable else 0
    return MemoryEstimate(
        parameters=params,
        optimizer_state=grads * slots + other,
        gradients=grads,
        mesh=sizes or {"devices": 1},
        optimizer=name,
        slots_per_weight=slots,
        abstract=abstract,
    )
