# Flower's examples/quickstart-pytorch (https://github.com/adap/flower, Apache-2.0,
# Copyright Flower Labs GmbH), reproduced unchanged for tests/flower/test_flower_quickstart.py.
"""pytorchexample."""
