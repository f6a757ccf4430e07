"""Where the tests find the repository, their helpers and their data, wherever a test module sits."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
HELPERS = os.path.join(TESTS, "helpers")
DATA = os.path.join(TESTS, "data")
