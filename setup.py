"""Builds tfdist; its dependencies come from the one version range it declares.

``tfdist/core/versions.py`` ``VERIFIED`` names the oldest and newest release of TensorFlow,
Keras and jax that tfdist's fixes were verified on. The same range drives the fixes'
guards and ``tfdist info``; here it gives the requirements: at least the oldest verified
release, below the next major one (outside the verified range tfdist still runs, its
fixes stepping aside where upstream code changed). The rest of the metadata is in
setup.cfg.
"""

import ast
from pathlib import Path

from setuptools import setup


def verified() -> dict:
    """``VERIFIED`` read from tfdist/core/versions.py without importing tfdist."""
    tree = ast.parse(Path(__file__).with_name("tfdist").joinpath("core", "versions.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "VERIFIED":
            return ast.literal_eval(node.value)
    raise RuntimeError("setup.py: tfdist/core/versions.py defines no VERIFIED")


def requirement(package: str, extra: str = "") -> str:
    oldest, _ = VERIFIED[package]
    major = int(oldest.split(".")[0])
    return f"{package}{extra}>={oldest},<{major + 1}"


VERIFIED = verified()

setup(
    install_requires=[
        requirement("tensorflow"),
        requirement("keras"),
        "tensorflow-datasets>=4.9",
        # tensorflow-datasets 4.9 imports importlib_resources without declaring it.
        "importlib_resources",
        "numpy",
        # TensorFlow 2.21 no longer pulls TensorBoard in; tfdist.callbacks.standard logs to it.
        "tensorboard",
        # tfdist train mnist draws its loss/accuracy curves to a PNG.
        "matplotlib",
    ],
    extras_require={
        # Keras 3 on JAX (KERAS_BACKEND=jax), on CPU; jax 0.11+ needs Python 3.12+. Orbax
        # writes the sharded checkpoints (tfdist.callbacks.checkpoint(..., sharded=True)).
        "jax": [requirement("jax", "[cpu]"), "orbax-checkpoint>=0.12"],
        # Open and run the walkthrough notebooks: `jupyter lab notebooks/`.
        "notebooks": ["jupyterlab", "nbconvert", "ipykernel", "nbclient", "nbformat"],
        # The manual in docs/ as a site: `mkdocs serve` (mkdocs.yml; CI builds it --strict).
        # mkdocstrings renders docs/reference/api.md from the docstrings.
        "docs": ["mkdocs>=1.6,<2", "mkdocstrings[python]>=0.29"],
        # Checkpoint directories and save/load paths as URLs (tfdist.core.storage); add gcsfs
        # for gs://, s3fs for s3://.
        "remote": ["fsspec>=2023.1"],
        # Ray Train (docs/ray.md): TensorflowTrainer and JaxTrainer run
        # tfdist scripts. Not in the test extra: .ci/run installs it in a stage of its own
        # for tests/e2e/test_ray.py (docs/testing.md, "What runs where").
        "ray": ["ray[train]>=2.60,<3"],
        "test": [
            "tfdist[jax,notebooks,docs,remote]",
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",
            "ruff",
            "mypy>=1.10,<2",  # tests/project/test_structure.py type-checks tfdist/
            "keras-hub",
            "pyyaml",  # tests/e2e/test_kubernetes.py reads the manifests in docs/k8s/
            # A real S3 API on 127.0.0.1 (moto's server) and the s3:// filesystem, for
            # tests/checkpoint/test_object_store.py (tests/object_store.py starts the server).
            "moto[server]>=5",
            "s3fs>=2024.3",  # before 2024 (0.4: no aiobotocore) it fails on botocore's Session
        ],
        # The sessions that test other release pairs of the verified range (noxfile.py).
        "dev": ["tfdist[test]", "nox"],
    },
)
