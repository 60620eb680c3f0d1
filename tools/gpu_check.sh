#!/usr/bin/env bash
# GPU check: the Triton PIC kernels compiled for CUDA and the FlashInfer attention backend, each against its
# torch reference (tests/kernels/test_triton_pic.py, tests/kernels/test_flashinfer_backend.py).
#
# Run from anywhere on a CUDA machine whose python3 holds a CUDA build of torch:  tools/gpu_check.sh
#   GPU_VENV  venv to use (default .venv); it must hold CUDA torch. If absent it is created from PYTHON and sees
#             PYTHON's packages; only the `gpu` extra of pyproject.toml is installed into it, never the base
#             dependencies (they pin a CPU torch). The package itself runs from the checkout (PYTHONPATH).
#   PYTHON    interpreter with CUDA torch to create the venv from (default python3)
#   WHEELS    wheelhouse for machines without network (default .whl); when it exists pip installs from it alone.
#             Fill it where pip works, e.g.  pip download --no-deps --only-binary=:all: --python-version 3.12
#             --platform manylinux_2_28_x86_64 -d .whl flashinfer-python==0.7.4 triton==3.7.1  (and their deps)
# Prints a summary; exits non-zero if anything failed or could not be checked. First FlashInfer use JIT-builds
# its kernels (a few minutes on a fresh machine); the test matrix is kept to three FlashInfer modules.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-.venv}
WHEELS=${WHEELS:-.whl}
START=$SECONDS
declare -a SUMMARY=()
STATUS=0
note() { SUMMARY+=("$1"); echo "gpu_check: $1"; }
failed() { note "FAIL $1"; STATUS=1; }

has_cuda_torch() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ ! -x "$VENV/bin/python" ]; then
  has_cuda_torch "$PY" || { echo "gpu_check: $PY has no CUDA-enabled torch; set PYTHON" >&2; exit 2; }
  "$PY" -m venv --system-site-packages "$VENV" || { echo "gpu_check: cannot create $VENV" >&2; exit 2; }
  # --system-site-packages reaches the base interpreter only; when $PY is itself a venv (where CUDA torch
  # usually lives) its site-packages are added by a .pth, after the new venv's own (which win on conflicts)
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/parent_site.pth"
fi
VPY="$VENV/bin/python"
has_cuda_torch "$VPY" || { echo "gpu_check: $VPY has no CUDA-enabled torch; set GPU_VENV or PYTHON" >&2; exit 2; }

# the gpu extra's packages (pyproject.toml) at their exact versions (constraints.txt)
mapfile -t GPU_REQS < <("$VPY" -c 'import re, tomllib
key = lambda name: re.sub(r"[-_.]+", "-", name).lower()
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
pins = dict(map(str.strip, line.split("#")[0].split("==")) for line in open("constraints.txt") if "==" in line.split("#")[0])
pins = {key(name): version for name, version in pins.items()}
print("\n".join(f"{name}=={pins[key(name)]}" for name in (re.match(r"[A-Za-z0-9_.-]+", r)[0] for r in extra)))')
if "$VPY" - "${GPU_REQS[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

pins = [requirement.partition("==") for requirement in sys.argv[1:]]
sys.exit(0 if all(installed(name) == wanted for name, _, wanted in pins) else 1)
PYEOF
then
  note "ok   gpu extra already installed: ${GPU_REQS[*]}"
else
  SOURCE=()
  [ -d "$WHEELS" ] && SOURCE=(--no-index --find-links "$WHEELS")
  if "$VPY" -m pip install -q --disable-pip-version-check "${SOURCE[@]}" "${GPU_REQS[@]}"; then
    note "ok   installed ${GPU_REQS[*]}"
  else
    failed "could not install ${GPU_REQS[*]} (offline? put wheels in $WHEELS); testing what is installed"
  fi
fi
"$VPY" -c 'import torch, triton; print("torch", torch.__version__, "| triton", triton.__version__,
    "|", torch.cuda.get_device_name())'
"$VPY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || failed "flashinfer does not import"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, not the interpreter
run_tests() {  # name, test file: a run passes only if no test failed and none was skipped for lack of a GPU
  local log rc
  log=$(mktemp)
  "$VPY" -m pytest -rs -p no:cacheprovider "$2" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then failed "$1 (pytest exit $rc)"
  elif grep -q "needs CUDA\|triton missing" "$log"; then failed "$1 skipped GPU tests"
  else note "ok   $1: $(tail -n 1 "$log")"; fi
  rm -f "$log"
}
run_tests "triton kernels (compiled)" tests/kernels/test_triton_pic.py
run_tests "flashinfer backend" tests/kernels/test_flashinfer_backend.py

echo "================ gpu_check summary ($((SECONDS - START)) s) ================"
printf '%s\n' "${SUMMARY[@]}"
[ "$STATUS" -eq 0 ] && echo "ALL PASSED" || echo "FAILED"
exit "$STATUS"
