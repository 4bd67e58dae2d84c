"""The floor every other layer stands on: validation, knobs, process state, upstream names,
atomic writes. A package of its own, so that an installed tfdist (not only an editable one)
holds it."""
