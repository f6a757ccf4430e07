"""A rank says where its sparkring comes from (tests/integration/test_standalone.py)."""
import sparkring
import sparkring.collective as sr

sr.init()
print(f"rank {sr.rank()} of {sr.size()}: sparkring at {sparkring.__file__}", flush=True)
sr.shutdown()
