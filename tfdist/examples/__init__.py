"""The MNIST walkthrough used by ``tfdist train mnist``: the job and its training recipes.

Example:
    >>> from tfdist.examples import recipes
    >>> recipes.get_recipe("fast").epochs
    7
"""
