"""Run the Python blocks of the given Markdown pages as a reader would, in this directory: each
page's blocks in order in one namespace, blocks that open with ``# fragment`` skipped; one line
``page: ok`` or ``page:line: failed: <error>`` (then its traceback) per page; the exit status is
the number of pages that failed. A process of its own, so that the blocks' relative paths mean
this directory to Python and to Spark's JVM alike."""
import re
import sys
import traceback

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FRAGMENT = "# fragment"


def python_blocks(path):
    """(line, code) of each ```python block of the page at ``path``."""
    text = open(path).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def run_page(path, name):
    namespace = {"__name__": "__main__"}
    for line, code in python_blocks(path):
        if code.lstrip().startswith(FRAGMENT):
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - reported per page
            print(f"{name}:{line}: failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            return False
    print(f"{name}: ok", flush=True)
    return True


if __name__ == "__main__":
    root, pages = sys.argv[1], sys.argv[2:]
    failed = sum(not run_page(f"{root}/{page}", page) for page in pages)
    sys.exit(failed)
