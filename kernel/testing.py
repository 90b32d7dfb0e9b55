"""Pytest helpers for plugin authors, from the ``miles_testing`` library (``pip install miles-testing``)."""
from miles_testing import *  # noqa: F401,F403
