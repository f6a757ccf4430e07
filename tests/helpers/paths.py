"""Where the tests find the repository, their helpers and their data, wherever a test module sits."""
import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
