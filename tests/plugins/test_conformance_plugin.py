"""The conformance kit run as a third party runs it: a pip-installed attention backend that is
3% off must be rejected with a figure, and the reference backend must pass.

The package is installed into a temporary ``--target`` directory put on the subprocess's
``PYTHONPATH`` (entry points are found there), so the shared environment is never changed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
KIT = [sys.executable, "-m", "pagedlm.core.testing.conformance", "--device", "cpu"]


def _env(*extra_paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in extra_paths] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")  # the kit's tensors are small
    return env


@pytest.fixture(scope="module")
def skewed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("skewed-site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(HERE / "skewed_attention")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def test_kit_rejects_a_backend_three_percent_off(skewed_site: Path):
    proc = subprocess.run([*KIT, "--attention-backend", "skewed_cpu", "--quick", "--skip-e2e", "--skip-ops",
                           "--dtype", "float32,bfloat16"], capture_output=True, text=True, timeout=300,
                          env=_env(skewed_site))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failures = re.findall(r"^FAIL attention: (.*) max_abs_err=(\S+) \(atol=(\S+) ", proc.stdout, re.MULTILINE)
    assert failures, proc.stdout
    # every fp32 case fails (3% of a score is far beyond rounding), each by more than its tolerance
    fp32 = [f for f in failures if "float32" in f[0]]
    assert len(fp32) == proc.stdout.count("float32"), proc.stdout
    assert all(float(err) > float(atol) for _, err, atol in failures)
    assert "DOES NOT CONFORM: device=cpu attention_backend=skewed_cpu" in proc.stdout


def test_reference_backend_conforms_on_the_quick_grid():
    proc = subprocess.run([*KIT, "--attention-backend", "cpu_paged", "--quick"], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
    for section in ("attention", "e2e"):
        assert f"PASS {section}:" in proc.stdout
    assert re.search(r"^CONFORMS: device=cpu attention_backend=cpu_paged: \d+ passed, 0 failed", proc.stdout,
                     re.MULTILINE)


def test_unknown_backend_is_a_usage_error():
    proc = subprocess.run([*KIT, "--attention-backend", "no_such_backend", "--quick"], capture_output=True,
                          text=True, timeout=300, env=_env())
    assert proc.returncode == 2
    assert "no_such_backend" in proc.stderr and "cpu_paged" in proc.stderr
