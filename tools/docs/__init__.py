"""The generators of the blocks in docs/ and README.md that come from measured results
(tools/results/) or from the code. Run them from the repository root."""
