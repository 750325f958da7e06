"""engine.heap.settle: what start-up left alive leaves the collector's walk; cyclic garbage made
afterwards is still collected. Run in a child process: freezing is process-wide."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, weakref
from engine import heap

class Node:
    pass

kept = [Node() for _ in range(1000)]           # start-up objects, alive
for a, b in zip(kept, kept[1:]):
    a.next, b.prev = b, a
dead = Node(); dead.me = dead; gone = weakref.ref(dead); del dead   # start-up garbage, cyclic
frozen = heap.settle()
assert gone() is None, "settle collects before it freezes"
assert frozen >= 1000 and gc.get_freeze_count() == frozen, frozen
assert not any(o is kept[0] for o in gc.get_objects()), "a start-up object is still walked"
later = Node(); later.me = later; ref = weakref.ref(later); del later  # a request's cyclic garbage
gc.collect()
assert ref() is None, "garbage made after settle is still collected"
print("ok", frozen)
"""


def test_settle_freezes_what_is_alive_and_still_collects_later_garbage():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
