"""Test configuration: every test runs on the torch backend."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "1")
