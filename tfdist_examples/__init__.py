"""The MNIST walkthrough ``tfdist train mnist`` runs: the job and its training recipes.

An application of tfdist, installed beside it and kept apart from its layers: only the
``tfdist train`` command imports it (tests/project/test_structure.py checks).

Example:
    >>> from tfdist_examples import recipes
    >>> recipes.get_recipe("fast").epochs
    7
"""
