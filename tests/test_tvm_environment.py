"""The installed TVM stack works for what ember needs of it."""

from __future__ import annotations

from helpers import run_python

# apache-tvm-ffi 0.1.15.x segfaults in tvm.ir.save_json (which meta_schedule's tuning
# database uses); run it in a subprocess so a crash fails this test, not the session.
SAVE_JSON_PROGRAM = """
import tvm
from tvm import te

a = te.placeholder((8,), "float32", name="a")
b = te.compute((8,), lambda i: a[i] + tvm.tirx.const(1.0, "float32"), name="b")
module = tvm.IRModule({"add_one": te.create_prim_func([a, b])})
text = tvm.ir.save_json(module)
tvm.ir.assert_structural_equal(tvm.ir.load_json(text), module)
print("ok", len(text))
"""


def test_save_json_round_trips_an_irmodule():
    result = run_python("-c", SAVE_JSON_PROGRAM)
    assert result.returncode == 0, f"exit {result.returncode} (a negative code is a signal):\n{result.stderr}"
    assert result.stdout.startswith("ok ")
