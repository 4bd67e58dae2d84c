"""The MNIST walkthrough used by ``tfdist train mnist``: recipes (model, optimizer, schedule).

Example:
    >>> from tfdist.examples import recipes  # doctest: +SKIP
    >>> recipes.get_recipe("fast").epochs      # doctest: +SKIP
    6
"""
