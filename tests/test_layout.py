"""Import direction: generating with the demo pair never imports the training code."""
from __future__ import annotations

import subprocess
import sys


def test_generation_imports_no_training_module():
    code = ("import sys; from staged_engine import Engine; "
            "eng = Engine.demo(ngram=False); eng.generate('def f(x):\\n', max_new_tokens=4, strategy='tree'); "
            "bad = sorted(m for m in sys.modules if m.startswith('staged_engine.training')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
