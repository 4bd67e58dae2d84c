"""The benchmarks: tfdist against raw TensorFlow and Keras, measured side by side.

``python -m tools.bench`` runs the table of rows (tools/bench/suite.py); each module here
measures one row or one experiment and also runs alone (``python -m tools.bench.<module>``).
Run them from the repository root. Their figures go to tools/results/.
"""
